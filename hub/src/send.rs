//! Handing an `outbound` to a driver connection and waiting for its receipt: the send types
//! every caller (control socket, controller connections, the outbox) shares.

use std::time::Duration;

use channeld_protocol::frame::{Delivery, Receipt};
use channeld_protocol::types::{DeliveryReceipt, OutboundMessage};
use channeld_protocol::{Frame, Id};
use tokio::sync::oneshot;

use crate::connection::{Connection, ReceiptOutcome};
use crate::instance::{Counters, Instance};
use crate::ledger::LedgerError;
use crate::metrics::SendOutcome as SendMetric;

/// Where a proactive send stands when the caller gets its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendState {
    /// The driver posted it (the receipt is attached).
    Receipted,
    /// Handed to the driver; the caller did not wait for the receipt.
    Handed,
    /// In the outbox, waiting for the driver to connect.
    Queued,
}

impl SendState {
    pub fn as_str(self) -> &'static str {
        match self {
            SendState::Receipted => "receipted",
            SendState::Handed => "handed",
            SendState::Queued => "queued",
        }
    }
}

/// How a proactive send went, from the caller's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendOutcome {
    pub request_id: Id,
    /// The outbox record, when the ledger is on.
    pub outbox_id: Option<i64>,
    pub state: SendState,
    pub receipt: Option<DeliveryReceipt>,
    /// The answer to a repeated idempotency key: the first send's record, nothing sent again.
    pub repeated: bool,
}

impl SendOutcome {
    pub fn receipted(request_id: Id, outbox_id: Option<i64>, receipt: DeliveryReceipt) -> Self {
        Self {
            request_id,
            outbox_id,
            state: SendState::Receipted,
            receipt: Some(receipt),
            repeated: false,
        }
    }

    pub fn handed(request_id: Id, outbox_id: Option<i64>) -> Self {
        Self { request_id, outbox_id, state: SendState::Handed, receipt: None, repeated: false }
    }

    pub fn queued(request_id: Id, outbox_id: Option<i64>) -> Self {
        Self { request_id, outbox_id, state: SendState::Queued, receipt: None, repeated: false }
    }

    /// Marks the answer to a repeated idempotency key.
    pub fn repeated(self) -> Self {
        Self { repeated: true, ..self }
    }
}

/// Why a proactive send did not produce a receipt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    #[error("no instance named {0}")]
    UnknownInstance(String),
    #[error("target channel {found} does not match instance {expected}")]
    WrongChannel { expected: String, found: String },
    #[error("driver for {0} is not connected")]
    Offline(String),
    #[error("driver did not declare {0}")]
    NotDeclared(&'static str),
    #[error("message does not fit in a frame: {0}")]
    TooLarge(String),
    #[error("driver reported failure: {code}: {message}")]
    Failed { request_id: Id, code: String, message: String },
    #[error("delivery outcome unknown: {reason}")]
    Unknown { request_id: Id, reason: String },
    #[error("idempotency keys need the ledger: configure hub.state_dir")]
    NeedsLedger,
    #[error(
        "the idempotency key was already used for a different message (outbox record {outbox_id})"
    )]
    Conflict { outbox_id: i64 },
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
}

impl SendError {
    /// The machine-readable code used by the control protocol.
    pub fn code(&self) -> &'static str {
        use channeld_control::code;
        match self {
            SendError::UnknownInstance(_) => code::UNKNOWN_INSTANCE,
            SendError::WrongChannel { .. } => code::INVALID_TARGET,
            SendError::Offline(_) => code::DRIVER_OFFLINE,
            SendError::NotDeclared(_) => code::NOT_DECLARED,
            SendError::TooLarge(_) => code::TOO_LARGE,
            SendError::Failed { .. } => code::SEND_FAILED,
            SendError::Unknown { .. } => code::OUTCOME_UNKNOWN,
            SendError::NeedsLedger => code::INVALID_REQUEST,
            SendError::Conflict { .. } => code::CONFLICT,
            SendError::Ledger(LedgerError::StorageFull) => code::STORAGE_FULL,
            SendError::Ledger(_) => code::LEDGER_UNAVAILABLE,
        }
    }
}

/// Refuses a message whose `outbound` frame with `request_id` would exceed the line limit,
/// before anything is recorded or handed over.
pub fn fits(request_id: &Id, message: &OutboundMessage) -> Result<(), SendError> {
    let frame =
        Frame::Outbound(Delivery { request_id: request_id.clone(), message: message.clone() });
    channeld_protocol::encode(&frame).map(drop).map_err(|err| SendError::TooLarge(err.to_string()))
}

/// The message of an `outbound`: as it is, or already encoded as JSON by this process
/// (`serde_json::to_vec` of an [`OutboundMessage`]), which the outbox has for the ledger: the
/// frame is then built around those bytes, not encoded again (BENCHMARKS.md, fix 27).
#[derive(Debug)]
pub enum Outgoing<'m> {
    Message(OutboundMessage),
    Encoded(&'m [u8]),
}

/// Hands an `outbound` to `conn` and registers for its receipt. Fails without sending when
/// the driver did not declare `send` or the connection is gone.
///
/// The frame is built, encoded and its receipt registered when this is called; the future
/// only queues the encoded line, so it holds neither the message nor the frame (it is part
/// of every send's future, which spawning and boxing copy). Await it at once.
pub fn handover<'a>(
    inst: &'a Instance,
    conn: &'a Connection,
    request_id: &'a Id,
    message: Outgoing<'_>,
) -> impl Future<Output = Result<oneshot::Receiver<ReceiptOutcome>, SendError>> + Send + 'a {
    let prepared = prepare(inst, conn, request_id, message);
    async move {
        let (waiter, line) = prepared?;
        if conn.sink.send_encoded(line).await.is_err() {
            conn.forget_receipt(request_id);
            return Err(SendError::Offline(inst.config.id.to_string()));
        }
        Counters::bump(&inst.counters.outbound);
        Ok(waiter)
    }
}

/// What [`handover`] does before it queues the line: the checks, the receipt's
/// registration and the encoded frame.
fn prepare(
    inst: &Instance,
    conn: &Connection,
    request_id: &Id,
    message: Outgoing<'_>,
) -> Result<(oneshot::Receiver<ReceiptOutcome>, Vec<u8>), SendError> {
    if !conn.declaration.can_send() {
        return Err(SendError::NotDeclared("send"));
    }
    let waiter = conn
        .expect_receipt(request_id.clone())
        .ok_or_else(|| SendError::Offline(inst.config.id.to_string()))?;
    let line = match message {
        Outgoing::Message(message) => channeld_protocol::encode(&Frame::Outbound(Delivery {
            request_id: request_id.clone(),
            message,
        })),
        Outgoing::Encoded(message) => channeld_protocol::encode_outbound(request_id, message),
    };
    match line {
        Ok(line) => Ok((waiter, line)),
        Err(err) => {
            conn.forget_receipt(request_id);
            Err(SendError::TooLarge(err.to_string()))
        }
    }
}

/// Waits up to `timeout` for the receipt of a handed-over `outbound`, and counts the outcome
/// in the instance's metrics.
pub async fn await_receipt(
    inst: &Instance,
    conn: &Connection,
    request_id: Id,
    waiter: oneshot::Receiver<ReceiptOutcome>,
    timeout: Duration,
) -> Result<DeliveryReceipt, SendError> {
    let outcome = receipt_of(conn, request_id, waiter, timeout).await;
    inst.metrics.send(match &outcome {
        Ok(_) => SendMetric::Receipted,
        Err(SendError::Failed { .. }) => SendMetric::Failed,
        Err(_) => SendMetric::Unknown,
    });
    outcome
}

async fn receipt_of(
    conn: &Connection,
    request_id: Id,
    waiter: oneshot::Receiver<ReceiptOutcome>,
    timeout: Duration,
) -> Result<DeliveryReceipt, SendError> {
    match tokio::time::timeout(timeout, waiter).await {
        Ok(Ok(ReceiptOutcome::Receipted(receipt))) => Ok(receipt),
        Ok(Ok(ReceiptOutcome::Failed { code, message })) => {
            Err(SendError::Failed { request_id, code, message })
        }
        Ok(Ok(ReceiptOutcome::Unknown { reason })) => {
            Err(SendError::Unknown { request_id, reason })
        }
        Ok(Err(_)) => Err(SendError::Unknown { request_id, reason: "driver disconnected".into() }),
        Err(_) => {
            conn.forget_receipt(&request_id);
            Err(SendError::Unknown {
                request_id,
                reason: format!("no receipt within {} s", timeout.as_secs()),
            })
        }
    }
}

/// Sends an `outbound` with a given request id on a given connection; with `wait`, waits up
/// to that long for the receipt. Without, the receipt is still counted when it arrives.
pub async fn send_on(
    inst: &Instance,
    conn: &Connection,
    request_id: Id,
    message: OutboundMessage,
    wait: Option<Duration>,
) -> Result<SendOutcome, SendError> {
    let waiter = handover(inst, conn, &request_id, Outgoing::Message(message)).await?;
    let Some(timeout) = wait else {
        return Ok(SendOutcome::handed(request_id, None));
    };
    let receipt = await_receipt(inst, conn, request_id.clone(), waiter, timeout).await?;
    Ok(SendOutcome::receipted(request_id, None, receipt))
}

/// Counts a receipt and completes its wait; gives it back when nobody waits for it on `conn`.
pub fn complete(inst: &Instance, conn: &Connection, receipt: Receipt) -> Option<Receipt> {
    Counters::bump(&inst.counters.receipts);
    conn.complete_receipt(receipt)
}
