//! Per instance: whether queued sends may be waiting, so that a send made while the driver
//! is connected queues behind them instead of overtaking them, and the turn that lets one
//! dispatcher at a time hand queued sends over, in record order.
//!
//! Bounded by construction: one entry per instance name the hub has served.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::connection::lock;

/// Every instance's backlog.
#[derive(Debug, Default)]
pub struct Backlogs {
    map: Mutex<HashMap<String, Arc<Backlog>>>,
}

impl Backlogs {
    /// The backlog of `instance`. A new one may hold sends queued before the hub started, so
    /// it starts as not clear: the first dispatch (when a driver connects) finds out.
    pub fn of(&self, instance: &str) -> Arc<Backlog> {
        lock(&self.map).entry(instance.to_owned()).or_default().clone()
    }
}

/// One instance's backlog.
#[derive(Debug, Default)]
pub struct Backlog {
    state: Mutex<State>,
    /// Held by the one dispatcher handing queued sends over.
    turn: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct State {
    /// Queued sends may exist.
    pending: bool,
    /// Sends being written as queued right now (not yet visible to a dispatcher).
    queuing: usize,
}

impl Default for State {
    fn default() -> Self {
        Self { pending: true, queuing: 0 }
    }
}

/// Held while a send is written as queued; a dispatcher that drains meanwhile does not
/// declare the backlog clear.
#[derive(Debug)]
pub struct Queuing<'a>(&'a Backlog);

impl Backlog {
    /// No send is queued: a new one may go to the driver directly.
    pub fn is_clear(&self) -> bool {
        !lock(&self.state).pending
    }

    /// Marks a send about to be written as queued (or put back in the queue).
    pub fn queuing(&self) -> Queuing<'_> {
        let mut state = lock(&self.state);
        state.pending = true;
        state.queuing += 1;
        Queuing(self)
    }

    /// A dispatcher found nothing left to claim: clear, unless a send is being queued now.
    pub fn drained(&self) {
        let mut state = lock(&self.state);
        if state.queuing == 0 {
            state.pending = false;
        }
    }

    /// Waits for the dispatcher's turn.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.turn.lock().await
    }
}

impl Drop for Queuing<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).queuing -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_backlog_is_not_clear_until_a_dispatcher_drained_it() {
        let backlogs = Backlogs::default();
        let backlog = backlogs.of("a.b");
        assert!(!backlog.is_clear(), "sends from before the start may be queued");
        backlog.drained();
        assert!(backlog.is_clear());
        assert!(Arc::ptr_eq(&backlog, &backlogs.of("a.b")));
    }

    #[test]
    fn a_send_being_queued_keeps_the_backlog_pending_through_a_drain() {
        let backlog = Backlog::default();
        backlog.drained();
        let queuing = backlog.queuing();
        assert!(!backlog.is_clear());
        // A dispatcher that found nothing yet must not clear it: the send is not visible.
        backlog.drained();
        assert!(!backlog.is_clear());
        drop(queuing);
        assert!(!backlog.is_clear(), "still queued until a dispatcher takes it");
        backlog.drained();
        assert!(backlog.is_clear());
    }
}
