//! One accepted socket connection's state: what the peer declared and
//! who waits for its answers (receipts, command results, health). Closing it fails every
//! wait at once.

use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use channeld_link::FrameSink;
use channeld_protocol::Id;
use channeld_protocol::ext::PeerDeclaration;
use channeld_protocol::frame::{CommandResultFrame, ErrorFrame, OperatorActionResult, Receipt};
use channeld_protocol::types::{DeliveryReceipt, Health};
use tokio::sync::oneshot;

/// Locks a mutex, taking the data of a poisoned one: every critical section here leaves its
/// data consistent even if it panics.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What kind of peer a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    /// Sent `hello`: the instance's live driver.
    Driver,
    /// Never sent `hello`: a one-shot reference driver; its replies go back on it.
    Legacy,
    /// Sent `control_hello`: a tool.
    Controller,
}

/// How a proactive send ended once handed to a driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiptOutcome {
    Receipted(DeliveryReceipt),
    /// The driver reported that posting failed; nothing was posted.
    Failed {
        code: String,
        message: String,
    },
    /// It may or may not have been posted (the driver said so, or disconnected, or the
    /// receipt timed out).
    Unknown {
        reason: String,
    },
}

#[derive(Debug, Default)]
struct Waits {
    receipts: HashMap<Id, oneshot::Sender<ReceiptOutcome>>,
    commands: HashMap<Id, oneshot::Sender<CommandResultFrame>>,
    health: HashMap<Id, oneshot::Sender<Health>>,
    operator_actions: HashMap<Id, oneshot::Sender<OperatorActionResult>>,
}

/// One accepted socket connection.
#[derive(Debug)]
pub struct Connection {
    pub id: u64,
    pub kind: PeerKind,
    pub sink: FrameSink,
    pub declaration: PeerDeclaration,
    /// The operator action names the driver declared (extension `operator_action`; empty
    /// when it was not negotiated).
    pub operator_actions: Vec<String>,
    pub connected_at: SystemTime,
    pub peer_pid: Option<i32>,
    /// Set once, by [`close`](Self::close), under the `waits` lock. An atomic, not a token:
    /// nothing awaits it, and it is asked on every send (`Instance::live`), where a token's
    /// check takes its mutex.
    closed: AtomicBool,
    /// The coarse monotonic clock's reading (nanoseconds) at the last frame read, or at the
    /// accept before any: an atomic written on every frame and read only by health probes,
    /// which count whole seconds. The coarse clock (a few milliseconds' resolution) is read
    /// from memory the kernel keeps, without the time counter the fine one asks for.
    last_seen: AtomicU64,
    waits: Mutex<Waits>,
    /// The driver refused a send because it is shutting down (`draining`).
    draining: AtomicBool,
}

impl Connection {
    pub fn new(
        id: u64,
        kind: PeerKind,
        sink: FrameSink,
        declaration: PeerDeclaration,
        peer_pid: Option<i32>,
    ) -> Self {
        Self {
            id,
            kind,
            sink,
            declaration,
            operator_actions: Vec::new(),
            connected_at: SystemTime::now(),
            peer_pid,
            closed: AtomicBool::new(false),
            last_seen: AtomicU64::new(coarse_now()),
            waits: Mutex::new(Waits::default()),
            draining: AtomicBool::new(false),
        }
    }

    /// The operator action names the driver declared in its `hello`.
    pub fn with_operator_actions(mut self, names: Vec<String>) -> Self {
        self.operator_actions = names;
        self
    }

    /// Remembers that the driver refused a send because it is shutting down: the outbox
    /// hands it no more sends (they wait for the next driver).
    pub fn mark_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether the driver said it is shutting down (see [`mark_draining`](Self::mark_draining)).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the connection has ended ([`close`](Self::close) ran).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Notes that the peer sent something just now.
    pub fn touch(&self) {
        self.last_seen.store(coarse_now(), Ordering::Relaxed);
    }

    /// How long since the peer last sent something (or connected), to the coarse clock's
    /// resolution.
    pub fn idle_for(&self) -> Duration {
        Duration::from_nanos(coarse_now().saturating_sub(self.last_seen.load(Ordering::Relaxed)))
    }

    /// Registers interest in the receipt for `request_id`. Fails if the connection is closed.
    pub fn expect_receipt(&self, request_id: Id) -> Option<oneshot::Receiver<ReceiptOutcome>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.is_closed() {
            return None;
        }
        waits.receipts.insert(request_id, tx);
        Some(rx)
    }

    pub fn forget_receipt(&self, request_id: &Id) {
        lock(&self.waits).receipts.remove(request_id);
    }

    /// Hands a receipt to the send that waits for it; gives it back when nobody does (it is
    /// moved, not copied, either way).
    pub fn complete_receipt(&self, receipt: Receipt) -> Option<Receipt> {
        let Some(tx) = self.take_receipt_wait(&receipt.request_id) else { return Some(receipt) };
        let _ = tx.send(ReceiptOutcome::Receipted(receipt.receipt));
        None
    }

    fn take_receipt_wait(&self, request_id: &Id) -> Option<oneshot::Sender<ReceiptOutcome>> {
        lock(&self.waits).receipts.remove(request_id)
    }

    /// An `error` frame for a pending outbound ends its wait.
    pub fn fail_receipt(&self, err: &ErrorFrame) -> bool {
        let Some(request_id) = &err.request_id else { return false };
        let Some(tx) = self.take_receipt_wait(request_id) else { return false };
        let outcome = if err.code == "send_unknown" {
            ReceiptOutcome::Unknown { reason: err.message.clone() }
        } else {
            ReceiptOutcome::Failed { code: err.code.clone(), message: err.message.clone() }
        };
        let _ = tx.send(outcome);
        true
    }

    pub fn expect_command(&self, request_id: Id) -> Option<oneshot::Receiver<CommandResultFrame>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.is_closed() {
            return None;
        }
        waits.commands.insert(request_id, tx);
        Some(rx)
    }

    pub fn forget_command(&self, request_id: &Id) {
        lock(&self.waits).commands.remove(request_id);
    }

    /// Completes the wait for `frame.request_id`; false when nobody waits for it.
    pub fn complete_command(&self, frame: CommandResultFrame) -> bool {
        let waiter = lock(&self.waits).commands.remove(&frame.request_id);
        match waiter {
            Some(tx) => {
                let _ = tx.send(frame);
                true
            }
            None => false,
        }
    }

    pub fn expect_health(&self, request_id: Id) -> Option<oneshot::Receiver<Health>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.is_closed() {
            return None;
        }
        waits.health.insert(request_id, tx);
        Some(rx)
    }

    pub fn forget_health(&self, request_id: &Id) {
        lock(&self.waits).health.remove(request_id);
    }

    pub fn complete_health(&self, request_id: &Id, health: Health) {
        if let Some(tx) = lock(&self.waits).health.remove(request_id) {
            let _ = tx.send(health);
        }
    }

    pub fn expect_operator_action(
        &self,
        request_id: Id,
    ) -> Option<oneshot::Receiver<OperatorActionResult>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.is_closed() {
            return None;
        }
        waits.operator_actions.insert(request_id, tx);
        Some(rx)
    }

    pub fn forget_operator_action(&self, request_id: &Id) {
        lock(&self.waits).operator_actions.remove(request_id);
    }

    /// Completes the wait for `result.request_id`; false when nobody waits for it.
    pub fn complete_operator_action(&self, result: OperatorActionResult) -> bool {
        let waiter = lock(&self.waits).operator_actions.remove(&result.request_id);
        match waiter {
            Some(tx) => {
                let _ = tx.send(result);
                true
            }
            None => false,
        }
    }

    /// Marks the connection closed and fails every wait at once: receipts become unknown,
    /// commands are dropped (their waiters answer `rejected`), probes get nothing.
    pub fn close(&self) {
        let waits = {
            let mut waits = lock(&self.waits);
            self.closed.store(true, Ordering::Release);
            std::mem::take(&mut *waits)
        };
        for (_, tx) in waits.receipts {
            let _ = tx.send(ReceiptOutcome::Unknown { reason: "driver disconnected".into() });
        }
    }
}

/// The coarse monotonic clock in nanoseconds (u64 nanoseconds last 584 years).
fn coarse_now() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_link::spawn_writer;

    fn id(value: &str) -> Id {
        Id::new(value).expect("a valid id")
    }

    fn connection() -> Connection {
        let (hub_side, _driver_side) = tokio::io::duplex(1024);
        let (sink, _writer) = spawn_writer(hub_side, 8);
        Connection::new(1, PeerKind::Driver, sink, PeerDeclaration::default(), None)
    }

    /// Closing answers the waits it had (a receipt becomes unknown) and takes no new ones.
    #[tokio::test]
    async fn a_closed_connection_ends_its_waits_and_takes_no_new_ones() {
        let conn = connection();
        assert!(!conn.is_closed());
        let receipt = conn.expect_receipt(id("r-1")).expect("an open connection waits");
        conn.close();
        assert!(conn.is_closed());
        assert_eq!(
            receipt.await.expect("the wait is answered"),
            ReceiptOutcome::Unknown { reason: "driver disconnected".into() }
        );
        assert!(conn.expect_receipt(id("r-2")).is_none());
        assert!(conn.expect_command(id("c-1")).is_none());
        assert!(conn.expect_health(id("h-1")).is_none());
        assert!(conn.expect_operator_action(id("o-1")).is_none());
    }

    /// `idle_for` counts from the last frame read, or from the accept before any.
    #[tokio::test]
    async fn idle_time_counts_from_the_last_frame() {
        let conn = connection();
        tokio::time::sleep(Duration::from_millis(60)).await;
        let before = conn.idle_for();
        // The coarse clock moves in ticks of a few milliseconds.
        assert!(before >= Duration::from_millis(40), "idle {before:?} since the accept");
        conn.touch();
        let after = conn.idle_for();
        assert!(after < before, "idle {after:?} after a frame, {before:?} before it");
    }
}
