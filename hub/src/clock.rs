//! The hub's clock for the times the ledger keeps (received, retry due, expiry, retention):
//! read from the wall clock once, when the hub starts, and advanced by the monotonic clock
//! after that. A wall-clock jump while the hub runs (NTP stepping, an operator's `date -s`,
//! a VM resumed) therefore neither expires outbox sends or replies early, nor retries too
//! soon or hours late, nor prunes dedupe entries before their retention passed. The values
//! are still Unix milliseconds, so they survive a restart and read as dates; a jump while
//! the hub is stopped is taken as elapsed time at the next start.
//!
//! In-memory timers (liveness, stall, deny notices, run timeouts) use `Instant` directly.
//! Wall-clock only, shown to people: `started_ms`, `connected_since_ms`,
//! `health_updated_ms`, `last_error_ms` in `status`.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Wall time at a monotonic instant, advanced by the monotonic clock only.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall_at_start_ms: u64,
    start: Instant,
}

impl Clock {
    /// A clock that reads `wall_ms` now and never consults the wall clock again.
    pub fn starting_at(wall_ms: u64) -> Self {
        Self { wall_at_start_ms: wall_ms, start: Instant::now() }
    }

    /// Unix milliseconds by this clock: never earlier than a reading before it.
    pub fn now_ms(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.wall_at_start_ms.saturating_add(elapsed)
    }
}

static HUB_CLOCK: OnceLock<Clock> = OnceLock::new();

/// The hub's clock, anchored to the wall clock at its first use (the hub's start).
pub fn now_ms() -> u64 {
    HUB_CLOCK
        .get_or_init(|| {
            let wall = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
            Clock::starting_at(u64::try_from(wall).unwrap_or(u64::MAX))
        })
        .now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_reads_the_wall_once_and_then_only_moves_forward() {
        // Anchored far from the real wall clock: the readings follow the anchor, so nothing
        // the wall clock does after the start (forward or back) reaches them.
        for anchor in [0, 1_000_000, 4_102_444_800_000] {
            let clock = Clock::starting_at(anchor);
            let mut last = clock.now_ms();
            assert!(last >= anchor);
            for _ in 0..1000 {
                let now = clock.now_ms();
                assert!(now >= last, "{now} < {last}");
                last = now;
            }
            // Far less than a day passed: the wall clock (some date after 2024) was not read.
            assert!(last - anchor < 86_400_000, "{last} - {anchor}");
        }
    }

    #[test]
    fn an_expiry_decided_by_the_clock_ignores_a_wall_clock_jump() {
        // A queued send due to expire in an hour, judged by the hub's clock: however far the
        // wall clock was set forward since, a reading now is not past the expiry.
        let clock = Clock::starting_at(1_700_000_000_000);
        let expires_ms = clock.now_ms() + 3_600_000;
        let wall_jumped_forward = 1_700_000_000_000 + 86_400_000;
        assert!(wall_jumped_forward > expires_ms, "the wall clock alone would expire it");
        assert!(clock.now_ms() < expires_ms);
    }
}
