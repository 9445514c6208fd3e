//! Cancelling the run of one inbound (extension `cancel`, control op `cancel`): a run waiting
//! its turn leaves the queue, a running one is stopped by its runtime (the exec agent's
//! process group gets SIGTERM, then SIGKILL after a grace period); either way it is recorded
//! `aborted` in the ledger (so recovery never runs it again), the driver gets its ending
//! instead of a reply, and nothing else of it is sent. A run that had already ended is
//! answered with what it ended as, and nothing is cancelled.

use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::Id;
use tracing::{info, warn};

use crate::cancels::{ABORTED, Lookup, RunCancel};
use crate::connection::{Connection, lock};
use crate::hub::Hub;
use crate::instance::Instance;
use crate::ledger::{InboundState, RunEnd};
use crate::runtime::RunError;

/// How long a cancel waits for a running run to stop and record its end: the runtime's
/// grace period and a kill, with room to spare.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// What a cancel did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// The event ids whose runs this cancel stopped or removed (empty: nothing was going on).
    pub cancelled: Vec<Id>,
    /// The state the event is in now: `aborted`, or how its run ended (`replied`,
    /// `delivered`, `failed`).
    pub state: &'static str,
}

/// Why a cancel was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CancelError {
    #[error("no accepted inbound with event id {0}")]
    UnknownEvent(Id),
    #[error("the inbound {0} is being recorded; try again")]
    NotReady(Id),
    #[error("the run of {0} did not stop within {STOP_WAIT:?}")]
    Timeout(Id),
    #[error("the ledger could not be read: {0}")]
    Ledger(String),
}

impl CancelError {
    /// The wire code (`error` frame or control error).
    pub fn code(&self) -> &'static str {
        match self {
            CancelError::UnknownEvent(_) => "unknown_event",
            CancelError::NotReady(_) => "not_ready",
            CancelError::Timeout(_) => "cancel_timeout",
            CancelError::Ledger(_) => "ledger_unavailable",
        }
    }

    pub fn retryable(&self) -> bool {
        !matches!(self, CancelError::UnknownEvent(_))
    }
}

/// Cancels the run of `event_id` on `inst`; answers once it is stopped and recorded.
pub async fn cancel(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    event_id: Id,
) -> Result<Cancelled, CancelError> {
    let lookup = lock(&inst.cancels).lookup(&event_id);
    match lookup {
        Lookup::Live(run) => {
            run.cancel();
            // A run waiting its turn leaves the queue now; a running one stops at its next
            // step and records its own end.
            let withdrawn = lock(&inst.runs).withdraw(&event_id);
            if let Some(starts) = withdrawn {
                super::start(starts);
                end_aborted(hub, inst, &event_id, &run, None).await;
            }
            let Ok(state) = tokio::time::timeout(STOP_WAIT, run.finished()).await else {
                return Err(CancelError::Timeout(event_id));
            };
            let cancelled =
                if state == ABORTED && run.claim() { vec![event_id.clone()] } else { Vec::new() };
            if !cancelled.is_empty() {
                info!(instance = %inst.config.id, %event_id, "run cancelled");
            }
            Ok(Cancelled { cancelled, state })
        }
        Lookup::Ended(state) => Ok(Cancelled { cancelled: Vec::new(), state }),
        Lookup::Unknown => {
            let stored = hub
                .ledger
                .inbound_outcome(inst.config.id.to_string(), event_id.to_string())
                .await
                .map_err(|err| CancelError::Ledger(err.to_string()));
            match stored {
                Ok(Some((InboundState::Running, _))) => Err(CancelError::NotReady(event_id)),
                Ok(Some((state, code))) => {
                    let state = match code.as_deref() {
                        Some(ABORTED) => ABORTED,
                        _ => state.as_str(),
                    };
                    Ok(Cancelled { cancelled: Vec::new(), state })
                }
                Ok(None) => Err(CancelError::UnknownEvent(event_id)),
                // Without a ledger only the runs this hub remembers are known.
                Err(_) if !hub.ledger.is_on() => Err(CancelError::UnknownEvent(event_id)),
                Err(err) => Err(err),
            }
        }
    }
}

/// Ends a run that never started (or stops before it does): recorded aborted, the driver
/// told with an `error` `aborted` (its one ending), the table told.
pub async fn end_aborted(
    hub: &Hub,
    inst: &Instance,
    event_id: &Id,
    run: &RunCancel,
    conn: Option<Arc<Connection>>,
) {
    if hub.ledger.is_on() {
        let end =
            RunEnd::Failed { code: ABORTED.to_owned(), message: RunError::Aborted.to_string() };
        let now = crate::clock::now_ms();
        let recorded = hub
            .ledger
            .finish_run(inst.config.id.to_string(), event_id.to_string(), end, None, false, now)
            .await;
        if let Err(err) = recorded {
            inst.record_error(format!("ledger: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "aborted run not recorded");
        }
    }
    if let Some(conn) = conn.filter(|c| !c.is_closed()).or_else(|| inst.live()) {
        super::run::end_run(&conn, event_id, &RunError::Aborted, 0).await;
    }
    lock(&inst.cancels).finish(event_id, run, ABORTED);
}
