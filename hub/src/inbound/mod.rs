//! The inbound path: the pure decision (`decide.rs`) and the thin layer here that carries it
//! out — the in-flight slot, the ledger record, the answer to the driver, the run
//! (`run.rs`) and the reply (`reply.rs`).
//!
//! With the ledger on, an event id is run at most once: a redelivery with the same content
//! (`fingerprint.rs`) replays the stored reply (or waits for the run in progress), different
//! content is a `conflict`, and a run cut off by a crash is started again once, flagged
//! `redelivered`.

pub mod decide;
pub mod fingerprint;
pub mod reply;
pub mod run;

use std::sync::Arc;
use std::time::SystemTime;

use channeld_protocol::frame::{Delivery, Inbound, InboundEventFrame};
use channeld_protocol::types::{MessageBody, OutboundMessage};
use channeld_protocol::{Frame, encode};
use tracing::{info, warn};

use crate::config::InstancePolicy;
use crate::connection::{Connection, lock};
use crate::hub::Hub;
use crate::inflight::Slot;
use crate::instance::{Counters, Instance, unix_ms};
use crate::ledger::{NewInbound, Recorded};
use decide::{Action, InboundView, InstanceView, Lookup, Replay, decide, slash_command};
use reply::{accept, refuse};
use run::{Admitted, Work};

/// An `inbound` frame from a driver (or a legacy peer).
pub(crate) async fn on_message(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    inbound: Inbound,
) {
    let admitted = Admitted::message(inbound, inst.config.identity_isolation);
    take(hub, inst, conn, admitted).await;
}

/// An `inbound_event` frame (reaction, edit, …).
pub(crate) async fn on_event(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    frame: InboundEventFrame,
) {
    let admitted = Admitted::event(frame, inst.config.identity_isolation);
    take(hub, inst, conn, admitted).await;
}

/// Starts again a run that a crash interrupted: same run id, flagged `redelivered`, with no
/// connection of its own (its reply goes to whichever driver is live when it ends).
pub(crate) fn rerun(hub: &Arc<Hub>, inst: &Arc<Instance>, admitted: Admitted, run_id: String) {
    let work = admitted.text().and_then(slash_command).map_or(Work::Runtime, Work::Hub);
    run::spawn(hub, inst, None, &admitted, run_id, true, work);
}

fn view(admitted: &Admitted) -> InboundView<'_> {
    InboundView {
        channel: admitted.origin.channel.as_str(),
        sender: admitted.sender.as_ref().map(|p| p.id.as_str()),
        text: admitted.text(),
    }
}

/// The instance's side of the decision, under its live settings as they are now.
fn instance_view<'a>(
    inst: &'a Instance,
    policy: &'a InstancePolicy,
    slot: Slot,
) -> InstanceView<'a> {
    InstanceView {
        channel: inst.config.id.as_str(),
        allow: &policy.allow,
        deny_notice: policy.deny_notice.is_some(),
        slot,
    }
}

/// The first decision, made on the reader with the in-flight table locked: an inbound that
/// may go on takes its slot in the same step.
async fn take(hub: &Arc<Hub>, inst: &Arc<Instance>, conn: &Arc<Connection>, admitted: Admitted) {
    Counters::bump(&inst.counters.inbound);
    let ledger = if hub.ledger.is_on() { Lookup::NotAsked } else { Lookup::Off };
    let policy = inst.policy();
    let action = {
        let mut inflight = lock(&conn.inflight);
        let slot = inflight.slot(&admitted.event_id);
        let action = decide(view(&admitted), instance_view(inst, &policy, slot), ledger);
        if matches!(action, Action::Record | Action::Run | Action::Answer(_)) {
            inflight.admit(&admitted.event_id);
        }
        action
    };
    if action == Action::Record {
        // Recording waits for a commit: do it off the reader, so the frames behind this one
        // are read (and group-committed together) meanwhile.
        let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
        hub.clone().runs.spawn(async move { record(&hub, &inst, &conn, admitted).await });
        return;
    }
    carry_out(hub, inst, conn, admitted, action, None).await;
}

/// Records the inbound in the ledger and carries out the second decision.
async fn record(hub: &Arc<Hub>, inst: &Arc<Instance>, conn: &Arc<Connection>, admitted: Admitted) {
    let event_id = admitted.event_id.clone();
    let (line, hash) = match (encode(&admitted.frame), fingerprint::fingerprint(&admitted.frame)) {
        (Ok(line), Some(hash)) => (line, hash),
        (Err(err), _) => {
            lock(&conn.inflight).finish(&event_id);
            refuse(conn, &event_id, "invalid_frame", err.to_string(), false).await;
            return;
        }
        (Ok(_), None) => {
            lock(&conn.inflight).finish(&event_id);
            refuse(conn, &event_id, "invalid_frame", "not an inbound frame".into(), false).await;
            return;
        }
    };
    let run_id = run::new_run_id(hub);
    let new = NewInbound {
        instance: inst.config.id.to_string(),
        event_id: event_id.to_string(),
        content_hash: hash,
        hash_version: fingerprint::FINGERPRINT_VERSION,
        frame: line[..line.len() - 1].to_vec(),
        run_id: run_id.clone(),
        now_ms: unix_ms(SystemTime::now()),
    };
    let recorded = hub.ledger.record_inbound(new, fingerprint::rehash).await;
    let lookup = match &recorded {
        Ok(Recorded::New) => Lookup::New,
        Ok(Recorded::Replay(stored)) => Lookup::Stored(stored),
        Ok(Recorded::Conflict) => Lookup::Conflict,
        Err(err) => {
            inst.record_error(format!("ledger: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "inbound not recorded; the driver will retry");
            Lookup::Failed
        }
    };
    let policy = inst.policy();
    let action = decide(view(&admitted), instance_view(inst, &policy, Slot::Taken), lookup);
    carry_out(hub, inst, conn, admitted, action, Some(run_id)).await;
}

/// Carries out a decision. The inbound holds its in-flight slot for `Record`, `Run` and
/// `Answer`, and after the ledger answered; every outcome that is not a run frees it.
async fn carry_out(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Admitted,
    action: Action,
    run_id: Option<String>,
) {
    let event_id = &admitted.event_id;
    let free_slot = || lock(&conn.inflight).finish(event_id);
    match action {
        Action::WrongChannel => {
            let text = format!(
                "target channel {} does not match instance {}",
                admitted.origin.channel, inst.config.id
            );
            refuse(conn, event_id, "invalid_target", text, false).await;
        }
        Action::Deny { notice } => deny(inst, conn, &admitted, notice).await,
        Action::Busy { max } => {
            Counters::bump(&inst.counters.busy);
            refuse(conn, event_id, "busy", format!("{max} inbound runs already in flight"), true)
                .await;
        }
        Action::InFlight => {
            // The run is in progress on this connection; its reply will come.
            if conn.declaration.extensions.accepted {
                accept(conn, event_id, true).await;
            } else {
                let text = "a run for this event is already in flight".to_owned();
                refuse(conn, event_id, "duplicate", text, false).await;
            }
        }
        Action::Record => Box::pin(record(hub, inst, conn, admitted)).await,
        Action::Replay(replay) => {
            free_slot();
            accept(conn, event_id, true).await;
            tracing::debug!(instance = %inst.config.id, %event_id, ?replay, "redelivered event; replaying");
            match replay {
                // Its reply goes to the instance's live driver when the run ends.
                Replay::Wait => {}
                Replay::Reply(text) => {
                    let target = admitted.reply_target();
                    reply::replay(hub, inst, conn, event_id, target, text).await;
                }
                Replay::Failure { code, message } => {
                    refuse(conn, event_id, &code, message, false).await;
                }
            }
        }
        Action::Conflict => {
            free_slot();
            let text = "this event id was already used for different content".to_owned();
            refuse(conn, event_id, "conflict", text, false).await;
        }
        Action::Unrecorded => {
            free_slot();
            let text = "the hub could not record this message".to_owned();
            refuse(conn, event_id, "ledger_unavailable", text, true).await;
        }
        Action::Answer(_) | Action::Run => {
            accept(conn, event_id, false).await;
            let work = match action {
                Action::Answer(command) => Work::Hub(command),
                _ => Work::Runtime,
            };
            let run_id = run_id.unwrap_or_else(|| run::new_run_id(hub));
            run::spawn(hub, inst, Some(conn.clone()), &admitted, run_id, false, work);
        }
    }
}

/// A sender off the allowlist: counted, logged, told so on the platform when a deny notice
/// is configured (once per sender per `deny_notice_interval_secs`), and refused
/// `sender_denied`.
async fn deny(inst: &Instance, conn: &Connection, admitted: &Admitted, notice: bool) {
    let event_id = &admitted.event_id;
    Counters::bump(&inst.counters.denied);
    info!(
        instance = %inst.config.id,
        %event_id,
        sender = admitted.sender.as_ref().map_or("<none>", |p| p.id.as_str()),
        "sender not on the allowlist; denied"
    );
    let policy = inst.policy();
    if notice
        && let Some(text) = &policy.deny_notice
        && let Some(sender) = &admitted.sender
        && inst.may_notify(sender.id.as_str())
        && let Ok(body) = MessageBody::text(text.clone())
    {
        let frame = Frame::Deliver(Delivery {
            request_id: event_id.clone(),
            message: OutboundMessage {
                target: admitted.origin.clone(),
                body,
                metadata: Default::default(),
            },
        });
        let _ = conn.sink.send(&frame).await;
    }
    refuse(conn, event_id, "sender_denied", "sender is not allowed on this channel".into(), false)
        .await;
}
