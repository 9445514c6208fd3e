//! Proactive sends: persisted before they are acknowledged, idempotent by key, queued while
//! the driver is offline and dispatched in order when it reconnects, and settled as
//! receipted, failed or unknown. A send handed to a driver is never resent automatically.
//!
//! `receipts.rs` takes the driver's answers (`receipt` and `error` frames) to what was
//! handed over; `waiters.rs` holds the callers waiting for a record to settle.

mod backlog;
pub mod receipts;
mod waiters;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use channeld_protocol::types::{DeliveryReceipt, OutboundMessage};
use channeld_protocol::{Id, MAX_LINE_BYTES};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

pub use backlog::Backlog;
pub use waiters::{OutboxOutcome, Waiters, Watch};

use crate::connection::{Connection, ReceiptOutcome};
use crate::ids::Ids;
use crate::instance::{Instance, Registry};
use crate::ledger::{Commit, Ledger, LedgerError, NewSend, OutboxRecord, OutboxState};
use crate::metrics::SendOutcome as SendMetric;
use crate::send::{self, Outgoing, SendError, SendOutcome, SendState};

/// The error code of a driver that refuses an `outbound` because it is shutting down (the
/// SDK's, before anything is posted): not a failure of the send.
const DRAINING: &str = "draining";

/// Metadata key carrying the caller's idempotency key to the driver (as the reference does).
pub const IDEMPOTENCY_METADATA: &str = "idempotency_key";

/// How long a waiting caller allows beyond its timeout for the outcome to be recorded.
const SETTLE_MARGIN: Duration = Duration::from_secs(2);

/// How many queued records are claimed per dispatch round.
const DISPATCH_BATCH: usize = 256;

/// More than the envelope, `type` and longest request id add to an encoded message: a
/// message this far under the line limit certainly fits in its `outbound` frame.
const FRAME_SLACK: usize = 4096;

/// A proactive send as the control socket asks for it.
#[derive(Debug, Clone)]
pub struct SendRequest {
    pub instance: String,
    pub message: OutboundMessage,
    /// Wait this long for the receipt; `None` returns once the send is durable and handed
    /// over (or queued).
    pub wait: Option<Duration>,
    pub idempotency_key: Option<String>,
}

/// The outbox of one hub. Cheap to clone: background settle tasks hold a copy.
#[derive(Debug, Clone)]
pub struct Outbox {
    ledger: Ledger,
    instances: Arc<Registry>,
    ids: Arc<Ids>,
    /// Where receipt waits run; the hub drains it at shutdown.
    tasks: TaskTracker,
    waiters: Arc<Waiters>,
    backlogs: Arc<backlog::Backlogs>,
    ttl: Duration,
    receipt_timeout: Duration,
    flight: Arc<Flight>,
}

/// Sends under way through [`Outbox::submit`] with the ledger on, and whether the last one
/// started alone. A send may be held in the send journal only when it and the one before it
/// each started with no other under way — a sequential caller. Not in waves of concurrent
/// sends (each wave's first starts alone too, but after the last of the previous wave; only
/// the first wave after sequential sends has its first held): those are recorded in their
/// batches and their outcomes synced together, and a held one's outcome would take a sync
/// of its own, out of step with theirs (BENCHMARKS.md, thirty-first round: −6.5 to −20 %
/// at 16 in flight).
#[derive(Debug)]
struct Flight {
    under_way: AtomicUsize,
    last_alone: AtomicBool,
}

impl Default for Flight {
    /// The first send a hub makes counts as following one that started alone.
    fn default() -> Self {
        Self { under_way: AtomicUsize::new(0), last_alone: AtomicBool::new(true) }
    }
}

impl Flight {
    /// Counts a send under way until the guard drops; and whether it may be held.
    fn start(&self) -> (UnderWay<'_>, bool) {
        let alone = self.under_way.fetch_add(1, Ordering::Relaxed) == 0;
        let was_alone = self.last_alone.swap(alone, Ordering::Relaxed);
        (UnderWay(&self.under_way), alone && was_alone)
    }
}

/// One send counted in [`Flight::under_way`] until dropped.
struct UnderWay<'a>(&'a AtomicUsize);

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn now_ms() -> u64 {
    crate::clock::now_ms()
}

impl Outbox {
    pub fn new(
        ledger: Ledger,
        instances: Arc<Registry>,
        ids: Arc<Ids>,
        tasks: TaskTracker,
        ttl: Duration,
        receipt_timeout: Duration,
    ) -> Self {
        Self {
            ledger,
            instances,
            ids,
            tasks,
            waiters: Arc::default(),
            backlogs: Arc::default(),
            ttl,
            receipt_timeout,
            flight: Arc::default(),
        }
    }

    /// Callers waiting for a record to settle (for tests and status).
    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }

    /// The queued sends of `instance`: whether any may wait, and the dispatchers' turn (for
    /// tests).
    pub fn backlog(&self, instance: &str) -> Arc<Backlog> {
        self.backlogs.of(instance)
    }

    /// Sends through the outbox when the ledger is on, directly otherwise.
    pub async fn submit(&self, request: SendRequest) -> Result<SendOutcome, SendError> {
        let SendRequest { instance, mut message, wait, idempotency_key } = request;
        let inst = self
            .instances
            .get(instance.as_str())
            .ok_or_else(|| SendError::UnknownInstance(instance.clone()))?;
        if message.target.channel != inst.config.id {
            return Err(SendError::WrongChannel {
                expected: inst.config.id.to_string(),
                found: message.target.channel.to_string(),
            });
        }
        if let Some(key) = &idempotency_key {
            message.metadata.insert(IDEMPOTENCY_METADATA.to_owned(), key.clone());
        }
        let live = sender(&inst);
        if let Some(conn) = &live
            && !conn.declaration.can_send()
        {
            return Err(SendError::NotDeclared("send"));
        }
        if !self.ledger.is_on() {
            if idempotency_key.is_some() {
                return Err(SendError::NeedsLedger);
            }
            let conn = live.ok_or_else(|| SendError::Offline(instance.clone()))?;
            return send::send_on(&inst, &conn, self.ids.request("out"), message, wait).await;
        }

        let (_under_way, alone) = self.flight.start();
        let encoded =
            serde_json::to_vec(&message).map_err(|err| SendError::TooLarge(err.to_string()))?;
        // Refused now rather than queued: a send that can never be a frame would otherwise
        // fail only when a driver connects.
        if encoded.len() + FRAME_SLACK > MAX_LINE_BYTES {
            send::fits(&self.request_id(i64::MAX), &message)?;
        }
        let backlog = self.backlogs.of(&instance);
        // Straight to a connected driver only when nothing is queued before it.
        let direct = live.as_ref().filter(|_| backlog.is_clear());
        let state = if direct.is_some() { OutboxState::Sent } else { OutboxState::Queued };
        let now = now_ms();
        // The bytes the ledger records are the message of the `outbound` frame too: a send
        // handed straight over is encoded once (BENCHMARKS.md, fix 27).
        let frame_message = direct.is_some().then(|| encoded.clone());
        let new = NewSend {
            instance: instance.clone(),
            idempotency_key,
            message: encoded,
            state,
            now_ms: now,
            expires_ms: now + self.ttl.as_millis() as u64,
        };
        // A send handed straight to its driver whose caller waits for the outcome hears
        // nothing before that outcome is recorded durably, and that fsync carries the record
        // too: one fsync on its path. A queued send, or one answered `handed` at once, is
        // durable before its caller hears of it.
        let commit = if state == OutboxState::Sent && wait.is_some() {
            Commit::Deferred
        } else {
            Commit::Durable
        };
        // A new record with its caller watching it, or the record its idempotency key has.
        // The wait is registered in the ledger call that adds the record: a dispatcher that
        // claims it (the one under way, or the one a driver connecting now starts) finds the
        // caller's wait there and gives the driver that (`receipt_window`), never the hub's
        // receipt timeout while the caller waits for less.
        // Such a send from a sequential caller (see `Flight`) is held in the send journal
        // instead: its row is written with its outcome, in one ledger transaction
        // (`ledger/journal.rs`).
        let held = match (commit, wait) {
            (Commit::Deferred, Some(wait)) if alone => match self.ledger.outbox_hold(new) {
                Ok(id) => Ok((id, self.waiters.watch_send(id, wait))),
                Err(new) => Err(new),
            },
            _ => Err(new),
        };
        let added = match held {
            Ok(held) => Ok(held),
            Err(new) => {
                let _queuing = (state == OutboxState::Queued).then(|| backlog.queuing());
                let waiters = self.waiters.clone();
                self.ledger
                    .outbox_add_watched(new, commit, move |id| match wait {
                        Some(wait) => waiters.watch_send(id, wait),
                        None => waiters.watch(id),
                    })
                    .await?
            }
        };
        let (id, mut settled) = match added {
            Ok(new) => new,
            Err(record) if same_send(&record.message, &message) => {
                return Box::pin(self.existing(&inst, record, wait))
                    .await
                    .map(SendOutcome::repeated);
            }
            Err(record) => return Err(SendError::Conflict { outbox_id: record.id }),
        };
        let request_id = self.request_id(id);
        // Where the send stands now, when known without asking the ledger.
        let known = match direct.zip(frame_message.as_deref()) {
            Some((conn, encoded)) => {
                let timeout = wait.unwrap_or(self.receipt_timeout);
                match send::handover(&inst, conn, &request_id, Outgoing::Encoded(encoded)).await {
                    Ok(waiter) => {
                        self.spawn_settle(
                            inst.clone(),
                            conn.clone(),
                            id,
                            request_id.clone(),
                            waiter,
                            timeout,
                        );
                        Some(SendState::Handed)
                    }
                    Err(SendError::Offline(_)) => {
                        // The frame never left the hub: back to the queue, nothing is lost.
                        debug!(instance = %inst.config.id, id, "driver left before the send; queued");
                        inst.metrics.send(SendMetric::Queued);
                        let _queuing = backlog.queuing();
                        Box::pin(self.record_outcome(id, OutboxState::Queued, None, None)).await;
                        Some(SendState::Queued)
                    }
                    Err(err) => {
                        let error = format!("{}: {err}", err.code());
                        Box::pin(self.record_outcome(id, OutboxState::Failed, None, Some(error)))
                            .await;
                        return Err(err);
                    }
                }
            }
            None => match sender(&inst) {
                // Queued behind earlier sends: dispatching hands them over in order, this one
                // last (unless the driver leaves meanwhile).
                Some(conn) => {
                    Box::pin(self.dispatch_queued(&inst, &conn)).await;
                    None
                }
                None => {
                    debug!(instance = %instance, id, "driver offline; send queued");
                    inst.metrics.send(SendMetric::Queued);
                    return Ok(SendOutcome::queued(request_id, Some(id)));
                }
            },
        };
        let Some(wait) = wait else {
            return match known {
                Some(SendState::Handed) => Ok(SendOutcome::handed(request_id, Some(id))),
                Some(_) => Ok(SendOutcome::queued(request_id, Some(id))),
                None => Box::pin(self.current(request_id, id)).await,
            };
        };
        // The settle task decides `wait` after the hand-over (whoever handed it over); give
        // it a moment to record the outcome.
        if let Some(outcome) = settled.outcome(wait + SETTLE_MARGIN).await {
            return outcome_result(request_id, id, outcome);
        }
        drop(settled);
        Box::pin(self.current(request_id, id)).await
    }

    /// Where record `id` stands now, as a send's answer.
    async fn current(&self, request_id: Id, id: i64) -> Result<SendOutcome, SendError> {
        match self.ledger.outbox_get(id).await? {
            Some(record) if record.state == OutboxState::Queued => {
                Ok(SendOutcome::queued(request_id, Some(id)))
            }
            Some(record) if record.state == OutboxState::Sent => {
                Ok(SendOutcome::handed(request_id, Some(id)))
            }
            Some(record) => outcome_result(request_id, id, record_outcome(&record)),
            None => Err(SendError::Ledger(LedgerError::NoSuchRecord(id))),
        }
    }

    /// The answer for a repeated idempotency key: the existing record, never a second send.
    /// A queued one with no driver connected is answered at once: nothing will settle it
    /// before a driver comes.
    async fn existing(
        &self,
        inst: &Instance,
        record: OutboxRecord,
        wait: Option<Duration>,
    ) -> Result<SendOutcome, SendError> {
        let request_id = self.request_id(record.id);
        // Wait for the first send to settle, unless nothing can settle it before a driver
        // connects.
        let may_settle = match record.state {
            OutboxState::Queued => sender(inst).is_some(),
            OutboxState::Sent => true,
            _ => false,
        };
        if may_settle && let Some(wait) = wait {
            let mut settled = self.waiters.watch(record.id);
            // It may have settled between the ledger's answer and the watch: look again.
            if let Ok(Some(now)) = self.ledger.outbox_get(record.id).await
                && !matches!(now.state, OutboxState::Queued | OutboxState::Sent)
            {
                return outcome_result(request_id, record.id, record_outcome(&now));
            }
            if let Some(outcome) = settled.outcome(wait).await {
                return outcome_result(request_id, record.id, outcome);
            }
        }
        match record.state {
            OutboxState::Queued => return Ok(SendOutcome::queued(request_id, Some(record.id))),
            OutboxState::Sent => return Ok(SendOutcome::handed(request_id, Some(record.id))),
            _ => {}
        }
        outcome_result(request_id, record.id, record_outcome(&record))
    }

    /// The wire request id of outbox record `id`.
    pub fn request_id(&self, id: i64) -> Id {
        Id::new(self.ledger.outbox_request_id(id)).expect("outbox request ids are short")
    }

    /// Waits for the receipt of a handed-over record in the background, then records it. A
    /// plain function: spawned from within an `async fn`, the settle task (which may dispatch,
    /// which spawns it) would need its own `Send` proof to hold it.
    fn spawn_settle(
        &self,
        inst: Arc<Instance>,
        conn: Arc<Connection>,
        id: i64,
        request_id: Id,
        waiter: oneshot::Receiver<ReceiptOutcome>,
        timeout: Duration,
    ) {
        self.tasks.spawn(self.clone().settle(inst, conn, id, request_id, waiter, timeout));
    }

    /// The settle task: the receipt (or its absence), recorded. Its rare turn (a driver that
    /// drained while a newer one connected) is boxed, so the task spawned per send stays
    /// small: spawning copies it, and so does each change of its stage.
    async fn settle(
        self,
        inst: Arc<Instance>,
        conn: Arc<Connection>,
        id: i64,
        request_id: Id,
        waiter: oneshot::Receiver<ReceiptOutcome>,
        timeout: Duration,
    ) {
        let outcome = send::await_receipt(&inst, &conn, request_id, waiter, timeout).await;
        let (state, receipt, error) = match outcome {
            Ok(receipt) => (OutboxState::Receipted, Some(receipt), None),
            // A driver shutting down refuses before posting: the send waits for the next
            // driver, as one the hub could not hand over at all.
            Err(SendError::Failed { code, .. }) if code == DRAINING => {
                conn.mark_draining();
                debug!(instance = %inst.config.id, id, "driver draining; the send is queued for the next one");
                (OutboxState::Queued, None, None)
            }
            Err(SendError::Failed { code, message, .. }) => {
                (OutboxState::Failed, None, Some(format!("{code}: {message}")))
            }
            // The record's state says the outcome is unknown; its error says why.
            Err(SendError::Unknown { reason, .. }) => (OutboxState::Unknown, None, Some(reason)),
            Err(err) => (OutboxState::Unknown, None, Some(err.to_string())),
        };
        if state == OutboxState::Unknown {
            inst.record_error(format!("send {id}: outcome unknown"));
            warn!(instance = %inst.config.id, id, error = ?error, "send outcome unknown; it will not be resent automatically");
        }
        {
            // Back in the queue: a send made meanwhile queues behind it, not past it.
            let backlog =
                (state == OutboxState::Queued).then(|| self.backlogs.of(inst.config.id.as_str()));
            let _queuing = backlog.as_ref().map(|backlog| backlog.queuing());
            self.record_outcome(id, state, receipt, error).await;
        }
        // A newer driver that connected while this one drained has already taken the queue
        // as it was then: it takes this send too.
        if state == OutboxState::Queued
            && let Some(live) = sender(&inst)
            && live.id != conn.id
        {
            Box::pin(self.dispatch_queued(&inst, &live)).await;
        }
    }

    /// Makes an outcome durable, then tells whoever waits for it. The ledger call is made
    /// when this is called and the future holds only it and the outcome (it is part of every
    /// settle task, which spawning copies).
    fn record_outcome(
        &self,
        id: i64,
        state: OutboxState,
        receipt: Option<DeliveryReceipt>,
        error: Option<String>,
    ) -> impl Future<Output = ()> + Send + '_ {
        let encoded = receipt.as_ref().and_then(|r| serde_json::to_vec(r).ok());
        let stored = self.ledger.outbox_set(id, state, encoded, error.clone(), now_ms());
        let outcome = OutboxOutcome { state, receipt, error };
        async move {
            if let Err(err) = stored.await {
                warn!(id, error = %err, "outbox outcome not recorded");
            }
            if outcome.state != OutboxState::Queued {
                self.waiters.settle(id, &outcome);
            }
        }
    }

    /// Tells the callers of records that expired while queued.
    fn expired(&self, ids: &[i64]) {
        let outcome = OutboxOutcome {
            state: OutboxState::Failed,
            receipt: None,
            error: Some(crate::ledger::outbox::EXPIRED.to_owned()),
        };
        for id in ids {
            self.waiters.settle(*id, &outcome);
        }
    }

    /// Fails queued sends past their expiry (housekeeping) and answers their waiters.
    pub async fn expire(&self) -> Result<usize, LedgerError> {
        let expired = self.ledger.outbox_expire(now_ms()).await?;
        self.expired(&expired);
        Ok(expired.len())
    }

    /// Sends every queued record of `inst` on `conn`, oldest first: frames go out in order
    /// (one dispatcher per instance at a time), receipts are awaited concurrently. A record
    /// that can never be sent (too large for a frame) fails with its reason and the ones
    /// behind it go on; when the driver leaves, the claimed records that were not handed over
    /// go back to the queue — none is left `sent` without a wait for its receipt.
    pub async fn dispatch_queued(&self, inst: &Arc<Instance>, conn: &Arc<Connection>) {
        if !self.ledger.is_on() || !conn.declaration.can_send() || conn.is_draining() {
            return;
        }
        let instance = inst.config.id.to_string();
        let backlog = self.backlogs.of(&instance);
        let _turn = backlog.turn().await;
        loop {
            let claimed = match self
                .ledger
                .outbox_claim_queued(instance.clone(), now_ms(), DISPATCH_BATCH)
                .await
            {
                Ok(claimed) => claimed,
                Err(err) => {
                    warn!(instance = %inst.config.id, error = %err, "cannot read the outbox");
                    return;
                }
            };
            self.expired(&claimed.expired);
            if claimed.records.is_empty() {
                backlog.drained();
                return;
            }
            let mut records = claimed.records.into_iter();
            while let Some(record) = records.next() {
                let request_id = self.request_id(record.id);
                let message: OutboundMessage = match serde_json::from_slice(&record.message) {
                    Ok(message) => message,
                    Err(err) => {
                        let error = format!("unreadable record: {err}");
                        self.record_outcome(record.id, OutboxState::Failed, None, Some(error))
                            .await;
                        continue;
                    }
                };
                match send::handover(inst, conn, &request_id, Outgoing::Message(message)).await {
                    Ok(waiter) => {
                        // A sender still waiting gives the driver its wait, as a send handed
                        // over at once has; otherwise the hub's receipt timeout.
                        let timeout =
                            self.waiters.receipt_window(record.id).unwrap_or(self.receipt_timeout);
                        let (inst, conn) = (inst.clone(), conn.clone());
                        self.spawn_settle(inst, conn, record.id, request_id, waiter, timeout);
                    }
                    Err(SendError::Offline(_)) => {
                        let unsent: Vec<i64> =
                            std::iter::once(record.id).chain(records.map(|r| r.id)).collect();
                        debug!(instance = %inst.config.id, records = unsent.len(), "driver left during dispatch; records stay queued");
                        let _queuing = backlog.queuing();
                        for id in unsent {
                            self.record_outcome(id, OutboxState::Queued, None, None).await;
                        }
                        return;
                    }
                    Err(err) => {
                        warn!(instance = %inst.config.id, id = record.id, error = %err, "queued send can never be sent; failed");
                        let error = format!("{}: {err}", err.code());
                        self.record_outcome(record.id, OutboxState::Failed, None, Some(error))
                            .await;
                    }
                }
            }
        }
    }

    /// An operator's explicit retry of an `unknown` or `failed` send: queued again, handed
    /// to the driver when one is connected, and answered once it settled (or the receipt
    /// timeout passed) — at once when it stays queued.
    pub async fn retry(&self, id: i64) -> Result<OutboxRecord, SendError> {
        let now = now_ms();
        let mut settled = self.waiters.watch(id);
        let expires = now + self.ttl.as_millis() as u64;
        let record = match self.ledger.outbox_get(id).await? {
            Some(record) => {
                let backlog = self.backlogs.of(&record.instance);
                let _queuing = backlog.queuing();
                self.ledger.outbox_requeue(id, now, expires).await?
            }
            None => return Err(SendError::Ledger(LedgerError::NoSuchRecord(id))),
        };
        if let Some(inst) = self.instances.get(record.instance.as_str())
            && let Some(conn) = sender(&inst)
        {
            self.dispatch_queued(&inst, &conn).await;
            let handed = self.ledger.outbox_get(id).await?;
            if handed.as_ref().is_some_and(|r| r.state == OutboxState::Sent) {
                settled.outcome(self.receipt_timeout + SETTLE_MARGIN).await;
            }
        }
        Ok(self.ledger.outbox_get(id).await?.unwrap_or(record))
    }
}

/// The driver connection that takes `inst`'s sends: the live one, unless it said it is
/// shutting down (its sends then wait for the next driver, as with none connected).
fn sender(inst: &Instance) -> Option<Arc<Connection>> {
    inst.live().filter(|conn| !conn.is_draining())
}

/// Whether a new send repeats the stored one: an idempotency key may only repeat the same
/// message (conversation, thread, text, metadata) on its instance.
fn same_send(stored: &[u8], new: &OutboundMessage) -> bool {
    serde_json::from_slice::<OutboundMessage>(stored).is_ok_and(|stored| stored == *new)
}

fn record_outcome(record: &OutboxRecord) -> OutboxOutcome {
    OutboxOutcome {
        state: record.state,
        receipt: record.receipt.as_ref().and_then(|r| serde_json::from_slice(r).ok()),
        error: record.error.clone(),
    }
}

fn outcome_result(
    request_id: Id,
    id: i64,
    outcome: OutboxOutcome,
) -> Result<SendOutcome, SendError> {
    let reason = outcome.error.unwrap_or_default();
    match (outcome.state, outcome.receipt) {
        (OutboxState::Receipted, Some(receipt)) => {
            Ok(SendOutcome::receipted(request_id, Some(id), receipt))
        }
        (OutboxState::Failed, _) => {
            let (code, message) = reason
                .split_once(": ")
                .map_or(("send_failed".to_owned(), reason.clone()), |(c, m)| {
                    (c.to_owned(), m.to_owned())
                });
            Err(SendError::Failed { request_id, code, message })
        }
        (OutboxState::Queued, _) => Ok(SendOutcome::queued(request_id, Some(id))),
        (OutboxState::Sent, _) => Ok(SendOutcome::handed(request_id, Some(id))),
        _ => Err(SendError::Unknown { request_id, reason }),
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::ChannelId;
    use channeld_protocol::types::{MessageBody, MessageTarget};

    use super::*;

    fn message(conversation: &str, text: &str) -> OutboundMessage {
        let channel = ChannelId::new("a.b").unwrap();
        let mut message = OutboundMessage {
            target: MessageTarget::new(channel, Id::new(conversation).unwrap()),
            body: MessageBody::text(text).unwrap(),
            metadata: Default::default(),
        };
        message.metadata.insert(IDEMPOTENCY_METADATA.into(), "k1".into());
        message
    }

    /// Sends one after another may be held; of a wave of concurrent ones, none is (its
    /// first starts alone, but after the previous wave's); after a wave, a sequential
    /// caller's sends are again, from the second.
    #[test]
    fn only_a_sequential_callers_sends_may_be_held() {
        let flight = Flight::default();
        for _ in 0..3 {
            let (under_way, held) = flight.start();
            assert!(held);
            drop(under_way);
        }
        // Only the first of a wave right after them looks sequential.
        let wave: Vec<_> = (0..16).map(|_| flight.start()).collect();
        assert_eq!(wave.iter().filter(|(_, held)| *held).count(), 1);
        assert!(wave[0].1);
        drop(wave);
        let wave: Vec<_> = (0..16).map(|_| flight.start()).collect();
        assert!(wave.iter().all(|(_, held)| !held), "the next wave's first starts alone");
        drop(wave);
        let held: Vec<bool> = (0..3).map(|_| flight.start().1).collect();
        assert_eq!(held, [false, true, true]);
    }

    #[test]
    fn a_key_may_repeat_only_the_same_message() {
        let stored = serde_json::to_vec(&message("c1", "deploy 881 finished")).unwrap();
        assert!(same_send(&stored, &message("c1", "deploy 881 finished")));
        assert!(!same_send(&stored, &message("c1", "deploy 882 finished")));
        assert!(!same_send(&stored, &message("c2", "deploy 881 finished")));
        let mut threaded = message("c1", "deploy 881 finished");
        threaded.target.thread = Some(Id::new("t").unwrap());
        assert!(!same_send(&stored, &threaded));
        assert!(!same_send(b"not json", &message("c1", "deploy 881 finished")));
    }
    /// Spawning a task copies its future, and so does each change of its stage: the settle
    /// task spawned for every send, and the ledger calls inside it, stay small (each was
    /// about twice this before BENCHMARKS.md's fix 22; the bounds leave room for compilers).
    #[test]
    fn the_futures_of_every_send_stay_small() {
        fn settle_size<F, Fut>(_: F) -> usize
        where
            F: FnOnce(
                Outbox,
                Arc<Instance>,
                Arc<Connection>,
                i64,
                Id,
                oneshot::Receiver<ReceiptOutcome>,
                Duration,
            ) -> Fut,
        {
            std::mem::size_of::<Fut>()
        }
        let settle = settle_size(Outbox::settle);
        assert!(settle <= 1536, "the settle task's future is {settle} bytes");
        let ledger = Ledger::off();
        let call = std::mem::size_of_val(&ledger.outbox_set(1, OutboxState::Sent, None, None, 1));
        assert!(call <= 256, "a ledger call's future is {call} bytes");
    }
}
