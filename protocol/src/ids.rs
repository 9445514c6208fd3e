//! Validated identifiers: bounded ids (request, event, message, conversation…) and channel ids.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
    #[error("channel id must be 1-{MAX_CHANNEL_ID_CHARS} characters of [a-z0-9._-]")]
    BadChannel,
}

/// A bounded identifier: non-empty, at most 256 bytes, no NUL.
///
/// Used for request ids, event ids, message ids, conversations, threads, participants,
/// sessions and command ids.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Id(String);

impl Id {
    pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
        let value = value.into();
        check_id(&value)?;
        Ok(Self(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
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
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId(String);

impl ChannelId {
    pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
        let value = value.into();
        let valid = !value.is_empty()
            && value.len() <= MAX_CHANNEL_ID_CHARS
            && value.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'));
        if valid { Ok(Self(value)) } else { Err(IdError::BadChannel) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The platform family: everything before the first dot.
    pub fn family(&self) -> &str {
        self.0.split_once('.').map_or(&self.0, |(family, _)| family)
    }

    /// The instance name after the first dot, if there is one.
    pub fn instance(&self) -> Option<&str> {
        self.0.split_once('.').map(|(_, instance)| instance)
    }
}

macro_rules! string_newtype {
    ($ty:ident) => {
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $ty {
            fn borrow(&self) -> &str {
                &self.0
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
                value.0
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let value = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
                Self::new(value.into_owned()).map_err(serde::de::Error::custom)
            }
        }
    };
}

string_newtype!(Id);
string_newtype!(ChannelId);

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
