//! The replay set: event ids of messages the hub has taken, so a replay of one (seconds or
//! an hour later) is dropped instead of answered twice, with how far its reply was posted so
//! a redelivered reply resumes instead of repeating parts.
//!
//! Entries live for the dedupe TTL (24 h by default) from first sight; beyond
//! [`MAX_ENTRIES`] the oldest go first. Pure: the caller persists it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Most remembered messages; beyond it the oldest are forgotten (a replay of one of those
/// would be answered again, so the cap is far above a bot's daily traffic).
pub const MAX_ENTRIES: usize = 50_000;

/// How far the reply to one message got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyProgress {
    /// A digest of the reply text, so a different text starts over.
    pub digest: String,
    /// Parts posted, in order.
    pub posted: u32,
    pub total: u32,
    /// The client id of the last part posted: the receipt's message id.
    pub last_client_id: String,
    /// A part sent without a known outcome (the driver died or the request timed out):
    /// its client id. A reply in doubt is reported unknown, never sent again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_doubt: Option<String>,
}

impl ReplyProgress {
    pub fn done(&self) -> bool {
        self.posted >= self.total
    }
}

/// One remembered message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    pub first_ms: u64,
    /// The hub took it (accepted, or refused for good): a replay is dropped.
    pub settled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<ReplyProgress>,
}

/// Event ids the driver remembers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenSet {
    entries: HashMap<String, Seen>,
}

impl SeenSet {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the hub already took this message.
    pub fn is_settled(&self, event_id: &str) -> bool {
        self.entries.get(event_id).is_some_and(|seen| seen.settled)
    }

    /// Remembers that the hub took this message.
    pub fn settle(&mut self, event_id: &str, now_ms: u64) {
        self.entry(event_id, now_ms).settled = true;
        self.cap();
    }

    pub fn reply(&self, event_id: &str) -> Option<&ReplyProgress> {
        self.entries.get(event_id)?.reply.as_ref()
    }

    /// Records how far the reply to `event_id` got.
    pub fn record_reply(&mut self, event_id: &str, progress: ReplyProgress, now_ms: u64) {
        self.entry(event_id, now_ms).reply = Some(progress);
        self.cap();
    }

    /// Forgets entries first seen more than `ttl_ms` ago; returns how many.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, seen| now_ms.saturating_sub(seen.first_ms) <= ttl_ms);
        before - self.entries.len()
    }

    fn entry(&mut self, event_id: &str, now_ms: u64) -> &mut Seen {
        self.entries.entry(event_id.to_owned()).or_insert(Seen {
            first_ms: now_ms,
            settled: false,
            reply: None,
        })
    }

    fn cap(&mut self) {
        super::evict_oldest(&mut self.entries, MAX_ENTRIES, |seen| seen.first_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY_MS: u64 = 86_400_000;

    #[test]
    fn a_settled_message_is_remembered_until_the_ttl() {
        let mut seen = SeenSet::default();
        assert!(!seen.is_settled("wx-1"));
        seen.settle("wx-1", 1_000);
        assert!(seen.is_settled("wx-1"));
        assert_eq!(seen.expire(1_000 + DAY_MS, DAY_MS), 0, "an hour-later replay is caught");
        assert!(seen.is_settled("wx-1"));
        assert_eq!(seen.expire(1_001 + DAY_MS, DAY_MS), 1);
        assert!(!seen.is_settled("wx-1"));
    }

    #[test]
    fn reply_progress_is_kept_per_message_and_a_reply_alone_does_not_settle() {
        let mut seen = SeenSet::default();
        let progress = ReplyProgress {
            digest: "d".into(),
            posted: 1,
            total: 3,
            last_client_id: "c1".into(),
            in_doubt: None,
        };
        seen.record_reply("wx-2", progress.clone(), 5);
        assert!(!seen.is_settled("wx-2"));
        assert_eq!(seen.reply("wx-2"), Some(&progress));
        assert!(!progress.done());
        seen.settle("wx-2", 9);
        assert_eq!(seen.reply("wx-2"), Some(&progress), "settling keeps the progress");
    }

    #[test]
    fn beyond_the_cap_the_oldest_are_forgotten_first() {
        let mut seen = SeenSet::default();
        for n in 0..=MAX_ENTRIES as u64 {
            seen.settle(&format!("wx-{n}"), n);
        }
        assert!(seen.len() <= MAX_ENTRIES);
        assert!(!seen.is_settled("wx-0"));
        assert!(seen.is_settled(&format!("wx-{MAX_ENTRIES}")));
    }
}
