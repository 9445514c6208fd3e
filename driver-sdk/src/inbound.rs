//! A small builder for the message a driver reports: `Inbound::text(conversation, sender,
//! text)` plus optional parts, validated in one step with one error type.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use channeld_protocol::types::{
    Attachment, BodyError, InboundMessage, MessageBody, MessageTarget, Metadata, Participant,
};
use channeld_protocol::{ChannelId, Id, IdError};

/// Why an [`Inbound`] cannot become a message: a part that is not a valid id (empty, over
/// 256 bytes, containing NUL) or an empty body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboundError {
    #[error("{part} is not a valid id: {source}")]
    Id { part: &'static str, source: IdError },
    #[error("message body is invalid: {0}")]
    Body(#[from] BodyError),
}

/// A platform message to report, built from plain strings:
///
/// ```
/// # use channeld_driver_sdk::Inbound;
/// # use channeld_driver_sdk::protocol::ChannelId;
/// let message = Inbound::text("room-1", "alice", "deploy status?")
///     .id("msg-1700000000.0001")
///     .thread("thread-7")
///     .sender_name("Alice")
///     .build(&ChannelId::new("demo.a").unwrap())
///     .unwrap();
/// assert_eq!(message.id, "msg-1700000000.0001");
/// assert_eq!(message.target.conversation, "room-1");
/// ```
///
/// [`Hub::inbound`](crate::Hub::inbound) takes it directly (it knows the channel). The id is
/// the event id, the hub's dedupe key: give the platform's message id, so a redelivery is
/// recognised. Without one the SDK makes a fresh id, and a redelivered copy runs again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbound {
    conversation: String,
    sender: String,
    text: String,
    id: Option<String>,
    thread: Option<String>,
    sender_name: Option<String>,
    sender_handle: Option<String>,
    timestamp_ms: Option<u64>,
    metadata: Metadata,
    attachments: Vec<Attachment>,
}

impl Inbound {
    /// A text message from `sender` in `conversation`.
    pub fn text(
        conversation: impl Into<String>,
        sender: impl Into<String>,
        text: impl Into<String>,
    ) -> Self {
        Self {
            conversation: conversation.into(),
            sender: sender.into(),
            text: text.into(),
            id: None,
            thread: None,
            sender_name: None,
            sender_handle: None,
            timestamp_ms: None,
            metadata: Metadata::new(),
            attachments: Vec::new(),
        }
    }

    /// The platform's message id (the event id).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// The thread the message belongs to (declare `threads`).
    pub fn thread(mut self, thread: impl Into<String>) -> Self {
        self.thread = Some(thread.into());
        self
    }

    /// The sender's display name.
    pub fn sender_name(mut self, name: impl Into<String>) -> Self {
        self.sender_name = Some(name.into());
        self
    }

    /// The sender's handle (`@alice`).
    pub fn sender_handle(mut self, handle: impl Into<String>) -> Self {
        self.sender_handle = Some(handle.into());
        self
    }

    /// When the platform says the message was sent, in Unix milliseconds.
    pub fn timestamp_ms(mut self, ms: u64) -> Self {
        self.timestamp_ms = Some(ms);
        self
    }

    /// A string key/value for the agent (`slack.team`, `mqtt_topic`, …).
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// An attachment by URL (declare `receive_attachments`).
    pub fn attachment(
        mut self,
        url: impl Into<String>,
        name: Option<String>,
        mime: Option<String>,
    ) -> Self {
        self.attachments.push(Attachment { url: url.into(), name, mime });
        self
    }

    /// The message for `channel`, validated.
    pub fn build(self, channel: &ChannelId) -> Result<InboundMessage, InboundError> {
        let id_of = |part: &'static str, value: String| {
            Id::new(value).map_err(|source| InboundError::Id { part, source })
        };
        let id = match self.id {
            Some(id) => id_of("message id", id)?,
            None => id_of("message id", generated_id())?,
        };
        let mut target =
            MessageTarget::new(channel.clone(), id_of("conversation", self.conversation)?);
        target.thread = self.thread.map(|thread| id_of("thread", thread)).transpose()?;
        let mut sender = Participant::new(id_of("sender", self.sender)?);
        sender.display_name = self.sender_name;
        sender.handle = self.sender_handle;
        if self.attachments.iter().any(|a| a.url.is_empty()) {
            return Err(InboundError::Body(BodyError::EmptyUrl));
        }
        Ok(InboundMessage {
            id,
            target,
            sender,
            body: MessageBody::with_attachments(self.text, self.attachments)?,
            timestamp_ms: self.timestamp_ms,
            metadata: self.metadata,
        })
    }
}

/// `gen-<pid>-<start µs>-<n>`: unique per process start and message.
fn generated_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let start = *START
        .get_or_init(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros()));
    format!("gen-{}-{start:x}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel() -> ChannelId {
        ChannelId::new("demo.a").unwrap()
    }

    #[test]
    fn every_part_lands_where_it_belongs() {
        let message = Inbound::text("room", "alice", "hi")
            .id("m-1")
            .thread("t-1")
            .sender_name("Alice")
            .sender_handle("@alice")
            .timestamp_ms(1_700_000_000_000)
            .metadata("k", "v")
            .attachment("https://example.invalid/a.png", Some("a.png".into()), None)
            .build(&channel())
            .unwrap();
        assert_eq!(message.id, "m-1");
        assert_eq!(message.target.channel, channel());
        assert_eq!(message.target.thread.as_ref().unwrap(), "t-1");
        assert_eq!(message.sender.display_name.as_deref(), Some("Alice"));
        assert_eq!(message.sender.handle.as_deref(), Some("@alice"));
        assert_eq!(message.timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(message.metadata["k"], "v");
        assert_eq!(message.body.attachments().len(), 1);
    }

    #[test]
    fn invalid_parts_are_named() {
        let err = Inbound::text("", "alice", "hi").build(&channel()).unwrap_err();
        assert!(err.to_string().starts_with("conversation is not a valid id"), "{err}");
        let err = Inbound::text("room", "a".repeat(300), "hi").build(&channel()).unwrap_err();
        assert!(err.to_string().starts_with("sender is not a valid id"), "{err}");
        let err = Inbound::text("room", "alice", "").build(&channel()).unwrap_err();
        assert_eq!(err, InboundError::Body(BodyError::Empty));
    }

    #[test]
    fn a_message_without_an_id_gets_a_fresh_one() {
        let a = Inbound::text("room", "alice", "hi").build(&channel()).unwrap();
        let b = Inbound::text("room", "alice", "hi").build(&channel()).unwrap();
        assert_ne!(a.id, b.id);
        assert!(a.id.as_str().starts_with("gen-"));
    }
}
