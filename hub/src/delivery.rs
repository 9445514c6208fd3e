//! The inbound path: authorise the sender, admit the run under the in-flight limit, record it
//! in the ledger, tell the driver it was accepted, run the runtime (or answer `/help` and
//! `/new`), record the outcome and deliver the reply.
//!
//! With the ledger on, an event id is run at most once: a redelivery with the same content
//! replays the stored reply (or waits for the run in progress), different content is a
//! `conflict`, and a run cut off by a crash is started again once, flagged `redelivered`.

use std::sync::Arc;
use std::time::SystemTime;

use channeld_protocol::ext::EffectGate;
use channeld_protocol::frame::{
    Accepted, Delivery, EffectFrame, ErrorFrame, Inbound, InboundEventFrame, Receipt,
};
use channeld_protocol::types::{
    Command, Effect, MessageBody, MessageTarget, OutboundMessage, Participant,
};
use channeld_protocol::{Frame, Id, MAX_LINE_BYTES, encode};
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use crate::conn::receipt_counted;
use crate::hub::Hub;
use crate::inflight::Admission;
use crate::instance::{Connection, Counters, Instance, ReceiptOutcome, lock, unix_ms};
use crate::ledger::{InboundState, NewInbound, Recorded, RunEnd, StoredRun};
use crate::route::RouteKey;
use crate::runtime::{self, CommandAnswer, RunInput, RunIo, RunOutput, RunRequest};

/// Replies are cut to this many bytes so the `deliver` frame fits in one line.
pub const MAX_REPLY_BYTES: usize = MAX_LINE_BYTES - 16 * 1024;

/// The text of `/help`.
pub const HELP_TEXT: &str = "Commands: /help shows this text; /new starts a new conversation \
session. Anything else goes to the agent.";

fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// What the runtime needs about one inbound, whichever frame carried it.
struct Admitted {
    event_id: Id,
    frame: Frame,
    input: RunInput,
    sender: Option<Participant>,
    origin: MessageTarget,
    reply_to: Option<Id>,
    route: RouteKey,
}

impl Admitted {
    fn message(inbound: Inbound, identity_isolation: bool) -> Self {
        let message = &inbound.message;
        Self {
            event_id: inbound.event_id.clone(),
            origin: message.target.clone(),
            reply_to: Some(message.id.clone()),
            route: RouteKey::new(&message.target, message.sender.id.as_str(), identity_isolation),
            sender: Some(message.sender.clone()),
            input: RunInput::Message { message: inbound.message.clone() },
            frame: Frame::Inbound(inbound),
        }
    }

    fn event(frame: InboundEventFrame, identity_isolation: bool) -> Self {
        let context = frame.event.context();
        let actor = context.participant.clone();
        Self {
            event_id: frame.event_id.clone(),
            origin: context.target.clone(),
            reply_to: None,
            route: RouteKey::new(
                &context.target,
                actor.as_ref().map_or("", |p| p.id.as_str()),
                identity_isolation,
            ),
            sender: actor,
            input: RunInput::Event { event: frame.event.clone() },
            frame: Frame::InboundEvent(frame),
        }
    }

    fn reply_target(&self) -> MessageTarget {
        reply_target(&self.origin, self.reply_to.clone())
    }
}

pub(crate) async fn on_inbound(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    inbound: Inbound,
) {
    Counters::bump(&inst.counters.inbound);
    let message = &inbound.message;
    if message.target.channel != inst.config.id {
        let text = format!(
            "target channel {} does not match instance {}",
            message.target.channel, inst.config.id
        );
        refuse(conn, &inbound.event_id, "invalid_target", text, false).await;
        return;
    }
    if !authorised(inst, conn, &inbound.event_id, Some(&message.sender), Some(&message.target))
        .await
    {
        return;
    }
    let admitted = Admitted::message(inbound, inst.config.identity_isolation);
    admit_and_run(hub, inst, conn, admitted).await;
}

pub(crate) async fn on_inbound_event(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    frame: InboundEventFrame,
) {
    Counters::bump(&inst.counters.inbound);
    let context = frame.event.context().clone();
    if context.target.channel != inst.config.id {
        let text = format!(
            "target channel {} does not match instance {}",
            context.target.channel, inst.config.id
        );
        refuse(conn, &frame.event_id, "invalid_target", text, false).await;
        return;
    }
    // An event without a verified actor is denied: nobody else may stand in for it.
    if !authorised(inst, conn, &frame.event_id, context.participant.as_ref(), None).await {
        return;
    }
    let admitted = Admitted::event(frame, inst.config.identity_isolation);
    admit_and_run(hub, inst, conn, admitted).await;
}

async fn admit_and_run(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Admitted,
) {
    let event_id = admitted.event_id.clone();
    let admission = lock(&conn.inflight).admit(&event_id);
    match admission {
        Admission::Admitted => {}
        Admission::Busy { max } => {
            Counters::bump(&inst.counters.busy);
            refuse(conn, &event_id, "busy", format!("{max} inbound runs already in flight"), true)
                .await;
            return;
        }
        Admission::Duplicate => {
            // The run is in progress on this connection; its reply will come.
            if conn.declaration.extensions.accepted {
                accept(conn, &event_id, true).await;
            } else {
                refuse(
                    conn,
                    &event_id,
                    "duplicate",
                    "a run for this event is already in flight".into(),
                    false,
                )
                .await;
            }
            return;
        }
    }
    let run_id = format!("run-{}", hub.request_id("r"));
    if hub.ledger.is_on() {
        // Recording waits for a commit: do it off the reader, so the frames behind this one
        // are read (and group-committed together) meanwhile.
        let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
        hub.clone().runs.spawn(async move {
            record_and_run(&hub, &inst, &conn, admitted, event_id, run_id).await;
        });
        return;
    }
    record_and_run(hub, inst, conn, admitted, event_id, run_id).await;
}

/// Records the inbound in the ledger (when it is on), tells the driver, starts the run.
async fn record_and_run(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: Admitted,
    event_id: Id,
    run_id: String,
) {
    if hub.ledger.is_on() {
        let encoded = match encode(&admitted.frame) {
            Ok(line) => line,
            Err(err) => {
                lock(&conn.inflight).finish(&event_id);
                refuse(conn, &event_id, "invalid_frame", err.to_string(), false).await;
                return;
            }
        };
        let body = &encoded[..encoded.len() - 1];
        let record = NewInbound {
            instance: inst.config.id.to_string(),
            event_id: event_id.to_string(),
            content_hash: fingerprint(&admitted.frame),
            frame: body.to_vec(),
            run_id: run_id.clone(),
            now_ms: now_ms(),
        };
        match hub.ledger.record_inbound(record).await {
            Ok(Recorded::New) => {}
            Ok(Recorded::Replay(stored)) => {
                lock(&conn.inflight).finish(&event_id);
                accept(conn, &event_id, true).await;
                replay(hub, inst, conn, &admitted, stored).await;
                return;
            }
            Ok(Recorded::Conflict) => {
                lock(&conn.inflight).finish(&event_id);
                refuse(
                    conn,
                    &event_id,
                    "conflict",
                    "this event id was already used for different content".into(),
                    false,
                )
                .await;
                return;
            }
            Err(err) => {
                lock(&conn.inflight).finish(&event_id);
                inst.record_error(format!("ledger: {err}"));
                warn!(instance = %inst.config.id, %event_id, error = %err, "inbound not recorded; the driver will retry");
                refuse(
                    conn,
                    &event_id,
                    "ledger_unavailable",
                    "the hub could not record this message".into(),
                    true,
                )
                .await;
                return;
            }
        }
    }
    accept(conn, &event_id, false).await;
    let request = run_request(hub, inst, &admitted, run_id, Some(conn), false);
    let target = admitted.reply_target();
    spawn_run(hub, inst, Some(conn.clone()), request, target, admitted.route);
}

/// A redelivered event that already has an entry: never run again.
async fn replay(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    admitted: &Admitted,
    stored: StoredRun,
) {
    debug!(instance = %inst.config.id, event_id = %admitted.event_id, state = %stored.state, "redelivered event; replaying");
    match stored.state {
        // The run is in progress; its reply goes to the instance's live driver when it ends.
        InboundState::Running => {}
        InboundState::Replied | InboundState::Delivered => {
            if let Some(reply) = stored.reply {
                deliver(hub, inst, conn, &admitted.event_id, admitted.reply_target(), reply).await;
            }
        }
        InboundState::Failed => {
            let (code, message) =
                stored.error.unwrap_or_else(|| ("agent_failed".into(), "the run failed".into()));
            refuse(conn, &admitted.event_id, &code, message, false).await;
        }
    }
}

fn run_request(
    hub: &Hub,
    inst: &Instance,
    admitted: &Admitted,
    run_id: String,
    conn: Option<&Arc<Connection>>,
    redelivered: bool,
) -> RunRequest {
    let route_id = admitted.route.session_id(0);
    let (capabilities, actions) = conn.map_or_else(
        || {
            inst.live()
                .map(|c| (c.declaration.capabilities, c.declaration.actions))
                .unwrap_or_default()
        },
        |c| (c.declaration.capabilities, c.declaration.actions),
    );
    RunRequest {
        instance: inst.config.id.clone(),
        run_id,
        session: admitted.route.session_id(inst.generation(&route_id)),
        event_id: admitted.event_id.clone(),
        input: admitted.input.clone(),
        sender: admitted.sender.clone(),
        capabilities,
        actions,
        redelivered,
        control_socket: hub.config.control_socket.clone(),
    }
}

/// Starts again a message run that a crash interrupted.
pub(crate) fn rerun_message(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    inbound: Inbound,
    run_id: String,
) {
    rerun(hub, inst, Admitted::message(inbound, inst.config.identity_isolation), run_id);
}

/// Starts again an event run that a crash interrupted.
pub(crate) fn rerun_event(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    frame: InboundEventFrame,
    run_id: String,
) {
    rerun(hub, inst, Admitted::event(frame, inst.config.identity_isolation), run_id);
}

fn rerun(hub: &Arc<Hub>, inst: &Arc<Instance>, admitted: Admitted, run_id: String) {
    let request = run_request(hub, inst, &admitted, run_id, None, true);
    spawn_run(hub, inst, None, request, admitted.reply_target(), admitted.route);
}

pub(crate) fn on_receipt(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    receipt: Receipt,
) {
    let Receipt { request_id, receipt } = receipt;
    if receipt_counted(inst, conn, &request_id, ReceiptOutcome::Receipted(receipt)) {
        return;
    }
    // Extension `reply_receipt`: the receipt of a `deliver` carries the inbound's event id.
    if conn.declaration.extensions.reply_receipt && hub.ledger.is_on() {
        let hub = hub.clone();
        let instance = inst.config.id.to_string();
        tokio::spawn(async move {
            if let Err(err) =
                hub.ledger.mark_delivered(instance, request_id.into_string(), now_ms()).await
            {
                warn!(error = %err, "reply receipt not recorded");
            }
        });
        return;
    }
    debug!(instance = %inst.config.id, %request_id, "receipt nobody waits for");
}

pub(crate) fn on_error(
    _hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    err: ErrorFrame,
) {
    // Every error the driver reports is the instance's latest error in `channelctl status`,
    // whether it ends a send's wait or not.
    inst.record_error(format!("{}: {}", err.code, err.message));
    if conn.fail_receipt(&err) {
        return;
    }
    warn!(
        instance = %inst.config.id,
        request_id = ?err.request_id.as_ref().map(Id::as_str),
        code = %err.code,
        message = %err.message,
        "error from driver"
    );
}

/// A driver (re)connected: hand it the replies it missed and the sends queued for it.
pub(crate) fn driver_connected(hub: &Arc<Hub>, inst: &Arc<Instance>, conn: &Arc<Connection>) {
    if !hub.ledger.is_on() {
        return;
    }
    let hub = hub.clone();
    let inst = inst.clone();
    let conn = conn.clone();
    tokio::spawn(async move {
        match hub.ledger.pending_replies(inst.config.id.to_string()).await {
            Ok(pending) => {
                if !pending.is_empty() {
                    info!(instance = %inst.config.id, replies = pending.len(), "delivering replies the driver missed");
                }
                for reply in pending {
                    if inst.is_replying(&reply.event_id) {
                        continue;
                    }
                    let target = match channeld_protocol::decode(&reply.frame) {
                        Ok(Frame::Inbound(inbound)) => {
                            reply_target(&inbound.message.target, Some(inbound.message.id.clone()))
                        }
                        Ok(Frame::InboundEvent(event)) => {
                            reply_target(&event.event.context().target, None)
                        }
                        _ => continue,
                    };
                    let Ok(event_id) = Id::new(reply.event_id) else { continue };
                    deliver(&hub, &inst, &conn, &event_id, target, reply.reply).await;
                }
            }
            Err(err) => warn!(instance = %inst.config.id, error = %err, "pending replies not read"),
        }
        hub.dispatch_queued(&inst, &conn).await;
    });
}

async fn authorised(
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    sender: Option<&Participant>,
    reply_in: Option<&MessageTarget>,
) -> bool {
    let permitted = sender.is_some_and(|p| inst.config.allow.permits(p.id.as_str()));
    if !permitted {
        Counters::bump(&inst.counters.denied);
        info!(
            instance = %inst.config.id,
            %event_id,
            sender = sender.map_or("<none>", |p| p.id.as_str()),
            "sender not on the allowlist; denied"
        );
        if let (Some(notice), Some(target)) = (&inst.config.deny_notice, reply_in)
            && let Ok(body) = MessageBody::text(notice.clone())
        {
            let frame = Frame::Deliver(Delivery {
                request_id: event_id.clone(),
                message: OutboundMessage {
                    target: target.clone(),
                    body,
                    metadata: Default::default(),
                },
            });
            let _ = conn.sink.send(&frame).await;
        }
        refuse(
            conn,
            event_id,
            "sender_denied",
            "sender is not allowed on this channel".into(),
            false,
        )
        .await;
    }
    permitted
}

/// Answers an inbound with an `error` frame. It waits for room in the connection's queue:
/// the driver relies on this answer to settle the message.
async fn refuse(conn: &Connection, event_id: &Id, code: &str, message: String, retryable: bool) {
    let _ = conn.sink.send(&Frame::error(Some(event_id.clone()), code, message, retryable)).await;
}

/// Tells the driver the hub took responsibility (extension `accepted`). Like `refuse`, it
/// waits for room rather than drop the answer.
async fn accept(conn: &Connection, event_id: &Id, duplicate: bool) {
    if conn.declaration.extensions.accepted {
        let frame = Frame::Accepted(Accepted { event_id: event_id.clone(), duplicate });
        let _ = conn.sink.send(&frame).await;
    }
}

fn reply_target(origin: &MessageTarget, reply_to: Option<Id>) -> MessageTarget {
    MessageTarget {
        channel: origin.channel.clone(),
        conversation: origin.conversation.clone(),
        thread: origin.thread.clone(),
        reply_to,
    }
}

/// `/help` and `/new` are answered by the hub; anything else is for the runtime.
async fn hub_command(
    hub: &Hub,
    inst: &Instance,
    input: &RunInput,
    route: &RouteKey,
) -> Option<String> {
    let RunInput::Message { message } = input else { return None };
    match message.body.text_str().trim() {
        "/help" => Some(HELP_TEXT.to_owned()),
        "/new" => {
            let route_id = route.session_id(0);
            let generation = if hub.ledger.is_on() {
                match hub.ledger.bump_generation(inst.config.id.to_string(), route_id.clone()).await
                {
                    Ok(generation) => {
                        inst.set_generation(&route_id, generation);
                        generation
                    }
                    Err(err) => {
                        warn!(instance = %inst.config.id, error = %err, "new session not recorded");
                        return Some("Could not start a new session; try again.".to_owned());
                    }
                }
            } else {
                inst.bump_generation(&route_id)
            };
            info!(instance = %inst.config.id, generation, "new session started by /new");
            Some("Started a new session.".to_owned())
        }
        _ => None,
    }
}

fn spawn_run(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    origin: Option<Arc<Connection>>,
    request: RunRequest,
    target: MessageTarget,
    route: RouteKey,
) {
    let hub = hub.clone();
    let inst = inst.clone();
    hub.clone().runs.spawn(async move {
        let event_id = request.event_id.clone();
        let result = match hub_command(&hub, &inst, &request.input, &route).await {
            Some(text) => Ok(RunOutput { reply: Some(text) }),
            None => {
                let io = ConnectionIo {
                    hub: hub.clone(),
                    inst: inst.clone(),
                    conn: origin.clone(),
                    session: request.session.clone(),
                    target: target.clone(),
                };
                runtime::run(&inst.runtime, &request, &io).await
            }
        };
        let end = match &result {
            Ok(RunOutput { reply: Some(text) }) => RunEnd::Reply(fit_reply(text.clone())),
            Ok(RunOutput { reply: None }) => RunEnd::NoReply,
            Err(err) => RunEnd::Failed { code: err.code().to_owned(), message: public_message(err) },
        };
        // From the moment the outcome is recorded until the reply is handed over, the
        // reconnect sweep must not deliver it as well.
        inst.begin_reply(&event_id);
        if hub.ledger.is_on() {
            let recorded = hub.ledger.finish_run(inst.config.id.to_string(), event_id.to_string(), end.clone(), now_ms()).await;
            if let Err(err) = recorded {
                inst.record_error(format!("ledger: {err}"));
                warn!(instance = %inst.config.id, %event_id, error = %err, "run outcome not recorded");
            }
        }
        // The outcome is recorded: a redelivery from now on replays it instead of waiting for
        // this run, so the slot is free before the reply goes out.
        if let Some(origin) = &origin {
            lock(&origin.inflight).finish(&event_id);
        }
        // The reply goes back on the connection that carried the inbound, or, if that one is
        // gone, on the instance's current driver; with neither it waits in the ledger.
        let conn = origin.clone().filter(|c| !c.closed.is_cancelled()).or_else(|| inst.live());
        match (end, conn) {
            (RunEnd::Reply(text), Some(conn)) => {
                deliver(&hub, &inst, &conn, &event_id, target, text).await;
            }
            (RunEnd::Reply(_), None) => {
                debug!(instance = %inst.config.id, %event_id, "no driver connected; the reply waits for one");
            }
            (RunEnd::NoReply, _) => debug!(instance = %inst.config.id, %event_id, "run finished without a reply"),
            (RunEnd::Failed { code, message }, conn) => {
                Counters::bump(&inst.counters.runs_failed);
                let err = result.err().map(|e| e.to_string()).unwrap_or_default();
                inst.record_error(format!("run {}: {err}", request.run_id));
                warn!(instance = %inst.config.id, %event_id, run_id = %request.run_id, error = %err, "run failed");
                if let Some(conn) = conn {
                    refuse(&conn, &event_id, &code, message, false).await;
                }
            }
        }
        inst.end_reply(&event_id);
    });
}

/// What the driver (and so possibly the platform) is told about a failed run: no stderr.
fn public_message(err: &runtime::RunError) -> String {
    match err {
        runtime::RunError::Failed { status, .. } => format!("agent exited with {status}"),
        other => other.to_string(),
    }
}

/// Sends the reply for `event_id` on `conn` and records that it was handed over (or, with
/// `reply_receipt`, leaves that to the driver's receipt).
async fn deliver(
    hub: &Hub,
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    text: String,
) {
    let body = match MessageBody::text(fit_reply(text)) {
        Ok(body) => body,
        Err(err) => {
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply is not a valid body; dropped");
            return;
        }
    };
    let frame = Frame::Deliver(Delivery {
        request_id: event_id.clone(),
        message: OutboundMessage { target, body, metadata: Default::default() },
    });
    match conn.sink.send(&frame).await {
        Ok(()) => {
            Counters::bump(&inst.counters.replies);
            if hub.ledger.is_on()
                && !conn.declaration.extensions.reply_receipt
                && let Err(err) = hub
                    .ledger
                    .mark_delivered(inst.config.id.to_string(), event_id.to_string(), now_ms())
                    .await
            {
                warn!(instance = %inst.config.id, %event_id, error = %err, "delivery not recorded");
            }
        }
        Err(err) => {
            inst.record_error(format!("reply for {event_id} not delivered: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply not delivered: driver connection gone");
        }
    }
}

/// What makes two deliveries of an event id "the same content": the frame without the fields
/// a platform may legitimately change on redelivery (timestamps, metadata, display names).
fn fingerprint(frame: &Frame) -> [u8; 32] {
    let mut frame = frame.clone();
    let strip = |participant: &mut Participant| {
        participant.display_name = None;
        participant.handle = None;
    };
    match &mut frame {
        Frame::Inbound(inbound) => {
            inbound.message.timestamp_ms = None;
            inbound.message.metadata.clear();
            strip(&mut inbound.message.sender);
        }
        Frame::InboundEvent(event) => {
            let context = match &mut event.event {
                channeld_protocol::types::IncomingEvent::Reaction { context, .. }
                | channeld_protocol::types::IncomingEvent::Typing { context, .. }
                | channeld_protocol::types::IncomingEvent::MessageEdited { context, .. }
                | channeld_protocol::types::IncomingEvent::MessageDeleted { context, .. }
                | channeld_protocol::types::IncomingEvent::Read { context, .. } => context,
            };
            context.timestamp_ms = None;
            context.metadata.clear();
            if let Some(participant) = context.participant.as_mut() {
                strip(participant);
            }
        }
        _ => {}
    }
    Sha256::digest(encode(&frame).unwrap_or_default()).into()
}

/// Removes NULs and cuts an over-long reply at a character boundary, saying so.
fn fit_reply(mut text: String) -> String {
    if text.contains('\0') {
        text = text.replace('\0', "");
    }
    if text.len() <= MAX_REPLY_BYTES {
        return text;
    }
    let mut end = MAX_REPLY_BYTES - 32;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str("\n[reply truncated]");
    text
}

/// A run's live channel back to the connection that carried its inbound. A run started again
/// after a crash has none: its effects are dropped and its commands fail closed.
struct ConnectionIo {
    hub: Arc<Hub>,
    inst: Arc<Instance>,
    conn: Option<Arc<Connection>>,
    session: String,
    target: MessageTarget,
}

impl RunIo for ConnectionIo {
    fn effect(&self, effect: Effect) {
        let Some(conn) = &self.conn else { return };
        match conn.declaration.effect_gate(&effect) {
            EffectGate::Send => {
                let frame = Frame::Effect(EffectFrame {
                    request_id: self.hub.request_id("fx"),
                    target: MessageTarget { reply_to: None, ..self.target.clone() },
                    effect,
                });
                // Live progress: a full queue drops it rather than stall the run.
                let _ = conn.sink.try_send(&frame);
            }
            EffectGate::Drop => {}
            EffectGate::Reject(reason) => debug!(%reason, "effect from the agent not sent"),
        }
    }

    async fn command(&self, command_id: Id, command: Command) -> CommandAnswer {
        let Some(conn) = &self.conn else {
            return CommandAnswer::rejected("the connection that carried this message is gone");
        };
        let Ok(session) = Id::new(self.session.clone()) else {
            return CommandAnswer::rejected("invalid session");
        };
        let target = Some(MessageTarget { reply_to: None, ..self.target.clone() });
        let timeout = self.hub.config.command_timeout;
        let answer =
            match self.hub.command(conn, session, command_id, command, target, timeout).await {
                Ok(answer) => answer,
                Err(err) => return CommandAnswer::rejected(err.to_string()),
            };
        vet_answer(&self.inst, conn, answer)
    }
}

/// A command's answer counts only when an allowlisted participant gave it: an `accepted` or
/// `value` result is turned into a rejection unless the driver negotiated `responder` and
/// named someone the allowlist permits (with `allow_all`, anyone).
pub(crate) fn vet_answer(
    inst: &Instance,
    conn: &Connection,
    answer: CommandAnswer,
) -> CommandAnswer {
    if matches!(answer.result, channeld_protocol::types::CommandResult::Rejected { .. }) {
        return answer;
    }
    if matches!(inst.config.allow, crate::config::Allowlist::All) {
        return answer;
    }
    let responder = answer.responder.as_ref().filter(|_| conn.declaration.extensions.responder);
    match responder {
        Some(who) if inst.config.allow.permits(who.id.as_str()) => answer,
        Some(who) => {
            info!(instance = %inst.config.id, responder = %who.id, "command answered by someone not on the allowlist; rejected");
            CommandAnswer::rejected("answered by a participant who is not allowed")
        }
        None => CommandAnswer::rejected("the driver did not say who answered"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_replies_are_cut_to_fit_a_frame() {
        let text = "é".repeat(MAX_REPLY_BYTES);
        let fitted = fit_reply(text);
        assert!(fitted.len() <= MAX_REPLY_BYTES);
        assert!(fitted.ends_with("[reply truncated]"));
        assert_eq!(fit_reply("a\0b".into()), "ab");
    }
}
