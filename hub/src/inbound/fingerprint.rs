//! What makes two deliveries of one event id "the same content", as a hash: SHA-256 over a
//! canonical, versioned byte form of the fields that identify the content — not over serde's
//! output, which a new optional field or another field order would change, turning
//! redeliveries into conflicts after an upgrade.
//!
//! Left out, because a platform may change them on redelivery: timestamps, metadata, display
//! names and handles. The form is fixed for a version: changing it means a new
//! [`FINGERPRINT_VERSION`], and the ledger compares older entries by rehashing their stored
//! frame ([`rehash`]).

use channeld_protocol::types::{Attachment, IncomingEvent, MessageBody, MessageTarget};
use channeld_protocol::{Frame, decode};
use sha2::{Digest, Sha256};

/// The version of the canonical form below (version 1 hashed serde's encoding).
pub const FINGERPRINT_VERSION: u32 = 2;

/// The fingerprint of an `inbound` or `inbound_event` frame; `None` for any other frame.
pub fn fingerprint(frame: &Frame) -> Option<[u8; 32]> {
    let mut form = Canonical::new();
    match frame {
        Frame::Inbound(inbound) => {
            let message = &inbound.message;
            form.str("message");
            form.str(message.id.as_str());
            form.target(&message.target);
            form.str(message.sender.id.as_str());
            form.body(&message.body);
        }
        Frame::InboundEvent(frame) => {
            let event = &frame.event;
            let context = event.context();
            form.str("event");
            form.str(event.kind());
            form.target(&context.target);
            form.opt(context.participant.as_ref().map(|p| p.id.as_str()));
            match event {
                IncomingEvent::Reaction { message_id, emoji, added, .. } => {
                    form.str(message_id.as_str());
                    form.str(emoji);
                    form.flag(*added);
                }
                IncomingEvent::Typing { active, .. } => form.flag(*active),
                IncomingEvent::MessageEdited { message_id, body, .. } => {
                    form.str(message_id.as_str());
                    form.body(body);
                }
                IncomingEvent::MessageDeleted { message_id, .. }
                | IncomingEvent::Read { message_id, .. } => form.str(message_id.as_str()),
            }
        }
        _ => return None,
    }
    Some(form.finish())
}

/// The current fingerprint of an encoded frame the ledger stored; `None` when it no longer
/// decodes to an inbound.
pub fn rehash(stored: &[u8]) -> Option<[u8; 32]> {
    fingerprint(&decode(stored).ok()?)
}

/// Length-prefixed fields, each tagged present or absent, so no two different field lists
/// can produce the same bytes.
struct Canonical(Sha256);

impl Canonical {
    fn new() -> Self {
        let mut hash = Sha256::new();
        hash.update(b"channeld.fingerprint/");
        hash.update(FINGERPRINT_VERSION.to_be_bytes());
        Self(hash)
    }

    fn str(&mut self, value: &str) {
        self.opt(Some(value));
    }

    fn opt(&mut self, value: Option<&str>) {
        match value {
            Some(value) => {
                self.0.update([1u8]);
                self.0.update((value.len() as u64).to_be_bytes());
                self.0.update(value.as_bytes());
            }
            None => self.0.update([0u8]),
        }
    }

    fn flag(&mut self, value: bool) {
        self.0.update([2u8, u8::from(value)]);
    }

    fn target(&mut self, target: &MessageTarget) {
        self.str(target.channel.as_str());
        self.str(target.conversation.as_str());
        self.opt(target.thread.as_ref().map(|t| t.as_str()));
        self.opt(target.reply_to.as_ref().map(|r| r.as_str()));
    }

    fn body(&mut self, body: &MessageBody) {
        self.str(body.text_str());
        self.0.update((body.attachments().len() as u64).to_be_bytes());
        for Attachment { url, name, mime } in body.attachments() {
            self.str(url);
            self.opt(name.as_deref());
            self.opt(mime.as_deref());
        }
    }

    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::frame::{Inbound, InboundEventFrame};
    use channeld_protocol::types::{EventContext, InboundMessage, Participant};
    use channeld_protocol::{ChannelId, Id, encode};

    use super::*;

    fn id(value: &str) -> Id {
        Id::new(value).unwrap()
    }

    fn message(text: &str) -> Frame {
        Frame::Inbound(Inbound {
            event_id: id("m-1"),
            message: InboundMessage {
                id: id("m-1"),
                target: MessageTarget::new(ChannelId::new("test.one").unwrap(), id("c1")),
                sender: Participant::new(id("alice")),
                body: MessageBody::text(text).unwrap(),
                timestamp_ms: None,
                metadata: Default::default(),
            },
        })
    }

    fn hex(hash: [u8; 32]) -> String {
        hash.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn the_canonical_form_of_a_version_never_changes() {
        // A changed value here means stored fingerprints no longer match: bump
        // FINGERPRINT_VERSION instead of editing this line.
        assert_eq!(
            hex(fingerprint(&message("hello")).unwrap()),
            "6ba9f67f51f9cd355d575f447d544d75214a96e14dbf0d7845cb7048b0256197"
        );
    }

    #[test]
    fn timestamps_metadata_and_display_names_do_not_change_the_content() {
        let plain = fingerprint(&message("hello")).unwrap();
        let Frame::Inbound(mut inbound) = message("hello") else { unreachable!() };
        inbound.message.timestamp_ms = Some(42);
        inbound.message.metadata.insert("delivery".into(), "2".into());
        inbound.message.sender.display_name = Some("Alice".into());
        inbound.message.sender.handle = Some("@alice".into());
        assert_eq!(fingerprint(&Frame::Inbound(inbound.clone())).unwrap(), plain);
        inbound.message.body = MessageBody::text("hello!").unwrap();
        assert_ne!(fingerprint(&Frame::Inbound(inbound)).unwrap(), plain);
    }

    #[test]
    fn field_boundaries_and_kinds_cannot_be_confused() {
        let Frame::Inbound(mut a) = message("hello") else { unreachable!() };
        let mut b = a.clone();
        a.message.target.conversation = id("ab");
        a.message.target.thread = Some(id("c"));
        b.message.target.conversation = id("a");
        b.message.target.thread = Some(id("bc"));
        assert_ne!(fingerprint(&Frame::Inbound(a)), fingerprint(&Frame::Inbound(b)));

        let context = EventContext {
            target: MessageTarget::new(ChannelId::new("test.one").unwrap(), id("c1")),
            participant: Some(Participant::new(id("alice"))),
            timestamp_ms: None,
            metadata: Default::default(),
        };
        let event = |event| Frame::InboundEvent(InboundEventFrame { event_id: id("e"), event });
        let deleted =
            event(IncomingEvent::MessageDeleted { context: context.clone(), message_id: id("m") });
        let read = event(IncomingEvent::Read { context: context.clone(), message_id: id("m") });
        assert_ne!(fingerprint(&deleted), fingerprint(&read));
        let added = event(IncomingEvent::Reaction {
            context: context.clone(),
            message_id: id("m"),
            emoji: "+1".into(),
            added: true,
        });
        let removed = event(IncomingEvent::Reaction {
            context,
            message_id: id("m"),
            emoji: "+1".into(),
            added: false,
        });
        assert_ne!(fingerprint(&added), fingerprint(&removed));
    }

    #[test]
    fn a_stored_frame_rehashes_to_the_fingerprint_of_its_message() {
        let frame = message("hello");
        let line = encode(&frame).unwrap();
        assert_eq!(rehash(&line[..line.len() - 1]), fingerprint(&frame));
        assert_eq!(rehash(b"not a frame"), None);
        let start = Frame::Start(channeld_protocol::frame::Lifecycle { request_id: id("s") });
        assert_eq!(fingerprint(&start), None);
    }
}
