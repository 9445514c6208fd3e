//! The inbound path: the pure decision (`decide.rs`) and the thin layer here that carries it
//! out — the place in the instance's run queue, the ledger record, the answer to the driver,
//! the run (`run.rs`) and the reply (`reply.rs`).
//!
//! Order: an inbound takes its place in its session's queue on the reader, in arrival order,
//! before anything is awaited; it is recorded (ledger on), answered `accepted` once the record
//! is on the disk, and its run starts when the runs before it in its session have ended and a
//! run slot is free (`runqueue.rs`) — possibly while the record is still being synced, its
//! frames then held behind `accepted` (`run::Gate`). `/help` and `/new` are runs like any other, so they take effect in that
//! order too.
//!
//! With the ledger on, an event id is run at most once: a redelivery with the same content
//! (`fingerprint.rs`) replays the stored reply (or waits for the run in progress), different
//! content is a `conflict`, and a run cut off by a crash is started again once, flagged
//! `redelivered`.

pub mod cancel;
pub mod decide;
pub mod fingerprint;
pub mod reply;
pub mod run;

use std::sync::Arc;

use channeld_protocol::frame::{Delivery, Inbound, InboundEventFrame};
use channeld_protocol::types::{MessageBody, OutboundMessage};
use channeld_protocol::{Frame, Id, encode};
use tracing::{info, warn};

use crate::config::InstancePolicy;
use crate::connection::{Connection, lock};
use crate::hub::Hub;
use crate::instance::{Counters, Instance, StartRun};
use crate::ledger::{NewHistory, NewInbound, NewItem, Pending, Recorded, Synced};
use crate::metrics::InboundOutcome;
use crate::runqueue::{Admission, Slot, Starts};
use crate::runtime::RunInput;
use decide::{Action, InboundView, InstanceView, Lookup, Replay, decide, slash_command};
use reply::{accept, refuse};
use run::{Admitted, Queued, Work};

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

/// Queues again, in its place, an accepted inbound whose run had not ended when the hub
/// stopped: same run id, flagged `redelivered` if it had started (`attempt` > 1), with no
/// connection of its own (its reply goes to whichever driver is live when it ends).
pub(crate) fn rerun(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    admitted: Box<Admitted>,
    run_id: String,
    attempt: u32,
) {
    let work = admitted.text().and_then(slash_command).map_or(Work::Runtime, Work::Hub);
    let event_id = admitted.event_id.clone();
    let route = admitted.route.clone();
    let queued = Queued {
        origin: None,
        cancel: lock(&inst.cancels).register(&event_id),
        admitted,
        run_id,
        entry: None,
        redelivered: attempt > 1,
        work,
        count_start: true,
        gate: run::Gate::open(),
    };
    let starts = lock(&inst.runs).restore(&event_id, &route, run::starter(hub, inst, queued));
    start(starts);
}

/// Starts what the run queue released (called outside its lock).
pub(crate) fn start(starts: Starts<StartRun>) {
    for (turn, run) in starts {
        run.start(turn);
    }
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

/// An inbound's place in the run queue, taken on the reader.
#[derive(Debug)]
struct Place {
    /// Given in arrival order (the ledger's recovery order relies on it).
    run_id: String,
    /// It had a run slot and an empty session: its run starts as soon as it is recorded.
    reserved: bool,
    /// Its item's ledger entry id, once recorded.
    entry: Option<i64>,
}

/// The first decision, made on the reader with the run queue locked: an inbound that may go
/// on takes its place in its session's queue in the same step, so places follow arrival.
async fn take(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Box<Admitted>,
) {
    Counters::bump(&inst.counters.inbound);
    let ledger = if hub.ledger.is_on() { Lookup::NotAsked } else { Lookup::Off };
    let policy = inst.policy();
    let (action, place) = {
        let mut runs = lock(&inst.runs);
        let slot = runs.slot(&admitted.event_id, &admitted.route);
        let action = decide(view(&admitted), instance_view(inst, &policy, slot), ledger);
        let place = matches!(action, Action::Record | Action::Run | Action::Answer(_)).then(|| {
            let admission = runs.admit(&admitted.event_id, &admitted.route);
            Place {
                run_id: run::new_run_id(hub),
                reserved: admission == Admission::Reserved,
                entry: None,
            }
        });
        (action, place)
    };
    match (action, place) {
        (Action::Record, Some(place)) => {
            // Queued on the reader, so the ledger records a driver's frames in the order it
            // sent them (an earlier receipt's history entry before this message's). The
            // commit is waited for off the reader, so the frames behind this one are read
            // (and group-committed together) meanwhile.
            let Some(queued) = queue_record(hub, inst, conn, &admitted, &place).await else {
                return;
            };
            let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
            // Boxed, as a run's task is (`run::starter`): tokio copies a task's whole state
            // when it spawns it and when it finishes, and this one would be 2.2 KB.
            hub.clone().runs.spawn(async move {
                Box::pin(recorded(&hub, &inst, &conn, admitted, place, queued)).await;
            });
        }
        (action, place) => carry_out(hub, inst, conn, admitted, action, place, None).await,
    }
}

/// Gives up the queue place of an inbound that will not run.
fn leave_queue(inst: &Instance, event_id: &Id) {
    let starts = lock(&inst.runs).cancel(event_id);
    start(starts);
}

/// Queues the inbound's record on the ledger. `None` when it cannot be recorded (refused
/// and out of the queue already).
async fn queue_record(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: &Admitted,
    place: &Place,
) -> Option<Pending<(Recorded, Synced)>> {
    let event_id = &admitted.event_id;
    // Read here, not as the inbound takes its place: only a recorded inbound has a time.
    let received_ms = crate::clock::now_ms();
    let frame = admitted.frame();
    let (line, hash) = match (encode(&frame), fingerprint::fingerprint(&frame)) {
        (Ok(line), Some(hash)) => (line, hash),
        (Err(err), _) => {
            inst.metrics.inbound(InboundOutcome::Error);
            leave_queue(inst, event_id);
            refuse(conn, event_id, "invalid_frame", err.to_string(), false).await;
            return None;
        }
        (Ok(_), None) => {
            inst.metrics.inbound(InboundOutcome::Error);
            leave_queue(inst, event_id);
            refuse(conn, event_id, "invalid_frame", "not an inbound frame".into(), false).await;
            return None;
        }
    };
    let new = NewInbound {
        instance: inst.config.id.to_string(),
        event_id: event_id.to_string(),
        content_hash: hash,
        hash_version: fingerprint::FINGERPRINT_VERSION,
        frame: line[..line.len() - 1].to_vec(),
        run_id: place.run_id.clone(),
        started: place.reserved,
        now_ms: received_ms,
        item: Some(NewItem::new(
            &admitted.origin,
            admitted.reply_to.as_ref(),
            admitted.sender.as_ref(),
        )),
    };
    let history = history_entry(inst, admitted, received_ms).zip(inst.policy().history);
    Some(hub.ledger.record_inbound(new, fingerprint::rehash, history).await)
}

/// Takes the ledger's answer to the inbound's record and carries out the second decision.
async fn recorded(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Box<Admitted>,
    mut place: Place,
    queued: Pending<(Recorded, Synced)>,
) {
    let event_id = admitted.event_id.clone();
    let (recorded, synced) = match queued.answer().await {
        Ok((recorded @ Recorded::New { .. }, synced)) => (Ok(recorded), Some(synced)),
        // Only a new record's run starts before its sync; any other answer waits for the
        // disk (a replay's entry may be the unsynced record of a copy sent just before).
        Ok((recorded, synced)) => (synced.wait().await.map(|()| recorded), None),
        Err(err) => (Err(err), None),
    };
    let lookup = match &recorded {
        Ok(Recorded::New { entry }) => {
            place.entry = *entry;
            Lookup::New
        }
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
    carry_out(hub, inst, conn, admitted, action, Some(place), synced).await;
}

/// The history entry of an admitted message (events are not part of the history).
fn history_entry(inst: &Instance, admitted: &Admitted, received_ms: u64) -> Option<NewHistory> {
    let RunInput::Message { message } = &admitted.input else { return None };
    Some(NewHistory::user(
        inst.config.id.as_str(),
        admitted.event_id.as_str(),
        message,
        received_ms,
    ))
}

/// Carries out a decision. An inbound with a queue `place` (`Record`, `Run`, `Answer`, and
/// after the ledger answered) either becomes ready to run or leaves the queue. With
/// `synced` (a new record, not yet on the disk) a run may start at once, but `accepted`
/// waits for the sync, and the run's frames for `accepted` ([`run::Gate`]).
async fn carry_out(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Box<Admitted>,
    action: Action,
    place: Option<Place>,
    synced: Option<Synced>,
) {
    let event_id = &admitted.event_id;
    if place.is_some() && !matches!(action, Action::Record | Action::Answer(_) | Action::Run) {
        leave_queue(inst, event_id);
    }
    match action {
        Action::WrongChannel => {
            inst.metrics.inbound(InboundOutcome::Error);
            let text = format!(
                "target channel {} does not match instance {}",
                admitted.origin.channel, inst.config.id
            );
            refuse(conn, event_id, "invalid_target", text, false).await;
        }
        Action::Deny { notice } => deny(inst, conn, &admitted, notice).await,
        Action::Busy { max } => {
            Counters::bump(&inst.counters.busy);
            let text = format!("{max} inbound messages already wait their turn");
            inst.metrics.inbound(InboundOutcome::Busy);
            refuse(conn, event_id, "busy", text, true).await;
        }
        Action::InFlight => {
            // The run is queued or in progress; its reply will come.
            inst.metrics.inbound(InboundOutcome::Duplicate);
            if conn.declaration.extensions.accepted {
                accept(conn, event_id, true).await;
            } else {
                let text = "a run for this event is already in flight".to_owned();
                refuse(conn, event_id, "duplicate", text, false).await;
            }
        }
        Action::Record => {
            let place = place.expect("a recorded inbound has its place");
            let Some(queued) = queue_record(hub, inst, conn, &admitted, &place).await else {
                return;
            };
            Box::pin(recorded(hub, inst, conn, admitted, place, queued)).await;
        }
        Action::Replay(replay) => {
            inst.metrics.inbound(InboundOutcome::Duplicate);
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
            inst.metrics.inbound(InboundOutcome::Conflict);
            let text = "this event id was already used for different content".to_owned();
            refuse(conn, event_id, "conflict", text, false).await;
        }
        Action::Unrecorded => {
            inst.metrics.inbound(InboundOutcome::Error);
            // Retryable either way: the driver keeps the message and sends it again.
            if hub.ledger.storage_full() {
                let text = "the hub's storage is full; try again later".to_owned();
                refuse(conn, event_id, "storage_full", text, true).await;
            } else {
                let text = "the hub could not record this message".to_owned();
                refuse(conn, event_id, "ledger_unavailable", text, true).await;
            }
        }
        Action::Answer(_) | Action::Run => {
            inst.metrics.inbound(InboundOutcome::Accepted);
            let place = place.expect("a run has its queue place");
            let (gate, opener) = match &synced {
                Some(_) => {
                    let (gate, opener) = run::Gate::shut(conn.clone());
                    (gate, Some(opener))
                }
                None => {
                    accept(conn, event_id, false).await;
                    (run::Gate::open(), None)
                }
            };
            let work = match action {
                Action::Answer(command) => Work::Hub(command),
                _ => Work::Runtime,
            };
            let event_id = event_id.clone();
            let queued = Queued {
                cancel: lock(&inst.cancels).register(&event_id),
                origin: Some(conn.clone()),
                admitted,
                run_id: place.run_id,
                entry: place.entry,
                redelivered: false,
                work,
                // A run that waited was recorded with no attempt: count it when it starts.
                count_start: hub.ledger.is_on() && !place.reserved,
                gate,
            };
            let starts = lock(&inst.runs).ready(&event_id, run::starter(hub, inst, queued));
            start(starts);
            if let Some(synced) = synced {
                told(inst, conn, &event_id, synced).await;
            }
            drop(opener);
        }
    }
}

/// Tells the driver of a new inbound whose run may have started: `accepted` once its record
/// is on the disk. If the sync failed (a failing disk), the driver is told to send it again,
/// retryable, though the record is committed and the run goes on: the copy sent again is
/// answered from that run, as any redelivery is.
async fn told(inst: &Instance, conn: &Connection, event_id: &Id, synced: Synced) {
    match synced.wait().await {
        Ok(()) => accept(conn, event_id, false).await,
        Err(err) => {
            inst.record_error(format!("ledger: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "inbound record not synced; the driver will retry");
            let text = "the hub could not make this message durable".to_owned();
            refuse(conn, event_id, "ledger_unavailable", text, true).await;
        }
    }
}

/// A sender off the allowlist: counted, logged, told so on the platform when a deny notice
/// is configured (once per sender per `deny_notice_interval_secs`), and refused
/// `sender_denied`.
async fn deny(inst: &Instance, conn: &Connection, admitted: &Admitted, notice: bool) {
    let event_id = &admitted.event_id;
    Counters::bump(&inst.counters.denied);
    inst.metrics.inbound(InboundOutcome::Denied);
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
