//! Runs: what a run needs about its inbound, starting it (the runtime, or the hub itself for
//! `/help` and `/new`) as a tracked task, recording how it ended, and handing its reply or
//! error back. While it runs, its effects and commands go to the connection that carried the
//! inbound.

use std::sync::Arc;
use std::time::SystemTime;

use channeld_protocol::ext::EffectGate;
use channeld_protocol::frame::{EffectFrame, Inbound, InboundEventFrame};
use channeld_protocol::types::{Command, Effect, MessageTarget, Participant};
use channeld_protocol::{Frame, Id};
use tracing::{debug, info, warn};

use super::decide::SlashCommand;
use super::reply::{self, refuse, reply_target};
use crate::command::{self, Presented};
use crate::connection::{Connection, PeerKind, lock};
use crate::hub::Hub;
use crate::instance::{Counters, Instance, unix_ms};
use crate::ledger::RunEnd;
use crate::route::RouteKey;
use crate::runtime::{self, CommandAnswer, RunError, RunInput, RunIo, RunOutput, RunRequest};

/// The text of `/help`.
pub const HELP_TEXT: &str = "Commands: /help shows this text; /new starts a new conversation \
session. Anything else goes to the agent.";

/// What a run needs about one inbound, whichever frame carried it.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub event_id: Id,
    /// The frame as received (recorded in the ledger to run it again after a crash).
    pub frame: Frame,
    pub input: RunInput,
    pub sender: Option<Participant>,
    pub origin: MessageTarget,
    pub reply_to: Option<Id>,
    pub route: RouteKey,
}

impl Admitted {
    pub fn message(inbound: Inbound, identity_isolation: bool) -> Self {
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

    pub fn event(frame: InboundEventFrame, identity_isolation: bool) -> Self {
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

    /// The text of a message; `None` for an event.
    pub fn text(&self) -> Option<&str> {
        match &self.input {
            RunInput::Message { message } => Some(message.body.text_str()),
            RunInput::Event { .. } => None,
        }
    }

    pub fn reply_target(&self) -> MessageTarget {
        reply_target(&self.origin, self.reply_to.clone())
    }
}

/// Who answers a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    Runtime,
    Hub(SlashCommand),
}

/// A fresh run id (kept across a crash retry: the ledger stores it).
pub fn new_run_id(hub: &Hub) -> String {
    format!("run-{}", hub.ids.request("r"))
}

fn request(
    hub: &Hub,
    inst: &Instance,
    admitted: &Admitted,
    run_id: String,
    conn: Option<&Arc<Connection>>,
    redelivered: bool,
) -> RunRequest {
    let route_id = admitted.route.session_id(0);
    let declaration = conn.map(|c| c.declaration).or_else(|| inst.live().map(|c| c.declaration));
    let (capabilities, actions) =
        declaration.map(|d| (d.capabilities, d.actions)).unwrap_or_default();
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

/// Starts a run as a tracked task (drained at shutdown). `origin` is the connection that
/// carried the inbound (`None` for a run started again after a crash), and holds its
/// in-flight slot until the outcome is recorded.
pub fn spawn(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    origin: Option<Arc<Connection>>,
    admitted: &Admitted,
    run_id: String,
    redelivered: bool,
    work: Work,
) {
    let request = request(hub, inst, admitted, run_id, origin.as_ref(), redelivered);
    let target = admitted.reply_target();
    let route = admitted.route.clone();
    let (hub, inst) = (hub.clone(), inst.clone());
    hub.clone().runs.spawn(async move {
        let event_id = request.event_id.clone();
        let result = match work {
            Work::Hub(command) => Ok(RunOutput { reply: Some(answer(&hub, &inst, command, &route).await) }),
            Work::Runtime => {
                let io = ConnectionIo {
                    hub: hub.clone(),
                    inst: inst.clone(),
                    conn: origin.clone(),
                    session: request.session.clone(),
                    target: target.clone(),
                };
                // The runtime as configured when the run starts: a reload does not change it.
                let policy = inst.policy();
                runtime::run(&policy.runtime, &request, &io).await
            }
        };
        // Every run ends with exactly one `deliver` or `error`: no reply is an error too.
        let result = result.and_then(|output| {
            output
                .reply
                .map(|text| reply::fit_reply(&event_id, &target, text))
                .filter(|text| !text.trim().is_empty())
                .ok_or(RunError::EmptyReply)
        });
        let end = match &result {
            Ok(text) => RunEnd::Reply(text.clone()),
            Err(err) => RunEnd::Failed { code: err.code().to_owned(), message: public_message(err) },
        };
        // A driver's reply is recorded with the outcome, and the courier delivers it (and
        // retries it); a legacy peer's goes back on its connection, once.
        let tracked = origin.as_ref().is_none_or(|c| c.kind == PeerKind::Driver);
        let reply = match &result {
            Ok(text) if tracked => reply::new_reply(&hub, &inst, &event_id, &target, text),
            _ => None,
        };
        let mut recorded = false;
        if hub.ledger.is_on() {
            let now = unix_ms(SystemTime::now());
            let with_reply = reply.is_some();
            let finished = hub.ledger.finish_run(inst.config.id.to_string(), event_id.to_string(), end.clone(), reply, now).await;
            match finished {
                Ok(done) => recorded = done && with_reply,
                Err(err) => {
                    inst.record_error(format!("ledger: {err}"));
                    warn!(instance = %inst.config.id, %event_id, error = %err, "run outcome not recorded");
                }
            }
        }
        // The outcome is recorded: a redelivery from now on replays it instead of waiting for
        // this run, so the slot is free before the reply goes out.
        if let Some(origin) = &origin {
            lock(&origin.inflight).finish(&event_id);
        }
        // An untracked reply goes back on the connection that carried the inbound, or, if
        // that one is gone, on the instance's current driver.
        let conn = origin.clone().filter(|c| !c.closed.is_cancelled()).or_else(|| inst.live());
        match (result, conn) {
            (Ok(_), _) if recorded => hub.courier.deliver(&inst).await,
            (Ok(text), Some(conn)) => {
                reply::deliver(&inst, &conn, &event_id, target, text).await;
            }
            (Ok(_), None) => {
                warn!(instance = %inst.config.id, %event_id, "no driver connected and the reply is not recorded; it is lost");
            }
            (Err(err), conn) => {
                Counters::bump(&inst.counters.runs_failed);
                inst.record_error(format!("run {}: {err}", request.run_id));
                warn!(instance = %inst.config.id, %event_id, run_id = %request.run_id, error = %err, "run failed");
                if let Some(conn) = conn {
                    refuse(&conn, &event_id, err.code(), public_message(&err), false).await;
                }
            }
        }
    });
}

/// The hub's own answer to `/help` and `/new`.
async fn answer(hub: &Hub, inst: &Instance, command: SlashCommand, route: &RouteKey) -> String {
    match command {
        SlashCommand::Help => HELP_TEXT.to_owned(),
        SlashCommand::NewSession => {
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
                        return "Could not start a new session; try again.".to_owned();
                    }
                }
            } else {
                inst.bump_generation(&route_id)
            };
            info!(instance = %inst.config.id, generation, "new session started by /new");
            "Started a new session.".to_owned()
        }
    }
}

/// What the driver (and so possibly the platform) is told about a failed run: no stderr.
fn public_message(err: &RunError) -> String {
    match err {
        RunError::Failed { status, .. } => format!("agent exited with {status}"),
        other => other.to_string(),
    }
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
                    request_id: self.hub.ids.request("fx"),
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
        let presented = Presented {
            request_id: self.hub.ids.request("cmd"),
            session,
            command_id,
            command,
            target: Some(MessageTarget { reply_to: None, ..self.target.clone() }),
        };
        match command::present(conn, presented, self.hub.config.command_timeout).await {
            // Vetted against the allowlist as it is when the answer comes.
            Ok(answer) => command::vet_answer(
                &self.inst.config.id,
                &self.inst.policy().allow,
                conn.declaration.extensions.responder,
                answer,
            ),
            Err(err) => CommandAnswer::rejected(err.to_string()),
        }
    }
}
