//! Proactive sends: persisted before they are acknowledged, idempotent by key, queued while
//! the driver is offline and dispatched in order when it reconnects, and settled as
//! receipted, failed or unknown. A send handed to a driver is never resent automatically.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use channeld_protocol::Id;
use channeld_protocol::types::{DeliveryReceipt, OutboundMessage};
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::hub::{Hub, SendError, SendOutcome};
use crate::instance::{Connection, Instance, lock, unix_ms};
use crate::ledger::{Added, LedgerError, NewSend, OutboxRecord, OutboxState};

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

/// How an outbox record settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxOutcome {
    pub state: OutboxState,
    pub receipt: Option<DeliveryReceipt>,
    pub error: Option<String>,
}

fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

impl Hub {
    /// Sends through the outbox when the ledger is on, directly otherwise.
    pub async fn submit(&self, request: SendRequest) -> Result<SendOutcome, SendError> {
        let SendRequest { instance, mut message, wait, idempotency_key } = request;
        let inst = self
            .instance(&instance)
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
            return self.send_on(&inst, &conn, self.request_id("out"), message, wait).await;
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
                expires_ms: now + self.config.outbox_ttl.as_millis() as u64,
            })
            .await?;
        let id = match added {
            Added::New(id) => id,
            Added::Existing(record) => return self.existing(record, wait).await,
        };
        let request_id = self.outbox_request_id(id);
        let settled = self.watch(id);
        match live {
            Some(conn) => {
                let timeout = wait.unwrap_or(self.config.receipt_timeout);
                match self.handover(&inst, &conn, &request_id, message).await {
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
                        self.record_outcome(
                            id,
                            OutboxState::Failed,
                            None,
                            Some(format!("{}: {err}", err.code())),
                        )
                        .await;
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
        match tokio::time::timeout(wait + SETTLE_MARGIN, settled).await {
            Ok(Ok(outcome)) => outcome_result(request_id, id, outcome),
            _ => match self.ledger.outbox_get(id).await? {
                Some(record) if record.state == OutboxState::Queued => {
                    Ok(SendOutcome::queued(request_id, Some(id)))
                }
                Some(record) if record.state == OutboxState::Sent => {
                    Ok(SendOutcome::handed(request_id, Some(id)))
                }
                Some(record) => outcome_result(request_id, id, record_outcome(&record)),
                None => Err(SendError::Ledger(LedgerError::NoSuchRecord(id))),
            },
        }
    }

    /// The answer for a repeated idempotency key: the existing record, never a second send.
    async fn existing(
        &self,
        record: OutboxRecord,
        wait: Option<Duration>,
    ) -> Result<SendOutcome, SendError> {
        let request_id = self.outbox_request_id(record.id);
        let pending = matches!(record.state, OutboxState::Queued | OutboxState::Sent);
        if pending {
            if let Some(wait) = wait {
                let settled = self.watch(record.id);
                if let Ok(Ok(outcome)) = tokio::time::timeout(wait, settled).await {
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

    pub(crate) fn outbox_request_id(&self, id: i64) -> Id {
        Id::new(self.ledger.outbox_request_id(id)).expect("outbox request ids are short")
    }

    fn watch(&self, id: i64) -> oneshot::Receiver<OutboxOutcome> {
        let (tx, rx) = oneshot::channel();
        lock(&self.outbox_waiters).entry(id).or_default().push(tx);
        rx
    }

    fn spawn_settle(
        &self,
        inst: Arc<Instance>,
        conn: Arc<Connection>,
        id: i64,
        request_id: Id,
        waiter: oneshot::Receiver<crate::instance::ReceiptOutcome>,
        timeout: Duration,
    ) {
        let hub = inst_hub(self);
        tokio::spawn(async move {
            let outcome = Hub::settle(&conn, request_id, waiter, timeout).await;
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
            if let Some(hub) = hub.upgrade() {
                hub.record_outcome(id, state, receipt, error).await;
            }
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
        let waiters = lock(&self.outbox_waiters).remove(&id).unwrap_or_default();
        let outcome = OutboxOutcome { state, receipt, error };
        for waiter in waiters {
            let _ = waiter.send(outcome.clone());
        }
    }

    /// Sends every queued record of `inst` on `conn`, oldest first: frames go out in order,
    /// receipts are awaited concurrently.
    pub(crate) async fn dispatch_queued(&self, inst: &Arc<Instance>, conn: &Arc<Connection>) {
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
            if claimed.is_empty() {
                return;
            }
            for record in claimed {
                let request_id = self.outbox_request_id(record.id);
                let message: OutboundMessage = match serde_json::from_slice(&record.message) {
                    Ok(message) => message,
                    Err(err) => {
                        self.record_outcome(
                            record.id,
                            OutboxState::Failed,
                            None,
                            Some(format!("unreadable record: {err}")),
                        )
                        .await;
                        continue;
                    }
                };
                match self.handover(inst, conn, &request_id, message).await {
                    Ok(waiter) => {
                        let timeout = self.config.receipt_timeout;
                        self.spawn_settle(
                            inst.clone(),
                            conn.clone(),
                            record.id,
                            request_id,
                            waiter,
                            timeout,
                        );
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
    pub async fn retry_send(&self, id: i64) -> Result<OutboxRecord, SendError> {
        let now = now_ms();
        let record = self
            .ledger
            .outbox_requeue(id, now, now + self.config.outbox_ttl.as_millis() as u64)
            .await?;
        if let Some(inst) = self.instance(&record.instance).cloned()
            && let Some(conn) = inst.live()
        {
            self.dispatch_queued(&inst, &conn).await;
        }
        Ok(self.ledger.outbox_get(id).await?.unwrap_or(record))
    }
}

/// A weak handle for background tasks, so a settle task never keeps a stopped hub alive.
fn inst_hub(hub: &Hub) -> std::sync::Weak<Hub> {
    hub.self_ref.clone()
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
