//! Per-instance state: the one live driver connection, health, counters and session
//! generations; and per-connection state: what the peer declared and who waits for its answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use channeld_link::FrameSink;
use channeld_protocol::Id;
use channeld_protocol::ext::PeerDeclaration;
use channeld_protocol::frame::{CommandResultFrame, ErrorFrame};
use channeld_protocol::types::{DeliveryReceipt, Health, HealthState};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::config::{InstanceConfig, RuntimeConfig};
use crate::inflight::InflightTable;

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Monotonic counters shown by `channelctl status`.
#[derive(Debug, Default)]
pub struct Counters {
    pub inbound: AtomicU64,
    pub denied: AtomicU64,
    pub runs_failed: AtomicU64,
    pub replies: AtomicU64,
    pub outbound: AtomicU64,
    pub receipts: AtomicU64,
    pub errors: AtomicU64,
    pub busy: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
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
}

/// One accepted socket connection.
#[derive(Debug)]
pub struct Connection {
    pub id: u64,
    pub kind: PeerKind,
    pub sink: FrameSink,
    pub declaration: PeerDeclaration,
    pub connected_at: SystemTime,
    pub peer_pid: Option<i32>,
    pub inflight: Mutex<InflightTable>,
    /// Cancelled when the connection ends.
    pub closed: CancellationToken,
    last_seen: Mutex<Instant>,
    waits: Mutex<Waits>,
}

impl Connection {
    pub fn new(
        id: u64,
        kind: PeerKind,
        sink: FrameSink,
        declaration: PeerDeclaration,
        peer_pid: Option<i32>,
        max_inflight: usize,
    ) -> Self {
        Self {
            id,
            kind,
            sink,
            declaration,
            connected_at: SystemTime::now(),
            peer_pid,
            inflight: Mutex::new(InflightTable::new(max_inflight)),
            closed: CancellationToken::new(),
            last_seen: Mutex::new(Instant::now()),
            waits: Mutex::new(Waits::default()),
        }
    }

    pub fn touch(&self) {
        *lock(&self.last_seen) = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        lock(&self.last_seen).elapsed()
    }

    pub fn inflight_len(&self) -> usize {
        lock(&self.inflight).len()
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

    /// Completes a command wait when request id, session and command id all match.
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

/// The health the hub believes, and when it learnt it.
#[derive(Debug, Clone)]
pub struct HealthView {
    pub health: Health,
    pub updated: SystemTime,
}

/// One configured channel instance.
#[derive(Debug)]
pub struct Instance {
    pub config: InstanceConfig,
    pub runtime: RuntimeConfig,
    pub counters: Counters,
    live: Mutex<Option<Arc<Connection>>>,
    health: Mutex<HealthView>,
    last_error: Mutex<Option<(SystemTime, String)>>,
    generations: Mutex<HashMap<String, u64>>,
    /// Events whose reply a finishing run is handing over right now; the reconnect sweep of
    /// undelivered replies leaves them alone, so a reply is not sent twice.
    replying: Mutex<std::collections::HashSet<Id>>,
}

impl Instance {
    pub fn new(config: InstanceConfig, runtime: RuntimeConfig) -> Self {
        Self {
            config,
            runtime,
            counters: Counters::default(),
            live: Mutex::new(None),
            health: Mutex::new(HealthView {
                health: Health::new(HealthState::Unavailable, Some("no driver connected".into())),
                updated: SystemTime::now(),
            }),
            last_error: Mutex::new(None),
            generations: Mutex::new(HashMap::new()),
            replying: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// The live driver connection, if any.
    pub fn live(&self) -> Option<Arc<Connection>> {
        lock(&self.live).clone().filter(|conn| !conn.closed.is_cancelled())
    }

    /// Makes `conn` the live driver unless another live one exists (which it returns).
    pub fn claim(&self, conn: &Arc<Connection>) -> Result<(), Arc<Connection>> {
        let mut live = lock(&self.live);
        if let Some(existing) = live.as_ref()
            && !existing.closed.is_cancelled()
        {
            return Err(existing.clone());
        }
        *live = Some(conn.clone());
        Ok(())
    }

    /// Clears the live slot if it still holds `conn`.
    pub fn release(&self, conn: &Arc<Connection>) {
        let mut live = lock(&self.live);
        if live.as_ref().is_some_and(|c| c.id == conn.id) {
            *live = None;
            drop(live);
            self.set_health(Health::new(
                HealthState::Unavailable,
                Some("driver disconnected".into()),
            ));
        }
    }

    pub fn health(&self) -> HealthView {
        lock(&self.health).clone()
    }

    pub fn set_health(&self, health: Health) {
        *lock(&self.health) = HealthView { health, updated: SystemTime::now() };
    }

    pub fn record_error(&self, message: impl Into<String>) {
        Counters::bump(&self.counters.errors);
        *lock(&self.last_error) = Some((SystemTime::now(), message.into()));
    }

    pub fn last_error(&self) -> Option<(SystemTime, String)> {
        lock(&self.last_error).clone()
    }

    /// The session generation for a route (bumped by `/new`).
    pub fn generation(&self, route: &str) -> u64 {
        lock(&self.generations).get(route).copied().unwrap_or(0)
    }

    /// Starts a new session for a route; returns the new generation.
    pub fn bump_generation(&self, route: &str) -> u64 {
        let mut generations = lock(&self.generations);
        let entry = generations.entry(route.to_owned()).or_insert(0);
        *entry += 1;
        *entry
    }

    /// Sets a route's generation (as recorded by the ledger).
    pub fn set_generation(&self, route: &str, generation: u64) {
        lock(&self.generations).insert(route.to_owned(), generation);
    }

    /// Marks a reply as being handed over by its run; false if it already was.
    pub fn begin_reply(&self, event_id: &Id) -> bool {
        lock(&self.replying).insert(event_id.clone())
    }

    pub fn end_reply(&self, event_id: &Id) {
        lock(&self.replying).remove(event_id);
    }

    pub fn is_replying(&self, event_id: &str) -> bool {
        lock(&self.replying).contains(event_id)
    }

    /// Loads persisted generations (from the ledger).
    pub fn load_generations(&self, loaded: HashMap<String, u64>) {
        *lock(&self.generations) = loaded;
    }
}
