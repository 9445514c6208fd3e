//! Capped exponential backoff with jitter that resets after a long enough healthy run.

use std::time::Duration;

/// Capped exponential backoff. Pure apart from [`Backoff::next_delay`], which draws jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    reset_after: Duration,
    base: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, reset_after: Duration) -> Self {
        Self { initial, max, reset_after, base: initial, attempt: 0 }
    }

    /// A driver reconnecting to the hub: 1 s doubling to 30 s, reset after 60 s connected.
    pub fn hub_reconnect() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(30), Duration::from_secs(60))
    }

    /// The hub restarting a supervised driver: 1 s doubling to 60 s, reset after 60 s healthy.
    pub fn supervisor() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(60), Duration::from_secs(60))
    }

    /// Failed attempts since the last reset.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The delay before the next attempt with `jitter` in `[0, 1)`: the base delay scaled by
    /// 0.75–1.25, capped at the maximum. The base then doubles.
    pub fn next_delay_with(&mut self, jitter: f64) -> Duration {
        let jitter = jitter.clamp(0.0, 1.0);
        let delay = self.base.mul_f64(0.75 + 0.5 * jitter).min(self.max);
        self.base = (self.base * 2).min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        delay
    }

    /// The delay before the next attempt, with random jitter.
    pub fn next_delay(&mut self) -> Duration {
        self.next_delay_with(fastrand::f64())
    }

    /// Records how long the last connection stayed up; a long enough run resets the backoff.
    pub fn record_uptime(&mut self, uptime: Duration) {
        if uptime >= self.reset_after {
            self.reset();
        }
    }

    pub fn reset(&mut self) {
        self.base = self.initial;
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets_after_a_healthy_run() {
        let mut backoff = Backoff::hub_reconnect();
        let delays: Vec<u64> = (0..7).map(|_| backoff.next_delay_with(0.5).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30]);
        backoff.record_uptime(Duration::from_secs(59));
        assert_eq!(backoff.next_delay_with(0.5), Duration::from_secs(30));
        backoff.record_uptime(Duration::from_secs(60));
        assert_eq!(backoff.next_delay_with(0.5), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_a_quarter() {
        let mut low = Backoff::supervisor();
        let mut high = Backoff::supervisor();
        assert_eq!(low.next_delay_with(0.0), Duration::from_millis(750));
        assert_eq!(high.next_delay_with(0.999_999).as_millis(), 1249);
    }
}
