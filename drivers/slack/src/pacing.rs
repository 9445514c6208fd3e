//! Post pacing: Slack allows about one `chat.postMessage` per second per channel (short
//! bursts aside), so each post reserves the channel's next slot. Pure and bounded.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Channels tracked before slots in the past are pruned.
const TRACKED_CHANNELS: usize = 1024;

/// The next free posting slot per channel.
#[derive(Debug)]
pub struct Pacer {
    interval: Duration,
    next: HashMap<String, Instant>,
}

impl Pacer {
    pub fn new(interval: Duration) -> Self {
        Self { interval, next: HashMap::new() }
    }

    /// When a post to `channel` asked for at `now` may go; the slot after it is reserved
    /// for the next post.
    pub fn reserve(&mut self, channel: &str, now: Instant) -> Instant {
        if self.interval.is_zero() {
            return now;
        }
        if self.next.len() >= TRACKED_CHANNELS {
            self.next.retain(|_, slot| *slot > now);
        }
        let slot = self.next.get(channel).copied().filter(|slot| *slot > now).unwrap_or(now);
        self.next.insert(channel.to_owned(), slot + self.interval);
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posts_to_one_channel_are_a_second_apart_and_channels_are_independent() {
        let now = Instant::now();
        let mut pacer = Pacer::new(Duration::from_secs(1));
        assert_eq!(pacer.reserve("C1", now), now);
        assert_eq!(pacer.reserve("C1", now), now + Duration::from_secs(1));
        assert_eq!(pacer.reserve("C1", now), now + Duration::from_secs(2));
        assert_eq!(pacer.reserve("C2", now), now);
        let later = now + Duration::from_secs(10);
        assert_eq!(pacer.reserve("C1", later), later, "an idle channel posts at once");
    }

    #[test]
    fn a_zero_interval_never_waits() {
        let now = Instant::now();
        let mut pacer = Pacer::new(Duration::ZERO);
        assert_eq!(pacer.reserve("C1", now), now);
        assert_eq!(pacer.reserve("C1", now), now);
    }
}
