//! Session routing: a deterministic session id from (instance, conversation, thread), with the
//! sender added when identity isolation is on, and a generation bumped by `/new`.

use channeld_protocol::types::MessageTarget;
use channeld_protocol::{ChannelId, Id};
use sha2::{Digest, Sha256};

/// The fields that select a session. The ids are the protocol's own (held inline up to 23
/// bytes, shared past them): a key is built for every inbound and copied twice into the run
/// queue, and with `String`s each of the three cost two allocations and frees or more.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteKey {
    pub instance: ChannelId,
    pub conversation: Id,
    pub thread: Option<Id>,
    /// Present only with identity isolation; empty for an event without an actor.
    pub sender: Option<String>,
}

impl RouteKey {
    pub fn new(target: &MessageTarget, sender: &str, identity_isolation: bool) -> Self {
        Self {
            instance: target.channel.clone(),
            conversation: target.conversation.clone(),
            thread: target.thread.clone(),
            sender: identity_isolation.then(|| sender.to_owned()),
        }
    }

    /// `im-<16 hex>`: SHA-256 over the length-prefixed fields and the generation, so no two
    /// different keys can collide by concatenation. An `Id` of 19 bytes, held inline: made
    /// for every inbound without an allocation.
    pub fn session_id(&self, generation: u64) -> Id {
        let mut hash = Sha256::new();
        hash.update(b"channeld.session/v1");
        for field in [
            Some(self.instance.as_str()),
            Some(self.conversation.as_str()),
            self.thread.as_ref().map(Id::as_str),
            self.sender.as_deref(),
        ] {
            match field {
                Some(value) => {
                    hash.update([1u8]);
                    hash.update((value.len() as u64).to_be_bytes());
                    hash.update(value.as_bytes());
                }
                None => hash.update([0u8]),
            }
        }
        hash.update(generation.to_be_bytes());
        let digest = hash.finalize();
        // By hand: a `format!` per byte was 16 formatted strings per inbound
        // (BENCHMARKS.md, fix 25).
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut id = [0u8; 19];
        id[..3].copy_from_slice(b"im-");
        for (pair, byte) in id[3..].chunks_exact_mut(2).zip(&digest[..8]) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0xf)];
        }
        let text = std::str::from_utf8(&id).expect("\"im-\" and hex digits are ASCII");
        Id::new(text).expect("19 bytes of ASCII without a NUL are a valid id")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(conversation: &str, thread: Option<&str>) -> MessageTarget {
        MessageTarget {
            channel: "slack.primary".try_into().unwrap(),
            conversation: conversation.try_into().unwrap(),
            thread: thread.map(|t| t.try_into().unwrap()),
            reply_to: None,
        }
    }

    #[test]
    fn same_key_same_session_and_format() {
        let a = RouteKey::new(&target("C1", None), "U1", false).session_id(0);
        let b = RouteKey::new(&target("C1", None), "U2", false).session_id(0);
        assert_eq!(a, b);
        assert_eq!(a.as_str().len(), 19);
        assert!(a.as_str().starts_with("im-"));
    }

    #[test]
    fn session_ids_keep_their_spelling() {
        // Stored in the ledger and shown to agents: the text must never change. Computed
        // independently (Python's hashlib over the same length-prefixed fields).
        let plain = RouteKey::new(&target("C1", None), "U1", false).session_id(0);
        assert_eq!(plain.as_str(), "im-71c350c03e288b95");
        let full = RouteKey::new(&target("C1", Some("t")), "U1", true).session_id(7);
        assert_eq!(full.as_str(), "im-dfe8791db771ea78");
    }

    #[test]
    fn thread_sender_and_generation_change_the_session() {
        let base = RouteKey::new(&target("C1", None), "U1", false).session_id(0);
        assert_ne!(base, RouteKey::new(&target("C1", Some("t")), "U1", false).session_id(0));
        assert_ne!(base, RouteKey::new(&target("C1", None), "U1", true).session_id(0));
        assert_ne!(base, RouteKey::new(&target("C1", None), "U1", false).session_id(1));
        let u1 = RouteKey::new(&target("C1", None), "U1", true).session_id(0);
        let u2 = RouteKey::new(&target("C1", None), "U2", true).session_id(0);
        assert_ne!(u1, u2);
    }

    #[test]
    fn field_boundaries_cannot_be_shifted() {
        let a = RouteKey::new(&target("ab", Some("c")), "U", false).session_id(0);
        let b = RouteKey::new(&target("a", Some("bc")), "U", false).session_id(0);
        assert_ne!(a, b);
    }
}
