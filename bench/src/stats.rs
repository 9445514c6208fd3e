//! Closed-loop measurement bookkeeping (the [`Meter`]) and the statistics the report shows:
//! percentiles of one repetition and the median over repetitions. Pure: no I/O, no clock reads.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How long and how hard one repetition runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Round trips kept in flight (1 = sequential).
    pub window: usize,
    /// Round trips completed before measuring starts (connections, caches, allocators warm).
    pub warmup: u64,
    /// Measuring time, after the warm-up.
    pub measure: Duration,
}

/// The outcome of one repetition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Round trips completed in the measuring time.
    pub count: u64,
    pub rate_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Round trips that came back with an error (not counted in `count`).
    pub errors: u64,
    /// Successful round trips of the whole run, warm-up and drain included.
    #[serde(default)]
    pub total: u64,
}

/// Tracks one closed-loop run: what is in flight, when measuring started, the latencies of
/// round trips completed while measuring.
///
/// The loop asks [`may_issue`](Self::may_issue) before each request, calls
/// [`issue`](Self::issue) for it and [`complete`](Self::complete) for its answer, and stops
/// once [`finished`](Self::finished).
#[derive(Debug)]
pub struct Meter {
    plan: Plan,
    next: u64,
    started: HashMap<u64, Instant>,
    completed: u64,
    succeeded: u64,
    measuring_since: Option<Instant>,
    measured: Vec<Duration>,
    errors: u64,
    first_error: Option<String>,
}

impl Meter {
    pub fn new(plan: Plan) -> Self {
        Self {
            plan,
            next: 0,
            started: HashMap::with_capacity(plan.window * 2),
            completed: 0,
            succeeded: 0,
            measuring_since: None,
            measured: Vec::with_capacity(64 * 1024),
            errors: 0,
            first_error: None,
        }
    }

    pub fn in_flight(&self) -> usize {
        self.started.len()
    }

    /// True while the window has room and the measuring time has not run out.
    pub fn may_issue(&self, now: Instant) -> bool {
        self.in_flight() < self.plan.window && !self.expired(now)
    }

    fn expired(&self, now: Instant) -> bool {
        self.measuring_since.is_some_and(|since| now.duration_since(since) >= self.plan.measure)
    }

    /// Registers a new request sent at `now`; returns its sequence number.
    pub fn issue(&mut self, now: Instant) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.started.insert(seq, now);
        seq
    }

    /// Registers the answer to `seq` received at `now`. Unknown sequence numbers (answers
    /// to nothing this meter issued) are counted as errors.
    pub fn complete(&mut self, seq: u64, now: Instant, outcome: Result<(), String>) {
        let Some(sent) = self.started.remove(&seq) else {
            self.error(format!("answer to unknown request {seq}"));
            return;
        };
        // Failed round trips count towards the warm-up too, so a run that only fails still
        // ends after its measuring time.
        self.completed += 1;
        match self.measuring_since {
            None if self.completed >= self.plan.warmup => self.measuring_since = Some(now),
            None => {}
            Some(since) if now.duration_since(since) < self.plan.measure && outcome.is_ok() => {
                self.measured.push(now.duration_since(sent));
            }
            Some(_) => {}
        }
        match outcome {
            Ok(()) => self.succeeded += 1,
            Err(err) => self.error(err),
        }
    }

    fn error(&mut self, message: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(message);
        }
    }

    /// True once the measuring time is over and nothing is in flight.
    pub fn finished(&self, now: Instant) -> bool {
        self.expired(now) && self.started.is_empty()
    }

    /// The first error seen, for the report.
    pub fn first_error(&self) -> Option<&str> {
        self.first_error.as_deref()
    }

    /// The repetition's numbers. The rate counts completions inside the measuring time only.
    pub fn sample(&mut self) -> Sample {
        let count = self.measured.len() as u64;
        let rate_per_s = count as f64 / self.plan.measure.as_secs_f64();
        self.measured.sort_unstable();
        Sample {
            count,
            rate_per_s,
            p50_us: percentile_us(&self.measured, 0.50),
            p99_us: percentile_us(&self.measured, 0.99),
            errors: self.errors,
            total: self.succeeded,
        }
    }
}

/// The `q` quantile (nearest rank) of sorted durations, in microseconds; 0 when empty.
pub fn percentile_us(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e6
}

/// The median of `values` (mean of the middle two for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 { sorted[mid] } else { (sorted[mid - 1] + sorted[mid]) / 2.0 }
}

/// Median of each metric over repetitions; errors are summed.
pub fn median_sample(samples: &[Sample]) -> Sample {
    let pick = |f: fn(&Sample) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
    Sample {
        count: pick(|s| s.count as f64) as u64,
        rate_per_s: pick(|s| s.rate_per_s),
        p50_us: pick(|s| s.p50_us),
        p99_us: pick(|s| s.p99_us),
        errors: samples.iter().map(|s| s.errors).sum(),
        total: samples.iter().map(|s| s.total).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(us).collect();
        assert_eq!(percentile_us(&sorted, 0.50), 50.0);
        assert_eq!(percentile_us(&sorted, 0.99), 99.0);
        assert_eq!(percentile_us(&[us(7)], 0.99), 7.0);
        assert_eq!(percentile_us(&[], 0.5), 0.0);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn meter_keeps_the_window_and_measures_after_the_warmup() {
        let plan = Plan { window: 2, warmup: 1, measure: Duration::from_millis(10) };
        let mut meter = Meter::new(plan);
        let t0 = Instant::now();
        let a = meter.issue(t0);
        let b = meter.issue(t0);
        assert!(!meter.may_issue(t0), "window of two is full");
        meter.complete(a, t0 + us(5), Ok(()));
        assert!(meter.may_issue(t0 + us(5)), "warm-up done, measuring starts");
        meter.complete(b, t0 + us(8), Ok(()));
        let c = meter.issue(t0 + us(8));
        meter.complete(c, t0 + us(20), Err("refused".into()));
        let late = t0 + us(5) + Duration::from_millis(10);
        assert!(!meter.may_issue(late));
        assert!(meter.finished(late));
        let sample = meter.sample();
        assert_eq!(sample.count, 1);
        assert_eq!(sample.errors, 1);
        assert_eq!(sample.p50_us, 8.0);
        assert_eq!(meter.first_error(), Some("refused"));
    }

    #[test]
    fn median_sample_takes_each_metric_separately() {
        let s = |rate, p50| Sample {
            count: 1,
            rate_per_s: rate,
            p50_us: p50,
            p99_us: p50,
            errors: 1,
            total: 1,
        };
        let m = median_sample(&[s(1.0, 30.0), s(3.0, 10.0), s(2.0, 20.0)]);
        assert_eq!((m.rate_per_s, m.p50_us, m.errors), (2.0, 20.0, 3));
    }
}
