//! channeld's extensions to the ABI and the pure rules for what each side may send.
//!
//! A peer declares the extensions it understands in the optional `extensions` list of its
//! `hello` / `control_hello`. The hub answers with `hello_ack` naming the ones both sides
//! support, and from then on each side may use exactly those. A reference peer declares none,
//! receives no `hello_ack` and never sees an extension field or frame.

use serde::{Deserialize, Serialize};

use crate::frame::Hello;
use crate::ids::Id;
use crate::types::{Actions, Capabilities, Command, Effect};

/// `accepted` frame: the hub tells a driver it has taken responsibility for an inbound.
pub const ACCEPTED: &str = "accepted";
/// `control_response.result`: receipts for `send`, values for `command`/`invoke`.
pub const CONTROL_RESULT: &str = "control_result";
/// `command_result.responder`: who answered a command on the platform.
pub const RESPONDER: &str = "responder";
/// `health.status`: a structured reason next to the free-text `detail`.
pub const HEALTH_STATUS: &str = "health_status";

/// A driver answers each `deliver` with a `receipt` (its `request_id` is the inbound's event
/// id) or an `error` frame, so the hub knows the reply reached the platform.
pub const REPLY_RECEIPT: &str = "reply_receipt";

/// `operator_action` / `operator_action_result` frames: an operator asks a driver to do
/// something only a person can decide (resume after re-authentication, re-login, …). The
/// driver lists the action names it supports in `hello.operator_actions`.
pub const OPERATOR_ACTION: &str = "operator_action";

/// The longest operator action name.
pub const MAX_OPERATOR_ACTION_NAME: usize = 64;

/// An operator action name is 1–64 characters of `[a-z0-9_]` starting with a letter
/// (`resume`, `relogin`), so it can be typed on a command line and logged as is.
pub fn valid_operator_action_name(name: &str) -> bool {
    name.len() <= MAX_OPERATOR_ACTION_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// `history_request` / `history_result` frames: a driver asks the hub for the last entries
/// of a conversation's history (the inbound texts it admitted and the replies posted).
pub const HISTORY: &str = "history";

/// `cancel` / `cancel_result` frames: a driver asks the hub to cancel the run started by one
/// of its inbound (named by its event id, which is also the run's name for the driver).
pub const CANCEL: &str = "cancel";

/// `stream` frames: a run's output as it is produced — ordered deltas and tool reports, then
/// the final reply (`deliver`, with `message.metadata.stream_seq`) or an end frame.
pub const STREAM: &str = "stream";

/// The `message.metadata` key of a streamed run's final `deliver`: the seq it takes (the
/// number of `stream` frames sent before it), as a decimal string. Only with `stream`.
pub const STREAM_SEQ_KEY: &str = "stream_seq";

/// `agent_env` frames (driver → hub): environment a driver's platform session hands its
/// agent runs (BCN's `bot.connect` `env`, whose bot token `bcs-cli` needs). The hub holds it
/// in memory only — never in the ledger, never logged — and exports it to the instance's
/// runs started after it, instead of the values riding in every inbound's metadata.
pub const AGENT_ENV: &str = "agent_env";

/// The most entries one `agent_env` frame may carry.
pub const MAX_AGENT_ENV_ENTRIES: usize = 64;
/// The longest value of an `agent_env` entry, in bytes.
pub const MAX_AGENT_ENV_VALUE: usize = 8192;

/// Every extension this implementation understands, in a stable order.
pub const ALL: &[&str] = &[
    ACCEPTED,
    CONTROL_RESULT,
    RESPONDER,
    HEALTH_STATUS,
    REPLY_RECEIPT,
    OPERATOR_ACTION,
    HISTORY,
    CANCEL,
    STREAM,
    AGENT_ENV,
];

/// A set of negotiated extensions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extensions {
    pub accepted: bool,
    pub control_result: bool,
    pub responder: bool,
    pub health_status: bool,
    pub reply_receipt: bool,
    pub operator_action: bool,
    pub history: bool,
    pub cancel: bool,
    pub stream: bool,
    pub agent_env: bool,
}

impl Extensions {
    /// Every extension on.
    pub fn all() -> Self {
        Self {
            accepted: true,
            control_result: true,
            responder: true,
            health_status: true,
            reply_receipt: true,
            operator_action: true,
            history: true,
            cancel: true,
            stream: true,
            agent_env: true,
        }
    }

    /// The set named by `names`; unknown names are ignored.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Self {
        let mut set = Self::default();
        for name in names {
            match name.as_ref() {
                ACCEPTED => set.accepted = true,
                CONTROL_RESULT => set.control_result = true,
                RESPONDER => set.responder = true,
                HEALTH_STATUS => set.health_status = true,
                REPLY_RECEIPT => set.reply_receipt = true,
                OPERATOR_ACTION => set.operator_action = true,
                HISTORY => set.history = true,
                CANCEL => set.cancel = true,
                STREAM => set.stream = true,
                AGENT_ENV => set.agent_env = true,
                _ => {}
            }
        }
        set
    }

    /// What both `self` (what we support) and `offered` (what the peer declared) contain.
    pub fn intersect(self, offered: Extensions) -> Self {
        Self {
            accepted: self.accepted && offered.accepted,
            control_result: self.control_result && offered.control_result,
            responder: self.responder && offered.responder,
            health_status: self.health_status && offered.health_status,
            reply_receipt: self.reply_receipt && offered.reply_receipt,
            operator_action: self.operator_action && offered.operator_action,
            history: self.history && offered.history,
            cancel: self.cancel && offered.cancel,
            stream: self.stream && offered.stream,
            agent_env: self.agent_env && offered.agent_env,
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Wire names, in [`ALL`] order.
    pub fn names(&self) -> Vec<String> {
        let flags = [
            self.accepted,
            self.control_result,
            self.responder,
            self.health_status,
            self.reply_receipt,
            self.operator_action,
            self.history,
            self.cancel,
            self.stream,
            self.agent_env,
        ];
        ALL.iter().zip(flags).filter(|(_, on)| *on).map(|(name, _)| (*name).to_owned()).collect()
    }
}

/// A `history_request` asks for this many entries unless it says otherwise.
pub const DEFAULT_HISTORY_LIMIT: u32 = 50;
/// The most entries one `history_request` (or control `history`) may ask for.
pub const MAX_HISTORY_LIMIT: u32 = 1000;

/// Extension frame `history_request` (driver → hub): the newest `limit` entries of a
/// conversation (and thread, when given) of this driver's instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryRequest {
    pub request_id: Id,
    pub conversation: Id,
    /// Only the entries of this thread; omitted: the conversation's entries outside threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<Id>,
    /// 1 to [`MAX_HISTORY_LIMIT`]; omitted: [`DEFAULT_HISTORY_LIMIT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// Extension frame `history_result` (hub → driver): the answer to one `history_request`,
/// oldest first. Empty when the hub knows nothing of the conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryResult {
    pub request_id: Id,
    pub entries: Vec<HistoryEntry>,
    /// True when older entries were left out so the frame fits in one line.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Who said a history entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryRole {
    /// An inbound message the hub admitted.
    User,
    /// A reply the driver posted.
    Assistant,
}

impl HistoryRole {
    pub fn as_str(self) -> &'static str {
        match self {
            HistoryRole::User => "user",
            HistoryRole::Assistant => "assistant",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "user" => Some(HistoryRole::User),
            "assistant" => Some(HistoryRole::Assistant),
            _ => None,
        }
    }
}

/// One entry of a conversation's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// The entry's id in the hub's ledger (grows with time within the conversation).
    pub id: i64,
    pub role: HistoryRole,
    pub text: String,
    /// When the hub admitted the inbound or recorded the reply posted (ms since the epoch).
    pub at_ms: u64,
    /// The sender of an inbound (`user`) entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    /// The platform message id: the inbound's, or the posted reply's from its receipt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// The inbound's event id (for a reply: the event it answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
}

/// Extension frame `cancel` (driver → hub): cancel the run started by the inbound
/// `event_id` of this driver's instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub request_id: Id,
    pub event_id: Id,
}

/// Extension frame `cancel_result` (hub → driver): the answer to one `cancel`, sent once the
/// run is stopped and recorded (after the run's own ending, an `error` `aborted` or a
/// `stream` end).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelResult {
    pub request_id: Id,
    pub event_id: Id,
    /// The event ids whose runs this cancel stopped or removed from the queue; empty when
    /// the run had already ended (or an earlier cancel stopped it).
    pub cancelled: Vec<Id>,
    /// The event's state now: `aborted`, or how its run had ended (`replied`, `delivered`,
    /// `failed`).
    pub state: String,
}

/// Extension frame `agent_env` (driver → hub): the whole environment the driver's platform
/// session gives the instance's agent runs, replacing the one sent before (an empty `env`
/// clears it). At most [`MAX_AGENT_ENV_ENTRIES`] entries of at most
/// [`MAX_AGENT_ENV_VALUE`] bytes; the hub takes only names in the driver family's namespace
/// (`BCN_…` for `bcn`) and refuses the frame otherwise. Its `Debug` shows the names only:
/// the values are secrets.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentEnv {
    pub env: std::collections::BTreeMap<String, String>,
}

impl std::fmt::Debug for AgentEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentEnv").field("env", &self.env.keys().collect::<Vec<_>>()).finish()
    }
}

/// How a streamed run ended without a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEnd {
    /// The run failed (`code` says how, as the `error` frame would).
    Error,
    /// The run was cancelled.
    Aborted,
}

/// A tool call the agent reported (`{"type":"tool","name":…,"status":…}` and any other
/// fields it wrote, passed through).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolReport {
    pub name: String,
    pub status: String,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

/// Extension frame `stream` (hub → driver): one step of a run's output, `seq` counting from
/// 0 per run. Exactly one of `text` (a delta of the reply), `tool` (a tool report) or `end`
/// (the run ended without a reply: `code` and `message` say why) is present.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamFrame {
    pub event_id: Id,
    pub seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<ToolReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<StreamEnd>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// What a driver declared in its `hello`, and therefore what the hub may send it.
///
/// A connection that never sent `hello` is `legacy`: the reference hub keeps pre-negotiation
/// behaviour for it (nothing is gated), and so does channeld.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerDeclaration {
    pub legacy: bool,
    pub capabilities: Capabilities,
    pub actions: Actions,
    pub extensions: Extensions,
}

/// What to do with an effect for a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectGate {
    Send,
    /// Undeclared live progress (typing, preview): dropped without a word.
    Drop,
    /// Undeclared otherwise: the requester is told why.
    Reject(String),
}

/// Why a command is refused before it reaches the driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandRefusal {
    #[error("driver did not declare commands")]
    CommandsNotDeclared,
    #[error("invoke needs tool_control, which the driver did not declare")]
    ToolControlNotDeclared,
    #[error("request_choice needs choices, which the driver did not declare")]
    ChoicesNotDeclared,
    #[error("a multiple choice needs multi_choice, which the driver did not declare")]
    MultiChoiceNotDeclared,
}

impl PeerDeclaration {
    /// A peer that never sent `hello`.
    pub fn legacy() -> Self {
        Self { legacy: true, ..Self::default() }
    }

    /// The declaration in `hello`, with extensions limited to what we support.
    pub fn from_hello(hello: &Hello, supported: Extensions) -> Self {
        Self {
            legacy: false,
            capabilities: hello.capabilities,
            actions: hello.actions,
            extensions: supported.intersect(Extensions::from_names(&hello.extensions)),
        }
    }

    pub fn effect_gate(&self, effect: &Effect) -> EffectGate {
        if self.legacy || self.actions.allows(effect) {
            EffectGate::Send
        } else if effect.is_live_progress() {
            EffectGate::Drop
        } else {
            EffectGate::Reject(format!("action {} not declared by driver", effect.action()))
        }
    }

    pub fn command_gate(&self, command: &Command) -> Result<(), CommandRefusal> {
        if self.legacy {
            return Ok(());
        }
        if !self.capabilities.commands {
            return Err(CommandRefusal::CommandsNotDeclared);
        }
        match command {
            Command::Invoke { .. } if !self.capabilities.tool_control => {
                Err(CommandRefusal::ToolControlNotDeclared)
            }
            Command::RequestChoice { multiple, .. } => {
                if !self.capabilities.choices {
                    Err(CommandRefusal::ChoicesNotDeclared)
                } else if *multiple && !self.capabilities.multi_choice {
                    Err(CommandRefusal::MultiChoiceNotDeclared)
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Whether a controller `send` (and any proactive outbound) may go to this peer.
    pub fn can_send(&self) -> bool {
        self.legacy || self.capabilities.send
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared(caps: &[&str], actions: &[&str]) -> PeerDeclaration {
        let mut decl = PeerDeclaration::default();
        for cap in caps {
            assert!(decl.capabilities.set(cap, true));
        }
        for action in actions {
            assert!(decl.actions.set(action, true));
        }
        decl
    }

    #[test]
    fn undeclared_progress_is_dropped_other_effects_rejected() {
        let decl = declared(&[], &["reaction"]);
        assert_eq!(decl.effect_gate(&Effect::Typing { active: true }), EffectGate::Drop);
        assert_eq!(decl.effect_gate(&Effect::Preview { text: "x".into() }), EffectGate::Drop);
        let pin = Effect::Pin { message_id: "m".try_into().unwrap() };
        assert!(matches!(decl.effect_gate(&pin), EffectGate::Reject(_)));
        let react = Effect::Reaction {
            message_id: "m".try_into().unwrap(),
            emoji: "eyes".into(),
            remove: false,
        };
        assert_eq!(decl.effect_gate(&react), EffectGate::Send);
    }

    #[test]
    fn commands_need_the_right_capabilities() {
        let notify = Command::Notify { level: "info".into(), text: "hi".into() };
        let invoke = Command::Invoke { name: "x".into(), payload: serde_json::json!({}) };
        assert_eq!(
            declared(&[], &[]).command_gate(&notify),
            Err(CommandRefusal::CommandsNotDeclared)
        );
        assert_eq!(declared(&["commands"], &[]).command_gate(&notify), Ok(()));
        assert_eq!(
            declared(&["commands"], &[]).command_gate(&invoke),
            Err(CommandRefusal::ToolControlNotDeclared)
        );
        assert_eq!(declared(&["commands", "tool_control"], &[]).command_gate(&invoke), Ok(()));
    }

    #[test]
    fn an_agent_env_frame_round_trips_and_its_debug_shows_names_only() {
        let line = r#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"agent_env","env":{"BCN_BOT_TOKEN":"tok-abc123","BCN_BOT_UUID":"bot-1"}}}"#;
        let frame = crate::decode(line.as_bytes()).expect("decodes");
        let crate::Frame::AgentEnv(env) = &frame else { panic!("{frame:?}") };
        assert_eq!(env.env["BCN_BOT_TOKEN"], "tok-abc123");
        let encoded = crate::encode(&frame).unwrap();
        assert_eq!(std::str::from_utf8(&encoded).unwrap().trim_end(), line);
        let shown = format!("{frame:?}");
        assert!(shown.contains("BCN_BOT_TOKEN"), "{shown}");
        assert!(!shown.contains("tok-abc123"), "{shown}");
        assert!(Extensions::from_names(&[AGENT_ENV]).agent_env);
        assert_eq!(Extensions::from_names(&[AGENT_ENV]).names(), [AGENT_ENV]);
    }

    #[test]
    fn legacy_peers_are_not_gated() {
        let legacy = PeerDeclaration::legacy();
        assert_eq!(legacy.effect_gate(&Effect::Typing { active: true }), EffectGate::Send);
        assert!(legacy.can_send());
    }

    #[test]
    fn operator_action_names_are_lowercase_words() {
        for good in ["resume", "relogin_qr", "a1"] {
            assert!(valid_operator_action_name(good), "{good}");
        }
        let long = "a".repeat(MAX_OPERATOR_ACTION_NAME + 1);
        for bad in ["", "Resume", "1st", "re-login", "re login", long.as_str()] {
            assert!(!valid_operator_action_name(bad), "{bad}");
        }
    }

    #[test]
    fn every_extension_name_round_trips() {
        let all = Extensions::all();
        assert_eq!(all.names(), ALL);
        assert_eq!(Extensions::from_names(ALL), all);
        let only = Extensions::from_names(&[OPERATOR_ACTION]);
        assert!(only.operator_action && !only.accepted);
    }

    #[test]
    fn negotiation_is_an_intersection() {
        let offered = Extensions::from_names(&["accepted", "future_thing"]);
        let agreed = Extensions::all().intersect(offered);
        assert_eq!(agreed.names(), vec!["accepted".to_owned()]);
    }
}
