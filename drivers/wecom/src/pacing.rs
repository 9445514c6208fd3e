//! Per-conversation pacing, free of I/O: WeCom allows a conversation 30 messages a minute and
//! 1,000 an hour (replies and proactive messages together).
//!
//! The platform counts a message when it receives it, which is after the driver sent it and
//! before its acknowledgement came back. So the pacer records each message at its
//! acknowledgement (or when the driver stopped waiting for one) and lets the next go only
//! once the window measured from those times allows it: what the platform counted can then
//! never exceed the limit, whatever the latency. The caller sends one message per
//! conversation at a time (first come, first served), asking for the next slot when its turn
//! comes.

use std::collections::{HashMap, VecDeque};

use tokio::time::Instant;

use crate::config::Pace;

/// Recorded messages per conversation, oldest first. Memory: at most `per_hour` times per
/// conversation that sent within the last hour (older ones are pruned on every call).
#[derive(Debug)]
pub struct Pacer {
    pace: Pace,
    chats: HashMap<String, VecDeque<Instant>>,
}

impl Pacer {
    pub fn new(pace: Pace) -> Self {
        Self { pace, chats: HashMap::new() }
    }

    /// The earliest time at or after `now` a message to `chat` may be sent.
    pub fn next_slot(&mut self, chat: &str, now: Instant) -> Instant {
        self.prune(now);
        let Some(times) = self.chats.get(chat) else { return now };
        let Pace { per_minute, per_hour, minute, hour } = self.pace;
        let mut slot = now;
        // With n messages inside a window, the n-th newest must have left it.
        if times.len() >= per_minute {
            slot = slot.max(times[times.len() - per_minute] + minute);
        }
        if times.len() >= per_hour {
            slot = slot.max(times[times.len() - per_hour] + hour);
        }
        slot
    }

    /// Records a message to `chat` that the platform had by `at`.
    pub fn record(&mut self, chat: &str, at: Instant) {
        let times = self.chats.entry(chat.to_owned()).or_default();
        // Keep the times sorted: two sends can finish out of order by a hair.
        let at = times.back().map_or(at, |last| at.max(*last));
        times.push_back(at);
        while times.len() > self.pace.per_hour.max(self.pace.per_minute) {
            times.pop_front();
        }
    }

    /// Conversations with messages in the last hour.
    pub fn tracked(&self) -> usize {
        self.chats.len()
    }

    fn prune(&mut self, now: Instant) {
        let hour = self.pace.hour.max(self.pace.minute);
        self.chats.retain(|_, times| {
            while times.front().is_some_and(|at| *at + hour <= now) {
                times.pop_front();
            }
            !times.is_empty()
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

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_conversation_gets_its_minute_quota_then_waits_for_the_oldest_to_leave() {
        let mut pacer = pacer(3, 1000);
        let t0 = Instant::now();
        for n in 0..3 {
            let now = t0 + secs(n);
            assert_eq!(pacer.next_slot("alice", now), now, "message {n} goes at once");
            pacer.record("alice", now);
        }
        let now = t0 + secs(10);
        assert_eq!(pacer.next_slot("alice", now), t0 + secs(60));
        // Another conversation is not held up.
        assert_eq!(pacer.next_slot("bob", now), now);
    }

    #[test]
    fn the_window_counts_from_the_acknowledgement_not_the_request() {
        let mut pacer = pacer(1, 1000);
        let t0 = Instant::now();
        assert_eq!(pacer.next_slot("alice", t0), t0);
        // The platform acknowledged it 300 ms later: it may have counted it as late as that.
        pacer.record("alice", t0 + Duration::from_millis(300));
        assert_eq!(pacer.next_slot("alice", t0), t0 + Duration::from_millis(60_300));
    }

    #[test]
    fn the_hour_limit_holds_across_minutes() {
        let mut pacer = pacer(30, 40);
        let t0 = Instant::now();
        let mut now = t0;
        for _ in 0..40 {
            now = pacer.next_slot("alice", now);
            pacer.record("alice", now);
        }
        // 30 in the first minute, 10 in the second; the 41st waits for the first to age out.
        assert_eq!(now, t0 + secs(60));
        assert_eq!(pacer.next_slot("alice", now), t0 + secs(3600));
    }

    #[test]
    fn every_minute_window_holds_at_most_the_quota() {
        let mut pacer = pacer(30, 1000);
        let t0 = Instant::now();
        let mut now = t0;
        let mut sent = Vec::new();
        for n in 0..200u64 {
            // Sends take a varying time to be acknowledged.
            now = pacer.next_slot("alice", now);
            let acked = now + Duration::from_millis(n % 7 * 40);
            pacer.record("alice", acked);
            sent.push((now, acked));
            now = acked;
        }
        // However late within [sent, acked] the platform counted each message, the 31st
        // newest had left the minute before a message was sent.
        for k in 30..sent.len() {
            let (sent_at, _) = sent[k];
            let (_, acked_31st) = sent[k - 30];
            assert!(sent_at >= acked_31st + secs(60), "message {k} went too early");
        }
    }

    #[test]
    fn conversations_idle_for_an_hour_are_forgotten() {
        let mut pacer = pacer(30, 1000);
        let t0 = Instant::now();
        pacer.record("alice", t0);
        pacer.record("bob", t0);
        assert_eq!(pacer.tracked(), 2);
        let later = t0 + secs(3600);
        pacer.next_slot("carol", later);
        assert_eq!(pacer.tracked(), 0);
    }
}
