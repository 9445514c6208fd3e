//! Which runs of an instance can be cancelled (extension `cancel`, control op `cancel`): one
//! [`RunCancel`] per accepted inbound from its admission until its run ended, and a bounded
//! memory of how recent runs ended, so a second cancel is answered without the ledger.
//!
//! The table only holds state; `inbound/cancel.rs` carries a cancel out.

use std::collections::VecDeque;

use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock};

use channeld_protocol::Id;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::connection::lock;

/// How many ended runs an instance remembers for cancels that come late.
pub const REMEMBERED: usize = 1024;

/// The state a cancelled run is recorded with (`error_code` in the ledger, the `error` code
/// the driver gets, `cancel_result.state`).
pub const ABORTED: &str = "aborted";

/// One accepted inbound's cancellation: asked by `token`, finished (its end recorded and
/// sent) once it has the state it ended in. Every run has one, and almost none is ever
/// cancelled: the finish is a store and a wake-up of no one, not a second token, and the
/// token itself is made only for a run that waits on it (an echo run never does).
#[derive(Debug, Default)]
pub struct RunCancel {
    /// Set by [`RunCancel::cancel`] before it cancels `token`: what the run's own checks
    /// read, an atomic load where the token's check takes its lock.
    cancelled: AtomicBool,
    /// What a runtime waits on, made by the first [`RunCancel::token`]; cancelled only
    /// through [`RunCancel::cancel`], or as it is made for a run already cancelled.
    token: OnceLock<CancellationToken>,
    /// Set once the run's end is recorded and its ending handed to the driver.
    ended: Mutex<Option<&'static str>>,
    /// Wakes those waiting in [`RunCancel::finished`] when `ended` is set.
    done: Notify,
    /// Taken by the first cancel that reports this run as cancelled.
    claimed: AtomicBool,
}

impl RunCancel {
    /// Cancels the run: it stops at its next step.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        // With the fence in `token`: a token made meanwhile is seen here, or it sees the
        // flag and is cancelled as it is made (never neither).
        fence(Ordering::SeqCst);
        if let Some(token) = self.token.get() {
            token.cancel();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// The token a runtime or a waiting run selects on, made on first use (already
    /// cancelled if the run is).
    pub fn token(&self) -> &CancellationToken {
        let token = self.token.get_or_init(CancellationToken::new);
        fence(Ordering::SeqCst);
        if self.cancelled.load(Ordering::SeqCst) {
            token.cancel();
        }
        token
    }

    /// The state it ended in (`aborted`, `replied`, `failed`, …), once done.
    pub fn ended(&self) -> Option<&'static str> {
        *lock(&self.ended)
    }

    /// Waits until the run is done, and returns the state it ended in.
    pub async fn finished(&self) -> &'static str {
        loop {
            // Registered before the check, so a finish between the two still wakes it.
            let notified = self.done.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(state) = self.ended() {
                return state;
            }
            notified.await;
        }
    }

    /// True for the first caller only: that cancel names the run in its answer.
    pub fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }
}

/// The table of one instance.
#[derive(Debug, Default)]
pub struct Cancels {
    live: HashMap<Id, Arc<RunCancel>>,
    /// Ended runs, oldest first, at most [`REMEMBERED`].
    ended: VecDeque<(Id, &'static str)>,
}

/// Where an event stands for a cancel.
#[derive(Debug, Clone)]
pub enum Lookup {
    Live(Arc<RunCancel>),
    Ended(&'static str),
    Unknown,
}

impl Cancels {
    /// A run for `event_id` is accepted; returns its handle (the existing one if it has one).
    pub fn register(&mut self, event_id: &Id) -> Arc<RunCancel> {
        self.live.entry(event_id.clone()).or_default().clone()
    }

    pub fn lookup(&self, event_id: &Id) -> Lookup {
        if let Some(run) = self.live.get(event_id) {
            return Lookup::Live(run.clone());
        }
        match self.ended.iter().rev().find(|(id, _)| id == event_id) {
            Some((_, state)) => Lookup::Ended(state),
            None => Lookup::Unknown,
        }
    }

    /// The run of `event_id` ended in `state`: it is remembered, and its waiters woken.
    pub fn finish(&mut self, event_id: &Id, run: &RunCancel, state: &'static str) {
        if self.live.get(event_id).is_some_and(|live| std::ptr::eq(live.as_ref(), run)) {
            self.live.remove(event_id);
        }
        if self.ended.len() == REMEMBERED {
            self.ended.pop_front();
        }
        self.ended.push_back((event_id.clone(), state));
        *lock(&run.ended) = Some(state);
        run.done.notify_waiters();
    }

    /// Runs registered and not ended.
    pub fn live_len(&self) -> usize {
        self.live.len()
    }
}

/// An instance's table behind its lock.
pub type SharedCancels = Mutex<Cancels>;

#[cfg(test)]
mod tests {
    use super::*;

    fn id(value: &str) -> Id {
        Id::new(value).unwrap()
    }

    /// The run's own checks read the flag and a runtime waits on the token: a cancel sets
    /// both, the flag first.
    #[test]
    fn a_cancel_sets_the_flag_and_the_token() {
        let run = RunCancel::default();
        assert!(!run.is_cancelled() && !run.token().is_cancelled());
        run.cancel();
        assert!(run.is_cancelled() && run.token().is_cancelled());
    }

    /// The token is made on first use: a run that never waits on it has none, and one made
    /// after the cancel is cancelled already.
    #[test]
    fn a_token_made_after_the_cancel_is_cancelled() {
        let run = RunCancel::default();
        assert!(run.token.get().is_none(), "no token until one is asked for");
        run.cancel();
        assert!(run.is_cancelled());
        assert!(run.token.get().is_none(), "a cancel makes no token");
        assert!(run.token().is_cancelled());
    }

    /// A cancel racing the token's making: the runtime that waits on the token hears it
    /// every time.
    #[test]
    fn a_cancel_racing_the_first_token_is_never_lost() {
        for _ in 0..2_000 {
            let run = Arc::new(RunCancel::default());
            let canceller = std::thread::spawn({
                let run = run.clone();
                move || run.cancel()
            });
            let token = run.token().clone();
            canceller.join().unwrap();
            assert!(token.is_cancelled());
        }
    }

    #[test]
    fn a_run_is_live_until_it_ends_then_remembered_with_its_state() {
        let mut table = Cancels::default();
        let run = table.register(&id("e1"));
        assert!(Arc::ptr_eq(&run, &table.register(&id("e1"))));
        assert!(matches!(table.lookup(&id("e1")), Lookup::Live(_)));
        assert!(matches!(table.lookup(&id("e2")), Lookup::Unknown));
        table.finish(&id("e1"), &run, ABORTED);
        assert_eq!(run.ended(), Some(ABORTED));
        assert!(matches!(table.lookup(&id("e1")), Lookup::Ended(state) if state == ABORTED));
        assert_eq!(table.live_len(), 0);
    }

    #[tokio::test]
    async fn a_cancel_waiting_for_the_end_hears_it_whenever_it_started_to_wait() {
        let mut table = Cancels::default();
        let run = table.register(&id("e1"));
        let waiter = tokio::spawn({
            let run = run.clone();
            async move { run.finished().await }
        });
        // The waiter is parked before the end comes.
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        table.finish(&id("e1"), &run, "replied");
        let heard = tokio::time::timeout(std::time::Duration::from_secs(5), waiter).await;
        assert_eq!(heard.expect("the waiter was not woken").unwrap(), "replied");
        // One that starts after the end returns at once.
        assert_eq!(run.finished().await, "replied");
    }

    #[test]
    fn only_the_first_cancel_claims_a_run() {
        let run = RunCancel::default();
        assert!(run.claim());
        assert!(!run.claim());
    }

    #[test]
    fn the_memory_of_ended_runs_is_bounded() {
        let mut table = Cancels::default();
        for n in 0..REMEMBERED + 5 {
            let event = id(&format!("e{n}"));
            let run = table.register(&event);
            table.finish(&event, &run, "replied");
        }
        assert!(matches!(table.lookup(&id("e0")), Lookup::Unknown));
        assert!(matches!(table.lookup(&id("e5")), Lookup::Ended(_)));
        assert_eq!(table.ended.len(), REMEMBERED);
    }
}
