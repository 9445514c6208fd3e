//! The inbound path: authorise the sender, answer hub commands (`/help`, `/new`), admit the
//! run under the in-flight limit, tell the driver it was accepted, run the runtime and deliver
//! its reply on the connection that carried the inbound.

use std::sync::Arc;

use channeld_protocol::ext::EffectGate;
use channeld_protocol::frame::{
    Accepted, Delivery, EffectFrame, ErrorFrame, Inbound, InboundEventFrame, Receipt,
};
use channeld_protocol::types::{
    Command, Effect, MessageBody, MessageTarget, OutboundMessage, Participant,
};
use channeld_protocol::{Frame, Id, MAX_LINE_BYTES};
use tracing::{debug, info, warn};

use crate::conn::receipt_counted;
use crate::hub::Hub;
use crate::inflight::Admission;
use crate::instance::{Connection, Counters, Instance, ReceiptOutcome};
use crate::route::RouteKey;
use crate::runtime::{self, CommandAnswer, RunInput, RunIo, RunOutput, RunRequest};

/// Replies are cut to this many bytes so the `deliver` frame fits in one line.
pub const MAX_REPLY_BYTES: usize = MAX_LINE_BYTES - 16 * 1024;

/// The text of `/help`.
pub const HELP_TEXT: &str = "Commands: /help shows this text; /new starts a new conversation \
session. Anything else goes to the agent.";

pub(crate) async fn on_inbound(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    inbound: Inbound,
) {
    Counters::bump(&inst.counters.inbound);
    let Inbound { event_id, message } = inbound;
    if message.target.channel != inst.config.id {
        let text = format!(
            "target channel {} does not match instance {}",
            message.target.channel, inst.config.id
        );
        refuse(conn, &event_id, "invalid_target", text, false);
        return;
    }
    let sender = message.sender.clone();
    if !authorised(inst, conn, &event_id, Some(&sender)) {
        return;
    }
    let route = RouteKey::new(&message.target, sender.id.as_str(), inst.config.identity_isolation);
    let route_id = route.session_id(0);
    if let Some(reply) = hub_command(inst, message.body.text_str(), &route_id) {
        accept(conn, &event_id);
        let target = reply_target(&message.target, Some(message.id.clone()));
        deliver(inst, conn, &event_id, target, reply).await;
        return;
    }
    if !admit(inst, conn, &event_id) {
        return;
    }
    accept(conn, &event_id);
    let session = route.session_id(inst.generation(&route_id));
    let target = reply_target(&message.target, Some(message.id.clone()));
    let request = RunRequest {
        instance: inst.config.id.clone(),
        run_id: format!("run-{}", hub.request_id("r")),
        session,
        event_id: event_id.clone(),
        sender: Some(sender),
        input: RunInput::Message { message },
        capabilities: conn.declaration.capabilities,
        actions: conn.declaration.actions,
        redelivered: false,
        control_socket: hub.config.control_socket.clone(),
    };
    spawn_run(hub, inst, conn, request, target);
}

pub(crate) async fn on_inbound_event(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    frame: InboundEventFrame,
) {
    Counters::bump(&inst.counters.inbound);
    let InboundEventFrame { event_id, event } = frame;
    let context = event.context().clone();
    if context.target.channel != inst.config.id {
        let text = format!(
            "target channel {} does not match instance {}",
            context.target.channel, inst.config.id
        );
        refuse(conn, &event_id, "invalid_target", text, false);
        return;
    }
    // An event without a verified actor is denied: nobody else may stand in for it.
    if !authorised(inst, conn, &event_id, context.participant.as_ref()) {
        return;
    }
    if !admit(inst, conn, &event_id) {
        return;
    }
    accept(conn, &event_id);
    let actor = context.participant.clone();
    let route = RouteKey::new(
        &context.target,
        actor.as_ref().map_or("", |p| p.id.as_str()),
        inst.config.identity_isolation,
    );
    let route_id = route.session_id(0);
    let request = RunRequest {
        instance: inst.config.id.clone(),
        run_id: format!("run-{}", hub.request_id("r")),
        session: route.session_id(inst.generation(&route_id)),
        event_id: event_id.clone(),
        sender: actor,
        input: RunInput::Event { event },
        capabilities: conn.declaration.capabilities,
        actions: conn.declaration.actions,
        redelivered: false,
        control_socket: hub.config.control_socket.clone(),
    };
    spawn_run(hub, inst, conn, request, reply_target(&context.target, None));
}

pub(crate) fn on_receipt(
    _hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    receipt: Receipt,
) {
    let Receipt { request_id, receipt } = receipt;
    if !receipt_counted(inst, conn, &request_id, ReceiptOutcome::Receipted(receipt)) {
        debug!(instance = %inst.config.id, %request_id, "receipt nobody waits for");
    }
}

pub(crate) fn on_error(
    _hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    err: ErrorFrame,
) {
    if conn.fail_receipt(&err) {
        return;
    }
    inst.record_error(format!("{}: {}", err.code, err.message));
    warn!(
        instance = %inst.config.id,
        request_id = ?err.request_id.as_ref().map(Id::as_str),
        code = %err.code,
        message = %err.message,
        "error from driver"
    );
}

fn authorised(
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    sender: Option<&Participant>,
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
        refuse(
            conn,
            event_id,
            "sender_denied",
            "sender is not allowed on this channel".into(),
            false,
        );
    }
    permitted
}

fn admit(inst: &Instance, conn: &Connection, event_id: &Id) -> bool {
    let admission = crate::instance::lock(&conn.inflight).admit(event_id);
    match admission {
        Admission::Admitted => true,
        Admission::Busy { max } => {
            Counters::bump(&inst.counters.busy);
            refuse(conn, event_id, "busy", format!("{max} inbound runs already in flight"), true);
            false
        }
        Admission::Duplicate => {
            refuse(
                conn,
                event_id,
                "duplicate",
                "a run for this event is already in flight".into(),
                false,
            );
            false
        }
    }
}

fn refuse(conn: &Connection, event_id: &Id, code: &str, message: String, retryable: bool) {
    let _ = conn.sink.try_send(&Frame::error(Some(event_id.clone()), code, message, retryable));
}

fn accept(conn: &Connection, event_id: &Id) {
    if conn.declaration.extensions.accepted {
        let _ = conn
            .sink
            .try_send(&Frame::Accepted(Accepted { event_id: event_id.clone(), duplicate: false }));
    }
}

/// `/help` and `/new` are answered by the hub; anything else is for the runtime.
fn hub_command(inst: &Instance, text: &str, route_id: &str) -> Option<String> {
    match text.trim() {
        "/help" => Some(HELP_TEXT.to_owned()),
        "/new" => {
            let generation = inst.bump_generation(route_id);
            info!(instance = %inst.config.id, generation, "new session started by /new");
            Some("Started a new session.".to_owned())
        }
        _ => None,
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

fn spawn_run(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    request: RunRequest,
    target: MessageTarget,
) {
    let hub = hub.clone();
    let inst = inst.clone();
    let conn = conn.clone();
    hub.clone().runs.spawn(async move {
        let io = ConnectionIo { hub: hub.clone(), conn: conn.clone(), session: request.session.clone(), target: target.clone() };
        let result = runtime::run(&inst.runtime, &request, &io).await;
        let event_id = request.event_id.clone();
        match result {
            Ok(RunOutput { reply: Some(text) }) => deliver(&inst, &conn, &event_id, target, text).await,
            Ok(RunOutput { reply: None }) => debug!(instance = %inst.config.id, %event_id, "run finished without a reply"),
            Err(err) => {
                Counters::bump(&inst.counters.runs_failed);
                inst.record_error(format!("run {}: {err}", request.run_id));
                warn!(instance = %inst.config.id, %event_id, run_id = %request.run_id, error = %err, "run failed");
                let message = match &err {
                    runtime::RunError::Failed { status, .. } => format!("agent exited with {status}"),
                    other => other.to_string(),
                };
                refuse(&conn, &event_id, err.code(), message, false);
            }
        }
        crate::instance::lock(&conn.inflight).finish(&event_id);
    });
}

/// Sends the reply for `event_id` on the originating connection.
async fn deliver(
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    text: String,
) {
    let text = fit_reply(text);
    let body = match MessageBody::text(text) {
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
        Ok(()) => Counters::bump(&inst.counters.replies),
        Err(err) => {
            inst.record_error(format!("reply for {event_id} not delivered: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply not delivered: driver connection gone");
        }
    }
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

/// A run's live channel back to the connection that carried its inbound.
struct ConnectionIo {
    hub: Arc<Hub>,
    conn: Arc<Connection>,
    session: String,
    target: MessageTarget,
}

impl RunIo for ConnectionIo {
    fn effect(&self, effect: Effect) {
        match self.conn.declaration.effect_gate(&effect) {
            EffectGate::Send => {
                let frame = Frame::Effect(EffectFrame {
                    request_id: self.hub.request_id("fx"),
                    target: MessageTarget { reply_to: None, ..self.target.clone() },
                    effect,
                });
                // Live progress: a full queue drops it rather than stall the run.
                let _ = self.conn.sink.try_send(&frame);
            }
            EffectGate::Drop => {}
            EffectGate::Reject(reason) => debug!(%reason, "effect from the agent not sent"),
        }
    }

    async fn command(&self, command_id: Id, command: Command) -> CommandAnswer {
        let Ok(session) = Id::new(self.session.clone()) else {
            return CommandAnswer::rejected("invalid session");
        };
        let target = Some(MessageTarget { reply_to: None, ..self.target.clone() });
        let timeout = self.hub.config.command_timeout;
        match self.hub.command(&self.conn, session, command_id, command, target, timeout).await {
            Ok(answer) => answer,
            Err(err) => CommandAnswer::rejected(err.to_string()),
        }
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
