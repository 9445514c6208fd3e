//! One accepted socket connection's state: what the peer declared and
//! who waits for its answers (receipts, command results, health). Closing it fails every
//! wait at once.

use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use channeld_link::FrameSink;
use channeld_protocol::Id;
use channeld_protocol::ext::PeerDeclaration;
use channeld_protocol::frame::{CommandResultFrame, ErrorFrame, OperatorActionResult};
use channeld_protocol::types::{DeliveryReceipt, Health};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

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
    /// Cancelled when the connection ends.
    pub closed: CancellationToken,
    last_seen: Mutex<Instant>,
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
            closed: CancellationToken::new(),
            last_seen: Mutex::new(Instant::now()),
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

    pub fn touch(&self) {
        *lock(&self.last_seen) = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        lock(&self.last_seen).elapsed()
    }

    /// Registers interest in the receipt for `request_id`. Fails if the connection is closed.
    pub fn expect_receipt(&self, request_id: Id) -> Option<oneshot::Receiver<ReceiptOutcome>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.closed.is_cancelled() {
            return None;
        }
        waits.receipts.insert(request_id, tx);
        Some(rx)
    }

    pub fn forget_receipt(&self, request_id: &Id) {
        lock(&self.waits).receipts.remove(request_id);
    }

    /// Completes a receipt wait; false when nobody waited for it.
    pub fn complete_receipt(&self, request_id: &Id, outcome: ReceiptOutcome) -> bool {
        match lock(&self.waits).receipts.remove(request_id) {
            Some(tx) => {
                let _ = tx.send(outcome);
                true
            }
            None => false,
        }
    }

    /// An `error` frame for a pending outbound ends its wait.
    pub fn fail_receipt(&self, err: &ErrorFrame) -> bool {
        let Some(request_id) = &err.request_id else { return false };
        let outcome = if err.code == "send_unknown" {
            ReceiptOutcome::Unknown { reason: err.message.clone() }
        } else {
            ReceiptOutcome::Failed { code: err.code.clone(), message: err.message.clone() }
        };
        self.complete_receipt(request_id, outcome)
    }

    pub fn expect_command(&self, request_id: Id) -> Option<oneshot::Receiver<CommandResultFrame>> {
        let (tx, rx) = oneshot::channel();
        let mut waits = lock(&self.waits);
        if self.closed.is_cancelled() {
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
        if self.closed.is_cancelled() {
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
        if self.closed.is_cancelled() {
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
            self.closed.cancel();
            std::mem::take(&mut *waits)
        };
        for (_, tx) in waits.receipts {
            let _ = tx.send(ReceiptOutcome::Unknown { reason: "driver disconnected".into() });
        }
    }
}
