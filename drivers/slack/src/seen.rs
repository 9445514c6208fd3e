//! Inbound messages the hub has already answered, so a second copy of a post (its
//! `app_mention` twin, or Slack's redelivery of an envelope whose ack was lost) is
//! acknowledged at once and never reaches the hub again. Pure and bounded.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::Id;

/// How long an answered id is remembered: longer than Slack's redelivery schedule (about
/// five minutes) with room to spare.
pub const REMEMBER_FOR: Duration = Duration::from_secs(3600);
/// Most ids remembered; the oldest is forgotten first. A forgotten id that comes back is
/// sent to the hub, which recognises it by its event id.
pub const REMEMBERED: usize = 8192;

/// Answered inbound ids, oldest first.
#[derive(Debug)]
pub struct Seen {
    ids: HashSet<Id>,
    order: VecDeque<(Instant, Id)>,
    ttl: Duration,
    capacity: usize,
}

impl Default for Seen {
    fn default() -> Self {
        Self::new(REMEMBER_FOR, REMEMBERED)
    }
}

impl Seen {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self { ids: HashSet::new(), order: VecDeque::new(), ttl, capacity: capacity.max(1) }
    }

    /// Whether the hub already answered `id`.
    pub fn answered(&mut self, id: &Id, now: Instant) -> bool {
        self.expire(now);
        self.ids.contains(id)
    }

    /// Records that the hub answered `id`.
    pub fn remember(&mut self, id: Id, now: Instant) {
        self.expire(now);
        if self.ids.insert(id.clone()) {
            self.order.push_back((now, id));
        }
        while self.order.len() > self.capacity {
            if let Some((_, old)) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < self.ttl {
                break;
            }
            if let Some((_, old)) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    #[test]
    fn an_answered_id_is_recognised_until_it_expires() {
        let start = Instant::now();
        let mut seen = Seen::new(Duration::from_secs(10), 100);
        assert!(!seen.answered(&id("C1:1.1"), start));
        seen.remember(id("C1:1.1"), start);
        assert!(seen.answered(&id("C1:1.1"), start + Duration::from_secs(9)));
        assert!(!seen.answered(&id("C1:1.1"), start + Duration::from_secs(10)));
        assert!(seen.is_empty());
    }

    #[test]
    fn the_oldest_is_forgotten_beyond_capacity() {
        let now = Instant::now();
        let mut seen = Seen::new(Duration::from_secs(60), 2);
        for name in ["a", "b", "c"] {
            seen.remember(id(name), now);
        }
        assert_eq!(seen.len(), 2);
        assert!(!seen.answered(&id("a"), now));
        assert!(seen.answered(&id("c"), now));
    }
}
