//! Validated identifiers: bounded ids (request, event, message, conversation…) and channel ids.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smol_str::SmolStr;

use crate::{MAX_CHANNEL_ID_CHARS, MAX_ID_BYTES};

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("id is empty")]
    Empty,
    #[error("id is longer than {MAX_ID_BYTES} bytes")]
    TooLong,
    #[error("id contains a NUL byte")]
    Nul,
    #[error("a value formatted into the id failed to format")]
    Format,
    #[error("channel id must be 1-{MAX_CHANNEL_ID_CHARS} characters of [a-z0-9._-]")]
    BadChannel,
}

/// A bounded identifier: non-empty, at most 256 bytes, no NUL.
///
/// Used for request ids, event ids, message ids, conversations, threads, participants,
/// sessions and command ids.
///
/// Ids are immutable and copied often (into routes, ledgers, replies), so the text is a
/// [`SmolStr`]: up to 23 bytes inline, longer ones shared. Neither a decode nor a clone
/// allocates for a short id, and a clone of a long one is a reference count.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Id(SmolStr);

impl Id {
    pub fn new(value: impl AsRef<str>) -> Result<Self, IdError> {
        let value = value.as_ref();
        check_id(value)?;
        Ok(Self(SmolStr::new(value)))
    }

    /// An id written from format arguments, e.g. `Id::format(format_args!("out-{n}"))`:
    /// written on the stack, so it is copied once into the id (which allocates only past 23
    /// bytes). Past 64 bytes the arguments are formatted again into a `String`.
    pub fn format(args: fmt::Arguments<'_>) -> Result<Self, IdError> {
        let mut stack = Stack::default();
        if fmt::Write::write_fmt(&mut stack, args).is_ok() {
            let text = std::str::from_utf8(&stack.buf[..stack.len]).map_err(|_| IdError::Format)?;
            return Self::new(text);
        }
        let mut heap = String::new();
        fmt::Write::write_fmt(&mut heap, args).map_err(|_| IdError::Format)?;
        Self::new(heap)
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    pub fn into_string(self) -> String {
        self.0.into()
    }
}

/// Where [`Id::format`] writes first: 64 bytes; a write that does not fit fails.
struct Stack {
    len: usize,
    buf: [u8; 64],
}

impl Default for Stack {
    fn default() -> Self {
        Self { len: 0, buf: [0; 64] }
    }
}

impl fmt::Write for Stack {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let end = self.len + text.len();
        self.buf.get_mut(self.len..end).ok_or(fmt::Error)?.copy_from_slice(text.as_bytes());
        self.len = end;
        Ok(())
    }
}

fn check_id(value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty);
    }
    if value.len() > MAX_ID_BYTES {
        return Err(IdError::TooLong);
    }
    if value.as_bytes().contains(&0) {
        return Err(IdError::Nul);
    }
    Ok(())
}

/// A channel instance id such as `slack.primary`: 1–64 characters of `[a-z0-9._-]`.
///
/// The family is the part before the first dot; an id without a dot is its own family.
/// Stored like [`Id`].
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId(SmolStr);

impl ChannelId {
    pub fn new(value: impl AsRef<str>) -> Result<Self, IdError> {
        let value = value.as_ref();
        check_channel(value)?;
        Ok(Self(SmolStr::new(value)))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The platform family: everything before the first dot.
    pub fn family(&self) -> &str {
        let id = self.as_str();
        id.split_once('.').map_or(id, |(family, _)| family)
    }

    /// The instance name after the first dot, if there is one.
    pub fn instance(&self) -> Option<&str> {
        self.as_str().split_once('.').map(|(_, instance)| instance)
    }
}

fn check_channel(value: &str) -> Result<(), IdError> {
    let valid = !value.is_empty()
        && value.len() <= MAX_CHANNEL_ID_CHARS
        && value.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'));
    if valid { Ok(()) } else { Err(IdError::BadChannel) }
}

macro_rules! string_newtype {
    ($ty:ident) => {
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self.as_str(), f)
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                self.as_str()
            }
        }

        impl Borrow<str> for $ty {
            fn borrow(&self) -> &str {
                self.as_str()
            }
        }

        impl std::str::FromStr for $ty {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $ty {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl TryFrom<&str> for $ty {
            type Error = IdError;
            fn try_from(value: &str) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl From<$ty> for String {
            fn from(value: $ty) -> String {
                value.0.into()
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_str(IdVisitor(std::marker::PhantomData::<$ty>))
            }
        }
    };
}

string_newtype!(Id);
string_newtype!(ChannelId);

/// Reads an id from the string in place: an unescaped JSON string is never copied into a
/// `String` first (serde's `Cow<str>` would be: it borrows only for a `#[serde(borrow)]`
/// field).
struct IdVisitor<T>(std::marker::PhantomData<T>);

/// What [`IdVisitor`] builds.
trait FromText: Sized {
    const EXPECTING: &'static str;
    fn from_text(text: &str) -> Result<Self, IdError>;
}

impl FromText for Id {
    const EXPECTING: &'static str = "an id: 1-256 bytes, no NUL";
    fn from_text(text: &str) -> Result<Self, IdError> {
        Id::new(text)
    }
}

impl FromText for ChannelId {
    const EXPECTING: &'static str = "a channel id: 1-64 characters of [a-z0-9._-]";
    fn from_text(text: &str) -> Result<Self, IdError> {
        ChannelId::new(text)
    }
}

impl<T: FromText> serde::de::Visitor<'_> for IdVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<T, E> {
        T::from_text(text).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_id_limits() {
        assert_eq!(Id::new(""), Err(IdError::Empty));
        assert_eq!(Id::new("a\0b"), Err(IdError::Nul));
        assert!(Id::new("x".repeat(256)).is_ok());
        assert_eq!(Id::new("x".repeat(257)), Err(IdError::TooLong));
        assert!(Id::new("héllo 世界").is_ok());
    }

    #[test]
    fn ids_of_any_length_read_write_hash_and_order_as_their_text() {
        use std::collections::{BTreeSet, HashSet};
        // 23 bytes fit inline; 24 and 256 are shared; both sides of the boundary must agree.
        let (inline, shared, longest) = ("x".repeat(23), "y".repeat(24), "z".repeat(256));
        let texts = ["e-1", &inline, &shared, &longest, "héllo 世界"];
        let mut hashed = HashSet::new();
        let mut ordered = BTreeSet::new();
        for text in texts {
            let id = Id::new(text).unwrap();
            assert_eq!(id.as_str(), text);
            assert_eq!(id.clone().into_string(), text);
            assert_eq!(Id::try_from(text).unwrap(), id);
            let json = serde_json::to_string(&id).unwrap();
            assert_eq!(serde_json::from_str::<Id>(&json).unwrap(), id);
            hashed.insert(id.clone());
            ordered.insert(id);
        }
        for text in texts {
            assert!(hashed.contains(text), "{text} looked up by its text");
        }
        let mut sorted = texts.map(str::to_owned);
        sorted.sort();
        assert_eq!(ordered.iter().map(Id::as_str).collect::<Vec<_>>(), sorted);
        // An escaped string decodes to its text and is checked like any other.
        assert_eq!(serde_json::from_str::<Id>(r#""a\u0062c""#).unwrap(), "abc");
        assert!(serde_json::from_str::<Id>(r#""a\u0000b""#).is_err());
        assert!(serde_json::from_str::<Id>(r#""""#).is_err());
    }

    #[test]
    fn formatted_ids_are_checked_like_any_other() {
        let seq = 1_234_567_u64;
        let short = Id::format(format_args!("out-{seq}")).unwrap();
        assert_eq!(short, "out-1234567");
        let long = Id::format(format_args!("out-0123456789ab-{seq}")).unwrap();
        assert_eq!(long, "out-0123456789ab-1234567");
        // Past the 64 bytes on the stack, in pieces that cross their end.
        let piece = "x".repeat(30);
        let spilled = Id::format(format_args!("{piece}{piece}{piece}-{seq}")).unwrap();
        assert_eq!(spilled.as_str(), format!("{piece}{piece}{piece}-{seq}"));
        let exact = "y".repeat(64);
        assert_eq!(Id::format(format_args!("{exact}")).unwrap(), exact.as_str());
        assert_eq!(Id::format(format_args!("{exact}z")).unwrap().as_str().len(), 65);
        assert_eq!(Id::format(format_args!("{}", "")), Err(IdError::Empty));
        assert_eq!(Id::format(format_args!("{}", "x".repeat(257))), Err(IdError::TooLong));
        assert_eq!(Id::format(format_args!("a{}b", '\0')), Err(IdError::Nul));
    }

    #[test]
    fn channel_id_charset_and_family() {
        let id = ChannelId::new("slack.primary").unwrap();
        assert_eq!(id.family(), "slack");
        assert_eq!(id.instance(), Some("primary"));
        let id = ChannelId::new("telegram").unwrap();
        assert_eq!(id.family(), "telegram");
        assert_eq!(id.instance(), None);
        assert!(ChannelId::new("mqtt.lab-2_x.y").is_ok());
        assert!(ChannelId::new("Slack Primary").is_err());
        assert!(ChannelId::new("").is_err());
        assert!(ChannelId::new("a".repeat(65)).is_err());
        assert!(ChannelId::new("a".repeat(64)).is_ok());
    }
}
