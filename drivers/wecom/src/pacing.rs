//! Per-conversation pacing, free of I/O: WeCom allows a conversation 30 messages a minute and
//! 1,000 an hour (replies and proactive messages together). Each message reserves the
//! earliest slot that keeps both sliding windows within [`Pace`]; later messages queue behind
//! it (first come, first served), and a message whose slot would come after its deadline
//! reserves nothing and is reported instead of waiting forever.

use std::collections::{HashMap, VecDeque};

use tokio::time::Instant;

use crate::config::Pace;

/// Slots reserved per conversation, oldest first. Memory: at most `per_hour` slots per
/// conversation that sent within the last hour (older slots are pruned on every call).
#[derive(Debug)]
pub struct Pacer {
    pace: Pace,
    chats: HashMap<String, VecDeque<Instant>>,
}

impl Pacer {
    pub fn new(pace: Pace) -> Self {
        Self { pace, chats: HashMap::new() }
    }

    /// Reserves the earliest slot at or after `now` for one message to `chat` and returns it,
    /// or returns `None` (reserving nothing) when that slot is after `deadline`.
    pub fn reserve(&mut self, chat: &str, now: Instant, deadline: Instant) -> Option<Instant> {
        self.prune(now);
        let slots = self.chats.get(chat);
        let slot = slots.map_or(now, |slots| self.earliest(slots, now));
        if slot > deadline {
            return None;
        }
        self.chats.entry(chat.to_owned()).or_default().push_back(slot);
        Some(slot)
    }

    /// Conversations with slots in the last hour.
    pub fn tracked(&self) -> usize {
        self.chats.len()
    }

    fn earliest(&self, slots: &VecDeque<Instant>, now: Instant) -> Instant {
        let Pace { per_minute, per_hour, minute, hour } = self.pace;
        // Slots are reserved in order, so the newest is last; a new slot never goes before
        // it (first come, first served).
        let mut slot = slots.back().map_or(now, |last| now.max(*last));
        // With n slots inside a window, the n-th newest must have left it.
        if slots.len() >= per_minute {
            slot = slot.max(slots[slots.len() - per_minute] + minute);
        }
        if slots.len() >= per_hour {
            slot = slot.max(slots[slots.len() - per_hour] + hour);
        }
        slot
    }

    fn prune(&mut self, now: Instant) {
        let hour = self.pace.hour;
        self.chats.retain(|_, slots| {
            while slots.front().is_some_and(|slot| *slot + hour <= now) {
                slots.pop_front();
            }
            !slots.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn pacer(per_minute: usize, per_hour: usize) -> Pacer {
        Pacer::new(Pace {
            per_minute,
            per_hour,
            minute: Duration::from_secs(60),
            hour: Duration::from_secs(3600),
        })
    }

    const FAR: Duration = Duration::from_secs(10_000);

    #[test]
    fn a_conversation_gets_its_minute_quota_then_waits_for_the_oldest_to_leave() {
        let mut pacer = pacer(3, 1000);
        let t0 = Instant::now();
        for n in 0..3 {
            let now = t0 + Duration::from_secs(n);
            assert_eq!(
                pacer.reserve("alice", now, now + FAR),
                Some(now),
                "message {n} goes at once"
            );
        }
        let now = t0 + Duration::from_secs(10);
        assert_eq!(pacer.reserve("alice", now, now + FAR), Some(t0 + Duration::from_secs(60)));
        // The next one queues behind it: the second slot must leave the window first.
        assert_eq!(pacer.reserve("alice", now, now + FAR), Some(t0 + Duration::from_secs(61)));
        // Another conversation is not held up.
        assert_eq!(pacer.reserve("bob", now, now), Some(now));
    }

    #[test]
    fn a_slot_after_the_deadline_is_refused_and_reserves_nothing() {
        let mut pacer = pacer(1, 1000);
        let t0 = Instant::now();
        assert_eq!(pacer.reserve("alice", t0, t0), Some(t0));
        assert_eq!(pacer.reserve("alice", t0, t0 + Duration::from_secs(30)), None);
        // Nothing was reserved, so the slot a minute later is still the next one.
        assert_eq!(
            pacer.reserve("alice", t0, t0 + Duration::from_secs(90)),
            Some(t0 + Duration::from_secs(60))
        );
    }

    #[test]
    fn the_hour_limit_holds_across_minutes() {
        let mut pacer = pacer(30, 40);
        let t0 = Instant::now();
        let mut last = t0;
        for _ in 0..40 {
            last = pacer.reserve("alice", t0, t0 + FAR).unwrap();
        }
        // 30 in the first minute, 10 in the second; the 41st waits for the first to age out.
        assert_eq!(last, t0 + Duration::from_secs(60));
        assert_eq!(pacer.reserve("alice", t0, t0 + FAR), Some(t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn every_minute_window_holds_at_most_the_quota() {
        let mut pacer = pacer(30, 1000);
        let t0 = Instant::now();
        let slots: Vec<Instant> =
            (0..200).map(|_| pacer.reserve("alice", t0, t0 + FAR).unwrap()).collect();
        for (index, slot) in slots.iter().enumerate() {
            let in_window = slots[index..]
                .iter()
                .filter(|later| **later < *slot + Duration::from_secs(60))
                .count();
            assert!(in_window <= 30, "{in_window} messages in the minute from slot {index}");
        }
        assert!(slots.windows(2).all(|pair| pair[0] <= pair[1]), "first come, first served");
    }

    #[test]
    fn conversations_idle_for_an_hour_are_forgotten() {
        let mut pacer = pacer(30, 1000);
        let t0 = Instant::now();
        pacer.reserve("alice", t0, t0);
        pacer.reserve("bob", t0, t0);
        assert_eq!(pacer.tracked(), 2);
        let later = t0 + Duration::from_secs(3600);
        pacer.reserve("carol", later, later);
        assert_eq!(pacer.tracked(), 1);
    }
}
