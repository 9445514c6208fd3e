//! What the ledger gives back after a restart — the run queues (runs interrupted by the stop
//! started again once, queued ones in their place), sends that were in flight marked unknown,
//! replies that were handed over made pending again (and replies owed by an older hub given a
//! delivery record), session generations — and the background upkeep (retention pruning,
//! outbox expiry, the storage probe while the ledger is full).

use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::types::{MessageBody, OutboundMessage};
use channeld_protocol::{Frame, decode};
use tracing::{info, warn};

use crate::hub::Hub;
use crate::inbound::{self, reply::reply_target, run::Admitted};
use crate::ledger::NewReply;

/// How often retention pruning and outbox expiry run.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(600);

/// How often a ledger marked full tries a small write to notice that space returned.
const STORAGE_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// While the ledger is marked `storage_full`, a small write every
/// [`STORAGE_PROBE_INTERVAL`]: the first that commits clears the mark, so the hub recovers
/// by itself even when no message arrives to try.
pub(crate) async fn storage_watch(hub: Arc<Hub>) {
    if !hub.ledger.is_on() {
        return;
    }
    let mut tick = tokio::time::interval(STORAGE_PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if hub.ledger.storage_full() {
            // The outcome is the mark itself (set or cleared by the ledger).
            let _ = hub.ledger.probe_storage(crate::clock::now_ms()).await;
        }
    }
}

/// Restores durable state before the sockets accept anything.
pub(crate) async fn restore(hub: &Arc<Hub>) {
    if !hub.ledger.is_on() {
        return;
    }
    let now = crate::clock::now_ms();
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
    match hub.ledger.replies_restart(now).await {
        Ok(0) => {}
        Ok(count) => info!(
            count,
            "replies were handed to a driver without an answer when the hub stopped; they are handed over again"
        ),
        Err(err) => warn!(error = %err, "replies not restored"),
    }
    track_untracked_replies(hub, now).await;
    match hub.ledger.agent_env_names().await {
        Ok(names) => {
            for (instance, names) in names {
                if let Some(inst) = hub.instance(&instance) {
                    info!(instance, ?names, "runs wait for the driver's agent environment");
                    inst.await_agent_env();
                }
            }
        }
        Err(err) => warn!(error = %err, "agent environment names not loaded"),
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

/// Gives the replies an older hub owed (inbound `replied`, no delivery record) a pending
/// delivery record, so the courier hands them over like any other.
async fn track_untracked_replies(hub: &Hub, now: u64) {
    let untracked = match hub.ledger.untracked_replies().await {
        Ok(untracked) => untracked,
        Err(err) => {
            warn!(error = %err, "owed replies not read");
            return;
        }
    };
    for reply in untracked {
        let target = match decode(&reply.frame) {
            Ok(Frame::Inbound(inbound)) => {
                reply_target(&inbound.message.target, Some(inbound.message.id.clone()))
            }
            Ok(Frame::InboundEvent(event)) => reply_target(&event.event.context().target, None),
            _ => continue,
        };
        let Ok(event_id) = channeld_protocol::Id::new(&reply.event_id) else { continue };
        // Older hubs stored replies uncut: fitted now, as a new one would be.
        let text = inbound::reply::fit_reply(&event_id, &target, &Default::default(), reply.reply);
        let Ok(body) = MessageBody::text(text) else { continue };
        let conversation = target.conversation.to_string();
        let message = OutboundMessage { target, body, metadata: Default::default() };
        let Ok(message) = serde_json::to_vec(&message) else { continue };
        let new = NewReply {
            instance: reply.instance,
            event_id: reply.event_id,
            conversation,
            message,
            expires_ms: now + hub.config.reply_ttl.as_millis() as u64,
        };
        if let Err(err) = hub.ledger.reply_add(new, now).await {
            warn!(error = %err, "owed reply not recorded for delivery");
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
        let now = crate::clock::now_ms();
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
