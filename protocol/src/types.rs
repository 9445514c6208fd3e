//! Payloads carried inside frames: targets, participants, messages, receipts, health,
//! capability declarations, effects, commands, incoming events and control actions.
//!
//! Field names, nullability and omission rules follow the reference implementation exactly:
//! nullable fields are written as `null`, "omitted when empty" fields are skipped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{ChannelId, Id};

/// A string→string map; omitted from the wire when empty.
pub type Metadata = BTreeMap<String, String>;

fn is_false(value: &bool) -> bool {
    !*value
}

/// Where a message goes or came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MessageTarget {
    pub channel: ChannelId,
    pub conversation: Id,
    #[serde(default)]
    pub thread: Option<Id>,
    #[serde(default)]
    pub reply_to: Option<Id>,
}

impl MessageTarget {
    pub fn new(channel: ChannelId, conversation: Id) -> Self {
        Self { channel, conversation, thread: None, reply_to: None }
    }
}

/// A person or bot on the platform.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Participant {
    pub id: Id,
    #[serde(default)]
    pub display_name: Option<String>,
    #[serde(default)]
    pub handle: Option<String>,
}

impl Participant {
    pub fn new(id: Id) -> Self {
        Self { id, display_name: None, handle: None }
    }
}

/// A URL-backed attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawAttachment")]
pub struct Attachment {
    pub url: String,
    pub name: Option<String>,
    pub mime: Option<String>,
}

#[derive(Deserialize)]
struct RawAttachment {
    url: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    mime: Option<String>,
}

impl TryFrom<RawAttachment> for Attachment {
    type Error = BodyError;
    fn try_from(raw: RawAttachment) -> Result<Self, BodyError> {
        if raw.url.is_empty() {
            return Err(BodyError::EmptyUrl);
        }
        Ok(Self { url: raw.url, name: raw.name, mime: raw.mime })
    }
}

/// Why a message body is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("body needs non-empty text or at least one attachment")]
    Empty,
    #[error("body text contains a NUL character")]
    Nul,
    #[error("attachment url is empty")]
    EmptyUrl,
}

/// Text plus attachments. Valid only with non-empty text or at least one attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawBody")]
pub struct MessageBody {
    text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    attachments: Vec<Attachment>,
}

#[derive(Deserialize)]
struct RawBody {
    #[serde(default)]
    text: String,
    #[serde(default)]
    attachments: Vec<Attachment>,
}

impl TryFrom<RawBody> for MessageBody {
    type Error = BodyError;
    fn try_from(raw: RawBody) -> Result<Self, BodyError> {
        MessageBody::with_attachments(raw.text, raw.attachments)
    }
}

impl MessageBody {
    /// A text-only body.
    pub fn text(text: impl Into<String>) -> Result<Self, BodyError> {
        Self::with_attachments(text.into(), Vec::new())
    }

    pub fn with_attachments(text: String, attachments: Vec<Attachment>) -> Result<Self, BodyError> {
        if text.contains('\0') {
            return Err(BodyError::Nul);
        }
        if text.is_empty() && attachments.is_empty() {
            return Err(BodyError::Empty);
        }
        Ok(Self { text, attachments })
    }

    pub fn text_str(&self) -> &str {
        &self.text
    }

    pub fn attachments(&self) -> &[Attachment] {
        &self.attachments
    }
}

/// A message a driver received from its platform.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboundMessage {
    pub id: Id,
    pub target: MessageTarget,
    pub sender: Participant,
    pub body: MessageBody,
    #[serde(default)]
    pub timestamp_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: Metadata,
}

/// A message the hub asks a driver to post.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboundMessage {
    pub target: MessageTarget,
    pub body: MessageBody,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: Metadata,
}

/// What a driver reports after posting a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryReceipt {
    pub channel: ChannelId,
    pub message_id: Id,
    pub target: MessageTarget,
    #[serde(default)]
    pub timestamp_ms: Option<u64>,
}

/// Coarse health; the one capitalised enum on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HealthState {
    Ready,
    Degraded,
    Unavailable,
}

impl HealthState {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Ready => "Ready",
            HealthState::Degraded => "Degraded",
            HealthState::Unavailable => "Unavailable",
        }
    }
}

/// A sanitised health report. `detail` must never carry a secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub state: HealthState,
    #[serde(default)]
    pub detail: Option<String>,
    /// Extension `health_status`: a structured reason. Sent only to peers that declared it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<HealthStatus>,
}

impl Health {
    pub fn new(state: HealthState, detail: Option<String>) -> Self {
        Self { state, detail, status: None }
    }

    pub fn ready() -> Self {
        Self::new(HealthState::Ready, None)
    }
}

/// Extension `health_status`: the structured reason behind a [`Health`] report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthStatus {
    /// Platform transport state, e.g. `connected`, `connecting`, `disconnected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// Authentication state, e.g. `ok`, `expired`, `rejected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
    /// Seconds since the platform last sent anything (message or keepalive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_seconds: Option<u64>,
    /// Outbound messages waiting to be posted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<u64>,
    /// Reconnect attempts since the transport was last up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Why an `Unavailable` driver cannot recover by itself, machine-readable: only an
    /// operator can fix it. See [`UnavailableReason`] for the values channeld drivers send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The machine-readable reasons behind an `Unavailable` health (`health.status.reason`): each
/// is a condition retrying cannot fix; an operator has to act.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnavailableReason {
    /// The platform refused the driver's credentials (wrong token or password, revoked key).
    AuthRejected,
    /// The credentials expired (a session token that needs a new login or QR scan).
    AuthExpired,
    /// Another client took over the platform session (the platform allows one connection
    /// per bot and this one was displaced).
    Fenced,
    /// The platform refused the driver's setup for a reason other than credentials (a queue
    /// declared with other arguments, a missing permission on a resource).
    SetupRefused,
}

impl UnavailableReason {
    /// Every reason, in wire form.
    pub const ALL: [UnavailableReason; 4] = [
        UnavailableReason::AuthRejected,
        UnavailableReason::AuthExpired,
        UnavailableReason::Fenced,
        UnavailableReason::SetupRefused,
    ];

    /// The wire value of `health.status.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            UnavailableReason::AuthRejected => "auth_rejected",
            UnavailableReason::AuthExpired => "auth_expired",
            UnavailableReason::Fenced => "fenced",
            UnavailableReason::SetupRefused => "setup_refused",
        }
    }
}

impl std::fmt::Display for UnavailableReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

macro_rules! flag_set {
    ($(#[$meta:meta])* $name:ident { $($(#[$field_meta:meta])* $field:ident),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(default)]
        pub struct $name {
            $(
                $(#[$field_meta])*
                #[serde(skip_serializing_if = "is_false")]
                pub $field: bool,
            )+
        }

        impl $name {
            /// Every flag name, in wire order.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($field)),+];

            /// True when no flag is set.
            pub fn is_empty(&self) -> bool {
                !($(self.$field)||+)
            }

            /// The names of the flags that are set, in wire order.
            pub fn enabled(&self) -> Vec<&'static str> {
                let mut names = Vec::new();
                $(if self.$field { names.push(stringify!($field)); })+
                names
            }

            /// Looks a flag up by its wire name.
            pub fn get(&self, name: &str) -> Option<bool> {
                match name {
                    $(stringify!($field) => Some(self.$field),)+
                    _ => None,
                }
            }

            /// Sets a flag by its wire name; false if the name is unknown.
            pub fn set(&mut self, name: &str, value: bool) -> bool {
                match name {
                    $(stringify!($field) => { self.$field = value; true })+
                    _ => false,
                }
            }
        }
    };
}

flag_set! {
    /// What a driver can do. Each flag defaults to false when omitted; false flags are not
    /// written. Flags that only make sense with another one are listed in
    /// [`Capabilities::REQUIRES`] and checked by [`Capabilities::unmet_requirements`] (the
    /// driver SDK refuses to start with an inconsistent declaration).
    ///
    /// The hub gates on `send`, `commands`, `choices`, `multi_choice` and `tool_control`; the
    /// other flags describe the platform to the agent (`CHANNELD_CAPS`) and to operators.
    Capabilities {
        /// Reports platform messages as `inbound` (and events as `inbound_event`).
        receive,
        /// Posts proactive messages: the hub sends `outbound` frames only to drivers with it.
        send,
        /// Conversations can have several participants (group chats, channels).
        group,
        /// Messages can belong to a thread: `target.thread` is meaningful both ways.
        threads,
        /// The platform carries images or other media (see the attachment flags).
        media,
        /// Attachments both ways (implies nothing by itself: pair it with `receive` or `send`).
        attachments,
        /// Inbound messages may carry attachments (URLs). Needs `receive`.
        receive_attachments,
        /// Posts may carry attachments. Needs `send`.
        send_attachments,
        /// The platform carries voice or audio messages.
        audio,
        /// The platform carries video.
        video,
        /// The platform has reactions (inbound `reaction` events; the effect needs the
        /// `reaction` action).
        reactions,
        /// The platform shows typing indicators (the effect needs the `typing` action).
        typing,
        /// Replies can be shown while they are being written (with the `preview` action).
        streaming,
        /// A posted message can be updated in place as a draft grows (with `edit`).
        draft_updates,
        /// A long streamed reply may span several platform messages.
        multi_message_streaming,
        /// Presents runtime commands (`request_input`, `request_approval`, `notify`) to a
        /// person and answers with `command_result`. Without it every command is rejected.
        commands,
        /// Presents `request_choice` with its options. Needs `commands`.
        choices,
        /// A choice may allow several options (`multiple: true`). Needs `choices`.
        multi_choice,
        /// Performs `invoke` platform operations and returns their value. Needs `commands`.
        tool_control,
        /// The driver polls the platform (informational).
        polling,
        /// The driver long-polls the platform (informational).
        long_polling,
        /// The driver holds a WebSocket to the platform (informational).
        websocket,
        /// The platform pushes to a webhook the driver serves (informational).
        webhook,
    }
}

/// Why a capability declaration is inconsistent: `flag` was declared without any of the
/// flags it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnmetRequirement {
    pub flag: &'static str,
    /// At least one of these must be declared too.
    pub any_of: &'static [&'static str],
}

impl std::fmt::Display for UnmetRequirement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} needs {}", self.flag, self.any_of.join(" or "))
    }
}

impl std::error::Error for UnmetRequirement {}

impl Capabilities {
    /// Which flags need which others: `(flag, at least one of these)`. The one place these
    /// rules live: the SDK checks every driver's declaration with it before saying `hello`,
    /// and the conformance suite asserts it on the wire.
    pub const REQUIRES: &'static [(&'static str, &'static [&'static str])] = &[
        ("multi_choice", &["choices"]),
        ("choices", &["commands"]),
        ("tool_control", &["commands"]),
        ("receive_attachments", &["receive"]),
        ("send_attachments", &["send"]),
        ("attachments", &["receive", "send"]),
    ];

    /// The rules of [`REQUIRES`](Self::REQUIRES) this declaration breaks, in that order;
    /// empty when it is consistent.
    pub fn unmet_requirements(&self) -> Vec<UnmetRequirement> {
        let declared = |flag: &str| self.get(flag) == Some(true);
        Self::REQUIRES
            .iter()
            .filter(|(flag, any_of)| declared(flag) && !any_of.iter().any(|other| declared(other)))
            .map(|&(flag, any_of)| UnmetRequirement { flag, any_of })
            .collect()
    }
}

flag_set! {
    /// Which live effects a driver accepts. Each effect needs the action of the same name; the
    /// hub drops an undeclared `typing`/`preview` and refuses any other undeclared effect.
    Actions {
        /// Show or clear a typing indicator.
        typing,
        /// Show a reply while it is being written.
        preview,
        /// Add or remove a reaction on a message.
        reaction,
        /// Replace a posted message's body.
        edit,
        /// Delete a posted message.
        delete,
        /// Mark a message as read.
        mark_read,
        /// Pin a message.
        pin,
        /// Unpin a message.
        unpin,
        /// Redact a message (remove its content, keep a trace).
        redact,
    }
}

impl Actions {
    /// Whether `effect` was declared.
    pub fn allows(&self, effect: &Effect) -> bool {
        self.get(effect.action()).unwrap_or(false)
    }
}

/// A live side effect on the platform.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Effect {
    Typing { active: bool },
    Preview { text: String },
    Reaction { message_id: Id, emoji: String, remove: bool },
    Edit { message_id: Id, body: MessageBody },
    Delete { message_id: Id },
    MarkRead { message_id: Id },
    Pin { message_id: Id },
    Unpin { message_id: Id },
    Redact { message_id: Id, reason: Option<String> },
}

impl Effect {
    /// The action name that gates this effect.
    pub fn action(&self) -> &'static str {
        match self {
            Effect::Typing { .. } => "typing",
            Effect::Preview { .. } => "preview",
            Effect::Reaction { .. } => "reaction",
            Effect::Edit { .. } => "edit",
            Effect::Delete { .. } => "delete",
            Effect::MarkRead { .. } => "mark_read",
            Effect::Pin { .. } => "pin",
            Effect::Unpin { .. } => "unpin",
            Effect::Redact { .. } => "redact",
        }
    }

    /// Live progress effects may be dropped silently when undeclared; the others are
    /// rejected.
    pub fn is_live_progress(&self) -> bool {
        matches!(self, Effect::Typing { .. } | Effect::Preview { .. })
    }
}

/// One option of a `request_choice` command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    pub id: Id,
    pub label: String,
}

/// A provider-neutral runtime command a driver presents to a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Command {
    RequestInput {
        prompt: String,
    },
    RequestApproval {
        tool: String,
        arguments: serde_json::Value,
    },
    RequestChoice {
        question: String,
        choices: Vec<Choice>,
        #[serde(default, skip_serializing_if = "is_false")]
        multiple: bool,
    },
    Notify {
        level: String,
        text: String,
    },
    Invoke {
        name: String,
        payload: serde_json::Value,
    },
}

impl Command {
    pub fn kind(&self) -> &'static str {
        match self {
            Command::RequestInput { .. } => "request_input",
            Command::RequestApproval { .. } => "request_approval",
            Command::RequestChoice { .. } => "request_choice",
            Command::Notify { .. } => "notify",
            Command::Invoke { .. } => "invoke",
        }
    }
}

/// A driver's answer to a [`Command`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandResult {
    Accepted,
    Rejected { reason: String },
    Value { payload: serde_json::Value },
}

impl CommandResult {
    pub fn rejected(reason: impl Into<String>) -> Self {
        CommandResult::Rejected { reason: reason.into() }
    }
}

/// A command's outcome with who answered it (when the driver negotiated `responder`): what
/// a driver returns and what the hub hands back to the runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandAnswer {
    pub result: CommandResult,
    pub responder: Option<Participant>,
}

impl CommandAnswer {
    pub fn rejected(reason: impl Into<String>) -> Self {
        Self { result: CommandResult::rejected(reason), responder: None }
    }
}

/// Who, where and when for an [`IncomingEvent`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventContext {
    pub target: MessageTarget,
    #[serde(default)]
    pub participant: Option<Participant>,
    #[serde(default)]
    pub timestamp_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: Metadata,
}

/// A provider-neutral platform event that is not a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum IncomingEvent {
    Reaction { context: EventContext, message_id: Id, emoji: String, added: bool },
    Typing { context: EventContext, active: bool },
    MessageEdited { context: EventContext, message_id: Id, body: MessageBody },
    MessageDeleted { context: EventContext, message_id: Id },
    Read { context: EventContext, message_id: Id },
}

impl IncomingEvent {
    pub fn context(&self) -> &EventContext {
        match self {
            IncomingEvent::Reaction { context, .. }
            | IncomingEvent::Typing { context, .. }
            | IncomingEvent::MessageEdited { context, .. }
            | IncomingEvent::MessageDeleted { context, .. }
            | IncomingEvent::Read { context, .. } => context,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            IncomingEvent::Reaction { .. } => "reaction",
            IncomingEvent::Typing { .. } => "typing",
            IncomingEvent::MessageEdited { .. } => "message_edited",
            IncomingEvent::MessageDeleted { .. } => "message_deleted",
            IncomingEvent::Read { .. } => "read",
        }
    }
}

/// Lifecycle notices carried by the `event` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LifecycleEvent {
    Connected,
    Disconnected,
    Heartbeat,
    RetryScheduled { attempt: u32 },
}

/// What a controller asks the hub to do on a channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlAction {
    Send {
        message: OutboundMessage,
    },
    Effect {
        target: MessageTarget,
        effect: Effect,
    },
    Command {
        session: Id,
        command_id: Id,
        command: Command,
        #[serde(default)]
        target: Option<MessageTarget>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_requirement_names_real_flags() {
        for (flag, any_of) in Capabilities::REQUIRES {
            assert!(Capabilities::NAMES.contains(flag), "{flag}");
            for other in *any_of {
                assert!(Capabilities::NAMES.contains(other), "{other}");
            }
        }
    }

    #[test]
    fn unmet_requirements_name_the_flag_and_what_it_needs() {
        let caps = Capabilities {
            receive: true,
            multi_choice: true,
            send_attachments: true,
            ..Default::default()
        };
        let problems: Vec<String> =
            caps.unmet_requirements().iter().map(ToString::to_string).collect();
        assert_eq!(problems, ["multi_choice needs choices", "send_attachments needs send"]);
        let lonely = Capabilities { attachments: true, ..Default::default() };
        assert_eq!(lonely.unmet_requirements()[0].to_string(), "attachments needs receive or send");
        let fine = Capabilities {
            receive: true,
            send: true,
            commands: true,
            choices: true,
            multi_choice: true,
            tool_control: true,
            receive_attachments: true,
            attachments: true,
            ..Default::default()
        };
        assert!(fine.unmet_requirements().is_empty());
    }

    #[test]
    fn unavailable_reasons_are_snake_case_on_the_wire() {
        let names: Vec<&str> = UnavailableReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["auth_rejected", "auth_expired", "fenced", "setup_refused"]);
    }
}
