//! The plugin restart delay, as the seed prescribes: 1 s after the first failure, doubling
//! to at most 60 s; a run that lasted at least 60 s starts the sequence again. Pure: the
//! caller says how long each run lasted, so tests use simulated durations.

use std::time::Duration;

/// The restart delays of one plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartBackoff {
    base: Duration,
    max: Duration,
    reset_after: Duration,
    next: Duration,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(60), Duration::from_secs(60))
    }
}

impl RestartBackoff {
    pub fn new(base: Duration, max: Duration, reset_after: Duration) -> Self {
        Self { base, max, reset_after, next: base }
    }

    /// The delay before the next start, after a run (or failed start) that lasted `ran_for`.
    pub fn after_run(&mut self, ran_for: Duration) -> Duration {
        if ran_for >= self.reset_after {
            self.next = self.base;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Starts the sequence again (an operator's `resume`).
    pub fn reset(&mut self) {
        self.next = self.base;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(delays: &[Duration]) -> Vec<u64> {
        delays.iter().map(Duration::as_secs).collect()
    }

    #[test]
    fn delays_double_from_one_second_to_sixty_and_reset_after_a_run_of_sixty_seconds() {
        let mut backoff = RestartBackoff::default();
        let short = Duration::from_millis(200);
        let delays: Vec<_> = (0..8).map(|_| backoff.after_run(short)).collect();
        assert_eq!(secs(&delays), [1, 2, 4, 8, 16, 32, 60, 60]);
        // 59 s up is not enough to forget the failures.
        assert_eq!(backoff.after_run(Duration::from_secs(59)).as_secs(), 60);
        // 60 s up (simulated) is.
        assert_eq!(backoff.after_run(Duration::from_secs(60)).as_secs(), 1);
        assert_eq!(backoff.after_run(short).as_secs(), 2);
        backoff.reset();
        assert_eq!(backoff.after_run(short).as_secs(), 1);
    }
}
