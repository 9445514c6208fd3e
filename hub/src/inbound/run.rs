//! Runs: what a run needs about its inbound, starting it when the run queue says it is its
//! turn (the runtime, or the hub itself for `/help` and `/new`) as a tracked task, recording
//! how it ended, handing its reply or error back, and only then letting the next run of its
//! session start. While it runs, its effects and commands go to the connection that carried
//! the inbound.

use std::sync::Arc;
use std::time::Instant;

use std::sync::atomic::{AtomicU64, Ordering};

use channeld_protocol::ext::{EffectGate, STREAM_SEQ_KEY, StreamEnd, StreamFrame};
use channeld_protocol::frame::{EffectFrame, Inbound, InboundEventFrame};
use channeld_protocol::types::{Command, Effect, MessageTarget, Metadata, Participant};
use channeld_protocol::{Frame, Id};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::decide::SlashCommand;
use super::reply::{self, refuse, reply_target};
use crate::cancels::{ABORTED, RunCancel};
use crate::command::{self, Presented};
use crate::connection::{Connection, PeerKind, lock};
use crate::hub::Hub;
use crate::instance::{Counters, Instance, StartRun};
use crate::ledger::RunEnd;
use crate::locator::{Locator, Unspelled};
use crate::metrics::RunOutcome;
use crate::route::RouteKey;
use crate::runqueue::Turn;
use crate::runtime::{
    self, CommandAnswer, RunError, RunInput, RunIo, RunOutput, RunRequest, StreamItem,
};

/// The text of `/help`.
pub const HELP_TEXT: &str = "Commands: /help shows this text; /new starts a new conversation \
session. Anything else goes to the agent.";

/// What a run needs about one inbound, whichever frame carried it. The frame itself is not
/// kept: [`Admitted::frame`] rebuilds it (its two fields are the event id and the input) for
/// the ledger's record, and without a ledger the message moves from the decoded frame to the
/// run's request uncopied. Made boxed: it is ~600 bytes and moves through the reader's
/// decision, the ledger's answer, the run queue and the run's task, and every future that
/// held it by value held its own copy (memcpy was 16.7 % of the hub's samples at 256 inbound
/// in flight, 11.6 % boxed; an inbound's handling 4.7 → 2.1 KB, BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct Admitted {
    pub event_id: Id,
    pub input: RunInput,
    pub sender: Option<Participant>,
    pub origin: MessageTarget,
    pub reply_to: Option<Id>,
    pub route: RouteKey,
}

impl Admitted {
    pub fn message(inbound: Inbound, identity_isolation: bool) -> Box<Self> {
        let Inbound { event_id, message } = inbound;
        Box::new(Self {
            event_id,
            origin: message.target.clone(),
            reply_to: Some(message.id.clone()),
            route: RouteKey::new(&message.target, message.sender.id.as_str(), identity_isolation),
            sender: Some(message.sender.clone()),
            input: RunInput::Message { message },
        })
    }

    pub fn event(frame: InboundEventFrame, identity_isolation: bool) -> Box<Self> {
        let InboundEventFrame { event_id, event } = frame;
        let context = event.context();
        let actor = context.participant.clone();
        Box::new(Self {
            event_id,
            origin: context.target.clone(),
            reply_to: None,
            route: RouteKey::new(
                &context.target,
                actor.as_ref().map_or("", |p| p.id.as_str()),
                identity_isolation,
            ),
            sender: actor,
            input: RunInput::Event { event },
        })
    }

    /// The frame that carried it, as received (recorded in the ledger to run it again after
    /// a crash): an `inbound` or `inbound_event` frame has no field besides these two.
    pub fn frame(&self) -> Frame {
        let event_id = self.event_id.clone();
        match &self.input {
            RunInput::Message { message } => {
                Frame::Inbound(Inbound { event_id, message: message.clone() })
            }
            RunInput::Event { event } => {
                Frame::InboundEvent(InboundEventFrame { event_id, event: event.clone() })
            }
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
    let id = hub.ids.request("r");
    let mut run_id = String::with_capacity(4 + id.as_str().len());
    run_id.push_str("run-");
    run_id.push_str(id.as_str());
    run_id
}

/// The run's request, made from the inbound it takes over (its input moves in, not copied),
/// and the inbound's route, which a hub command still needs.
fn request(
    hub: &Hub,
    inst: &Instance,
    admitted: Box<Admitted>,
    run_id: String,
    entry: Option<i64>,
    conn: Option<&Arc<Connection>>,
    redelivered: bool,
) -> (RunRequest, RouteKey) {
    let Admitted { event_id, input, sender, origin, reply_to, route } = *admitted;
    let route_id = route.session_id(0);
    // A route's first session (generation 0) is its route id: hashed once, not twice.
    let session = match inst.generation(route_id.as_str()) {
        0 => route_id,
        generation => route.session_id(generation),
    };
    let declaration = conn.map(|c| c.declaration).or_else(|| inst.live().map(|c| c.declaration));
    let (capabilities, actions) =
        declaration.map(|d| (d.capabilities, d.actions)).unwrap_or_default();
    // Structural ids only, never the text or a display name; taken from the inbound, not
    // copied, and spelled only by a runtime that hands it on.
    let locator = Locator {
        instance: origin.channel,
        conversation: origin.conversation,
        thread: origin.thread,
        message: reply_to,
        event_id: event_id.clone(),
        entry,
    };
    let locator = Unspelled::new(locator, hub.locator_key());
    let request = RunRequest {
        instance: inst.config.id.clone(),
        run_id,
        session,
        event_id,
        input,
        sender,
        capabilities,
        actions,
        redelivered,
        control_socket: hub.control_socket.clone(),
        locator,
        agent_env: inst.agent_env(),
    };
    (request, route)
}

/// Whether the driver may hear of a run yet. A run whose inbound was just recorded may start
/// while the record is being synced, but the driver hears `accepted` first, once the record
/// is on the disk: until then the run's effects (live progress) are held, at most
/// [`MAX_HELD`] of them, and its stream frames, commands and ending wait. Every other run's
/// gate is open, and costs nothing (`None`).
#[derive(Debug, Clone)]
pub struct Gate(Option<Arc<GateState>>);

#[derive(Debug)]
struct GateState {
    open: CancellationToken,
    /// Effects sent while shut, in order; let through as it opens.
    held: std::sync::Mutex<Vec<Frame>>,
}

/// Effects a shut gate holds; more are dropped (live progress, like a full queue's).
pub const MAX_HELD: usize = 32;

impl Gate {
    pub fn open() -> Self {
        Self(None)
    }

    /// A shut gate, and what opens it once dropped (also when the task that holds it ends
    /// early), letting the effects it held through to `conn` first.
    pub fn shut(conn: Arc<Connection>) -> (Self, Opener) {
        let state =
            Arc::new(GateState { open: CancellationToken::new(), held: Default::default() });
        (Self(Some(state.clone())), Opener { state, conn })
    }

    /// Sends an effect's frame now, or holds it while the gate is shut. Under the lock, so an
    /// effect never passes those held before it.
    fn send_or_hold(&self, conn: &Connection, frame: Frame) {
        let Some(state) = &self.0 else {
            let _ = conn.sink.try_send(&frame);
            return;
        };
        let mut held = lock(&state.held);
        if state.open.is_cancelled() {
            let _ = conn.sink.try_send(&frame);
        } else if held.len() < MAX_HELD {
            held.push(frame);
        } else {
            debug!("effect before the message was accepted; too many held, dropped");
        }
    }

    async fn wait(&self) {
        if let Some(state) = &self.0 {
            state.open.cancelled().await;
        }
    }
}

/// Opens a shut [`Gate`] when dropped.
#[derive(Debug)]
pub struct Opener {
    state: Arc<GateState>,
    conn: Arc<Connection>,
}

impl Drop for Opener {
    fn drop(&mut self) {
        let mut held = lock(&self.state.held);
        for frame in held.drain(..) {
            let _ = self.conn.sink.try_send(&frame);
        }
        self.state.open.cancel();
    }
}

/// An inbound whose run waits in the queue, with what starting it needs.
#[derive(Debug)]
pub struct Queued {
    /// The connection that carried the inbound (`None` for a run queued again after a
    /// restart).
    pub origin: Option<Arc<Connection>>,
    pub admitted: Box<Admitted>,
    pub run_id: String,
    /// Its item's ledger entry id, when known (not for a run queued again after a restart).
    pub entry: Option<i64>,
    pub redelivered: bool,
    pub work: Work,
    /// The ledger counts the start as an attempt first (a run that waited, or was recovered).
    pub count_start: bool,
    /// How a cancel reaches this run (`inbound/cancel.rs`).
    pub cancel: Arc<RunCancel>,
    /// Whether its driver may hear of it yet.
    pub gate: Gate,
}

/// The end of a run's turn, also when its task panics or is dropped: the queue lets the next
/// run of its session (and any run waiting for a slot) start.
struct TurnEnd {
    inst: Arc<Instance>,
    turn: Turn,
}

impl Drop for TurnEnd {
    fn drop(&mut self) {
        let starts = lock(&self.inst.runs).finish(self.turn);
        super::start(starts);
    }
}

/// What starts `queued` when the queue says it is its turn: a tracked task (drained at
/// shutdown). Its request is made then, so a `/new` before it in its session applies. While
/// the hub stops, a queued run the ledger holds is left for the next start; without a ledger
/// it still runs within the drain deadline.
pub fn starter(hub: &Arc<Hub>, inst: &Arc<Instance>, queued: Queued) -> StartRun {
    let (hub, inst) = (hub.clone(), inst.clone());
    StartRun::new(move |turn| {
        // The ledger first: a token's check takes its lock.
        let stopping = hub.ledger.is_on() && hub.shutdown.is_cancelled();
        if stopping || hub.close_connections.is_cancelled() {
            debug!(instance = %inst.config.id, event_id = %queued.admitted.event_id, "hub stopping; the queued run is not started");
            return;
        }
        let end = TurnEnd { inst: inst.clone(), turn };
        // Every line logged during the run (the runtime's too) carries the run's ids.
        let span = info_span!("run", instance = %inst.config.id, event_id = %queued.admitted.event_id, run_id = %queued.run_id);
        // One box for the whole run: tokio copies a task's future when it spawns it and when
        // it finishes, so the task holds a pointer, and the run's state is copied once, into
        // the box (the memcpy was 15 % of the hub's time at 256 inbound in flight when the
        // task held it all).
        hub.clone().runs.spawn(Box::pin(async move {
            if let Some(wait) = inst.agent_env_wait() {
                // After a restart, until the driver gave its runs their environment again.
                debug!("run waits for the driver's agent environment");
                tokio::select! {
                    () = wait.cancelled() => {}
                    // Left for the next start, as a queued run is.
                    () = hub.shutdown.cancelled() => return,
                    // It ends as cancelled, without starting.
                    () = queued.cancel.token().cancelled() => {}
                }
            }
            if queued.count_start {
                let event_id = queued.admitted.event_id.to_string();
                let counted = hub.ledger.start_run(inst.config.id.to_string(), event_id).await;
                if let Err(err) = counted {
                    inst.record_error(format!("ledger: {err}"));
                    warn!(instance = %inst.config.id, event_id = %queued.admitted.event_id, error = %err, "run start not recorded");
                }
            }
            execute(&hub, &inst, turn, queued).await;
            drop(end);
        }.instrument(span)));
    })
}

/// One run, from its request to its reply (or error) handed to the driver's writer: the
/// next run of its session starts only after that, so replies keep the inbound order.
async fn execute(hub: &Arc<Hub>, inst: &Arc<Instance>, turn: Turn, queued: Queued) {
    let Queued { origin, admitted, run_id, entry, redelivered, work, cancel, gate, .. } = queued;
    let target = admitted.reply_target();
    let (request, route) =
        request(hub, inst, admitted, run_id, entry, origin.as_ref(), redelivered);
    // A run's length is for the metrics and the debug log: the clock is read only for them.
    let timed = inst.metrics.is_on() || tracing::enabled!(tracing::Level::DEBUG);
    let (began, event_id) = (timed.then(Instant::now), request.event_id.clone());
    inst.metrics.run_started();
    debug!(redelivered, "run started");
    let io = ConnectionIo {
        hub,
        inst,
        conn: origin.as_ref(),
        session: &request.session,
        target: &target,
        event_id: &event_id,
        cancel: &cancel,
        seq: AtomicU64::new(0),
        gate: &gate,
    };
    let result = match work {
        _ if cancel.is_cancelled() => Err(RunError::Aborted),
        Work::Hub(command) => {
            let text = answer(hub, inst, command, &route).await;
            Ok(RunOutput { reply: Some(text), ..RunOutput::default() })
        }
        Work::Runtime => {
            // The runtime as configured when the run starts: a reload does not change it.
            let policy = inst.policy();
            runtime::run(&hub.remote, &policy.runtime, &request, &io, &cancel).await
        }
    };
    // Every run ends with exactly one `deliver` or `error`: no reply is an error too.
    let mut metadata = Metadata::new();
    let result = result.and_then(|output| {
        metadata = output.metadata;
        output
            .reply
            .map(|text| reply::fit_reply(&event_id, &target, &metadata, text))
            .filter(|text| !text.trim().is_empty())
            .ok_or(RunError::EmptyReply)
    });
    // The seq the final reply takes, for a run streamed to its driver, and the seq of the
    // frame that ends a failed run: the run streams nothing more once it returned.
    let (stream_seq, end_seq) = (io.streamed(), io.next_seq());
    let outcome = if result.is_ok() { RunOutcome::Replied } else { RunOutcome::Failed };
    // One clock read for the run's length and the reply's start.
    let ended = began.map(|began| {
        let ended = Instant::now();
        let took = ended.saturating_duration_since(began);
        inst.metrics.run_finished(outcome, took);
        debug!(outcome = outcome.as_str(), elapsed_ms = took.as_millis() as u64, "run finished");
        ended
    });
    // A driver's reply is recorded with the outcome, and the courier delivers it (and
    // retries it); a legacy peer's goes back on its connection, once.
    // (Without a ledger nothing is recorded: the record is not even made.)
    let tracked = hub.ledger.is_on() && origin.as_ref().is_none_or(|c| c.kind == PeerKind::Driver);
    let reply = match &result {
        Ok(text) if tracked => {
            reply::new_reply(hub, inst, &event_id, &target, &metadata, text, stream_seq)
        }
        _ => None,
    };
    let mut recorded = false;
    let mut claimed = None;
    if hub.ledger.is_on() {
        let now = crate::clock::now_ms();
        let with_reply = reply.is_some();
        // With a driver to take it, the reply is claimed as it is recorded (one transaction,
        // not two) unless an earlier reply holds its conversation.
        let claim = with_reply && inst.live().is_some();
        let (instance, event) = (inst.config.id.to_string(), event_id.to_string());
        // Made for the ledger only: without one the reply's text is not copied.
        let end = match &result {
            Ok(text) => RunEnd::Reply(text.clone()),
            Err(err) => {
                RunEnd::Failed { code: err.code().to_owned(), message: err.public_message() }
            }
        };
        let finished = hub.ledger.finish_run(instance, event, end, reply, claim, now).await;
        match finished {
            Ok(done) => {
                recorded = done.ended && with_reply;
                claimed = done.handed;
            }
            Err(err) => {
                inst.record_error(format!("ledger: {err}"));
                warn!(instance = %inst.config.id, %event_id, error = %err, "run outcome not recorded");
            }
        }
    }
    // The outcome is recorded: a redelivery from now on is answered from the ledger or as
    // a duplicate, so the run slot goes to another session; this session's next run still
    // waits until the reply below is handed over.
    let starts = lock(&inst.runs).ended(turn);
    super::start(starts);
    // Its ending goes after `accepted`.
    gate.wait().await;
    // A recorded reply goes through the courier (in order per conversation, retried); an
    // untracked one goes back on the connection that carried the inbound, or, if that one
    // is gone, on the instance's current driver.
    let conn = origin.filter(|c| !c.is_closed()).or_else(|| inst.live());
    let end_state = match &result {
        Ok(_) => "replied",
        Err(RunError::Aborted) => ABORTED,
        Err(_) => "failed",
    };
    match (result, conn) {
        (Ok(_), _) if recorded => {
            match claimed {
                Some(reply) => hub.courier.deliver_claimed(inst, reply).await,
                None => hub.courier.deliver(inst).await,
            }
            reply_delivered(inst, ended);
        }
        (Ok(text), Some(conn)) => {
            if let (true, Some(seq)) = (conn.declaration.extensions.stream, stream_seq) {
                metadata.insert(STREAM_SEQ_KEY.to_owned(), seq.to_string());
            }
            reply::deliver(inst, &conn, &event_id, target, &metadata, text).await;
            reply_delivered(inst, ended);
        }
        (Ok(_), None) => {
            warn!(instance = %inst.config.id, %event_id, "no driver connected and the reply is not recorded; it is lost");
        }
        (Err(err), conn) => {
            if matches!(err, RunError::Aborted) {
                info!(instance = %inst.config.id, %event_id, run_id = %request.run_id, "run aborted");
            } else {
                Counters::bump(&inst.counters.runs_failed);
                inst.record_error(format!("run {}: {err}", request.run_id));
                warn!(instance = %inst.config.id, %event_id, run_id = %request.run_id, error = %err, "run failed");
            }
            if let Some(conn) = conn {
                end_run(&conn, &event_id, &err, end_seq).await;
            }
        }
    }
    // Its ending is with the driver: a cancel waiting for it may answer now.
    lock(&inst.cancels).finish(&event_id, &cancel, end_state);
}

/// Counts a reply handed over, timed from its run's end (when the run was timed).
fn reply_delivered(inst: &Instance, ended: Option<Instant>) {
    if let Some(ended) = ended {
        inst.metrics.reply_delivered(ended.elapsed());
    }
}

/// A run that ended without a reply: its one ending is an `error` frame, or for a driver
/// with `stream` the stream's end frame (`aborted` for a cancelled run, else `error`).
pub async fn end_run(conn: &Connection, event_id: &Id, err: &RunError, seq: u64) {
    if !conn.declaration.extensions.stream {
        refuse(conn, event_id, err.code(), err.public_message(), false).await;
        return;
    }
    let end = if matches!(err, RunError::Aborted) { StreamEnd::Aborted } else { StreamEnd::Error };
    let frame = Frame::Stream(StreamFrame {
        event_id: event_id.clone(),
        seq,
        text: None,
        tool: None,
        end: Some(end),
        code: Some(err.code().to_owned()),
        message: Some(err.public_message()),
    });
    let _ = conn.sink.send(&frame).await;
}

/// The hub's own answer to `/help` and `/new`.
async fn answer(hub: &Hub, inst: &Instance, command: SlashCommand, route: &RouteKey) -> String {
    match command {
        SlashCommand::Help => HELP_TEXT.to_owned(),
        SlashCommand::NewSession => {
            let route_id = route.session_id(0);
            let generation = if hub.ledger.is_on() {
                match hub
                    .ledger
                    .bump_generation(inst.config.id.to_string(), route_id.to_string())
                    .await
                {
                    Ok(generation) => {
                        inst.set_generation(route_id.as_str(), generation);
                        generation
                    }
                    Err(err) => {
                        warn!(instance = %inst.config.id, error = %err, "new session not recorded");
                        return "Could not start a new session; try again.".to_owned();
                    }
                }
            } else {
                inst.bump_generation(route_id.as_str())
            };
            info!(instance = %inst.config.id, generation, "new session started by /new");
            "Started a new session.".to_owned()
        }
    }
}

/// A run's live channel back to the connection that carried its inbound. A run started again
/// after a crash has none: its effects are dropped and its commands fail closed.
/// It borrows what the run's task holds: building one copies no string and counts no
/// reference.
struct ConnectionIo<'a> {
    hub: &'a Hub,
    inst: &'a Instance,
    conn: Option<&'a Arc<Connection>>,
    session: &'a Id,
    target: &'a MessageTarget,
    event_id: &'a Id,
    /// Once it is cancelled, nothing more of the run reaches the driver.
    cancel: &'a RunCancel,
    /// The next `stream` frame's seq.
    seq: AtomicU64,
    /// Open once the driver was told `accepted`.
    gate: &'a Gate,
}

impl ConnectionIo<'_> {
    fn streams(&self) -> Option<&Arc<Connection>> {
        self.conn.filter(|conn| conn.declaration.extensions.stream)
    }

    /// The seq the run's next (or final) frame takes.
    fn next_seq(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// For a run streamed to its driver, the seq its final reply takes.
    fn streamed(&self) -> Option<u64> {
        self.streams().map(|_| self.next_seq())
    }
}

impl RunIo for ConnectionIo<'_> {
    async fn stream(&self, item: StreamItem) {
        let Some(conn) = self.streams() else { return };
        self.gate.wait().await;
        if self.cancel.is_cancelled() {
            return;
        }
        let (text, tool) = match item {
            StreamItem::Delta(text) => (Some(text), None),
            StreamItem::Tool(report) => (None, Some(report)),
        };
        let frame = Frame::Stream(StreamFrame {
            event_id: self.event_id.clone(),
            seq: self.seq.fetch_add(1, Ordering::AcqRel),
            text,
            tool,
            end: None,
            code: None,
            message: None,
        });
        // Not live progress: a delta lost would garble the text, so the run waits for room.
        if conn.sink.send(&frame).await.is_err() {
            debug!("stream frame not sent: the connection is gone");
        }
    }

    fn effect(&self, effect: Effect) {
        let Some(conn) = self.conn else { return };
        if self.cancel.is_cancelled() {
            return;
        }
        match conn.declaration.effect_gate(&effect) {
            EffectGate::Send => {
                let frame = Frame::Effect(EffectFrame {
                    request_id: self.hub.ids.request("fx"),
                    target: MessageTarget { reply_to: None, ..self.target.clone() },
                    effect,
                });
                // Live progress: a full queue drops it rather than stall the run.
                self.gate.send_or_hold(conn, frame);
            }
            EffectGate::Drop => {}
            EffectGate::Reject(reason) => debug!(%reason, "effect from the agent not sent"),
        }
    }

    async fn command(&self, command_id: Id, command: Command) -> CommandAnswer {
        let Some(conn) = self.conn else {
            return CommandAnswer::rejected("the connection that carried this message is gone");
        };
        self.gate.wait().await;
        if self.cancel.is_cancelled() {
            return CommandAnswer::rejected("the run was cancelled");
        }
        let session = self.session.clone();
        let presented = Presented {
            request_id: self.hub.ids.request("cmd"),
            session,
            command_id,
            command,
            target: Some(MessageTarget { reply_to: None, ..self.target.clone() }),
        };
        match command::present(conn, presented, self.hub.config.command_timeout, &self.inst.metrics)
            .await
        {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use channeld_link::spawn_writer;
    use channeld_protocol::ext::PeerDeclaration;
    use channeld_protocol::frame::Accepted;
    use tokio::io::{AsyncBufReadExt, BufReader};

    use super::*;
    use crate::connection::PeerKind;

    fn frame(event_id: &str) -> Frame {
        Frame::Accepted(Accepted { event_id: Id::new(event_id).unwrap(), duplicate: false })
    }

    /// The ledger records the frame `Admitted` rebuilds (a run after a crash starts from it,
    /// and a redelivery's fingerprint is compared with it): it must be the frame received,
    /// every field of a message and of an event included.
    #[test]
    fn the_frame_recorded_for_an_inbound_is_the_frame_received() {
        use channeld_protocol::ChannelId;
        use channeld_protocol::types::{
            Attachment, EventContext, InboundMessage, IncomingEvent, MessageBody,
        };

        let id = |text: &str| Id::new(text).unwrap();
        let mut target = MessageTarget::new(ChannelId::new("slack.primary").unwrap(), id("C1"));
        target.thread = Some(id("t-1"));
        let ada = Participant {
            id: id("U1"),
            display_name: Some("Ada".into()),
            handle: Some("ada".into()),
        };
        let attachment = Attachment {
            url: "https://files.example/a.png".into(),
            name: Some("a.png".into()),
            mime: Some("image/png".into()),
        };
        let message = InboundMessage {
            id: id("m-1"),
            target: target.clone(),
            sender: ada.clone(),
            body: MessageBody::with_attachments("hi \"there\"".into(), vec![attachment]).unwrap(),
            timestamp_ms: Some(1_700_000_000_123),
            metadata: [("team".to_owned(), "T1".to_owned())].into(),
        };
        let inbound = Inbound { event_id: id("ev-1"), message };
        assert_eq!(Admitted::message(inbound.clone(), true).frame(), Frame::Inbound(inbound),);

        let context = EventContext {
            target,
            participant: Some(ada),
            timestamp_ms: Some(1_700_000_000_456),
            metadata: [("kind".to_owned(), "emoji".to_owned())].into(),
        };
        let event = IncomingEvent::Reaction {
            context,
            message_id: id("m-1"),
            emoji: "+1".into(),
            added: true,
        };
        let frame = InboundEventFrame { event_id: id("ev-2"), event };
        assert_eq!(Admitted::event(frame.clone(), false).frame(), Frame::InboundEvent(frame));
    }

    /// A shut gate holds effects (in order, at most `MAX_HELD`) and keeps the run's other
    /// frames waiting; its opener lets the held effects out first, then everything else.
    #[tokio::test]
    async fn a_shut_gate_holds_effects_in_order_and_lets_them_out_before_the_rest() {
        let (hub_side, driver_side) = tokio::io::duplex(1 << 20);
        let (sink, _writer) = spawn_writer(hub_side, 256);
        let conn =
            Arc::new(Connection::new(1, PeerKind::Driver, sink, PeerDeclaration::default(), None));
        let mut lines = BufReader::new(driver_side).lines();

        let (gate, opener) = Gate::shut(conn.clone());
        for n in 0..MAX_HELD + 3 {
            gate.send_or_hold(&conn, frame(&format!("held-{n}")));
        }
        let waiting = {
            let (gate, conn) = (gate.clone(), conn.clone());
            tokio::spawn(async move {
                gate.wait().await;
                conn.sink.send(&frame("after")).await.unwrap();
            })
        };
        let nothing = tokio::time::timeout(Duration::from_millis(50), lines.next_line()).await;
        assert!(nothing.is_err(), "nothing reaches the driver while the gate is shut");

        drop(opener);
        waiting.await.unwrap();
        gate.send_or_hold(&conn, frame("open"));
        let mut seen = Vec::new();
        while seen.len() < MAX_HELD + 2 {
            let line = lines.next_line().await.unwrap().unwrap();
            let event: serde_json::Value = serde_json::from_str(&line).unwrap();
            seen.push(event["frame"]["event_id"].as_str().unwrap().to_owned());
        }
        let held: Vec<_> = (0..MAX_HELD).map(|n| format!("held-{n}")).collect();
        assert_eq!(seen[..MAX_HELD], held[..], "the first MAX_HELD, in order");
        assert_eq!(seen[MAX_HELD..], ["after", "open"]);
        let open = Gate::open();
        open.wait().await;
        open.send_or_hold(&conn, frame("at once"));
        let line = lines.next_line().await.unwrap().unwrap();
        assert!(line.contains("at once"), "{line}");
    }
}
