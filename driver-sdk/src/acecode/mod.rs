//! The `--acecode` transport: the driver speaks ACECode's channel platform plugin protocol
//! on stdin/stdout instead of connecting to a hub.
//!
//! The driver's own hub session is unchanged: it runs over one end of a socket pair, and
//! [`Bridge`] plays a minimal hub on the other end, translating between channel-socket
//! frames and plugin frames. So the lifecycle (platform side started once the "hub" accepted
//! the driver, drain on shutdown, redelivered requests answered without posting twice) is
//! the one every driver already has.
//!
//! Order: the bridge reads ACECode's `initialize` first, then starts the session and
//! answers `initialize` with the capabilities the driver's `hello` declared (the platform
//! side connects only then). `shutdown` (or the end of stdin) drains the driver like SIGTERM.

pub mod convert;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use channeld_link::{FrameReader, FrameSink, QuietRead, split_unix};
use channeld_protocol::acecode::{
    self as wire, ActionParams, HostLine, InitializeParams, InitializeResult, Outcome,
    PROTOCOL_VERSION, Request, Response, SendResult, SendTextParams, SetTypingParams, event,
    method,
};
use channeld_protocol::ext::{self, Extensions};
use channeld_protocol::frame::{
    Accepted, Delivery, EffectFrame, ErrorFrame, HelloAck, OperatorActionFrame,
};
use channeld_protocol::framing::{LineEvent, LineFramer};
use channeld_protocol::types::{Effect, Health, HealthState};
use channeld_protocol::{Frame, Id};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::driver::Driver;
use crate::hub::Shared;
use crate::runtime::{Admission, RunError};
use crate::session::{
    MAX_CONCURRENT_HANDLERS, MAX_QUEUED_REQUESTS, RecentPosts, Session, SessionEnd,
};

/// `CHANNELD_ACECODE_ACCOUNT`: the `account` the transport reports in `status` (ACECode
/// routes private messages whose sender is the account to a session); default: the channel
/// id.
pub const VAR_ACCOUNT: &str = "ACECODE_ACCOUNT";
/// Lines queued for stdout; senders wait beyond it.
const OUTPUT_QUEUE: usize = 256;
/// Frames queued towards the driver's session.
const SESSION_QUEUE: usize = 512;
/// The hub name the bridge gives in `hello_ack`.
const BRIDGE_NAME: &str = concat!("channeld-acecode-transport/", env!("CARGO_PKG_VERSION"));

/// What the bridge offers the driver: no ledger, no control clients, no replies to inbound.
const BRIDGE_EXTENSIONS: Extensions = Extensions {
    accepted: true,
    control_result: false,
    responder: false,
    health_status: true,
    reply_receipt: false,
    operator_action: true,
    history: false,
    cancel: false,
    stream: false,
    agent_env: false,
};

/// Lines to stdout, written by one task in order.
#[derive(Debug, Clone)]
struct Output(mpsc::Sender<Vec<u8>>);

impl Output {
    async fn line(&self, value: &impl serde::Serialize) {
        let mut line = match serde_json::to_vec(value) {
            Ok(line) => line,
            Err(err) => {
                warn!(error = %err, "cannot encode a line for ACECode");
                return;
            }
        };
        line.push(b'\n');
        let _ = self.0.send(line).await;
    }

    async fn respond(&self, response: Response) {
        self.line(&response).await;
    }

    async fn event(&self, name: &str, params: impl serde::Serialize) {
        let params = serde_json::to_value(params).unwrap_or(Value::Null);
        self.line(&wire::Event { event: name.to_owned(), params }).await;
    }
}

fn spawn_output<W: AsyncWrite + Unpin + Send + 'static>(
    mut out: W,
    tracker: &TaskTracker,
) -> Output {
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(OUTPUT_QUEUE);
    tracker.spawn(async move {
        while let Some(line) = rx.recv().await {
            if out.write_all(&line).await.is_err() || out.flush().await.is_err() {
                break;
            }
        }
    });
    Output(tx)
}

/// Reads the host's lines, bounded at 1 MiB; an oversize line is skipped.
struct HostReader<R> {
    input: R,
    framer: LineFramer,
}

impl<R: AsyncRead + Unpin> HostReader<R> {
    /// The next line, `None` at the end of input.
    async fn next(&mut self) -> Option<HostLine> {
        loop {
            match self.framer.next_line() {
                Some(LineEvent::Line(line)) => match wire::parse_host_line(line) {
                    Ok(line) => return Some(line),
                    Err(err) => warn!(error = %err, "unreadable line from ACECode; ignored"),
                },
                Some(LineEvent::TooLong) => warn!("a line from ACECode exceeds 1 MiB; ignored"),
                None => match self.input.read_buf(self.framer.buffer_for_read()).await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => {}
                },
            }
        }
    }
}

/// Runs the driver's session over a socket pair with the bridge on the other end, reading
/// ACECode from `input` and writing to `output`. ACECode's `shutdown` (or the end of input)
/// cancels `shutdown`, and the runtime drains as on SIGTERM.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn connection<D, R, W>(
    driver: Arc<D>,
    shared: Arc<Shared>,
    tracker: TaskTracker,
    session_token: CancellationToken,
    admissions: mpsc::Sender<Admission>,
    input: R,
    output: W,
    shutdown: CancellationToken,
) -> Result<(), RunError>
where
    D: Driver,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let io_tasks = TaskTracker::new();
    let out = spawn_output(output, &io_tasks);
    let mut host = HostReader { input, framer: LineFramer::new(wire::MAX_LINE_BYTES) };
    let channel = shared.launch.channel.clone();
    let account = shared.launch.var(VAR_ACCOUNT).unwrap_or(channel.as_str()).to_owned();

    // Until `initialize`, nothing else is served.
    let (init_id, init) = loop {
        let Some(line) = host.next().await else {
            shutdown.cancel();
            return Ok(());
        };
        match line {
            HostLine::Request(req) if req.method == method::INITIALIZE => {
                match serde_json::from_value::<InitializeParams>(req.params) {
                    Ok(params) if params.protocol_version == PROTOCOL_VERSION => {
                        break (req.id, params);
                    }
                    Ok(params) => {
                        let reason =
                            format!("unsupported protocol_version {}", params.protocol_version);
                        out.respond(Response::err(req.id, reason)).await;
                    }
                    Err(err) => {
                        out.respond(Response::err(req.id, format!("invalid params: {err}"))).await
                    }
                }
            }
            HostLine::Request(req) if req.method == method::SHUTDOWN => {
                out.respond(Response::ok(req.id, json!({}))).await;
                shutdown.cancel();
                return Ok(());
            }
            HostLine::Request(req) => {
                out.respond(Response::err(req.id, "not initialized")).await;
            }
            _ => {}
        }
    };
    info!(%channel, platform = %init.platform, reason = %init.reason, "ACECode initialized the plugin");

    let (ours, theirs) = UnixStream::pair().map_err(|err| RunError::Driver(err.into()))?;
    let session = Session {
        driver,
        shared: shared.clone(),
        tracker,
        recent: Arc::new(Mutex::new(RecentPosts::default())),
        handlers: Arc::new(Semaphore::new(MAX_CONCURRENT_HANDLERS)),
        queued: Arc::new(Semaphore::new(MAX_QUEUED_REQUESTS)),
    };
    let session_task = {
        let token = session_token.clone();
        tokio::spawn(async move { session.run(theirs, &token, &admissions).await })
    };
    let (reader, sink, writer) =
        split_unix(ours, SESSION_QUEUE).map_err(|err| RunError::Driver(err.into()))?;
    let mut bridge = Bridge {
        channel,
        account,
        out: out.clone(),
        sink,
        operator_actions: Vec::new(),
        typing: false,
        sends: HashMap::new(),
        actions: HashMap::new(),
        next: 0,
        last_status: None,
        shutdown,
    };
    bridge.serve(reader, &mut host, init_id).await;
    let end = session_task.await;
    drop(bridge);
    let _ = writer.close().await;
    drop(out);
    io_tasks.close();
    io_tasks.wait().await;
    match end {
        Ok(SessionEnd::Refused { code, message, retryable: false }) => {
            Err(RunError::Refused { code, message })
        }
        Ok(_) => Ok(()),
        Err(_) => Err(RunError::Panicked),
    }
}

/// The hub end of the socket pair, and ACECode's side.
struct Bridge {
    channel: channeld_protocol::ChannelId,
    account: String,
    out: Output,
    sink: FrameSink,
    operator_actions: Vec<String>,
    typing: bool,
    /// `outbound` request id → the `send_text` request waiting for its receipt.
    sends: HashMap<Id, u64>,
    /// `operator_action` request id → the `action` request waiting for its result.
    actions: HashMap<Id, u64>,
    next: u64,
    last_status: Option<wire::StatusParams>,
    shutdown: CancellationToken,
}

impl Bridge {
    async fn serve<R: AsyncRead + Unpin>(
        &mut self,
        mut reader: FrameReader<QuietRead>,
        host: &mut HostReader<R>,
        init_id: u64,
    ) {
        // The session says hello first; answer it, then `initialize`.
        let declaration = loop {
            match reader.next().await {
                Ok(Some(Ok(Frame::Hello(hello)))) => break hello,
                Ok(Some(Ok(_))) | Ok(Some(Err(_))) => continue,
                _ => {
                    self.out.respond(Response::err(init_id, "the driver stopped")).await;
                    return;
                }
            }
        };
        let negotiated =
            BRIDGE_EXTENSIONS.intersect(Extensions::from_names(&declaration.extensions));
        if negotiated.operator_action {
            self.operator_actions = declaration.operator_actions.clone();
        }
        self.typing = declaration.actions.typing;
        let ack = Frame::HelloAck(HelloAck {
            request_id: declaration.request_id.clone(),
            extensions: negotiated.names(),
            hub: BRIDGE_NAME.to_owned(),
        });
        let _ = self.sink.send(&ack).await;
        let decl = crate::driver::Declaration {
            capabilities: declaration.capabilities,
            actions: declaration.actions,
            operator_actions: self.operator_actions.clone(),
        };
        let result = InitializeResult {
            protocol_version: PROTOCOL_VERSION,
            capabilities: convert::capabilities(&decl),
        };
        self.out
            .respond(Response::ok(init_id, serde_json::to_value(result).unwrap_or_default()))
            .await;
        // ACECode drops inbound messages until it knows the account.
        self.health(Health::new(HealthState::Degraded, Some("connecting to the platform".into())))
            .await;

        let mut host_open = true;
        loop {
            tokio::select! {
                frame = reader.next() => match frame {
                    Ok(Some(Ok(frame))) => {
                        if !self.on_frame(frame).await {
                            break;
                        }
                    }
                    Ok(Some(Err(err))) => debug!(error = %err, "undecodable frame from the driver"),
                    Ok(None) | Err(_) => break,
                },
                line = host.next(), if host_open => match line {
                    Some(line) => self.on_host(line).await,
                    None => {
                        info!(channel = %self.channel, "ACECode closed stdin; stopping");
                        host_open = false;
                        self.shutdown.cancel();
                    }
                },
            }
        }
        // Whatever still waits gets an answer: the driver is gone.
        for (_, id) in self.sends.drain() {
            let result = SendResult {
                outcome: Outcome::Failed,
                error: Some("the driver stopped; the outcome is unknown".into()),
            };
            self.out
                .respond(Response::ok(id, serde_json::to_value(result).unwrap_or_default()))
                .await;
        }
        for (_, id) in self.actions.drain() {
            self.out.respond(Response::err(id, "the driver stopped")).await;
        }
    }

    fn request_id(&mut self, kind: &str) -> Id {
        self.next += 1;
        Id::new(format!("acecode-{kind}-{}", self.next)).expect("a short ascii id")
    }

    async fn health(&mut self, health: Health) {
        let status = convert::status(&health, &self.account);
        if self.last_status.as_ref() != Some(&status) {
            self.out.event(event::STATUS, &status).await;
            self.last_status = Some(status);
        }
    }

    /// One frame from the driver; false when it left.
    async fn on_frame(&mut self, frame: Frame) -> bool {
        match frame {
            Frame::Inbound(inbound) => {
                let event_id = inbound.event_id.clone();
                match convert::inbound(&inbound.message) {
                    Ok(params) => {
                        self.out.event(event::INBOUND, &params).await;
                        let accepted = Frame::Accepted(Accepted { event_id, duplicate: false });
                        let _ = self.sink.send(&accepted).await;
                    }
                    Err(err) => {
                        warn!(%event_id, error = %err, "inbound not representable for ACECode; refused");
                        let refusal =
                            Frame::error(Some(event_id), "invalid_frame", err.to_string(), false);
                        let _ = self.sink.send(&refusal).await;
                    }
                }
            }
            // ACECode has no events besides messages: taken, not forwarded.
            Frame::InboundEvent(event) => {
                let accepted =
                    Frame::Accepted(Accepted { event_id: event.event_id, duplicate: false });
                let _ = self.sink.send(&accepted).await;
            }
            Frame::Receipt(receipt) => {
                if let Some(id) = self.sends.remove(&receipt.request_id) {
                    let result = SendResult { outcome: Outcome::Sent, error: None };
                    self.out
                        .respond(Response::ok(id, serde_json::to_value(result).unwrap_or_default()))
                        .await;
                }
            }
            Frame::Error(ErrorFrame { request_id: Some(request_id), code, message, .. }) => {
                if let Some(id) = self.sends.remove(&request_id) {
                    // A send that may have been posted is reported failed too: ACECode never
                    // resends a failed one, which is what an unknown outcome needs.
                    let error = if code == "send_unknown" {
                        format!("outcome unknown: {message}")
                    } else {
                        message
                    };
                    let result = SendResult { outcome: Outcome::Failed, error: Some(error) };
                    self.out
                        .respond(Response::ok(id, serde_json::to_value(result).unwrap_or_default()))
                        .await;
                }
            }
            Frame::OperatorActionResult(result) => {
                if let Some(id) = self.actions.remove(&result.request_id) {
                    let response = if result.ok {
                        Response::ok(id, result.data.unwrap_or_else(|| json!({})))
                    } else {
                        let code = result.code.unwrap_or_else(|| "failed".into());
                        let reason = match result.message {
                            Some(message) => format!("{code}: {message}"),
                            None => code,
                        };
                        Response::err(id, reason)
                    };
                    self.out.respond(response).await;
                }
            }
            Frame::Health(report) => self.health(report.health).await,
            Frame::Stop(_) => return false,
            _ => {}
        }
        true
    }

    /// One line from ACECode.
    async fn on_host(&mut self, line: HostLine) {
        match line {
            HostLine::Request(req) => self.on_request(req).await,
            HostLine::Notification(note) if note.method == method::SET_TYPING => {
                let Ok(params) = serde_json::from_value::<SetTypingParams>(note.params) else {
                    return;
                };
                if !self.typing {
                    return;
                }
                if let Ok(target) = convert::target(&self.channel, &params.address, &Value::Null) {
                    let request_id = self.request_id("typing");
                    let effect = Effect::Typing { active: params.on };
                    let _ = self
                        .sink
                        .send(&Frame::Effect(EffectFrame { request_id, target, effect }))
                        .await;
                }
            }
            _ => {}
        }
    }

    async fn on_request(&mut self, req: Request) {
        let id = req.id;
        match req.method.as_str() {
            method::SEND_TEXT => {
                let send = serde_json::from_value::<SendTextParams>(req.params)
                    .map_err(|err| convert::BadSend(format!("invalid params: {err}")))
                    .and_then(|send| convert::outbound(&self.channel, &send));
                match send {
                    Ok(message) => {
                        let request_id = self.request_id("send");
                        self.sends.insert(request_id.clone(), id);
                        let frame =
                            Frame::Outbound(Delivery { request_id: request_id.clone(), message });
                        if self.sink.send(&frame).await.is_err() {
                            self.sends.remove(&request_id);
                            self.failed(id, "the driver stopped").await;
                        }
                    }
                    Err(err) => self.failed(id, &err.0).await,
                }
            }
            method::SEND_FILE => {
                self.failed(id, "this driver does not send files through ACECode").await
            }
            method::DOWNLOAD => {
                self.out
                    .respond(Response::err(id, "this driver has no attachments to download"))
                    .await;
            }
            method::CONFIGURE => self.out.respond(Response::ok(id, json!({}))).await,
            method::INITIALIZE => self.out.respond(Response::err(id, "already initialized")).await,
            method::ACTION => match serde_json::from_value::<ActionParams>(req.params) {
                Ok(action)
                    if self.operator_actions.contains(&action.name)
                        && ext::valid_operator_action_name(&action.name) =>
                {
                    let request_id = self.request_id("action");
                    self.actions.insert(request_id.clone(), id);
                    let frame = Frame::OperatorAction(OperatorActionFrame {
                        request_id: request_id.clone(),
                        name: action.name,
                        args: if action.args.is_object() { action.args } else { json!({}) },
                    });
                    if self.sink.send(&frame).await.is_err() {
                        self.actions.remove(&request_id);
                        self.out.respond(Response::err(id, "the driver stopped")).await;
                    }
                }
                Ok(action) => {
                    let reason = format!("unsupported action {}", action.name);
                    self.out.respond(Response::err(id, reason)).await;
                }
                Err(err) => {
                    self.out.respond(Response::err(id, format!("invalid params: {err}"))).await
                }
            },
            method::SHUTDOWN => {
                self.out.respond(Response::ok(id, json!({}))).await;
                info!(channel = %self.channel, "ACECode asked the plugin to shut down");
                self.shutdown.cancel();
            }
            other => self.out.respond(Response::err(id, format!("unknown method {other}"))).await,
        }
    }

    async fn failed(&self, id: u64, error: &str) {
        let result = SendResult { outcome: Outcome::Failed, error: Some(error.to_owned()) };
        self.out.respond(Response::ok(id, serde_json::to_value(result).unwrap_or_default())).await;
    }
}
