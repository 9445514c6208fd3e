//! The fake Slack's shared state: the workspace (users, messages, DMs), the Socket Mode
//! bookkeeping (tickets, sockets, envelopes awaiting acks) and the record tests assert on.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::mpsc;

/// What a socket task is told to do by the handle.
#[derive(Debug)]
pub(crate) enum SocketCommand {
    /// Write this text frame.
    Send(String),
    /// Send `{"type":"disconnect","reason":…}`; close the socket after `close_after` (or keep
    /// it open when `None`, as Slack does after `warning`).
    Disconnect { reason: String, close_after: Option<Duration> },
    /// Drop the connection without a close frame.
    Abrupt,
    /// Stop reading and writing but keep the TCP connection open (a half-open link).
    Silent,
    /// A normal close frame.
    Close,
}

/// How a socket ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketEnd {
    /// The client sent a close frame or closed its connection.
    ByClient,
    /// The fake closed it with a close frame (after a disconnect or on request).
    ByServer,
    /// The fake dropped it without a close frame.
    Abrupt,
}

/// One WebSocket connection, from the fake's point of view.
#[derive(Debug, Clone)]
pub struct SocketRecord {
    /// 1, 2, 3… in connection order.
    pub id: u64,
    pub ticket: String,
    pub opened_at: Instant,
    /// When `hello` was sent (never for a connection refused with `disconnect`).
    pub hello_at: Option<Instant>,
    /// `disconnect` reasons sent on this socket, in order.
    pub disconnects: Vec<String>,
    /// The socket no longer reads or writes (half-open mode).
    pub silent: bool,
    pub closed_at: Option<Instant>,
    pub end: Option<SocketEnd>,
    /// WebSocket pings received from the client.
    pub pings: u64,
    /// Text frames that were not a well-formed acknowledgement.
    pub unexpected: Vec<String>,
}

impl SocketRecord {
    /// Open and answering: envelopes may be sent here.
    pub fn is_live(&self) -> bool {
        self.hello_at.is_some() && self.closed_at.is_none() && !self.silent
    }
}

/// One envelope sent on a socket (each redelivery is its own envelope).
#[derive(Debug, Clone)]
pub struct EnvelopeRecord {
    pub envelope_id: String,
    /// `events_api` or `interactive`.
    pub kind: String,
    /// `payload.event_id` for `events_api`.
    pub event_id: Option<String>,
    pub retry_attempt: u32,
    pub socket: u64,
    pub sent_at: Instant,
    /// When the first acknowledgement arrived on the envelope's own socket.
    pub acked_at: Option<Instant>,
    /// Acknowledgements received for this envelope on its socket.
    pub acks: u32,
    pub ack_payload: Option<Value>,
}

/// One acknowledgement frame as received.
#[derive(Debug, Clone)]
pub struct AckRecord {
    pub socket: u64,
    pub envelope_id: String,
    /// False when no envelope with this id was sent on this socket.
    pub matched: bool,
    pub at: Instant,
}

/// One Web API request and the fake's answer.
#[derive(Debug, Clone)]
pub struct ApiCall {
    pub method: String,
    /// `app`, `bot`, `unknown` (a token the fake did not issue) or `none`.
    pub token: &'static str,
    pub content_type: Option<String>,
    /// Query, form and JSON arguments merged into one object.
    pub args: Value,
    pub at: Instant,
    pub status: u16,
    /// The JSON body sent back (`null` for a request left unanswered).
    pub response: Value,
}

/// A message in the fake workspace (user or bot).
#[derive(Debug, Clone)]
pub struct StoredMessage {
    pub channel: String,
    pub ts: String,
    pub thread_ts: Option<String>,
    /// The author: a user id, or the bot's user id for messages the bot posted.
    pub user: String,
    pub by_bot: bool,
    pub text: String,
    pub blocks: Option<Value>,
    /// Previous texts, oldest first, one per `chat.update`.
    pub edits: Vec<String>,
    pub deleted: bool,
    /// Reaction names the bot added and has not removed.
    pub reactions: Vec<String>,
}

/// One `assistant.threads.setStatus` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusRecord {
    pub channel_id: String,
    pub thread_ts: String,
    pub status: String,
}

/// Everything the fake saw, for assertions. [`FakeSlack::record`](super::FakeSlack::record)
/// returns a snapshot.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub calls: Vec<ApiCall>,
    pub sockets: Vec<SocketRecord>,
    pub envelopes: Vec<EnvelopeRecord>,
    pub acks: Vec<AckRecord>,
    pub messages: Vec<StoredMessage>,
    pub statuses: Vec<StatusRecord>,
}

impl Record {
    /// Calls of one Web API method, in order.
    pub fn calls_to(&self, method: &str) -> Vec<&ApiCall> {
        self.calls.iter().filter(|call| call.method == method).collect()
    }

    /// Messages the bot posted (deleted ones included), in order.
    pub fn bot_messages(&self) -> Vec<&StoredMessage> {
        self.messages.iter().filter(|m| m.by_bot).collect()
    }

    /// Bot messages still visible in `channel`.
    pub fn visible_bot_messages(&self, channel: &str) -> Vec<&StoredMessage> {
        self.messages.iter().filter(|m| m.by_bot && !m.deleted && m.channel == channel).collect()
    }

    /// A message by channel and ts.
    pub fn message(&self, channel: &str, ts: &str) -> Option<&StoredMessage> {
        self.messages.iter().find(|m| m.channel == channel && m.ts == ts)
    }

    /// Envelopes carrying the `events_api` event `event_id`, in order.
    pub fn deliveries_of(&self, event_id: &str) -> Vec<&EnvelopeRecord> {
        self.envelopes.iter().filter(|e| e.event_id.as_deref() == Some(event_id)).collect()
    }

    /// Whether some envelope of `event_id` was acknowledged.
    pub fn event_acked(&self, event_id: &str) -> bool {
        self.deliveries_of(event_id).iter().any(|e| e.acked_at.is_some())
    }

    /// Sockets that got `hello`, in connection order.
    pub fn hello_sockets(&self) -> Vec<&SocketRecord> {
        self.sockets.iter().filter(|s| s.hello_at.is_some()).collect()
    }
}

/// An event waiting for an acknowledgement, and how often it was delivered.
#[derive(Debug, Clone)]
pub(crate) struct Outstanding {
    pub kind: &'static str,
    /// The payload (the `event_callback` wrapper or the interactive payload).
    pub payload: Value,
    pub event_id: Option<String>,
    /// Deliveries so far (0 = waiting for a first socket).
    pub attempts: u32,
    /// The envelope id of the latest delivery.
    pub envelope_id: Option<String>,
    pub socket: Option<u64>,
    /// When to deliver again if still unacknowledged.
    pub due: Option<Instant>,
}

/// A live socket's command channel.
#[derive(Debug)]
pub(crate) struct SocketHandle {
    pub id: u64,
    pub commands: mpsc::Sender<SocketCommand>,
}

/// A fault injected into a Web API method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// HTTP 200 `{"ok":false,"error":<code>}`.
    Error(String),
    /// HTTP 429, `Retry-After: <secs>`, `{"ok":false,"error":"ratelimited"}`.
    RateLimited { retry_after_secs: u64 },
    /// Answer normally after this delay (a slow server).
    Delay(Duration),
    /// Read the request and never answer (the client must time out).
    Hang,
    /// An HTTP 5xx with an HTML body, as a proxy in front of Slack would send.
    ServerError(u16),
}

#[derive(Debug, Clone)]
pub(crate) struct FaultRule {
    pub fault: Fault,
    /// Remaining uses; `None` until cleared.
    pub remaining: Option<u32>,
}

/// The mutable state behind the fake.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub record: Record,
    pub users: HashMap<String, Value>,
    pub tickets: HashMap<String, bool>,
    pub live: Vec<SocketHandle>,
    pub next_socket: u64,
    pub round_robin: usize,
    pub outstanding: VecDeque<Outstanding>,
    pub faults: HashMap<String, VecDeque<FaultRule>>,
    pub channel_errors: HashMap<String, String>,
    pub link_disabled: bool,
    pub tokens_revoked: bool,
    pub counter: u64,
    /// Recent accepted posts per channel, for the per-channel rate limit.
    pub recent_posts: HashMap<String, VecDeque<Instant>>,
    /// Every `events_api` payload pushed, by event id, for [`FakeSlack::redeliver`].
    pub payloads: HashMap<String, Value>,
}

impl State {
    /// A fresh number for ids and timestamps.
    pub fn next(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// A message timestamp, unique and increasing, shaped like Slack's (`secs.micros`).
    pub fn next_ts(&mut self) -> String {
        let n = self.next();
        format!("{}.{:06}", 1_700_000_000 + n / 1_000_000, n % 1_000_000)
    }

    /// An envelope id shaped like Slack's (a UUID).
    pub fn next_envelope_id(&mut self) -> String {
        let n = self.next();
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            fastrand::u32(..),
            n & 0xffff,
            fastrand::u16(..0x1000),
            fastrand::u16(..0x1000),
            n
        )
    }

    /// Takes the next fault for `method`, if any.
    pub fn take_fault(&mut self, method: &str) -> Option<Fault> {
        let rules = self.faults.get_mut(method)?;
        let rule = rules.front_mut()?;
        let fault = rule.fault.clone();
        if let Some(remaining) = &mut rule.remaining {
            *remaining -= 1;
            if *remaining == 0 {
                rules.pop_front();
            }
        }
        Some(fault)
    }

    pub fn socket_mut(&mut self, id: u64) -> Option<&mut SocketRecord> {
        self.record.sockets.iter_mut().find(|s| s.id == id)
    }

    pub fn message_mut(&mut self, channel: &str, ts: &str) -> Option<&mut StoredMessage> {
        self.record.messages.iter_mut().find(|m| m.channel == channel && m.ts == ts && !m.deleted)
    }

    /// The live sockets in round-robin order starting at the next one.
    pub fn pick_socket(&mut self) -> Option<(u64, mpsc::Sender<SocketCommand>)> {
        let live: Vec<(u64, mpsc::Sender<SocketCommand>)> = self
            .live
            .iter()
            .filter(|handle| {
                self.record.sockets.iter().any(|s| s.id == handle.id && s.is_live())
                    && !handle.commands.is_closed()
            })
            .map(|handle| (handle.id, handle.commands.clone()))
            .collect();
        if live.is_empty() {
            return None;
        }
        self.round_robin = self.round_robin.wrapping_add(1);
        Some(live[self.round_robin % live.len()].clone())
    }
}
