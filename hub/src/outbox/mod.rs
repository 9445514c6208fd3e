//! Proactive sends: persisted before they are acknowledged, idempotent by key, queued while
//! the driver is offline and dispatched in order when it reconnects, and settled as
//! receipted, failed or unknown. A send handed to a driver is never resent automatically.
//!
//! `receipts.rs` takes the driver's answers (`receipt` and `error` frames) to what was
//! handed over; `waiters.rs` holds the callers waiting for a record to settle.

pub mod receipts;
mod waiters;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use channeld_protocol::Id;
use channeld_protocol::types::{DeliveryReceipt, OutboundMessage};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

pub use waiters::{OutboxOutcome, Waiters, Watch};

use crate::connection::{Connection, ReceiptOutcome};
use crate::ids::Ids;
use crate::instance::{Instance, Instances, unix_ms};
use crate::ledger::{Added, Ledger, LedgerError, NewSend, OutboxRecord, OutboxState};
use crate::send::{self, SendError, SendOutcome};

/// Metadata key carrying the caller's idempotency key to the driver (as the reference does).
pub const IDEMPOTENCY_METADATA: &str = "idempotency_key";

/// How long a waiting caller allows beyond its timeout for the outcome to be recorded.
const SETTLE_MARGIN: Duration = Duration::from_secs(2);

/// How many queued records are claimed per dispatch round.
const DISPATCH_BATCH: usize = 256;

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
    instances: Arc<Instances>,
    ids: Arc<Ids>,
    /// Where receipt waits run; the hub drains it at shutdown.
    tasks: TaskTracker,
    waiters: Arc<Waiters>,
    ttl: Duration,
    receipt_timeout: Duration,
}

fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

impl Outbox {
    pub fn new(
        ledger: Ledger,
        instances: Arc<Instances>,
        ids: Arc<Ids>,
        tasks: TaskTracker,
        ttl: Duration,
        receipt_timeout: Duration,
    ) -> Self {
        Self { ledger, instances, ids, tasks, waiters: Arc::default(), ttl, receipt_timeout }
    }

    /// Callers waiting for a record to settle (for tests and status).
    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }

    /// Sends through the outbox when the ledger is on, directly otherwise.
    pub async fn submit(&self, request: SendRequest) -> Result<SendOutcome, SendError> {
        let SendRequest { instance, mut message, wait, idempotency_key } = request;
        let inst = self
            .instances
            .get(instance.as_str())
            .ok_or_else(|| SendError::UnknownInstance(instance.clone()))?
            .clone();
        if message.target.channel != inst.config.id {
            return Err(SendError::WrongChannel {
                expected: inst.config.id.to_string(),
                found: message.target.channel.to_string(),
            });
        }
        if let Some(key) = &idempotency_key {
            message.metadata.insert(IDEMPOTENCY_METADATA.to_owned(), key.clone());
        }
        let live = inst.live();
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

        let now = now_ms();
        let encoded =
            serde_json::to_vec(&message).map_err(|err| SendError::TooLarge(err.to_string()))?;
        let state = if live.is_some() { OutboxState::Sent } else { OutboxState::Queued };
        let added = self
            .ledger
            .outbox_add(NewSend {
                instance: instance.clone(),
                idempotency_key,
                message: encoded,
                state,
                now_ms: now,
                expires_ms: now + self.ttl.as_millis() as u64,
            })
            .await?;
        let id = match added {
            Added::New(id) => id,
            Added::Existing(record) => return self.existing(record, wait).await,
        };
        let request_id = self.request_id(id);
        let mut settled = self.waiters.watch(id);
        match live {
            Some(conn) => {
                let timeout = wait.unwrap_or(self.receipt_timeout);
                match send::handover(&inst, &conn, &request_id, message).await {
                    Ok(waiter) => {
                        self.spawn_settle(
                            inst.clone(),
                            conn,
                            id,
                            request_id.clone(),
                            waiter,
                            timeout,
                        );
                    }
                    Err(SendError::Offline(_)) => {
                        // The frame never left the hub: back to the queue, nothing is lost.
                        debug!(instance = %inst.config.id, id, "driver left before the send; queued");
                        self.record_outcome(id, OutboxState::Queued, None, None).await;
                    }
                    Err(err) => {
                        let error = format!("{}: {err}", err.code());
                        self.record_outcome(id, OutboxState::Failed, None, Some(error)).await;
                        return Err(err);
                    }
                }
            }
            None => debug!(instance = %instance, id, "driver offline; send queued"),
        }
        let Some(wait) = wait else {
            let queued = inst.live().is_none() && state == OutboxState::Queued;
            return Ok(if queued {
                SendOutcome::queued(request_id, Some(id))
            } else {
                SendOutcome::handed(request_id, Some(id))
            });
        };
        // The settle task decides at `wait`; give it a moment to record the outcome.
        if let Some(outcome) = settled.outcome(wait + SETTLE_MARGIN).await {
            return outcome_result(request_id, id, outcome);
        }
        drop(settled);
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
    async fn existing(
        &self,
        record: OutboxRecord,
        wait: Option<Duration>,
    ) -> Result<SendOutcome, SendError> {
        let request_id = self.request_id(record.id);
        let pending = matches!(record.state, OutboxState::Queued | OutboxState::Sent);
        if pending {
            if let Some(wait) = wait {
                let mut settled = self.waiters.watch(record.id);
                if let Some(outcome) = settled.outcome(wait).await {
                    return outcome_result(request_id, record.id, outcome);
                }
            }
            return Ok(match record.state {
                OutboxState::Queued => SendOutcome::queued(request_id, Some(record.id)),
                _ => SendOutcome::handed(request_id, Some(record.id)),
            });
        }
        outcome_result(request_id, record.id, record_outcome(&record))
    }

    /// The wire request id of outbox record `id`.
    pub fn request_id(&self, id: i64) -> Id {
        Id::new(self.ledger.outbox_request_id(id)).expect("outbox request ids are short")
    }

    /// Waits for the receipt of a handed-over record in the background, then records it.
    fn spawn_settle(
        &self,
        inst: Arc<Instance>,
        conn: Arc<Connection>,
        id: i64,
        request_id: Id,
        waiter: oneshot::Receiver<ReceiptOutcome>,
        timeout: Duration,
    ) {
        let outbox = self.clone();
        self.tasks.spawn(async move {
            let outcome = send::await_receipt(&conn, request_id, waiter, timeout).await;
            let (state, receipt, error) = match outcome {
                Ok(receipt) => (OutboxState::Receipted, Some(receipt), None),
                Err(SendError::Failed { code, message, .. }) => {
                    (OutboxState::Failed, None, Some(format!("{code}: {message}")))
                }
                Err(err) => (OutboxState::Unknown, None, Some(err.to_string())),
            };
            if state == OutboxState::Unknown {
                inst.record_error(format!("send {id}: outcome unknown"));
                warn!(instance = %inst.config.id, id, error = ?error, "send outcome unknown; it will not be resent automatically");
            }
            outbox.record_outcome(id, state, receipt, error).await;
        });
    }

    /// Makes an outcome durable, then tells whoever waits for it.
    async fn record_outcome(
        &self,
        id: i64,
        state: OutboxState,
        receipt: Option<DeliveryReceipt>,
        error: Option<String>,
    ) {
        let encoded = receipt.as_ref().and_then(|r| serde_json::to_vec(r).ok());
        if let Err(err) = self.ledger.outbox_set(id, state, encoded, error.clone(), now_ms()).await
        {
            warn!(id, error = %err, "outbox outcome not recorded");
        }
        if state == OutboxState::Queued {
            return;
        }
        self.waiters.settle(id, &OutboxOutcome { state, receipt, error });
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

    /// Sends every queued record of `inst` on `conn`, oldest first: frames go out in order,
    /// receipts are awaited concurrently.
    pub async fn dispatch_queued(&self, inst: &Arc<Instance>, conn: &Arc<Connection>) {
        if !self.ledger.is_on() || !conn.declaration.can_send() {
            return;
        }
        loop {
            let claimed = match self
                .ledger
                .outbox_claim_queued(inst.config.id.to_string(), now_ms(), DISPATCH_BATCH)
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
                return;
            }
            for record in claimed.records {
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
                match send::handover(inst, conn, &request_id, message).await {
                    Ok(waiter) => {
                        let timeout = self.receipt_timeout;
                        let (inst, conn) = (inst.clone(), conn.clone());
                        self.spawn_settle(inst, conn, record.id, request_id, waiter, timeout);
                    }
                    Err(err) => {
                        self.record_outcome(record.id, OutboxState::Queued, None, None).await;
                        debug!(instance = %inst.config.id, error = %err, "dispatch stopped; records stay queued");
                        return;
                    }
                }
            }
        }
    }

    /// An operator's explicit retry of an `unknown` or `failed` send.
    pub async fn retry(&self, id: i64) -> Result<OutboxRecord, SendError> {
        let now = now_ms();
        let record = self.ledger.outbox_requeue(id, now, now + self.ttl.as_millis() as u64).await?;
        if let Some(inst) = self.instances.get(record.instance.as_str())
            && let Some(conn) = inst.live()
        {
            self.dispatch_queued(inst, &conn).await;
        }
        Ok(self.ledger.outbox_get(id).await?.unwrap_or(record))
    }
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
