//! Pure mapping between MQTT and channeld frames: the topic templates (who sent a message and
//! where a reply goes), the inbound payload format and the outbound payload.
//!
//! Identity comes from the topic, never from the payload: the broker's ACL decides who may
//! publish on `…/in/alice/…`, so the topic is the one claim the driver can trust. A payload
//! that names a sender is not believed; [`InboundPayload::claimed_sender`] only lets the
//! platform side log the mismatch.
//!
//! Inbound payload: a JSON object `{"text": "...", "thread": "...", "id": "..."}` (`thread`
//! and `id` optional, strings or numbers, other fields ignored) or raw UTF-8 text (one
//! trailing newline dropped). A payload that starts with `{` must be valid JSON: one that is
//! not is refused rather than taken as text, because its `id` would be lost and every
//! redelivery would run again. Outbound payload: see [`outbound_payload`].

use channeld_driver_sdk::PostKind;
use channeld_driver_sdk::protocol::frame::Inbound;
use channeld_driver_sdk::protocol::types::{
    Attachment, BodyError, InboundMessage, MessageBody, MessageTarget, Metadata, OutboundMessage,
    Participant,
};
use channeld_driver_sdk::protocol::{
    ChannelId, EncodeError, Frame, Id, IdError, MAX_ID_BYTES, encode,
};
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The placeholder for the sender's level in the inbound topic template.
pub const SENDER: &str = "{sender}";
/// The placeholder for the conversation's level in either template.
pub const CONVERSATION: &str = "{conversation}";
/// Inbound metadata key holding the topic the message arrived on.
pub const META_TOPIC: &str = "mqtt_topic";

/// Why a topic template is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("is empty")]
    Empty,
    #[error("contains a NUL character")]
    Nul,
    #[error("must contain {SENDER} exactly once")]
    Sender,
    #[error("contains {0} more than once")]
    Repeated(&'static str),
    #[error("level {0:?} is not allowed here: a placeholder, `+` or `#` must be a whole level")]
    BadLevel(String),
    #[error("contains {0}, which only the inbound template may use")]
    InboundOnly(String),
    #[error("contains the wildcard {0:?}; a topic to publish to has none")]
    Wildcard(String),
}

/// Why an outbound topic could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("conversation {0:?} cannot be a topic level (it contains '/', '+', '#' or NUL)")]
    Conversation(String),
}

/// One level of a parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Level {
    Literal(String),
    /// `+`: any single level (inbound only).
    Any,
    Sender,
    Conversation,
}

fn parse_levels(raw: &str) -> Result<Vec<Level>, TemplateError> {
    if raw.is_empty() {
        return Err(TemplateError::Empty);
    }
    if raw.contains('\0') {
        return Err(TemplateError::Nul);
    }
    let mut seen_sender = false;
    let mut seen_conversation = false;
    raw.split('/')
        .map(|level| match level {
            SENDER if seen_sender => Err(TemplateError::Repeated(SENDER)),
            SENDER => {
                seen_sender = true;
                Ok(Level::Sender)
            }
            CONVERSATION if seen_conversation => Err(TemplateError::Repeated(CONVERSATION)),
            CONVERSATION => {
                seen_conversation = true;
                Ok(Level::Conversation)
            }
            "+" => Ok(Level::Any),
            _ if level.contains(['{', '}', '+', '#']) => {
                Err(TemplateError::BadLevel(level.to_owned()))
            }
            _ => Ok(Level::Literal(level.to_owned())),
        })
        .collect()
}

/// The inbound topic template, e.g. `lab/in/{sender}/{conversation}`: it names the levels that
/// carry the sender and the conversation. Without `{conversation}` the conversation is the
/// sender (a direct chat). `+` levels match anything and carry nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityTemplate {
    levels: Vec<Level>,
}

/// Who sent a message and where, as read from its topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicIdentity<'a> {
    pub sender: &'a str,
    pub conversation: &'a str,
}

impl IdentityTemplate {
    pub fn parse(raw: &str) -> Result<Self, TemplateError> {
        let levels = parse_levels(raw)?;
        if !levels.contains(&Level::Sender) {
            return Err(TemplateError::Sender);
        }
        Ok(Self { levels })
    }

    /// The subscription filter that covers every topic this template matches.
    pub fn filter(&self) -> String {
        let levels: Vec<&str> = self
            .levels
            .iter()
            .map(|level| match level {
                Level::Literal(text) => text.as_str(),
                Level::Any | Level::Sender | Level::Conversation => "+",
            })
            .collect();
        levels.join("/")
    }

    /// Reads sender and conversation from `topic`; `None` when the topic does not match or a
    /// placeholder level is empty.
    pub fn identify<'a>(&self, topic: &'a str) -> Option<TopicIdentity<'a>> {
        let mut sender = None;
        let mut conversation = None;
        let mut levels = topic.split('/');
        for expected in &self.levels {
            let level = levels.next()?;
            match expected {
                Level::Literal(text) if text != level => return None,
                Level::Literal(_) | Level::Any => {}
                Level::Sender if level.is_empty() => return None,
                Level::Sender => sender = Some(level),
                Level::Conversation if level.is_empty() => return None,
                Level::Conversation => conversation = Some(level),
            }
        }
        if levels.next().is_some() {
            return None;
        }
        let sender = sender?;
        Some(TopicIdentity { sender, conversation: conversation.unwrap_or(sender) })
    }
}

/// The outbound topic template, e.g. `lab/out/{conversation}`: literal levels and at most one
/// `{conversation}`, no wildcards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundTemplate {
    levels: Vec<Level>,
}

impl OutboundTemplate {
    pub fn parse(raw: &str) -> Result<Self, TemplateError> {
        let levels = parse_levels(raw)?;
        for level in &levels {
            match level {
                Level::Any => return Err(TemplateError::Wildcard("+".into())),
                Level::Sender => return Err(TemplateError::InboundOnly(SENDER.into())),
                Level::Literal(_) | Level::Conversation => {}
            }
        }
        Ok(Self { levels })
    }

    /// The topic for a message to `conversation`. The conversation must be one topic level, so
    /// a hub request cannot publish outside the template.
    pub fn render(&self, conversation: &str) -> Result<String, TopicError> {
        if conversation.is_empty() || conversation.contains(['/', '+', '#', '\0']) {
            return Err(TopicError::Conversation(conversation.to_owned()));
        }
        let levels: Vec<&str> = self
            .levels
            .iter()
            .map(|level| match level {
                Level::Literal(text) => text.as_str(),
                _ => conversation,
            })
            .collect();
        Ok(levels.join("/"))
    }
}

/// A decoded inbound payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundPayload {
    pub text: String,
    pub thread: Option<String>,
    /// The publisher's message id: the dedupe key for broker redeliveries.
    pub id: Option<String>,
    /// A sender the payload names (`"sender"`). Never used as the sender.
    pub claimed_sender: Option<String>,
}

/// Why a payload is unusable. Such a message is acknowledged and dropped: the broker would
/// otherwise redeliver it forever.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("payload is empty")]
    Empty,
    /// Starts with `{` but does not parse (bad syntax, a number out of range, nesting deeper
    /// than the parser allows).
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    #[error("payload is neither a JSON object nor UTF-8 text")]
    NotUtf8,
    #[error("JSON payload has no non-empty \"text\" string")]
    MissingText,
    #[error("JSON payload field \"{0}\" must be a string or a number")]
    BadField(&'static str),
}

/// Decodes a payload: a JSON object with `text` (and optional `thread`, `id`), or raw text.
pub fn parse_payload(bytes: &[u8]) -> Result<InboundPayload, PayloadError> {
    if bytes.trim_ascii_start().starts_with(b"{") {
        let object = serde_json::from_slice::<Map<String, Value>>(bytes)
            .map_err(|err| PayloadError::InvalidJson(err.to_string()))?;
        return from_object(&object);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| PayloadError::NotUtf8)?;
    let text = text.strip_suffix('\n').map_or(text, |t| t.strip_suffix('\r').unwrap_or(t));
    if text.trim().is_empty() {
        return Err(PayloadError::Empty);
    }
    Ok(InboundPayload { text: text.to_owned(), thread: None, id: None, claimed_sender: None })
}

fn from_object(object: &Map<String, Value>) -> Result<InboundPayload, PayloadError> {
    let text = match object.get("text") {
        Some(Value::String(text)) if !text.trim().is_empty() => text.clone(),
        _ => return Err(PayloadError::MissingText),
    };
    let claimed_sender = match object.get("sender") {
        Some(Value::String(sender)) => Some(sender.clone()),
        Some(Value::Object(sender)) => sender.get("id").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    };
    Ok(InboundPayload {
        text,
        thread: scalar(object, "thread")?,
        id: scalar(object, "id")?,
        claimed_sender,
    })
}

/// A string or number field as a string; absent, null and `""` are `None`.
fn scalar(
    object: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, PayloadError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(value)) if value.is_empty() => Ok(None),
        Some(Value::String(value)) => Ok(Some(value.clone())),
        Some(Value::Number(value)) => Ok(Some(value.to_string())),
        Some(_) => Err(PayloadError::BadField(field)),
    }
}

/// Why a matched message cannot become an inbound frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Payload(#[from] PayloadError),
    #[error("{what} is not a valid id: {source}")]
    Id { what: &'static str, source: IdError },
    #[error("message text is invalid: {0}")]
    Body(#[from] BodyError),
    #[error("the inbound frame would be {0} bytes, over the line limit")]
    TooLarge(usize),
    #[error("the inbound frame does not encode: {0}")]
    Encode(String),
}

/// The event id of a message: `<sender>/<payload id>` when the payload has an id, so a broker
/// redelivery is recognised by the hub and one sender cannot suppress another's message by
/// reusing its id. When that is longer than an id may be, `sha256-<hex>` of it: still the
/// same for every redelivery, still distinct per sender. Without an id, `generated` (unique
/// per delivery): such messages are at least once, and a redelivery after a failure may run
/// twice.
pub fn event_id(
    sender: &str,
    payload_id: Option<&str>,
    generated: &str,
) -> Result<Id, ConvertError> {
    let raw = match payload_id {
        Some(id) => bounded(format!("{sender}/{id}")),
        None => generated.to_owned(),
    };
    Id::new(raw).map_err(|source| ConvertError::Id { what: "event id", source })
}

/// `raw` itself when it fits in an id, else `sha256-<hex of raw>`.
fn bounded(raw: String) -> String {
    if raw.len() <= MAX_ID_BYTES {
        return raw;
    }
    format!("sha256-{}", hex(&Sha256::digest(raw.as_bytes())))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Builds the inbound message for a payload on a matched topic, and checks that its frame
/// fits on one line.
///
/// The frame depends only on topic and payload (MQTT 3.1.1 carries no timestamp, and the
/// receipt time is left out), so a broker redelivery is byte-identical and the hub's ledger
/// recognises it as the same event rather than a conflicting reuse of its id.
pub fn inbound_message(
    channel: &ChannelId,
    topic: &str,
    identity: TopicIdentity<'_>,
    payload: InboundPayload,
    generated_id: &str,
) -> Result<InboundMessage, ConvertError> {
    let id_of = |what: &'static str, value: &str| {
        Id::new(value).map_err(|source| ConvertError::Id { what, source })
    };
    let sender = id_of("sender", identity.sender)?;
    let conversation = id_of("conversation", identity.conversation)?;
    let thread = payload.thread.as_deref().map(|thread| id_of("thread", thread)).transpose()?;
    let id = event_id(identity.sender, payload.id.as_deref(), generated_id)?;
    let mut target = MessageTarget::new(channel.clone(), conversation);
    target.thread = thread;
    let message = InboundMessage {
        id,
        target,
        sender: Participant::new(sender),
        body: MessageBody::text(payload.text)?,
        timestamp_ms: None,
        metadata: Metadata::from([(META_TOPIC.to_owned(), topic.to_owned())]),
    };
    let frame = Frame::Inbound(Inbound { event_id: message.id.clone(), message: message.clone() });
    match encode(&frame) {
        Ok(_) => {}
        Err(EncodeError::TooLong { len, .. }) => return Err(ConvertError::TooLarge(len)),
        Err(err @ EncodeError::Json(_)) => return Err(ConvertError::Encode(err.to_string())),
    }
    Ok(message)
}

/// The message id a post is published with and receipted as: `reply-<event id>` for a
/// reply, `send-<request id>` for a proactive send (a SHA-256 digest when that is too long).
/// Deterministic, so a subscriber can drop a message the hub had re-sent after a restart.
pub fn outbound_message_id(kind: &PostKind) -> Id {
    let (prefix, source) = match kind {
        PostKind::Reply { event_id } => ("reply", event_id),
        PostKind::Proactive { request_id } => ("send", request_id),
    };
    let plain = format!("{prefix}-{source}");
    let raw = if plain.len() <= MAX_ID_BYTES {
        plain
    } else {
        format!("{prefix}-sha256-{}", hex(&Sha256::digest(source.as_str().as_bytes())))
    };
    Id::new(raw).expect("a prefixed non-empty id without NUL within the length limit")
}

/// The JSON published for an outbound message:
/// `{"id","text","conversation","thread","reply_to"}` (`thread` and `reply_to` null when
/// absent), plus `attachments` and `metadata` when not empty.
#[derive(Debug, Serialize)]
struct OutboundPayload<'a> {
    id: &'a str,
    text: &'a str,
    conversation: &'a str,
    thread: Option<&'a str>,
    reply_to: Option<&'a str>,
    #[serde(skip_serializing_if = "<[Attachment]>::is_empty")]
    attachments: &'a [Attachment],
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    metadata: &'a Metadata,
}

/// Serialises an outbound message as published on the outbound topic.
pub fn outbound_payload(message_id: &Id, message: &OutboundMessage) -> Vec<u8> {
    let target = &message.target;
    let payload = OutboundPayload {
        id: message_id.as_str(),
        text: message.body.text_str(),
        conversation: target.conversation.as_str(),
        thread: target.thread.as_ref().map(Id::as_str),
        reply_to: target.reply_to.as_ref().map(Id::as_str),
        attachments: message.body.attachments(),
        metadata: &message.metadata,
    };
    serde_json::to_vec(&payload).expect("a struct of strings always serialises")
}
