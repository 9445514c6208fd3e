//! Callers waiting for outbox records to settle (a `send` with `wait`, or a repeated
//! idempotency key whose first send is still pending), and how long the sender waits: a
//! queued send handed over later gets its sender's wait as its receipt window, as one
//! handed over at once does.
//!
//! Bounded by construction: an entry lives only while its caller waits. A [`Watch`] removes
//! its own entry when dropped (answered, timed out, or the caller went away), and settling
//! or expiring a record answers and removes every entry for it. So the map never holds more
//! entries than there are control requests in flight.

use foldhash::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use channeld_protocol::types::DeliveryReceipt;
use tokio::sync::oneshot;

use crate::connection::lock;
use crate::ledger::OutboxState;

/// How an outbox record settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxOutcome {
    pub state: OutboxState,
    pub receipt: Option<DeliveryReceipt>,
    pub error: Option<String>,
}

/// One waiting caller: its token (to withdraw it), how long it waits for the receipt (the
/// sender; `None` for anyone else) and where its answer goes.
type Waiting = (u64, Option<Duration>, oneshot::Sender<OutboxOutcome>);

/// The registry of waiting callers, by record id.
#[derive(Debug, Default)]
pub struct Waiters {
    map: Mutex<HashMap<i64, Vec<Waiting>>>,
    next: AtomicU64,
}

/// One caller's wait for record `id`; dropping it withdraws the wait.
#[derive(Debug)]
pub struct Watch {
    waiters: Arc<Waiters>,
    id: i64,
    token: u64,
    rx: oneshot::Receiver<OutboxOutcome>,
}

impl Waiters {
    /// Registers a wait for record `id`.
    pub fn watch(self: &Arc<Self>, id: i64) -> Watch {
        self.register(id, None)
    }

    /// Registers the sender's wait for record `id`: `wait` is how long it gives the driver
    /// to confirm, counted from the hand-over (see [`Waiters::receipt_window`]).
    pub fn watch_send(self: &Arc<Self>, id: i64, wait: Duration) -> Watch {
        self.register(id, Some(wait))
    }

    fn register(self: &Arc<Self>, id: i64, wait: Option<Duration>) -> Watch {
        let (tx, rx) = oneshot::channel();
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.map).entry(id).or_default().push((token, wait, tx));
        Watch { waiters: self.clone(), id, token, rx }
    }

    /// How long the driver has to confirm record `id` once handed over, when its sender
    /// still waits for it (the longest such wait); `None` when nobody does.
    pub fn receipt_window(&self, id: i64) -> Option<Duration> {
        lock(&self.map).get(&id)?.iter().filter_map(|(_, wait, _)| *wait).max()
    }

    /// Answers every wait for record `id` and forgets them.
    pub fn settle(&self, id: i64, outcome: &OutboxOutcome) {
        let waiting = lock(&self.map).remove(&id).unwrap_or_default();
        for (_, _, tx) in waiting {
            let _ = tx.send(outcome.clone());
        }
    }

    /// How many callers wait, over all records.
    pub fn len(&self) -> usize {
        lock(&self.map).values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn withdraw(&self, id: i64, token: u64) {
        let mut map = lock(&self.map);
        if let Some(waiting) = map.get_mut(&id) {
            waiting.retain(|(t, _, _)| *t != token);
            if waiting.is_empty() {
                map.remove(&id);
            }
        }
    }
}

impl Watch {
    /// The record's outcome, or `None` if it did not settle within `limit`.
    pub async fn outcome(&mut self, limit: Duration) -> Option<OutboxOutcome> {
        tokio::time::timeout(limit, &mut self.rx).await.ok()?.ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.waiters.withdraw(self.id, self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> OutboxOutcome {
        OutboxOutcome { state: OutboxState::Failed, receipt: None, error: Some("x".into()) }
    }

    #[tokio::test]
    async fn a_settled_record_answers_every_waiter_and_leaves_nothing_behind() {
        let waiters = Arc::new(Waiters::default());
        let mut first = waiters.watch(7);
        let mut second = waiters.watch(7);
        assert_eq!(waiters.len(), 2);
        waiters.settle(7, &failed());
        assert!(waiters.is_empty());
        assert_eq!(first.outcome(Duration::from_secs(1)).await, Some(failed()));
        assert_eq!(second.outcome(Duration::from_secs(1)).await, Some(failed()));
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_withdraws_its_entry() {
        let waiters = Arc::new(Waiters::default());
        // A repeated idempotency key whose first send never settles: each repeat waits, times
        // out and goes; the registry does not grow.
        for _ in 0..100 {
            let mut watch = waiters.watch(3);
            assert_eq!(watch.outcome(Duration::from_millis(1)).await, None);
        }
        assert!(waiters.is_empty());
        let kept = waiters.watch(3);
        let dropped = waiters.watch(3);
        drop(dropped);
        assert_eq!(waiters.len(), 1);
        drop(kept);
        assert!(waiters.is_empty());
    }

    #[tokio::test]
    async fn a_record_has_the_receipt_window_of_its_waiting_sender_only() {
        let waiters = Arc::new(Waiters::default());
        assert_eq!(waiters.receipt_window(5), None);
        let repeat = waiters.watch(5);
        assert_eq!(waiters.receipt_window(5), None, "a repeated key's caller sets no window");
        let sender = waiters.watch_send(5, Duration::from_secs(3));
        assert_eq!(waiters.receipt_window(5), Some(Duration::from_secs(3)));
        drop(sender);
        assert_eq!(waiters.receipt_window(5), None, "a sender that left sets no window");
        drop(repeat);
        assert!(waiters.is_empty());
    }
}
