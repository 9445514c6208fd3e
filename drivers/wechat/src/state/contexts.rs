//! The latest context token per user. iLink refuses a message without the token of the
//! user's recent message (`ret: -2`), so every send carries the newest one; a token the
//! server refused is marked and not presented again until the user writes anew.
//!
//! Pure: the caller persists it.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Most users remembered; beyond it the least recently heard from are forgotten.
pub const MAX_USERS: usize = 100_000;

/// A user's latest context token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextToken {
    pub token: String,
    /// The `create_time_ms` of the message that brought it, to keep the newest when
    /// replays arrive out of order.
    #[serde(default)]
    pub message_ms: Option<u64>,
    pub received_ms: u64,
    /// The `ret` the server refused it with; a refused token is not sent again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<i64>,
}

impl fmt::Debug for ContextToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextToken")
            .field("token", &"***")
            .field("message_ms", &self.message_ms)
            .field("received_ms", &self.received_ms)
            .field("refused", &self.refused)
            .finish()
    }
}

/// What a send may use for a user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usable<'a> {
    Token(&'a str),
    /// The user never wrote (or was forgotten): the platform will not deliver.
    Missing,
    /// The last token was refused with this code and no newer one came.
    Refused(i64),
}

/// Context tokens by user id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextTokens {
    users: HashMap<String, ContextToken>,
}

impl ContextTokens {
    /// Takes the token of a message from `user` unless a newer message's token is already
    /// kept. Returns whether it changed.
    pub fn offer(&mut self, user: &str, token: &str, message_ms: Option<u64>, now_ms: u64) -> bool {
        if let Some(kept) = self.users.get(user) {
            let older =
                matches!((message_ms, kept.message_ms), (Some(new), Some(old)) if new < old);
            if kept.token == token || older {
                return false;
            }
        }
        self.users.insert(
            user.to_owned(),
            ContextToken {
                token: token.to_owned(),
                message_ms,
                received_ms: now_ms,
                refused: None,
            },
        );
        self.cap();
        true
    }

    pub fn usable(&self, user: &str) -> Usable<'_> {
        match self.users.get(user) {
            None => Usable::Missing,
            Some(ContextToken { refused: Some(code), .. }) => Usable::Refused(*code),
            Some(kept) => Usable::Token(&kept.token),
        }
    }

    /// Marks `token` refused with `code`, if it is still the user's latest.
    pub fn refuse(&mut self, user: &str, token: &str, code: i64) -> bool {
        match self.users.get_mut(user) {
            Some(kept) if kept.token == token => {
                kept.refused = Some(code);
                true
            }
            _ => false,
        }
    }

    pub fn len(&self) -> usize {
        self.users.len()
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    fn cap(&mut self) {
        super::evict_oldest(&mut self.users, MAX_USERS, |kept| kept.received_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_message_token_wins_even_when_replays_come_late() {
        let mut tokens = ContextTokens::default();
        assert_eq!(tokens.usable("alice"), Usable::Missing);
        assert!(tokens.offer("alice", "t2", Some(200), 1));
        assert!(!tokens.offer("alice", "t1", Some(100), 2), "a replayed older message");
        assert_eq!(tokens.usable("alice"), Usable::Token("t2"));
        assert!(tokens.offer("alice", "t3", None, 3), "no time: the latest arrival wins");
        assert_eq!(tokens.usable("alice"), Usable::Token("t3"));
        assert_eq!(tokens.usable("bob"), Usable::Missing);
    }

    #[test]
    fn a_refused_token_is_not_offered_again_until_the_user_writes() {
        let mut tokens = ContextTokens::default();
        tokens.offer("alice", "t1", Some(1), 1);
        assert!(!tokens.refuse("alice", "other", -2), "only the current token");
        assert!(tokens.refuse("alice", "t1", -2));
        assert_eq!(tokens.usable("alice"), Usable::Refused(-2));
        assert!(!tokens.offer("alice", "t1", Some(1), 2), "the same token again stays refused");
        assert_eq!(tokens.usable("alice"), Usable::Refused(-2));
        tokens.offer("alice", "t2", Some(2), 3);
        assert_eq!(tokens.usable("alice"), Usable::Token("t2"));
        assert!(!format!("{tokens:?}").contains("t2\""), "tokens never print");
    }
}
