//! Ack-after-accept settlement: a platform message is acknowledged to the platform only once
//! the hub has answered for it. [`PendingAcks`] holds one platform acknowledgement per
//! message in flight, settles each with the hub's answer as it arrives, and drains them all
//! (bounded) when the driver stops, so nothing is acknowledged that the hub does not have
//! and nothing is left waiting forever.
//!
//! The driver decides what each answer means on its platform by implementing [`Settle`]:
//! `Accepted` (also a duplicate) → acknowledge; `Rejected` (a final refusal, e.g. a denied
//! sender) → acknowledge or reject, as the platform prefers, so it is not redelivered
//! forever; `Unresolved` (no answer: hub unreachable, driver stopping) → leave it (or requeue)
//! for the platform to redeliver.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::hub::InboundTicket;
use crate::pending::Acceptance;

/// How long settling may take once the wait for the hub's answers is over (the platform
/// calls themselves: a PUBACK, a `basic.nack`).
pub const SETTLE_WITHIN: Duration = Duration::from_secs(2);

/// A platform acknowledgement handle: a PUBACK to send, an AMQP acker, a cursor to commit.
pub trait Settle: Send + 'static {
    /// Tells the platform the outcome of its message. Called exactly once.
    fn settle(self, outcome: &Acceptance) -> impl Future<Output = ()> + Send;
}

/// Platform acknowledgements waiting for the hub's answers. Each is settled in a task of its
/// own tracker, so none is ever detached: [`drain`](Self::drain) waits for all of them.
/// Their number is bounded by the SDK's pending-inbound limit
/// ([`MAX_PENDING_INBOUND`](crate::MAX_PENDING_INBOUND)), since each waits on a ticket.
#[derive(Debug, Default)]
pub struct PendingAcks {
    tracker: TaskTracker,
    abandon: CancellationToken,
}

impl PendingAcks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Settles `ack` with the hub's answer to `ticket` once it comes.
    pub fn track<S: Settle>(&self, ticket: InboundTicket, ack: S) {
        let abandon = self.abandon.clone();
        self.tracker.spawn(async move {
            let event_id = ticket.event_id().clone();
            let outcome = tokio::select! {
                outcome = ticket.outcome() => outcome,
                () = abandon.cancelled() => Acceptance::Unresolved,
            };
            match &outcome {
                Acceptance::Accepted { duplicate } => {
                    debug!(%event_id, duplicate, "the hub has the message; acknowledging it");
                }
                Acceptance::Rejected { code, message } if code == "sender_denied" => {
                    debug!(%event_id, %code, %message, "sender not allowed; settled as refused");
                }
                Acceptance::Rejected { code, message } => {
                    info!(%event_id, %code, %message, "the hub refused the message; settled as refused");
                }
                Acceptance::Unresolved => {
                    debug!(%event_id, "no answer from the hub; left for the platform to redeliver");
                }
            }
            ack.settle(&outcome).await;
        });
    }

    /// Settles `ack` now with `outcome`, for a message that never reaches the hub (one that
    /// cannot be converted is `Rejected`), still tracked so a drain waits for it.
    pub fn settle_now<S: Settle>(&self, ack: S, outcome: Acceptance) {
        self.tracker.spawn(async move { ack.settle(&outcome).await });
    }

    /// Acknowledgements not settled yet.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Waits up to `within` for the hub to answer every tracked message; the ones still
    /// unanswered are then settled as `Unresolved` (bounded by [`SETTLE_WITHIN`]). Returns how
    /// many were left unanswered. Call it before closing the platform connection the
    /// acknowledgements travel on; `Duration::ZERO` abandons at once (the connection is gone).
    pub async fn drain(self, within: Duration) -> usize {
        self.tracker.close();
        if tokio::time::timeout(within, self.tracker.wait()).await.is_ok() {
            return 0;
        }
        let unanswered = self.tracker.len();
        self.abandon.cancel();
        if tokio::time::timeout(SETTLE_WITHIN, self.tracker.wait()).await.is_err() {
            warn!(
                left = self.tracker.len(),
                "platform acknowledgements did not finish; the platform redelivers those messages"
            );
        }
        unanswered
    }
}
