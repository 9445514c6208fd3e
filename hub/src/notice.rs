//! Which denied senders are sent the deny notice now: each at most once per interval, so a
//! sender who keeps writing (or a flood of them) cannot make the hub post without end. Pure.
//!
//! Bounded: it remembers at most [`NOTICE_MEMORY`] senders. When that many were told within
//! the interval, a new sender gets no notice (denied all the same): under a flood, silence.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most senders remembered as told.
pub const NOTICE_MEMORY: usize = 4096;

/// When each recently denied sender was last told.
#[derive(Debug, Default)]
pub struct NoticeLimiter {
    told: HashMap<String, Instant>,
}

impl NoticeLimiter {
    /// Whether `sender` gets the notice at `now`; if so, remembers that it was told.
    pub fn allow(&mut self, sender: &str, now: Instant, interval: Duration) -> bool {
        let recent = |at: &Instant| now.saturating_duration_since(*at) < interval;
        if let Some(at) = self.told.get(sender) {
            if recent(at) {
                return false;
            }
        } else if self.told.len() >= NOTICE_MEMORY {
            self.told.retain(|_, at| recent(at));
            if self.told.len() >= NOTICE_MEMORY {
                return false;
            }
        }
        self.told.insert(sender.to_owned(), now);
        true
    }

    /// How many senders are remembered.
    pub fn len(&self) -> usize {
        self.told.len()
    }

    pub fn is_empty(&self) -> bool {
        self.told.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn each_sender_is_told_once_per_interval() {
        let mut limiter = NoticeLimiter::default();
        let start = Instant::now();
        assert!(limiter.allow("mallory", start, HOUR));
        assert!(!limiter.allow("mallory", start + Duration::from_secs(5), HOUR));
        assert!(limiter.allow("eve", start + Duration::from_secs(6), HOUR));
        assert!(!limiter.allow("mallory", start + HOUR - Duration::from_secs(1), HOUR));
        assert!(limiter.allow("mallory", start + HOUR, HOUR));
    }

    #[test]
    fn memory_is_bounded_and_a_flood_of_new_senders_is_not_told() {
        let mut limiter = NoticeLimiter::default();
        let start = Instant::now();
        for n in 0..NOTICE_MEMORY {
            assert!(limiter.allow(&format!("s{n}"), start, HOUR));
        }
        assert!(!limiter.allow("one-too-many", start, HOUR));
        assert_eq!(limiter.len(), NOTICE_MEMORY);
        // Once the interval passed, the old entries make room.
        assert!(limiter.allow("later", start + HOUR, HOUR));
        assert_eq!(limiter.len(), 1);
    }
}
