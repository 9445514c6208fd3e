//! The `channeld.control/v1` JSONL protocol spoken on the hub's control socket (by
//! `channelctl` and applications): one request object per line, one response per request,
//! matched by `id`, possibly out of order.
//!
//! Types only: this crate does no I/O and links neither the hub nor SQLite, so a client
//! depends on it alone (plus `channeld-protocol` for the payload types it shares).

use std::collections::BTreeMap;

pub use channeld_protocol::ext::{HistoryEntry, HistoryRole};
use channeld_protocol::types::{DeliveryReceipt, Health};
use serde::{Deserialize, Serialize};

/// The protocol name (documented in PROTOCOL.md).
pub const CONTROL_PROTOCOL: &str = "channeld.control/v1";

/// Largest request or response line (newline included).
pub const MAX_CONTROL_LINE: usize = 1024 * 1024;

/// Machine-readable `error.code` values (PROTOCOL.md lists what each means).
pub mod code {
    pub const INVALID_REQUEST: &str = "invalid_request";
    pub const UNKNOWN_INSTANCE: &str = "unknown_instance";
    pub const INVALID_TARGET: &str = "invalid_target";
    pub const DRIVER_OFFLINE: &str = "driver_offline";
    pub const NOT_DECLARED: &str = "not_declared";
    pub const TOO_LARGE: &str = "too_large";
    pub const SEND_FAILED: &str = "send_failed";
    pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";
    pub const LEDGER_OFF: &str = "ledger_off";
    pub const LEDGER_UNAVAILABLE: &str = "ledger_unavailable";
    /// The ledger cannot write for lack of space: nothing was recorded, nothing sent; try
    /// again once space returns (the hub notices by itself).
    pub const STORAGE_FULL: &str = "storage_full";
    pub const NOT_FOUND: &str = "not_found";
    pub const NOT_RETRYABLE: &str = "not_retryable";
    /// An idempotency key reused for a different message on the same instance.
    pub const CONFLICT: &str = "conflict";
    /// The answer would exceed [`MAX_CONTROL_LINE`](super::MAX_CONTROL_LINE).
    pub const ANSWER_TOO_LARGE: &str = "answer_too_large";
    pub const INTERNAL: &str = "internal";
    /// `action`: the driver answered the operator action `ok: false`; the message carries
    /// its code (`unsupported`, `invalid_args`, `failed`) and sentence.
    pub const ACTION_FAILED: &str = "action_failed";
    /// `cancel`: no accepted inbound has this event id.
    pub const UNKNOWN_EVENT: &str = "unknown_event";
    /// `history`: the instance keeps no history (`history = false`, or the ledger is off).
    pub const HISTORY_OFF: &str = "history_off";
    /// `action`: the driver did not answer within the timeout (it may still act).
    pub const ACTION_TIMEOUT: &str = "action_timeout";
    /// The connecting process's credentials are not admitted (`control_allow_uids` /
    /// `control_allow_gids`); sent with `id` 0 before the hub closes the connection.
    pub const PEER_NOT_ALLOWED: &str = "peer_not_allowed";
    /// The hub serves its limit of control connections; sent with `id` 0, then closed. Retry.
    pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";
    /// `read`, `respond`, `complete`: not a locator this hub issued (malformed, unknown
    /// version, another family, altered, too long); the message says which.
    pub const INVALID_LOCATOR: &str = "invalid_locator";
}

/// One request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    #[serde(flatten)]
    pub op: Op,
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// A proactive message through an instance's driver.
    Send(SendArgs),
    /// Probe one instance's driver.
    Health { instance: String },
    /// Instances' state, in instance-id order, one page at a time.
    Status {
        /// Only this instance (`slack.primary`) or this family's instances (`slack`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        instance: Option<String>,
        /// Only instances whose id sorts after this one: the `next_after` of the previous
        /// page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
        /// At most this many (default and maximum [`MAX_STATUS_PAGE`]); fewer when the answer
        /// would otherwise exceed the line limit.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
    /// Driver families this build knows.
    Catalog,
    /// Outbox records, newest first, text and error cut to previews; one page at a time.
    Outbox {
        #[serde(default)]
        instance: Option<String>,
        #[serde(default)]
        state: Option<String>,
        /// At most this many (default 100, at most [`MAX_OUTBOX_PAGE`]); fewer when the
        /// answer would otherwise exceed the line limit.
        #[serde(default)]
        limit: Option<usize>,
        /// Only records with a smaller id: the `next_before` of the previous page.
        #[serde(default)]
        before: Option<i64>,
    },
    /// One outbox record in full (its whole text and error).
    OutboxGet { outbox_id: i64 },
    /// Sends an `unknown` or `failed` record again, on an operator's explicit request.
    /// (Not `id`: that key is the request's own.)
    OutboxRetry { outbox_id: i64 },
    /// Replies and where their delivery stands, newest first, text and error cut to
    /// previews; one page at a time.
    Replies {
        #[serde(default)]
        instance: Option<String>,
        /// One of [`REPLY_STATES`].
        #[serde(default)]
        state: Option<String>,
        /// At most this many (default 100, at most [`MAX_OUTBOX_PAGE`]).
        #[serde(default)]
        limit: Option<usize>,
        /// Only replies with a smaller id: the `next_before` of the previous page.
        #[serde(default)]
        before: Option<i64>,
    },
    /// Sends an `unknown`, `failed` or `expired` reply again, on an operator's explicit
    /// request (it may post a second copy).
    RepliesRetry { reply_id: i64 },
    /// An operator action (extension `operator_action`) performed by the instance's
    /// connected driver, e.g. `resume` or `login`; answered with the driver's result.
    Action {
        instance: String,
        name: String,
        /// The action's arguments (a JSON object; `{}` when omitted).
        #[serde(default = "empty_object")]
        args: serde_json::Value,
        /// How long to wait for the driver's answer (default `hub.command_timeout_secs`).
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    /// Cancels the run started by the inbound `event_id` (a queued one leaves the queue, a
    /// running one is stopped); answered once it is stopped and recorded.
    Cancel { instance: String, event_id: String },
    /// The newest entries of a conversation's history (admitted inbound texts and posted
    /// replies), oldest first.
    History {
        instance: String,
        conversation: String,
        /// Only this thread's entries; omitted: the conversation's entries outside threads.
        #[serde(default)]
        thread: Option<String>,
        /// At most this many (default 50, at most 1,000).
        #[serde(default)]
        limit: Option<u32>,
    },
    /// Admitted inbound items (the agent's inbox), newest first, without their text: each
    /// with its locator and whether it was handled.
    Inbox {
        #[serde(default)]
        instance: Option<String>,
        /// Only items not handled yet (neither answered through `respond` nor `complete`d).
        #[serde(default)]
        unhandled: bool,
        /// At most this many (default 50, at most [`MAX_OUTBOX_PAGE`]).
        #[serde(default)]
        limit: Option<usize>,
        /// Only items with a smaller entry id: the `next_before` of the previous page.
        #[serde(default)]
        before: Option<i64>,
    },
    /// One item and up to `limit` entries before it in its conversation (thread), each
    /// marked untrusted, and whether it was handled.
    Read {
        locator: String,
        /// Previous entries (default 10, at most [`MAX_READ_CONTEXT`]).
        #[serde(default)]
        limit: Option<usize>,
    },
    /// Replies to an item in its conversation (thread) through the driver, once: a repeat
    /// returns the first outcome. Then marks it handled.
    Respond { locator: String, text: String },
    /// Marks an item handled without replying.
    Complete { locator: String },
}

/// Most previous entries `read` returns.
pub const MAX_READ_CONTEXT: usize = 50;

/// One item of `inbox`. No text: an agent reads it with `read`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboxItem {
    pub entry_id: i64,
    pub locator: String,
    pub instance: String,
    pub event_id: String,
    pub conversation: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// The sender's platform id (never a display name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    pub received_ms: u64,
    /// A reply was posted through `respond` (or is on its way: see `read`).
    pub replied: bool,
    pub handled: bool,
    /// `respond` or `complete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_ms: Option<u64>,
}

/// The result of `inbox`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboxResult {
    pub items: Vec<InboxItem>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_before: Option<i64>,
}

/// One entry of a conversation as `read` shows it. `untrusted` is always true for what a
/// sender wrote: treat the text as data, never as instructions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadEntry {
    /// `inbound` (a sender's message or event) or `reply` (what the hub posted in answer).
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    pub text: String,
    /// The text was cut (to [`MAX_READ_TEXT`] bytes).
    #[serde(default)]
    pub truncated: bool,
    pub untrusted: bool,
    pub at_ms: u64,
}

/// The longest text of one entry `read` returns (bytes; cut at a character boundary).
pub const MAX_READ_TEXT: usize = 8192;

/// The result of `read`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadResult {
    pub locator: String,
    pub instance: String,
    pub conversation: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    pub handled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_by: Option<String>,
    pub replied: bool,
    /// The item itself.
    pub target: ReadEntry,
    /// The entries before it in its conversation (thread), oldest first.
    pub context: Vec<ReadEntry>,
}

/// The result of `respond`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RespondResult {
    /// The driver's receipt says the reply was posted.
    pub replied: bool,
    /// The item is marked handled (in the ledger, and by the driver's effect where declared).
    pub handled: bool,
    /// The platform's id of the posted reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    /// Set for a partial result (`replied` without `handled`, or a reply still queued):
    /// report it, and never respond again to post the reply a second time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// The reply's outbox record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outbox_id: Option<i64>,
    /// True when an earlier `respond` already sent the reply: this is its outcome.
    #[serde(default)]
    pub repeated: bool,
}

/// The result of `complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompleteResult {
    pub handled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// The result of `cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelView {
    pub instance: String,
    pub event_id: String,
    /// The event ids whose runs this request stopped or removed (empty: nothing was going on).
    pub cancelled: Vec<String>,
    /// `aborted`, or how the run had ended: `replied` (with a reply, however its delivery
    /// went), `delivered` (without one), `failed`.
    pub state: String,
}

/// The result of `history`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryView {
    pub instance: String,
    pub conversation: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    /// Oldest first.
    pub entries: Vec<HistoryEntry>,
    /// True when older entries were left out so the answer fits in one line.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

/// The result of `action`: what the driver answered `ok: true` with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionResult {
    pub instance: String,
    pub name: String,
    /// The driver's sentence for the operator, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// What the action produced (an object), if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

/// The states of a reply's delivery, as `replies` shows and filters them: `pending` (waiting
/// to be handed to the driver), `handed` (waiting for its receipt), `posted`,
/// `failed_retryable` (retried with backoff), `failed` (refused for good), `unknown` (may or
/// may not have been posted; never resent by itself) and `expired` (its TTL passed).
pub const REPLY_STATES: [&str; 7] =
    ["pending", "handed", "posted", "failed_retryable", "failed", "unknown", "expired"];

fn yes() -> bool {
    true
}

/// One response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// A failure: a machine-readable code and a sentence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
    /// Set when the failure concerns a request already handed to a driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// The result of `send`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendResult {
    pub request_id: String,
    /// `receipted` (with `receipt`), `handed` (not waited for) or `queued` (driver offline).
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<DeliveryReceipt>,
    /// The outbox record, when the hub keeps a ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outbox_id: Option<i64>,
    /// The idempotency key was used before for this same message: this is the first send's
    /// record, and nothing was posted again.
    #[serde(default, skip_serializing_if = "is_false")]
    pub repeated: bool,
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// The send queue's name unless `[hub.amqp_sends] queue` (or `channelctl --amqp-queue`) says
/// otherwise.
pub const DEFAULT_SEND_QUEUE: &str = "channeld.sends";

/// The `type` property of a send-queue message and of its outcome.
pub const SEND_MESSAGE_TYPE: &str = "channeld.send";
pub const SEND_OUTCOME_TYPE: &str = "channeld.send_outcome";

/// The control `send` op's fields ([`Op::Send`]), and a message on the hub's AMQP send queue
/// (`[hub.amqp_sends]`, PROTOCOL.md "Sends over RabbitMQ"), which carries them without `id`
/// and `op`. On the queue the idempotency key is required (the body's, else the message's
/// `message_id` property): RabbitMQ may deliver a message twice, and the key makes the second
/// delivery answer without posting again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendArgs {
    pub instance: String,
    pub conversation: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    pub text: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Wait for the receipt before answering (default true).
    #[serde(default = "yes")]
    pub wait: bool,
    /// How long to wait for the receipt (the hub's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The same key never sends twice: a repeat returns the first send's record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// The hub's answer to a [`SendArgs`], published to the message's `reply_to` with its
/// `correlation_id`: what the control socket would have answered, without the request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSendOutcome {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<SendResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

impl RemoteSendOutcome {
    pub fn sent(result: SendResult) -> Self {
        Self { ok: true, result: Some(result), error: None }
    }

    pub fn failed(error: ErrorBody) -> Self {
        Self { ok: false, result: None, error: Some(error) }
    }
}

/// The hub's send-queue consumer, as `status` shows it (`[hub.amqp_sends]` set).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AmqpSendsStatus {
    pub queue: String,
    /// Consuming now (false while it reconnects).
    pub connected: bool,
    /// Messages taken from the queue.
    pub received: u64,
    /// Of those, how many ended in a send that was sent, queued or repeated.
    pub sent: u64,
    /// Of those, how many the hub refused or could not send (an error outcome).
    pub failed: u64,
    /// Of those, how many were not a send message at all (dead-lettered).
    pub malformed: u64,
    /// Connections made after the first (broker restarts, network loss).
    pub reconnects: u64,
    /// The last broker error (never the URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// One outbox record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    pub id: i64,
    pub request_id: String,
    pub instance: String,
    pub state: String,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    pub conversation: String,
    /// The whole text from `outbox_get`; its first 100 characters in an `outbox` listing.
    pub text: String,
    /// The whole text's length in bytes (more than `text` holds when it is a preview).
    #[serde(default)]
    pub text_bytes: usize,
    #[serde(default)]
    pub receipt: Option<DeliveryReceipt>,
    /// Whole from `outbox_get`; its first 100 characters in an `outbox` listing.
    #[serde(default)]
    pub error: Option<String>,
    pub attempts: u32,
    pub created_ms: u64,
    pub updated_ms: u64,
}

/// Most records one `outbox` page holds.
pub const MAX_OUTBOX_PAGE: usize = 1000;

/// Most instances one `status` answer holds; `next_after` points to the rest.
pub const MAX_STATUS_PAGE: usize = 1000;

/// The result of `outbox`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxResult {
    pub records: Vec<OutboxEntry>,
    /// Set when more records match: pass it as `before` for the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_before: Option<i64>,
}

/// One reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyEntry {
    pub id: i64,
    pub instance: String,
    /// The inbound it answers (the `deliver` frame's `request_id`).
    pub event_id: String,
    pub conversation: String,
    pub state: String,
    /// Its first 100 characters in a listing.
    pub text: String,
    #[serde(default)]
    pub text_bytes: usize,
    #[serde(default)]
    pub receipt: Option<DeliveryReceipt>,
    /// The driver's last error (`code: message`); its first 100 characters in a listing.
    #[serde(default)]
    pub error: Option<String>,
    pub attempts: u32,
    /// When a `pending` or `failed_retryable` reply is handed over next.
    pub next_ms: u64,
    pub expires_ms: u64,
    pub created_ms: u64,
    pub updated_ms: u64,
}

/// The result of `replies`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepliesResult {
    pub replies: Vec<ReplyEntry>,
    /// Set when more replies match: pass it as `before` for the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_before: Option<i64>,
}

/// How many replies of an instance are in each state (ledger on).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyCounts {
    pub pending: u64,
    pub handed: u64,
    pub posted: u64,
    pub failed_retryable: u64,
    pub failed: u64,
    pub unknown: u64,
    pub expired: u64,
}

/// The result of `health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthResult {
    pub instance: String,
    pub health: Health,
    /// `storage_full` while the hub's ledger cannot write for lack of space (new inbound is
    /// refused, sends fail); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
}

/// Counters of one instance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountersView {
    pub inbound: u64,
    pub denied: u64,
    pub busy: u64,
    pub replies: u64,
    pub runs_failed: u64,
    pub outbound: u64,
    pub receipts: u64,
    pub errors: u64,
}

/// One row of `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceStatus {
    pub instance: String,
    pub family: String,
    pub socket: String,
    pub runtime: String,
    pub connected: bool,
    #[serde(default)]
    pub connected_since_ms: Option<u64>,
    #[serde(default)]
    pub driver_pid: Option<i32>,
    pub health: Health,
    pub health_updated_ms: u64,
    /// Runs going on now (at most the instance's `max_inflight`).
    pub in_flight: usize,
    /// Accepted messages waiting for their turn in their conversation's queue.
    #[serde(default)]
    pub queued: usize,
    pub counters: CountersView,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub last_error_ms: Option<u64>,
    /// The driver process the hub supervises (`spawn = [...]`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_process: Option<DriverProcess>,
    /// Where the replies of its runs stand (ledger on; posted ones until pruned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replies: Option<ReplyCounts>,
    /// The names of the environment its driver gave its runs (extension `agent_env`), never
    /// the values; absent when it gave none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_env: Vec<String>,
}

/// A supervised driver process, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverProcess {
    /// `running`, `restarting` (waiting out its backoff) or `stopped` (not restarted: it
    /// exited with 78, invalid configuration, or could not be started).
    pub state: String,
    #[serde(default)]
    pub pid: Option<u32>,
    /// How many times it was started.
    pub starts: u64,
    /// How the last run ended, e.g. `exit status: 78`.
    #[serde(default)]
    pub last_exit: Option<String>,
}

/// The result of `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusResult {
    pub hub: String,
    pub pid: u32,
    pub started_ms: u64,
    pub instances: Vec<InstanceStatus>,
    /// How many instances match the request's filter (all of them without one), on every
    /// page.
    #[serde(default)]
    pub total: usize,
    /// Set when instances are left for the next page: pass it as `after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<String>,
    /// `storage_full` while the hub's ledger cannot write for lack of space (new inbound is
    /// refused, sends fail); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
    /// The AMQP send queue's consumer, when `[hub.amqp_sends]` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amqp_sends: Option<AmqpSendsStatus>,
}

/// One family in `catalog`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Family {
    pub family: String,
    pub binary: String,
    pub transport: String,
    pub installed: bool,
}

/// The result of `catalog`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogResult {
    pub families: Vec<Family>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The send-queue message and its outcome, exactly as PROTOCOL.md shows them.
    #[test]
    fn remote_sends_and_outcomes_have_their_documented_json() {
        let line = r#"{"instance":"mqtt.lab","conversation":"ops","text":"deploy 881 finished","idempotency_key":"deploy-881"}"#;
        let send: SendArgs = serde_json::from_str(line).unwrap();
        assert!(send.wait);
        assert_eq!(send.idempotency_key.as_deref(), Some("deploy-881"));
        let back = serde_json::to_string(&send).unwrap();
        assert_eq!(
            back,
            r#"{"instance":"mqtt.lab","conversation":"ops","text":"deploy 881 finished","wait":true,"idempotency_key":"deploy-881"}"#
        );
        assert!(matches!(Op::Send(send), Op::Send(SendArgs { wait: true, .. })));
        let repeated = RemoteSendOutcome::sent(SendResult {
            request_id: "out-7".into(),
            state: "queued".into(),
            receipt: None,
            outbox_id: Some(7),
            repeated: true,
        });
        assert_eq!(
            serde_json::to_string(&repeated).unwrap(),
            r#"{"ok":true,"result":{"request_id":"out-7","state":"queued","outbox_id":7,"repeated":true}}"#
        );
        let conflict = RemoteSendOutcome::failed(ErrorBody {
            code: code::CONFLICT.into(),
            message: "m".into(),
            request_id: None,
        });
        assert_eq!(
            serde_json::to_string(&conflict).unwrap(),
            r#"{"ok":false,"error":{"code":"conflict","message":"m"}}"#
        );
        assert!(
            serde_json::from_str::<SendArgs>(
                r#"{"instance":"a.b","conversation":"c","text":"t","id":1}"#
            )
            .is_err()
        );
    }

    /// Every op a client can build reads back as itself: no op field may collide with the
    /// request's own keys (`id`, `op`), which the flattened layout shares.
    #[test]
    fn a_bare_status_request_asks_for_the_first_page_of_everything() {
        let bare: Request = serde_json::from_str(r#"{"id":1,"op":"status"}"#).unwrap();
        assert_eq!(bare.op, Op::Status { instance: None, after: None, limit: None });
        assert_eq!(serde_json::to_string(&bare).unwrap(), r#"{"id":1,"op":"status"}"#);
        let unknown = serde_json::from_str::<Request>(r#"{"id":1,"op":"status","page":2}"#);
        assert!(unknown.is_err(), "an unknown field is refused");
    }

    #[test]
    fn every_request_round_trips_through_its_json_line() {
        let ops = [
            Op::Send(SendArgs {
                instance: "a.b".into(),
                conversation: "c".into(),
                thread: None,
                text: "t".into(),
                metadata: BTreeMap::new(),
                wait: true,
                timeout_ms: Some(5),
                idempotency_key: Some("k".into()),
            }),
            Op::Health { instance: "a.b".into() },
            Op::Status { instance: None, after: None, limit: None },
            Op::Status {
                instance: Some("slack".into()),
                after: Some("slack.a".into()),
                limit: Some(2),
            },
            Op::Catalog,
            Op::Outbox { instance: Some("a.b".into()), state: None, limit: Some(3), before: None },
            Op::OutboxRetry { outbox_id: 17 },
            Op::OutboxGet { outbox_id: 17 },
            Op::Replies {
                instance: Some("a.b".into()),
                state: Some("failed".into()),
                limit: None,
                before: Some(4),
            },
            Op::RepliesRetry { reply_id: 3 },
            Op::Action {
                instance: "a.b".into(),
                name: "resume".into(),
                args: serde_json::json!({"k": 1}),
                timeout_ms: Some(5),
            },
            Op::Inbox { instance: None, unhandled: true, limit: Some(3), before: Some(9) },
            Op::Read { locator: "mqtt:v1:AA".into(), limit: Some(4) },
            Op::Respond { locator: "mqtt:v1:AA".into(), text: "hi".into() },
            Op::Complete { locator: "mqtt:v1:AA".into() },
        ];
        for op in ops {
            let request = Request { id: 9, op };
            let line = serde_json::to_string(&request).unwrap();
            let back: Request =
                serde_json::from_str(&line).unwrap_or_else(|err| panic!("{line}: {err}"));
            assert_eq!(back, request);
        }
    }
}
