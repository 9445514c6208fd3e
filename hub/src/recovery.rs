//! What the ledger gives back after a restart — the run queues (runs interrupted by the stop
//! started again once, queued ones in their place), sends
//! that were in flight marked unknown, session generations — and the background upkeep
//! (retention pruning, outbox expiry).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use channeld_protocol::{Frame, decode};
use tracing::{info, warn};

use crate::hub::Hub;
use crate::inbound::{self, run::Admitted};
use crate::instance::unix_ms;

/// How often retention pruning and outbox expiry run.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(600);

/// Restores durable state before the sockets accept anything.
pub(crate) async fn restore(hub: &Arc<Hub>) {
    if !hub.ledger.is_on() {
        return;
    }
    let now = unix_ms(SystemTime::now());
    for inst in hub.instances.snapshot().values() {
        match hub.ledger.generations(inst.config.id.to_string()).await {
            Ok(generations) => inst.load_generations(generations),
            Err(err) => {
                warn!(instance = %inst.config.id, error = %err, "session generations not loaded")
            }
        }
    }
    match hub.ledger.outbox_restart(now).await {
        Ok(0) => {}
        Ok(count) => warn!(
            count,
            "sends were in flight when the hub stopped; their outcome is unknown and they will not be resent"
        ),
        Err(err) => warn!(error = %err, "outbox not restored"),
    }
    let recovered = match hub.ledger.recover(now).await {
        Ok(recovered) => recovered,
        Err(err) => {
            warn!(error = %err, "interrupted runs not recovered");
            return;
        }
    };
    if !recovered.is_empty() {
        let interrupted = recovered.iter().filter(|run| run.attempt > 1).count();
        info!(
            runs = recovered.len(),
            interrupted,
            "queueing again, in arrival order, the runs accepted and not finished (interrupted ones flagged redelivered)"
        );
    }
    for run in recovered {
        let Some(inst) = hub.instance(&run.instance) else {
            warn!(instance = %run.instance, event_id = %run.event_id, "interrupted run for an instance no longer configured; left as is");
            continue;
        };
        let isolation = inst.config.identity_isolation;
        match decode(&run.frame) {
            Ok(Frame::Inbound(inbound)) => {
                inbound::rerun(
                    hub,
                    &inst,
                    Admitted::message(inbound, isolation),
                    run.run_id,
                    run.attempt,
                );
            }
            Ok(Frame::InboundEvent(event)) => {
                inbound::rerun(
                    hub,
                    &inst,
                    Admitted::event(event, isolation),
                    run.run_id,
                    run.attempt,
                );
            }
            Ok(other) => {
                warn!(event_id = %run.event_id, frame = other.type_name(), "ledger entry holds an unexpected frame")
            }
            Err(err) => {
                warn!(event_id = %run.event_id, error = %err, "ledger entry does not decode")
            }
        }
    }
}

/// Prunes finished entries past the retention window and fails expired queued sends.
pub(crate) async fn housekeeping(hub: Arc<Hub>) {
    if !hub.ledger.is_on() {
        return;
    }
    let mut tick = tokio::time::interval(HOUSEKEEPING_INTERVAL);
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = unix_ms(SystemTime::now());
        let cutoff = now.saturating_sub(hub.config.retention.as_millis() as u64);
        match hub.ledger.prune(cutoff).await {
            Ok(0) => {}
            Ok(rows) => info!(rows, "pruned ledger entries past the retention window"),
            Err(err) => warn!(error = %err, "ledger pruning failed"),
        }
        match hub.outbox.expire().await {
            Ok(0) => {}
            Ok(sends) => info!(sends, "queued sends expired"),
            Err(err) => warn!(error = %err, "outbox expiry failed"),
        }
    }
}
