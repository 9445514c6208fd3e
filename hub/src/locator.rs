//! Locators: the opaque, versioned handle an agent uses to name one admitted inbound item
//! (`<family>:v1:<base64url payload>`), for `read`, `respond` and `complete`.
//!
//! The payload holds structural ids only — instance, conversation, thread, message id, event
//! id and the ledger entry id — never sender-controlled text such as a body or a display
//! name. Only the hub encodes and decodes it; callers pass it through unchanged. A checksum
//! bound to the hub's ledger id ends the payload, so any changed bit, a locator from another
//! hub's ledger, another family prefix, another version or an oversized string is refused
//! with a [`LocatorError`]. The checksum is an integrity check, not a secret: who may use a
//! locator is decided by the control socket's peer check.
//!
//! Pure: no I/O, no async.

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use channeld_protocol::{ChannelId, Id};
use sha2::{Digest, Sha256};

/// The only payload version this hub writes and reads.
pub const LOCATOR_VERSION: &str = "v1";

/// The longest locator string accepted (bytes). Five ids of at most 256 bytes each, the
/// entry id and the checksum fit with room to spare.
pub const MAX_LOCATOR_BYTES: usize = 2048;

/// Bytes of checksum at the end of the payload.
const CHECK_BYTES: usize = 12;

/// Domain separation for the checksum.
const CHECK_DOMAIN: &[u8] = b"channeld.locator/v1\0";

/// One admitted inbound item, as a locator names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locator {
    /// The channel instance (`family.name`); its family is the locator's prefix.
    pub instance: ChannelId,
    pub conversation: Id,
    pub thread: Option<Id>,
    /// The platform's message id (absent for an event without one).
    pub message: Option<Id>,
    /// The inbound's event id: the ledger's key for it.
    pub event_id: Id,
    /// The ledger entry (the item's row in the inbox), when known.
    pub entry: Option<i64>,
}

/// Why a string is not a locator this hub issued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocatorError {
    #[error("the locator is {len} bytes; at most {MAX_LOCATOR_BYTES} are accepted")]
    TooLong { len: usize },
    #[error("not a locator ({0}); expected <family>:v1:<base64url payload>")]
    Malformed(&'static str),
    #[error("unknown locator version {0:?}; this hub reads v1")]
    UnknownVersion(String),
    #[error("the locator payload is not base64url")]
    Encoding,
    #[error("the locator's checksum does not match: it was altered, or another hub issued it")]
    Tampered,
    #[error("the locator's family {prefix:?} is not the family of its instance {instance}")]
    ForeignFamily { prefix: String, instance: String },
    #[error("the locator payload is invalid ({0})")]
    Payload(&'static str),
}

impl LocatorError {
    /// The control protocol's error code for a refused locator.
    pub const CODE: &'static str = "invalid_locator";
}

/// What binds locators to one hub: its ledger id (see the module docs; not a secret). Holds
/// the checksum's hash state after the domain and the id, which every locator shares; shared,
/// so a run's [`Unspelled`] locator holds it for a reference count.
#[derive(Debug, Clone)]
pub struct LocatorKey(Arc<Sha256>);

impl LocatorKey {
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        let bytes = bytes.as_ref();
        let mut hash = Sha256::new();
        hash.update(CHECK_DOMAIN);
        hash.update((bytes.len() as u64).to_be_bytes());
        hash.update(bytes);
        Self(Arc::new(hash))
    }

    fn check(&self, payload: &[u8]) -> [u8; CHECK_BYTES] {
        let mut hash = Sha256::clone(&self.0);
        hash.update(payload);
        let digest = hash.finalize();
        let mut check = [0; CHECK_BYTES];
        check.copy_from_slice(&digest[..CHECK_BYTES]);
        check
    }
}

/// A run's locator, with the key that spells it, not yet spelled: only a runtime that hands
/// it on (exec, amqp) needs its string, and the built-in echo never does (its hash and
/// encoding were 3.4 % of the hub's samples per inbound, BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct Unspelled {
    locator: Locator,
    key: LocatorKey,
}

impl Unspelled {
    pub fn new(locator: Locator, key: &LocatorKey) -> Self {
        Self { locator, key: key.clone() }
    }

    /// The locator string, as [`Locator::encode`] spells it.
    pub fn encode(&self) -> String {
        self.locator.encode(&self.key)
    }
}

impl Locator {
    /// The locator string: `<family>:v1:<base64url(payload ‖ checksum)>`.
    pub fn encode(&self, key: &LocatorKey) -> String {
        let mut payload = Vec::with_capacity(256);
        put(&mut payload, self.instance.as_str());
        put(&mut payload, self.conversation.as_str());
        put(&mut payload, self.thread.as_ref().map_or("", Id::as_str));
        put(&mut payload, self.message.as_ref().map_or("", Id::as_str));
        put(&mut payload, self.event_id.as_str());
        match self.entry {
            Some(entry) => {
                payload.push(1);
                payload.extend_from_slice(&entry.to_be_bytes());
            }
            None => payload.push(0),
        }
        let check = key.check(&payload);
        payload.extend_from_slice(&check);
        let family = self.instance.family();
        let mut text = String::with_capacity(
            family.len() + LOCATOR_VERSION.len() + 2 + payload.len() * 4 / 3 + 4,
        );
        text.push_str(family);
        text.push(':');
        text.push_str(LOCATOR_VERSION);
        text.push(':');
        URL_SAFE_NO_PAD.encode_string(&payload, &mut text);
        text
    }

    /// Reads a locator this hub (`key`) issued; anything else is a [`LocatorError`].
    pub fn decode(text: &str, key: &LocatorKey) -> Result<Self, LocatorError> {
        if text.len() > MAX_LOCATOR_BYTES {
            return Err(LocatorError::TooLong { len: text.len() });
        }
        let mut parts = text.splitn(3, ':');
        let (Some(family), Some(version), Some(encoded)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(LocatorError::Malformed("it has fewer than three ':'-separated parts"));
        };
        if family.is_empty()
            || !family
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            return Err(LocatorError::Malformed("the family is not [a-z0-9_-]+"));
        }
        if version != LOCATOR_VERSION {
            let numbered = version.strip_prefix('v').is_some_and(|n| {
                !n.is_empty() && n.len() <= 9 && n.bytes().all(|b| b.is_ascii_digit())
            });
            return Err(if numbered {
                LocatorError::UnknownVersion(version.to_owned())
            } else {
                LocatorError::Malformed("the version is not v<number>")
            });
        }
        let bytes = URL_SAFE_NO_PAD.decode(encoded).map_err(|_| LocatorError::Encoding)?;
        let Some(split) = bytes.len().checked_sub(CHECK_BYTES) else {
            return Err(LocatorError::Payload("too short"));
        };
        let (payload, check) = bytes.split_at(split);
        if key.check(payload) != check {
            return Err(LocatorError::Tampered);
        }
        let mut reader = Reader(payload);
        let instance = reader.string()?;
        let instance =
            ChannelId::new(instance).map_err(|_| LocatorError::Payload("the instance"))?;
        let conversation = id(reader.string()?, "the conversation")?;
        let thread = optional(reader.string()?, "the thread")?;
        let message = optional(reader.string()?, "the message id")?;
        let event_id = id(reader.string()?, "the event id")?;
        let entry = match reader.byte()? {
            0 => None,
            1 => Some(i64::from_be_bytes(reader.array()?)),
            _ => return Err(LocatorError::Payload("the entry flag")),
        };
        if !reader.0.is_empty() {
            return Err(LocatorError::Payload("trailing bytes"));
        }
        if instance.family() != family {
            return Err(LocatorError::ForeignFamily {
                prefix: family.to_owned(),
                instance: instance.to_string(),
            });
        }
        Ok(Self { instance, conversation, thread, message, event_id, entry })
    }
}

fn id(text: &str, what: &'static str) -> Result<Id, LocatorError> {
    Id::new(text).map_err(|_| LocatorError::Payload(what))
}

fn optional(text: &str, what: &'static str) -> Result<Option<Id>, LocatorError> {
    if text.is_empty() { Ok(None) } else { id(text, what).map(Some) }
}

/// A field: its length (two bytes, big-endian) and its bytes. Ids are at most 256 bytes.
fn put(out: &mut Vec<u8>, text: &str) {
    let len = u16::try_from(text.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&text.as_bytes()[..usize::from(len)]);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LocatorError> {
        if self.0.len() < n {
            return Err(LocatorError::Payload("cut short"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, LocatorError> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], LocatorError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn string(&mut self) -> Result<&'a str, LocatorError> {
        let len = u16::from_be_bytes(self.array()?);
        std::str::from_utf8(self.take(usize::from(len))?)
            .map_err(|_| LocatorError::Payload("not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn key() -> LocatorKey {
        LocatorKey::new("a1b2c3d4e5f6")
    }

    fn sample() -> Locator {
        Locator {
            instance: ChannelId::new("mqtt.lab").unwrap(),
            conversation: Id::new("room1").unwrap(),
            thread: Some(Id::new("t-9").unwrap()),
            message: Some(Id::new("m-42").unwrap()),
            event_id: Id::new("alice/42").unwrap(),
            entry: Some(17),
        }
    }

    /// Locators outlive a hub's process (an agent may hold one across an upgrade): the
    /// encoding is pinned, byte for byte (this value was computed outside this code, from
    /// the layout the module docs describe).
    #[test]
    fn a_locator_keeps_its_encoding() {
        assert_eq!(
            sample().encode(&key()),
            "mqtt:v1:AAhtcXR0LmxhYgAFcm9vbTEAA3QtOQAEbS00MgAIYWxpY2UvNDIBAAAAAAAAABFrGL349lKCv6PZ4Us"
        );
    }

    #[test]
    fn a_locator_round_trips_and_starts_with_its_family_and_version() {
        let text = sample().encode(&key());
        assert!(text.starts_with("mqtt:v1:"), "{text}");
        assert_eq!(Locator::decode(&text, &key()).unwrap(), sample());
        let bare = Locator { thread: None, message: None, entry: None, ..sample() };
        assert_eq!(Locator::decode(&bare.encode(&key()), &key()).unwrap(), bare);
    }

    #[test]
    fn another_family_version_or_hub_is_refused_with_its_reason() {
        let text = sample().encode(&key());
        let payload = text.strip_prefix("mqtt:v1:").unwrap();
        assert_eq!(
            Locator::decode(&format!("slack:v1:{payload}"), &key()),
            Err(LocatorError::ForeignFamily {
                prefix: "slack".into(),
                instance: "mqtt.lab".into()
            })
        );
        assert_eq!(
            Locator::decode(&format!("mqtt:v2:{payload}"), &key()),
            Err(LocatorError::UnknownVersion("v2".into()))
        );
        assert_eq!(
            Locator::decode(&text, &LocatorKey::new("another-hub")),
            Err(LocatorError::Tampered)
        );
        assert!(matches!(Locator::decode("mqtt:v1", &key()), Err(LocatorError::Malformed(_))));
        assert!(matches!(Locator::decode("", &key()), Err(LocatorError::Malformed(_))));
        assert!(matches!(Locator::decode("MQTT:v1:AAAA", &key()), Err(LocatorError::Malformed(_))));
        assert!(matches!(Locator::decode("mqtt:vX:AAAA", &key()), Err(LocatorError::Malformed(_))));
        assert_eq!(Locator::decode("mqtt:v1:***", &key()), Err(LocatorError::Encoding));
        assert_eq!(
            Locator::decode("mqtt:v1:AAAA", &key()),
            Err(LocatorError::Payload("too short"))
        );
    }

    #[test]
    fn an_oversized_locator_is_refused_before_it_is_read() {
        let text = format!("mqtt:v1:{}", "A".repeat(MAX_LOCATOR_BYTES));
        assert_eq!(
            Locator::decode(&text, &key()),
            Err(LocatorError::TooLong { len: MAX_LOCATOR_BYTES + 8 })
        );
    }

    #[test]
    fn the_largest_ids_still_make_an_acceptable_locator() {
        let long = |c: char| Id::new(c.to_string().repeat(256)).unwrap();
        let locator = Locator {
            instance: ChannelId::new(format!("a.{}", "b".repeat(62))).unwrap(),
            conversation: long('c'),
            thread: Some(long('t')),
            message: Some(long('m')),
            event_id: long('e'),
            entry: Some(i64::MAX),
        };
        let text = locator.encode(&key());
        assert!(text.len() <= MAX_LOCATOR_BYTES, "{}", text.len());
        assert_eq!(Locator::decode(&text, &key()).unwrap(), locator);
    }

    fn id_strategy() -> impl Strategy<Value = Id> {
        "[^\u{0}]{1,40}".prop_filter_map("an id", |s| Id::new(s).ok())
    }

    prop_compose! {
        fn locators()(
            name in "[a-z0-9]{1,8}\\.[a-z0-9_-]{1,8}",
            conversation in id_strategy(),
            thread in proptest::option::of(id_strategy()),
            message in proptest::option::of(id_strategy()),
            event_id in id_strategy(),
            entry in proptest::option::of(any::<i64>()),
        ) -> Locator {
            Locator {
                instance: ChannelId::new(name).unwrap(),
                conversation, thread, message, event_id, entry,
            }
        }
    }

    proptest! {
        #[test]
        fn fuzz_locators_round_trip(locator in locators()) {
            let text = locator.encode(&key());
            prop_assert!(text.len() <= MAX_LOCATOR_BYTES);
            prop_assert_eq!(Locator::decode(&text, &key()).unwrap(), locator);
        }

        /// Any single flipped bit anywhere in the string is refused.
        #[test]
        fn fuzz_a_flipped_bit_is_refused(locator in locators(), at in any::<usize>(), bit in 0u8..8) {
            let mut bytes = locator.encode(&key()).into_bytes();
            let at = at % bytes.len();
            bytes[at] ^= 1 << bit;
            if let Ok(text) = String::from_utf8(bytes) {
                prop_assert!(Locator::decode(&text, &key()).is_err(), "{text} decoded");
            }
        }

        /// Arbitrary input never panics and never decodes without this hub's checksum.
        #[test]
        fn fuzz_arbitrary_text_is_refused(text in "\\PC{0,300}", tail in "[A-Za-z0-9_-]{0,200}") {
            prop_assert!(Locator::decode(&text, &key()).is_err());
            let prefixed = format!("mqtt:v1:{tail}");
            prop_assert!(Locator::decode(&prefixed, &key()).is_err());
        }
    }
}
