//! One hub session: the handshake (with admission reported to the lifecycle loop), the
//! dispatch of hub frames to the [`Driver`], heartbeats, resending unanswered inbound after a
//! reconnect, and answering a redelivered `deliver`/`outbound` without posting twice.

use std::collections::VecDeque;

// foldhash (seeded per map), not SipHash: two lookups per post. The keys are request ids (a
// reply's is its inbound's event id, which a platform chose); the maps hold at most the
// handler queue and `RECENT_POSTS` (4,096) of them.
use foldhash::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use channeld_link::{FrameReader, FrameSink, QuietRead, SocketFirst, Turn, split_unix};
use channeld_protocol::ext::{Extensions, PeerDeclaration};
use channeld_protocol::frame::{
    CommandFrame, CommandResultFrame, Delivery, EffectFrame, ErrorFrame, EventFrame,
    HealthResponse, Hello, Lifecycle, OperatorActionFrame, OperatorActionResult, Receipt,
};
use channeld_protocol::types::{DeliveryReceipt, Health, LifecycleEvent};
use channeld_protocol::{Frame, Id};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, TryAcquireError, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::driver::{
    CommandRequest, Driver, EffectError, EffectRequest, OperatorAction, OperatorActionError, Post,
    PostError, PostKind,
};
use crate::hub::{Shared, sanitise};
use crate::launch::DriverLaunchConfig;
use crate::pending::{Acceptance, ErrorAction};
use crate::runtime::{Admission, HEARTBEAT_INTERVAL};

/// How long the runtime waits for `hello_ack` before assuming a reference hub.
const HELLO_ACK_WAIT: Duration = Duration::from_secs(2);
/// Hub requests (posts, effects, commands) handled concurrently.
pub(crate) const MAX_CONCURRENT_HANDLERS: usize = 64;
/// Hub requests queued for a handler; the reader waits beyond this (backpressure on the socket).
pub(crate) const MAX_QUEUED_REQUESTS: usize = 4096;
/// Outgoing frame queue per connection.
const SEND_QUEUE: usize = 512;
/// After a write to the hub failed, how long the session still reads what the hub sent
/// before it went away (an `accepted` among it must not be lost, or the inbound it resolves
/// would be sent again after the reconnect).
const READ_AFTER_WRITE_FAILURE: Duration = Duration::from_millis(250);
/// Posts remembered so a redelivered `deliver`/`outbound` is answered without posting twice.
const RECENT_POSTS: usize = 4096;

/// How a session ended.
pub(crate) enum SessionEnd {
    /// Shutdown finished: `stop` was sent.
    Finished,
    /// The connection broke; reconnect.
    Lost(String),
    /// The hub said `stop` (it is shutting down); reconnect when it is back.
    HubStopped,
    /// The hub refused the hello: for now (`retryable`, e.g. another driver is connected)
    /// or for good (e.g. the channel does not match the socket).
    Refused { code: String, message: String, retryable: bool },
}

impl Shared {
    /// Takes the new connection; returns the frames that state what the driver set (health,
    /// the runs' environment) and then the inbound to send again, in that order.
    fn connected(&self, sink: FrameSink, negotiated: Extensions) -> (Vec<Frame>, Vec<Frame>) {
        let mut state = self.lock();
        state.sink = Some(sink);
        state.negotiated = Some(negotiated);
        state.connected_since = Some(Instant::now());
        let health = state.health.clone().map(|h| {
            Frame::Health(channeld_protocol::frame::HealthReport {
                health: sanitise(h, negotiated),
            })
        });
        let agent_env =
            state.agent_env.clone().filter(|_| negotiated.agent_env).map(Frame::AgentEnv);
        (health.into_iter().chain(agent_env).collect(), state.pending.frames_in_order())
    }

    fn disconnected(&self) {
        let mut state = self.lock();
        state.sink = None;
        state.negotiated = None;
        state.connected_since = None;
        // Their answers would come on this connection: the requests fail `Disconnected`.
        state.requests.clear();
    }
}

pub(crate) struct Session<D> {
    pub driver: Arc<D>,
    pub shared: Arc<Shared>,
    pub tracker: TaskTracker,
    pub recent: Arc<Mutex<RecentPosts>>,
    pub handlers: Arc<Semaphore>,
    pub queued: Arc<Semaphore>,
}

/// What a session's frame loop woke for, besides its socket.
enum Woke {
    /// The session is asked to stop.
    Stop,
    /// Time for a heartbeat.
    Heartbeat,
    /// Time to expire the replies that waited too long.
    Sweep,
    /// The connection's writer ended (a write failed).
    WriterGone,
}

impl<D: Driver> Session<D> {
    pub async fn run(
        self,
        stream: UnixStream,
        session_token: &CancellationToken,
        admissions: &mpsc::Sender<Admission>,
    ) -> SessionEnd {
        let launch = &self.shared.launch;
        let (mut reader, sink, writer) = match split_unix(stream, SEND_QUEUE) {
            Ok(split) => split,
            Err(err) => return SessionEnd::Lost(format!("could not watch the connection: {err}")),
        };
        let hello_id = request_id(launch, "hello");
        let hello = Frame::Hello(Hello {
            request_id: hello_id.clone(),
            channel: launch.channel.clone(),
            capabilities: self.shared.declaration.capabilities,
            actions: self.shared.declaration.actions,
            extensions: self.shared.wanted.names(),
            operator_actions: if self.shared.wanted.operator_action {
                self.shared.declaration.operator_actions.clone()
            } else {
                Vec::new()
            },
        });
        let start = Frame::Start(Lifecycle { request_id: request_id(launch, "start") });
        if sink.send(&hello).await.is_err() || sink.send(&start).await.is_err() {
            return SessionEnd::Lost("hub closed the socket during the handshake".into());
        }

        let (negotiated, mut first) =
            match self.await_hello_ack(&mut reader, &sink, &hello_id).await {
                Ok(pair) => pair,
                Err(end) => return end,
            };
        info!(
            channel = %launch.channel,
            extensions = ?negotiated.names(),
            "connected to the hub"
        );
        if admissions.send(Admission::Accepted).await.is_err() {
            return SessionEnd::Finished;
        }
        let (stated, resend) = self.shared.connected(sink.clone(), negotiated);
        for frame in stated {
            let _ = sink.try_send(&frame);
        }
        for frame in resend {
            if sink.send(&frame).await.is_err() {
                break;
            }
            self.shared.after_write(&frame);
        }

        let mut heartbeat = tokio::time::interval(HEARTBEAT_INTERVAL);
        heartbeat.tick().await;
        let mut sweep = tokio::time::interval(Duration::from_secs(5));
        // The loop's futures borrow the sink, which is dropped after it.
        let end = {
            // Made once per session, not per frame: a fresh one registers its waiter again.
            let (stopping, writer_gone) = (session_token.cancelled(), sink.closed());
            tokio::pin!(stopping, writer_gone);
            // A frame already here goes on without polling the rest (each poll takes a
            // lock); the rest still go first every `FRAMES_BETWEEN_CHECKS` frames.
            let mut turns = SocketFirst::default();
            loop {
                let turn = match first.take() {
                    Some(frame) => Turn::Frame(Ok(Some(Ok(frame)))),
                    None => {
                        let others = async {
                            tokio::select! {
                                biased;
                                () = &mut stopping => Woke::Stop,
                                _ = heartbeat.tick() => Woke::Heartbeat,
                                _ = sweep.tick() => Woke::Sweep,
                                () = &mut writer_gone => Woke::WriterGone,
                            }
                        };
                        turns.next(reader.next(), others).await
                    }
                };
                let item = match turn {
                    Turn::Frame(item) => item,
                    Turn::Other(Woke::Stop) => {
                        let stop =
                            Frame::Stop(Lifecycle { request_id: request_id(launch, "stop") });
                        let _ = sink.send(&stop).await;
                        break SessionEnd::Finished;
                    }
                    Turn::Other(Woke::Heartbeat) => {
                        let _ = sink.try_send(&Frame::Event(EventFrame {
                            event: LifecycleEvent::Heartbeat,
                        }));
                        continue;
                    }
                    Turn::Other(Woke::Sweep) => {
                        self.shared.expire(launch.reply_timeout);
                        continue;
                    }
                    Turn::Other(Woke::WriterGone) => {
                        self.read_what_is_left(&mut reader, &sink, negotiated, &hello_id).await;
                        break SessionEnd::Lost("write to the hub failed".into());
                    }
                };
                match item {
                    Ok(Some(Ok(frame))) => {
                        if let Some(end) = self.dispatch(frame, &sink, negotiated, &hello_id).await
                        {
                            break end;
                        }
                    }
                    Ok(Some(Err(err))) => {
                        warn!(code = err.code(), error = %err, "undecodable line from the hub");
                        let _ = sink.try_send(&err.to_error_frame());
                    }
                    Ok(None) => break SessionEnd::Lost("hub closed the connection".into()),
                    Err(err) => break SessionEnd::Lost(format!("read failed: {err}")),
                }
            }
        };
        self.shared.disconnected();
        drop(sink);
        let _ = tokio::time::timeout(Duration::from_secs(2), writer.close()).await;
        end
    }

    /// Dispatches the frames the hub sent before the connection broke, until the end of the
    /// stream or [`READ_AFTER_WRITE_FAILURE`]. A failed write can be noticed before the
    /// runtime has seen that the socket is readable, so frames written just before the hub
    /// closed (an `accepted`, a `deliver`) may still be unread.
    async fn read_what_is_left(
        &self,
        reader: &mut FrameReader<QuietRead>,
        sink: &FrameSink,
        negotiated: Extensions,
        hello_id: &Id,
    ) {
        let deadline = tokio::time::Instant::now() + READ_AFTER_WRITE_FAILURE;
        while let Ok(Ok(Some(item))) = tokio::time::timeout_at(deadline, reader.next()).await {
            if let Ok(frame) = item
                && self.dispatch(frame, sink, negotiated, hello_id).await.is_some()
            {
                return;
            }
        }
    }

    /// Waits briefly for the hub's `hello_ack`. A reference hub sends none; whatever it sends
    /// first is handed back to be dispatched.
    async fn await_hello_ack(
        &self,
        reader: &mut FrameReader<QuietRead>,
        sink: &FrameSink,
        hello_id: &Id,
    ) -> Result<(Extensions, Option<Frame>), SessionEnd> {
        if self.shared.wanted.is_empty() {
            return Ok((Extensions::default(), None));
        }
        let deadline = tokio::time::Instant::now() + HELLO_ACK_WAIT;
        loop {
            match tokio::time::timeout_at(deadline, reader.next()).await {
                Err(_) => return Ok((Extensions::default(), None)),
                Ok(Ok(Some(Ok(Frame::HelloAck(ack))))) => {
                    let agreed =
                        self.shared.wanted.intersect(Extensions::from_names(&ack.extensions));
                    return Ok((agreed, None));
                }
                Ok(Ok(Some(Ok(Frame::Error(err)))))
                    if err.request_id.as_ref() == Some(hello_id) =>
                {
                    return Err(refusal(err));
                }
                Ok(Ok(Some(Ok(frame)))) => return Ok((Extensions::default(), Some(frame))),
                Ok(Ok(Some(Err(err)))) => {
                    // Answer the bad line as the ABI requires and keep waiting for the ack.
                    warn!(code = err.code(), error = %err, "undecodable line from the hub");
                    let _ = sink.try_send(&err.to_error_frame());
                }
                Ok(Ok(None)) => {
                    return Err(SessionEnd::Lost(
                        "hub closed the connection during the handshake".into(),
                    ));
                }
                Ok(Err(err)) => return Err(SessionEnd::Lost(format!("read failed: {err}"))),
            }
        }
    }

    async fn dispatch(
        &self,
        frame: Frame,
        sink: &FrameSink,
        ext: Extensions,
        hello_id: &Id,
    ) -> Option<SessionEnd> {
        match frame {
            Frame::Accepted(accepted) => {
                let outcome = Acceptance::Accepted { duplicate: accepted.duplicate };
                self.shared.resolve(accepted.event_id.as_str(), outcome);
            }
            Frame::Deliver(delivery) => {
                // Without `accepted`, a reply is the first sign the hub took the message.
                self.shared.resolve(
                    delivery.request_id.as_str(),
                    Acceptance::Accepted { duplicate: false },
                );
                // A run ended, so the hub has room for an inbound it refused `busy`.
                self.resend_waiting(sink);
                self.spawn_post(
                    PostKind::Reply { event_id: delivery.request_id.clone() },
                    delivery,
                    sink,
                    ext,
                )
                .await;
            }
            Frame::Outbound(delivery) => {
                let refusal = if self.shared.closing.is_cancelled() {
                    Some(("draining", "driver is shutting down", true))
                } else if !self.shared.declaration.capabilities.send {
                    Some(("unsupported", "driver did not declare send", false))
                } else {
                    None
                };
                match refusal {
                    Some((code, message, retryable)) => {
                        let frame =
                            Frame::error(Some(delivery.request_id), code, message, retryable);
                        let _ = sink.send(&frame).await;
                    }
                    None => {
                        let kind = PostKind::Proactive { request_id: delivery.request_id.clone() };
                        self.spawn_post(kind, delivery, sink, ext).await;
                    }
                }
            }
            Frame::Effect(effect) => self.spawn_effect(effect, sink).await,
            Frame::Command(command) => self.spawn_command(command, sink, ext).await,
            Frame::OperatorAction(request) if ext.operator_action => {
                self.spawn_operator_action(request, sink).await;
            }
            Frame::HealthRequest(request) => {
                let reported = self.shared.lock().health.clone();
                let health = sanitise(reported.unwrap_or_else(Health::ready), ext);
                let answer = Frame::HealthResponse(HealthResponse {
                    request_id: request.request_id,
                    health,
                });
                let _ = sink.try_send(&answer);
            }
            Frame::HistoryResult(result) => {
                let request_id = result.request_id.clone();
                if !self.shared.complete_request(&request_id, Ok(Frame::HistoryResult(result))) {
                    debug!(%request_id, "history_result nobody waits for");
                }
            }
            // In order: each step is handled before the next frame is read.
            Frame::Stream(step) if ext.stream => self.driver.stream(step).await,
            Frame::CancelResult(result) => {
                let request_id = result.request_id.clone();
                if !self.shared.complete_request(&request_id, Ok(Frame::CancelResult(result))) {
                    debug!(%request_id, "cancel_result nobody waits for");
                }
            }
            Frame::Error(err)
                if err
                    .request_id
                    .as_ref()
                    .is_some_and(|id| self.shared.lock().requests.contains_key(id)) =>
            {
                let request_id = err.request_id.clone().expect("checked above");
                self.shared.complete_request(&request_id, Err(err));
            }
            Frame::Error(err) => return self.on_error(err, sink, hello_id),
            Frame::Stop(_) => return Some(SessionEnd::HubStopped),
            Frame::HelloAck(_) | Frame::HealthResponse(_) | Frame::Health(_) | Frame::Event(_) => {}
            other => {
                let kind = other.type_name();
                debug!(frame = kind, "unexpected frame from the hub");
                let answer = Frame::error(
                    None,
                    "unexpected_frame",
                    format!("a driver does not accept {kind} frames"),
                    false,
                );
                let _ = sink.try_send(&answer);
            }
        }
        None
    }

    fn on_error(&self, err: ErrorFrame, sink: &FrameSink, hello_id: &Id) -> Option<SessionEnd> {
        let Some(request_id) = err.request_id.clone() else {
            warn!(code = %err.code, message = %err.message, "error from the hub");
            return None;
        };
        if &request_id == hello_id {
            return Some(refusal(err));
        }
        let action = self.shared.lock().pending.on_error(
            request_id.as_str(),
            &err.code,
            &err.message,
            err.retryable,
        );
        match action {
            ErrorAction::Retry(delay) => {
                debug!(event_id = %request_id, code = %err.code, ?delay, "hub asked to retry");
                let shared = self.shared.clone();
                let sink = sink.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    // Unless a finished run already resent it.
                    let frame = shared.lock().pending.take_waiting(request_id.as_str());
                    if let Some(frame) = frame
                        && sink.send(&frame).await.is_ok()
                    {
                        shared.after_write(&frame);
                    }
                });
            }
            ErrorAction::Resolved => {
                self.shared.slots.add_permits(1);
                // A denied sender is the allowlist doing its job: the hub logs it already.
                if err.code == "sender_denied" {
                    debug!(event_id = %request_id, code = %err.code, "the hub denied the sender");
                } else {
                    warn!(event_id = %request_id, code = %err.code, message = %err.message, "hub rejected an inbound");
                }
            }
            ErrorAction::NotPending => {
                // Often a run that failed: a slot is free again.
                self.resend_waiting(sink);
                warn!(request_id = %request_id, code = %err.code, message = %err.message, "error from the hub");
            }
        }
        None
    }

    /// A run ended on the hub, so a slot is free: resend the oldest inbound it refused `busy`.
    fn resend_waiting(&self, sink: &FrameSink) {
        let Some(frame) = self.shared.lock().pending.take_oldest_waiting() else { return };
        let shared = self.shared.clone();
        let sink = sink.clone();
        tokio::spawn(async move {
            if sink.send(&frame).await.is_ok() {
                shared.after_write(&frame);
            }
        });
    }

    /// Runs `handle(driver, sink)` once a handler is free, holding a slot of the bounded queue
    /// of hub requests meanwhile. The reader waits here only when [`MAX_QUEUED_REQUESTS`] are
    /// queued; it never waits for a handler itself, so `accepted` and `error` frames are read
    /// even while every handler is busy. A request that finds no handler free takes its
    /// place in the handlers' queue before the next frame is read, so requests get handlers
    /// in the order they came. One that finds a handler free runs here until it first waits,
    /// and only one that waits becomes a tracked task: a post that completes at once (a
    /// driver that hands it to a queue, the console) costs no task.
    async fn spawn_handler<F, Fut>(&self, sink: &FrameSink, handle: F)
    where
        F: FnOnce(Arc<D>, FrameSink) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Ok(queued) = self.queued.clone().acquire_owned().await else { return };
        let handler = match self.handlers.clone().try_acquire_owned() {
            Ok(handler) => handler,
            Err(TryAcquireError::Closed) => return,
            Err(TryAcquireError::NoPermits) => {
                // Polled once, the wait joins the handlers' queue now; its task keeps that
                // place (the box keeps the queue's entry where it is).
                // (A handler released on another thread meanwhile is taken at once.)
                let mut wait = Box::pin(self.handlers.clone().acquire_owned());
                match wait.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                    Poll::Ready(Ok(handler)) => handler,
                    Poll::Ready(Err(_)) => return,
                    Poll::Pending => {
                        let (driver, sink) = (self.driver.clone(), sink.clone());
                        self.tracker.spawn(async move {
                            let Ok(handler) = wait.await else { return };
                            let _permits = (queued, handler);
                            // Boxed: a driver's post or effect future (an HTTP request's
                            // state, often kilobytes) would otherwise size the task tokio
                            // copies on spawn.
                            Box::pin(handle(driver, sink)).await;
                        });
                        return;
                    }
                }
            }
        };
        // Boxed before its first poll: a future that waits is moved into its task.
        let mut handler_future = Box::pin(handle(self.driver.clone(), sink.clone()));
        if !finished_here(handler_future.as_mut()) {
            self.tracker.spawn(async move {
                let _permits = (queued, handler);
                handler_future.await;
            });
        }
    }

    async fn spawn_post(
        &self,
        kind: PostKind,
        delivery: Delivery,
        sink: &FrameSink,
        ext: Extensions,
    ) {
        let request_id = delivery.request_id.clone();
        let is_reply = matches!(kind, PostKind::Reply { .. });
        let answers = !is_reply || ext.reply_receipt;
        let waiter = answers.then(|| sink.clone());
        match self.recent.lock().unwrap_or_else(|p| p.into_inner()).begin(&request_id, waiter) {
            PostState::New => {}
            // The post in flight answers this copy too, once it is done: a hub that
            // reconnected meanwhile waits on its new session for the answer.
            PostState::InFlight => return,
            PostState::Done(receipt) => {
                debug!(%request_id, "redelivered request already posted; answering with its receipt");
                if answers {
                    let _ = sink.try_send(&Frame::Receipt(Receipt { request_id, receipt }));
                }
                return;
            }
        }
        let recent = self.recent.clone();
        self.spawn_handler(sink, move |driver, sink| async move {
            let result = driver.post(Post { kind, message: delivery.message }).await;
            let answer = match result {
                Ok(receipt) => Frame::Receipt(Receipt { request_id: request_id.clone(), receipt }),
                Err(err) => {
                    warn!(%request_id, code = err.code(), error = %err, "post failed");
                    post_error_frame(request_id.clone(), &err)
                }
            };
            let (line, waiting) = {
                let mut recent = recent.lock().unwrap_or_else(|p| p.into_inner());
                // Encoded only when someone hears it, and before the receipt moves into the
                // ring (not cloned for it): one line for every copy.
                let line = (answers || recent.is_awaited(&request_id))
                    .then(|| channeld_protocol::encode(&answer));
                let receipt = match answer {
                    Frame::Receipt(Receipt { receipt, .. }) => Some(receipt),
                    _ => None,
                };
                (line, recent.finish(&request_id, receipt))
            };
            let mut line = match line {
                Some(Ok(line)) => line,
                // No one to answer: a reply without the `reply_receipt` extension, no copy.
                None => return,
                Some(Err(err)) => {
                    warn!(%request_id, error = %err, "cannot encode the post's answer");
                    return;
                }
            };
            if answers {
                let own = if waiting.is_empty() { std::mem::take(&mut line) } else { line.clone() };
                let _ = sink.send_encoded(own).await;
            }
            for other in waiting {
                let _ = other.send_encoded(line.clone()).await;
            }
        })
        .await;
    }

    async fn spawn_effect(&self, frame: EffectFrame, sink: &FrameSink) {
        if !self.shared.declaration.actions.allows(&frame.effect) {
            let message = format!("action {} not declared by this driver", frame.effect.action());
            let _ = sink.try_send(&Frame::error(
                Some(frame.request_id),
                "unsupported_effect",
                message,
                false,
            ));
            return;
        }
        self.spawn_handler(sink, move |driver, sink| async move {
            let request_id = frame.request_id.clone();
            let request = EffectRequest {
                request_id: frame.request_id,
                target: frame.target,
                effect: frame.effect,
            };
            if let Err(err) = driver.effect(request).await {
                let code = match err {
                    EffectError::Unsupported => "unsupported_effect",
                    EffectError::Failed(_) => "effect_failed",
                };
                let _ =
                    sink.send(&Frame::error(Some(request_id), code, err.to_string(), false)).await;
            }
        })
        .await;
    }

    async fn spawn_command(&self, frame: CommandFrame, sink: &FrameSink, ext: Extensions) {
        let own = PeerDeclaration {
            legacy: false,
            capabilities: self.shared.declaration.capabilities,
            actions: self.shared.declaration.actions,
            extensions: ext,
        };
        if let Err(refusal) = own.command_gate(&frame.command) {
            let result = channeld_protocol::types::CommandResult::rejected(refusal.to_string());
            let answer = command_result(&frame, result, None);
            let _ = sink.try_send(&answer);
            return;
        }
        self.spawn_handler(sink, move |driver, sink| async move {
            let request = CommandRequest {
                request_id: frame.request_id.clone(),
                session: frame.session.clone(),
                command_id: frame.command_id.clone(),
                command: frame.command.clone(),
                target: frame.target.clone(),
            };
            let answer = driver.command(request).await;
            let responder = if ext.responder { answer.responder } else { None };
            let _ = sink.send(&command_result(&frame, answer.result, responder)).await;
        })
        .await;
    }

    /// Answers an operator action: `unsupported` for a name the driver did not declare,
    /// otherwise the driver's result.
    async fn spawn_operator_action(&self, frame: OperatorActionFrame, sink: &FrameSink) {
        let request_id = frame.request_id.clone();
        if !self.shared.declaration.operator_actions.contains(&frame.name) {
            let answer = operator_action_result(request_id, Err(OperatorActionError::Unsupported));
            let _ = sink.try_send(&answer);
            return;
        }
        self.spawn_handler(sink, move |driver, sink| async move {
            let name = frame.name.clone();
            let result = driver.operator_action(OperatorAction { name, args: frame.args }).await;
            match &result {
                Ok(_) => info!(%request_id, action = %frame.name, "operator action done"),
                Err(err) => warn!(%request_id, action = %frame.name, code = err.code(), error = %err, "operator action failed"),
            }
            let _ = sink.send(&operator_action_result(request_id, result)).await;
        })
        .await;
    }
}

fn operator_action_result(
    request_id: Id,
    result: Result<serde_json::Value, OperatorActionError>,
) -> Frame {
    let answer = match result {
        Ok(data) => OperatorActionResult {
            request_id,
            ok: true,
            code: None,
            message: None,
            data: (!data.is_null()).then_some(data),
        },
        Err(err) => OperatorActionResult {
            request_id,
            ok: false,
            code: Some(err.code().to_owned()),
            message: Some(err.to_string()),
            data: None,
        },
    };
    Frame::OperatorActionResult(answer)
}

fn command_result(
    frame: &CommandFrame,
    result: channeld_protocol::types::CommandResult,
    responder: Option<channeld_protocol::types::Participant>,
) -> Frame {
    Frame::CommandResult(CommandResultFrame {
        request_id: frame.request_id.clone(),
        session: frame.session.clone(),
        command_id: frame.command_id.clone(),
        result,
        responder,
    })
}

fn refusal(err: ErrorFrame) -> SessionEnd {
    SessionEnd::Refused { code: err.code, message: err.message, retryable: err.retryable }
}

/// Polls a handler once, with a waker that does nothing (one that waits is spawned, and its
/// task's first poll registers the task's own); whether it finished. A panic ends the
/// handler as it would end its task, and not the session: logged, the handler dropped.
fn finished_here(handler: Pin<&mut (impl Future<Output = ()> + ?Sized)>) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    match std::panic::catch_unwind(AssertUnwindSafe(|| handler.poll(&mut cx))) {
        Ok(poll) => poll.is_ready(),
        Err(_) => {
            error!("a driver handler panicked; its request has no answer");
            true
        }
    }
}

fn request_id(launch: &DriverLaunchConfig, suffix: &str) -> Id {
    Id::new(launch.request_id(suffix))
        .unwrap_or_else(|_| Id::new(suffix).expect("static suffix is a valid id"))
}

/// The `error` frame that reports a failed post: `send_failed` (retryable as the driver
/// says: the hub tries a retryable reply again with backoff, never a final one) or
/// `send_unknown` (never retryable: it may have been posted).
pub(crate) fn post_error_frame(request_id: Id, err: &PostError) -> Frame {
    let retryable = matches!(err, PostError::Failed { retryable: true, .. });
    Frame::error(Some(request_id), err.code(), err.to_string(), retryable)
}

enum PostState {
    New,
    InFlight,
    Done(DeliveryReceipt),
}

/// At most this many redelivered copies of one post in flight wait for its answer.
const WAITING_COPIES: usize = 8;

/// Forgotten posts the map of recent posts keeps until it drops them all in one sweep: with
/// [`RECENT_POSTS`] remembered, the map holds at most 6,144 entries.
const SWEEP_EVERY: usize = RECENT_POSTS / 2;

/// Recently handled `deliver`/`outbound` request ids, so a redelivery is not posted twice.
/// The receipts sit in a ring in the order they were posted; the map holds only each id's
/// place in it (numbered from the first post), so its entries stay small: dropping the
/// oldest post touched a cold 184-byte bucket per post (6 % of a driver's CPU per message).
/// The ring drops its oldest receipt as a new one comes; the map keeps the dropped post's
/// number, which no longer finds a receipt, until a sweep of the whole map every
/// [`SWEEP_EVERY`] posts: a sequential scan instead of a cold bucket per post.
#[derive(Debug, Default)]
pub(crate) struct RecentPosts {
    /// Posts in flight, with the sinks of redelivered copies that wait for their answer.
    in_flight: HashMap<Id, Vec<FrameSink>>,
    /// Each remembered post's number, and for at most [`SWEEP_EVERY`] forgotten posts a
    /// number below `first`.
    done: HashMap<Id, u64>,
    /// The remembered posts, oldest first; the front one is number `first`.
    receipts: VecDeque<(Id, DeliveryReceipt)>,
    first: u64,
}

impl RecentPosts {
    /// `waiter`: where a copy that arrives while the post is in flight wants its answer.
    fn begin(&mut self, request_id: &Id, waiter: Option<FrameSink>) -> PostState {
        if let Some(receipt) = self.receipt(request_id) {
            return PostState::Done(receipt.clone());
        }
        if let Some(waiting) = self.in_flight.get_mut(request_id) {
            if let Some(waiter) = waiter
                && waiting.len() < WAITING_COPIES
            {
                waiting.push(waiter);
            }
            return PostState::InFlight;
        }
        self.in_flight.insert(request_id.clone(), Vec::new());
        PostState::New
    }

    /// Records the outcome and returns the copies waiting for it; failed posts are forgotten
    /// so a retry may post. At most [`RECENT_POSTS`] are remembered, the oldest going first.
    fn finish(&mut self, request_id: &Id, receipt: Option<DeliveryReceipt>) -> Vec<FrameSink> {
        let waiting = self.in_flight.remove(request_id).unwrap_or_default();
        let Some(receipt) = receipt else { return waiting };
        if let Some(slot) = self.slot(request_id) {
            self.receipts[slot].1 = receipt;
            return waiting;
        }
        let number = self.first + self.receipts.len() as u64;
        self.done.insert(request_id.clone(), number);
        self.receipts.push_back((request_id.clone(), receipt));
        if self.receipts.len() > RECENT_POSTS {
            self.receipts.pop_front();
            self.first += 1;
        }
        if self.done.len() >= RECENT_POSTS + SWEEP_EVERY {
            let first = self.first;
            self.done.retain(|_, number| *number >= first);
        }
        waiting
    }

    /// Whether a copy of the post in flight waits for its answer.
    fn is_awaited(&self, request_id: &Id) -> bool {
        self.in_flight.get(request_id).is_some_and(|waiting| !waiting.is_empty())
    }

    fn receipt(&self, request_id: &Id) -> Option<&DeliveryReceipt> {
        self.slot(request_id).map(|slot| &self.receipts[slot].1)
    }

    /// Where a remembered post's receipt sits in the ring; `None` for a post never made, or
    /// forgotten and not yet swept.
    fn slot(&self, request_id: &Id) -> Option<usize> {
        let number = *self.done.get(request_id)?;
        let slot = usize::try_from(number.checked_sub(self.first)?).ok()?;
        (slot < self.receipts.len()).then_some(slot)
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::ChannelId;
    use channeld_protocol::types::MessageTarget;

    use super::*;

    fn id(value: &str) -> Id {
        Id::new(value).unwrap()
    }

    fn receipt() -> DeliveryReceipt {
        let channel = ChannelId::new("a.b").unwrap();
        DeliveryReceipt {
            channel: channel.clone(),
            message_id: id("m-1"),
            target: MessageTarget::new(channel, id("c1")),
            timestamp_ms: None,
        }
    }

    #[test]
    fn a_failed_post_is_retryable_only_when_the_driver_says_so_and_unknown_never_is() {
        let cases = [
            (PostError::failed("broker down", true), "send_failed", true),
            (PostError::failed("refused", false), "send_failed", false),
            (PostError::unknown("no confirm"), "send_unknown", false),
        ];
        for (err, code, retryable) in cases {
            match post_error_frame(id("e-1"), &err) {
                Frame::Error(frame) => {
                    assert_eq!(frame.request_id, Some(id("e-1")));
                    assert_eq!((frame.code.as_str(), frame.retryable), (code, retryable), "{err}");
                }
                other => panic!("expected an error frame, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_newest_posts_are_remembered_and_the_oldest_forgotten_first() {
        let mut recent = RecentPosts::default();
        let receipt_for =
            |n: usize| DeliveryReceipt { message_id: id(&format!("m-{n}")), ..receipt() };
        for n in 0..RECENT_POSTS + 10 {
            assert!(matches!(recent.begin(&id(&format!("e-{n}")), None), PostState::New));
            recent.finish(&id(&format!("e-{n}")), Some(receipt_for(n)));
        }
        // Posted again (a retry the hub did not see answered): its newest receipt is kept.
        let again = format!("e-{}", RECENT_POSTS + 5);
        assert!(matches!(recent.begin(&id(&again), None), PostState::Done(_)));
        recent.finish(&id(&again), Some(receipt_for(99_999)));
        for n in 0..10 {
            assert!(matches!(recent.begin(&id(&format!("e-{n}")), None), PostState::New), "e-{n}");
        }
        for n in [10, 11, RECENT_POSTS, RECENT_POSTS + 9] {
            match recent.begin(&id(&format!("e-{n}")), None) {
                PostState::Done(receipt) => {
                    assert_eq!(receipt.message_id.as_str(), format!("m-{n}"), "e-{n}")
                }
                _ => panic!("e-{n} is forgotten"),
            }
        }
        match recent.begin(&id(&again), None) {
            PostState::Done(receipt) => assert_eq!(receipt.message_id.as_str(), "m-99999"),
            _ => panic!("{again} is forgotten"),
        }
        assert_eq!(recent.receipts.len(), RECENT_POSTS);
        assert!(recent.done.len() < RECENT_POSTS + SWEEP_EVERY);
    }

    /// Forgotten posts wait in the map for a sweep: until it comes they are forgotten all the
    /// same, a post made again is remembered anew, and the map's memory stays bounded however
    /// many posts come.
    #[test]
    fn forgotten_posts_stay_forgotten_before_and_after_their_sweep() {
        let mut recent = RecentPosts::default();
        let post = |recent: &mut RecentPosts, n: usize| {
            let id = id(&format!("e-{n}"));
            let state = recent.begin(&id, None);
            recent.finish(&id, Some(receipt()));
            state
        };
        for n in 0..RECENT_POSTS + 1 {
            assert!(matches!(post(&mut recent, n), PostState::New));
        }
        // e-0 has left the ring; its number is still in the map, unswept.
        assert_eq!(recent.done.len(), RECENT_POSTS + 1);
        assert!(recent.receipt(&id("e-0")).is_none());
        // Made again, it is a new post, remembered with a new number.
        assert!(matches!(post(&mut recent, 0), PostState::New));
        assert!(matches!(recent.begin(&id("e-0"), None), PostState::Done(_)));
        let mut peak = 0;
        for n in RECENT_POSTS + 1..4 * RECENT_POSTS {
            assert!(matches!(post(&mut recent, n), PostState::New));
            peak = peak.max(recent.done.len());
        }
        assert_eq!(peak, RECENT_POSTS + SWEEP_EVERY - 1, "swept as it reaches the bound");
        for n in [0, 1, 3 * RECENT_POSTS - 1] {
            assert!(recent.receipt(&id(&format!("e-{n}"))).is_none(), "e-{n}");
        }
        assert!(recent.receipt(&id(&format!("e-{}", 3 * RECENT_POSTS))).is_some());
        // Its memory is bounded: many more posts do not grow the map with them.
        let mut peak_capacity = 0;
        for n in 4 * RECENT_POSTS..16 * RECENT_POSTS {
            post(&mut recent, n);
            peak_capacity = peak_capacity.max(recent.done.capacity());
        }
        assert!(peak_capacity <= 4 * (RECENT_POSTS + SWEEP_EVERY), "{peak_capacity}");
    }

    #[tokio::test]
    async fn a_copy_redelivered_while_its_post_is_in_flight_waits_for_the_answer() {
        let (sink, _writer) = channeld_link::spawn_writer(tokio::io::sink(), 4);
        let mut recent = RecentPosts::default();
        assert!(matches!(recent.begin(&id("e-1"), None), PostState::New));
        assert!(!recent.is_awaited(&id("e-1")), "no copy yet");
        for _ in 0..WAITING_COPIES + 3 {
            assert!(matches!(recent.begin(&id("e-1"), Some(sink.clone())), PostState::InFlight));
        }
        assert!(recent.is_awaited(&id("e-1")));
        let waiting = recent.finish(&id("e-1"), Some(receipt()));
        assert_eq!(waiting.len(), WAITING_COPIES, "bounded");
        assert!(matches!(recent.begin(&id("e-1"), Some(sink.clone())), PostState::Done(_)));
        // A failed post is forgotten: the next copy posts again, and nobody waits any more.
        assert!(matches!(recent.begin(&id("e-2"), None), PostState::New));
        assert!(matches!(recent.begin(&id("e-2"), Some(sink)), PostState::InFlight));
        assert_eq!(recent.finish(&id("e-2"), None).len(), 1);
        assert!(matches!(recent.begin(&id("e-2"), None), PostState::New));
    }
}
