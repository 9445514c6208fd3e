//! Reconnecting to a platform: capped exponential backoff with jitter, reset once a connection
//! stayed up for a stable period, and a slow lane for failures only an operator can fix
//! (refused credentials, a displaced session), so a driver never hammers a platform that
//! will keep saying no. Waiting ends early on cancellation or on a [`Nudge`].
//!
//! ```no_run
//! # use channeld_driver_sdk::{Failure, Hub, LinkState, Reconnect, ReconnectPolicy, CancellationToken};
//! # async fn connect() -> Result<(), (Failure, String)> { Ok(()) }
//! # async fn serve() -> Result<(), String> { Ok(()) }
//! # async fn example(hub: Hub, shutdown: CancellationToken) {
//! let mut reconnect = Reconnect::new(ReconnectPolicy::default());
//! loop {
//!     hub.link_state(LinkState::Connecting { attempt: reconnect.attempt() });
//!     let failure = match connect().await {
//!         Ok(()) => {
//!             reconnect.connected();
//!             hub.link_state(LinkState::up());
//!             let error = serve().await.err().unwrap_or_default();
//!             hub.link_state(LinkState::Retrying { attempt: reconnect.attempt() + 1, error });
//!             Failure::Transient
//!         }
//!         Err((failure, _error)) => failure,
//!     };
//!     if !reconnect.wait(failure, &shutdown).await {
//!         break; // shutting down
//!     }
//! }
//! # }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use channeld_link::Backoff;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Delays of a [`Reconnect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// First delay after a transient failure; it doubles (with ±25 % jitter) up to `max`.
    pub initial: Duration,
    pub max: Duration,
    /// A connection that stayed up this long resets both lanes to their first delay.
    pub reset_after: Duration,
    /// First delay after a failure only an operator can fix; it doubles up to
    /// `operator_max`. Never shorter than `initial`.
    pub operator_initial: Duration,
    pub operator_max: Duration,
}

impl Default for ReconnectPolicy {
    /// 0.5 s doubling to 30 s; 30 s doubling to 10 min for operator-only failures; reset
    /// after 60 s up.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
            operator_initial: Duration::from_secs(30),
            operator_max: Duration::from_secs(600),
        }
    }
}

impl ReconnectPolicy {
    /// The default policy with another cap on the transient lane (a driver setting such as
    /// `CHANNELD_MQTT_RECONNECT_MAX_SECONDS`).
    pub fn with_max(self, max: Duration) -> Self {
        Self { max: max.max(self.initial), ..self }
    }
}

/// What kind of failure a wait follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Network trouble, an outage, a timeout: retry on the normal lane.
    Transient,
    /// Refused or expired credentials, a displaced session, a refused setup: retry on the
    /// slow lane (the operator may have fixed it meanwhile, but it is not likely soon).
    Operator,
}

/// Wakes a [`Reconnect`] that is waiting, e.g. when an operator action says "resume now".
/// Cheap to clone. A nudge while nobody waits makes the next wait end at once.
#[derive(Debug, Clone, Default)]
pub struct Nudge(Arc<Notify>);

impl Nudge {
    pub fn nudge(&self) {
        self.0.notify_one();
    }
}

/// Reconnect bookkeeping for one platform link. Pure apart from [`Reconnect::wait`] (which
/// sleeps) and the clock read by [`Reconnect::connected`] and [`Reconnect::failed`].
#[derive(Debug)]
pub struct Reconnect {
    policy: ReconnectPolicy,
    transient: Backoff,
    operator: Backoff,
    attempt: u32,
    up_since: Option<Instant>,
    nudge: Nudge,
}

impl Reconnect {
    pub fn new(policy: ReconnectPolicy) -> Self {
        let operator_initial = policy.operator_initial.max(policy.initial);
        Self {
            policy,
            transient: Backoff::new(policy.initial, policy.max, policy.reset_after),
            operator: Backoff::new(
                operator_initial,
                policy.operator_max.max(operator_initial),
                policy.reset_after,
            ),
            attempt: 0,
            up_since: None,
            nudge: Nudge::default(),
        }
    }

    /// Failed attempts since the link was last up for a stable period (0 at the start).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The link is up now. When it next fails, the time it stayed up decides whether the
    /// backoff starts over.
    pub fn connected(&mut self) {
        self.up_since = Some(Instant::now());
    }

    /// A handle that ends the current (or next) wait early.
    pub fn nudger(&self) -> Nudge {
        self.nudge.clone()
    }

    /// Records a failure and returns how long to wait before the next attempt (report the
    /// link state with [`attempt`](Self::attempt) now counting this failure, then
    /// [`sleep`](Self::sleep)).
    pub fn failed(&mut self, failure: Failure) -> Duration {
        self.failed_at(failure, Instant::now(), fastrand::f64())
    }

    /// [`failed`](Self::failed) with the clock and the jitter (in `[0, 1)`) given.
    pub fn failed_at(&mut self, failure: Failure, now: Instant, jitter: f64) -> Duration {
        if let Some(since) = self.up_since.take()
            && now.saturating_duration_since(since) >= self.policy.reset_after
        {
            self.transient.reset();
            self.operator.reset();
            self.attempt = 0;
        }
        self.attempt = self.attempt.saturating_add(1);
        match failure {
            Failure::Transient => self.transient.next_delay_with(jitter),
            Failure::Operator => self.operator.next_delay_with(jitter),
        }
    }

    /// Waits `delay`. Returns false when `cancel` fired (stop reconnecting), true when it is
    /// time for the next attempt (the delay passed or the wait was nudged).
    pub async fn sleep(&self, delay: Duration, cancel: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            () = cancel.cancelled() => false,
            () = self.nudge.0.notified() => true,
            () = tokio::time::sleep(delay) => true,
        }
    }

    /// [`failed`](Self::failed), then [`sleep`](Self::sleep).
    pub async fn wait(&mut self, failure: Failure, cancel: &CancellationToken) -> bool {
        let delay = self.failed(failure);
        self.sleep(delay, cancel).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> ReconnectPolicy {
        ReconnectPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
            reset_after: Duration::from_secs(60),
            operator_initial: Duration::from_secs(30),
            operator_max: Duration::from_secs(120),
        }
    }

    #[test]
    fn transient_failures_double_to_the_cap() {
        let mut reconnect = Reconnect::new(policy());
        let now = Instant::now();
        let delays: Vec<u64> =
            (0..6).map(|_| reconnect.failed_at(Failure::Transient, now, 0.5).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 8, 8]);
        assert_eq!(reconnect.attempt(), 6);
    }

    #[test]
    fn operator_failures_take_the_slow_lane() {
        let mut reconnect = Reconnect::new(policy());
        let now = Instant::now();
        let delays: Vec<u64> =
            (0..4).map(|_| reconnect.failed_at(Failure::Operator, now, 0.5).as_secs()).collect();
        assert_eq!(delays, [30, 60, 120, 120]);
        // Jitter never takes the slow lane below three quarters of its first delay.
        let mut low = Reconnect::new(policy());
        assert!(low.failed_at(Failure::Operator, now, 0.0) >= Duration::from_millis(22_500));
    }

    #[test]
    fn a_stable_connection_resets_the_backoff_and_a_short_one_does_not() {
        let mut reconnect = Reconnect::new(policy());
        let start = Instant::now();
        for _ in 0..4 {
            reconnect.failed_at(Failure::Transient, start, 0.5);
        }
        reconnect.up_since = Some(start);
        let short = reconnect.failed_at(Failure::Transient, start + Duration::from_secs(5), 0.5);
        assert_eq!(short, Duration::from_secs(8));
        reconnect.up_since = Some(start);
        let stable = reconnect.failed_at(Failure::Transient, start + Duration::from_secs(60), 0.5);
        assert_eq!(stable, Duration::from_secs(1));
        assert_eq!(reconnect.attempt(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_ends_on_cancellation_or_a_nudge() {
        let mut reconnect = Reconnect::new(policy());
        let cancel = CancellationToken::new();
        reconnect.nudger().nudge();
        // Paused time: only the nudge can end this wait without advancing the clock.
        let before = tokio::time::Instant::now();
        assert!(reconnect.wait(Failure::Operator, &cancel).await);
        assert_eq!(tokio::time::Instant::now(), before, "the nudge ended the wait at once");
        cancel.cancel();
        assert!(!reconnect.wait(Failure::Operator, &cancel).await);
    }
}
