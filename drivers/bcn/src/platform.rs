//! The BCN driver: the [`Driver`] implementation tying the pieces together.
//!
//! `run` keeps one connection ([`session`]) up with the kit's [`Reconnect`]: transient
//! failures retry at 1 s doubling to the configured cap (jittered); `unauthorized` is
//! `auth_rejected` on the slow lane; a version BCN and the driver cannot share is
//! `setup_refused`, retried on the slow lane too. `chat.send` is answered at once with the run
//! id (the inbound's event id) and the message goes to the hub through a bounded queue;
//! the hub's reply goes back as a `chat.event` `final`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::ext::{Extensions, MAX_HISTORY_LIMIT, StreamEnd, StreamFrame};
use channeld_driver_sdk::protocol::types::{Capabilities, DeliveryReceipt, InboundMessage};
use channeld_driver_sdk::transport::websocket::WsSender;
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, Failure, Hub, HubError,
    LinkState, PendingAcks, Post, PostError, PostKind, Reconnect, ReconnectPolicy, Settle,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::config::BcnConfig;
use crate::convert::{self, Context};
use crate::runs::{AbortCheck, Ending, Runs};
use crate::session::{self, End, Handler};
use crate::wire::{
    self, AbortParams, ChatParams, Connected, ErrorBody, HistoryParams, Request, code, method,
};

/// `chat.send` messages accepted from BCN and waiting for the hub. When full, reading from
/// BCN pauses until there is room (nothing is dropped).
pub const DISPATCH_QUEUE: usize = 1024;

/// A message for the hub: answered to BCN already, reported in arrival order.
#[derive(Debug)]
struct Job {
    run_id: String,
    message: InboundMessage,
}

/// What every connection shares with the driver.
#[derive(Debug)]
struct Shared {
    config: Arc<BcnConfig>,
    /// The live connection's writer, if any.
    current: watch::Sender<Option<WsSender>>,
    runs: Runs,
    context: Mutex<Context>,
    /// The last deprecation notice logged (each distinct one is logged once).
    deprecation: Mutex<Option<String>>,
    hub: Mutex<Option<Hub>>,
    jobs: mpsc::Sender<Job>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    /// The current connection's writer, waiting until `deadline` for one.
    async fn sender(&self, deadline: Instant) -> Option<WsSender> {
        let mut current = self.current.subscribe();
        let found = tokio::time::timeout_at(deadline, current.wait_for(Option::is_some)).await;
        match found {
            Ok(Ok(sender)) => sender.clone(),
            _ => None,
        }
    }

    /// Sends the next `chat.event` of a run (ending it with `ending`); false when the run
    /// is unknown or has ended (the event is suppressed) or no connection came up in time.
    async fn chat_event(
        &self,
        run_id: &str,
        state: &str,
        text: Option<&str>,
        ending: Option<Ending>,
    ) -> Result<u64, String> {
        self.chat_event_with(run_id, state, text, ending, serde_json::Map::new()).await
    }

    /// [`chat_event`](Self::chat_event) with `extra` payload fields (`routing`, tool fields).
    async fn chat_event_with(
        &self,
        run_id: &str,
        state: &str,
        text: Option<&str>,
        ending: Option<Ending>,
        extra: serde_json::Map<String, Value>,
    ) -> Result<u64, String> {
        let deadline = Instant::now() + self.config.send_timeout;
        let Some(sender) = self.sender(deadline).await else {
            return Err("not connected to BCN".into());
        };
        let Some(slot) = self.runs.next(run_id, ending) else {
            return Err(format!("run {run_id} is unknown or has ended"));
        };
        let mut payload = convert::chat_event(run_id, slot.group_id.as_deref(), state, text);
        if let Value::Object(fields) = &mut payload {
            fields.extend(extra);
        }
        if let Err(err) = sender.send_text(wire::event(method::CHAT_EVENT, payload, slot.seq)).await
        {
            // Not sent: the run stays where it was, so a retry sends the same event.
            self.runs.undo(run_id, slot.seq);
            return Err(format!("the connection to BCN closed: {err}"));
        }
        Ok(slot.seq)
    }

    fn up_state(&self, connected: &Connected, negotiated: u32) -> LinkState {
        let mut detail =
            format!("connected as bot {} (protocol v{negotiated})", connected.bot_uuid);
        if let Some(deprecation) = &connected.deprecation {
            let sunset = deprecation.sunset_date.as_deref().unwrap_or("unannounced");
            detail.push_str(&format!("; deprecation: {} (sunset {sunset})", deprecation.message));
        }
        LinkState::up_as(detail)
    }
}

impl Handler for Shared {
    fn connected(&self, sender: WsSender, connected: &Connected, negotiated: u32) {
        if negotiated != self.config.protocol_version {
            info!(
                asked = self.config.protocol_version,
                negotiated, "BCN negotiated another protocol version"
            );
        }
        if let Some(deprecation) = &connected.deprecation {
            let mut logged = lock(&self.deprecation);
            if logged.as_deref() != Some(deprecation.message.as_str()) {
                warn!(
                    message = %deprecation.message,
                    sunset_date = deprecation.sunset_date.as_deref().unwrap_or("unannounced"),
                    "BCN deprecates the protocol version in use: upgrade CHANNELD_BCN_PROTOCOL_VERSION"
                );
                *logged = Some(deprecation.message.clone());
            }
        }
        info!(bot_uuid = %connected.bot_uuid, is_new = connected.is_new, negotiated, "connected to BCN");
        *lock(&self.context) = Context { protocol_version: negotiated, env: connected.env.clone() };
        if let Some(hub) = lock(&self.hub).as_ref() {
            // The env (with the bot token) goes to the hub once, held in its memory; only a
            // hub without `agent_env` gets it in each inbound's metadata instead.
            if let Err(err) = hub.agent_env(connected.env.clone()) {
                info!(error = %err, "the hub takes the BCN env only in each inbound's metadata");
            }
            hub.link_state(self.up_state(connected, negotiated));
        }
        self.current.send_replace(Some(sender));
    }

    fn disconnected(&self) {
        self.current.send_replace(None);
    }

    async fn request(&self, sender: &WsSender, request: Request) {
        let id = request.id.clone();
        let answer = match request.method.as_str() {
            method::SEND => self.chat_send(request).await,
            // Observation only: nothing runs, nothing answers.
            method::INJECT => Ok(json!({})),
            method::ABORT => self.chat_abort(request).await,
            method::HISTORY => self.chat_history(request).await,
            other => Err(ErrorBody::new(code::UNKNOWN_METHOD, format!("unknown method {other}"))),
        };
        let frame = match answer {
            Ok(payload) => wire::ok(&id, payload),
            Err(error) => {
                debug!(%id, code = %error.code, message = %error.message, "request refused");
                wire::refuse(&id, &error)
            }
        };
        if sender.send_text(frame).await.is_err() {
            debug!(%id, "the connection closed before the answer");
        }
    }
}

impl Shared {
    /// Starts a run: checks the message, answers with the run id, queues it for the hub.
    async fn chat_send(&self, request: Request) -> Result<Value, ErrorBody> {
        let params: ChatParams = serde_json::from_value(request.params)
            .map_err(|err| ErrorBody::new(code::INVALID_REQUEST, format!("chat.send: {err}")))?;
        let run_id = format!("run-{:016x}", fastrand::u64(..));
        let mut context = lock(&self.context).clone();
        let hub_lacks_agent_env =
            lock(&self.hub).as_ref().and_then(Hub::negotiated).is_some_and(|ext| !ext.agent_env);
        if !hub_lacks_agent_env {
            // The hub has it from `agent_env`: the token stays out of the ledger's records.
            context.env.clear();
        }
        let message = convert::inbound_message(&self.config.channel, &run_id, &params, &context)
            .map_err(|err| ErrorBody::new(code::INVALID_REQUEST, format!("chat.send: {err}")))?;
        self.runs.start(&run_id, &params.session_key, params.bcs_group_id.clone());
        let job = Job { run_id: run_id.clone(), message };
        if self.jobs.send(job).await.is_err() {
            self.runs.next(&run_id, Some(Ending::Error));
            return Err(ErrorBody::new(code::UNAVAILABLE, "the driver is stopping"));
        }
        Ok(json!({"run_id": run_id}))
    }

    fn hub(&self) -> Result<Hub, ErrorBody> {
        lock(&self.hub).clone().ok_or_else(|| {
            ErrorBody::new(code::UNAVAILABLE, "the driver is not connected to its hub")
        })
    }

    /// The hub's stored history of the session key: the newest `limit`, oldest first.
    async fn chat_history(&self, request: Request) -> Result<Value, ErrorBody> {
        let params: HistoryParams = serde_json::from_value(request.params)
            .map_err(|err| ErrorBody::new(code::INVALID_REQUEST, format!("chat.history: {err}")))?;
        let mut payload = json!({"session_key": params.session_key, "messages": []});
        if let Some(group) = self.runs.group_of(&params.session_key) {
            payload["session_id"] = json!(group);
        }
        let limit = params.limit.map(|limit| limit.min(u64::from(MAX_HISTORY_LIMIT)) as u32);
        // No such conversation can exist (an invalid id) or nothing was asked for.
        let Ok(conversation) = Id::new(&params.session_key) else { return Ok(payload) };
        if limit == Some(0) {
            return Ok(payload);
        }
        let entries = self.hub()?.history(conversation, None, limit).await.map_err(|err| {
            ErrorBody::new(code::UNAVAILABLE, format!("the hub's history is unavailable: {err}"))
        })?;
        payload["messages"] = entries
            .iter()
            .map(|entry| {
                json!({"role": entry.role.as_str(), "content": entry.text, "timestamp": entry.at_ms})
            })
            .collect();
        Ok(payload)
    }

    async fn chat_abort(&self, request: Request) -> Result<Value, ErrorBody> {
        let params: AbortParams = serde_json::from_value(request.params)
            .map_err(|err| ErrorBody::new(code::INVALID_REQUEST, format!("chat.abort: {err}")))?;
        match self.runs.check_abort(&params.run_id, &params.session_key) {
            AbortCheck::Unknown => {
                Err(ErrorBody::new(code::NOT_FOUND, format!("no run {}", params.run_id)))
            }
            AbortCheck::OtherSession => Err(ErrorBody::new(
                code::INVALID_REQUEST,
                format!("run {} belongs to another session_key", params.run_id),
            )),
            AbortCheck::Ended => Ok(json!({"aborted": false, "aborted_run_ids": []})),
            AbortCheck::Active => {
                let event_id = Id::new(&params.run_id)
                    .map_err(|err| ErrorBody::new(code::INVALID_REQUEST, err.to_string()))?;
                let result = self.hub()?.cancel(event_id).await.map_err(|err| match err {
                    HubError::Refused { code: refused, message, .. }
                        if refused == "unknown_event" =>
                    {
                        ErrorBody::new(code::NOT_FOUND, message)
                    }
                    other => ErrorBody::new(
                        code::UNAVAILABLE,
                        format!("the hub could not cancel: {other}"),
                    ),
                })?;
                // The hub has stopped the run; whatever it still had is suppressed. If its
                // end did not come as a stream frame, the run ends here.
                let _ = self
                    .chat_event(&params.run_id, wire::state::ABORTED, None, Some(Ending::Aborted))
                    .await;
                self.runs.abort(&params.run_id);
                let ids: Vec<&str> = result
                    .cancelled
                    .iter()
                    .map(Id::as_str)
                    .filter(|id| *id == params.run_id)
                    .collect();
                Ok(json!({"aborted": !ids.is_empty(), "aborted_run_ids": ids}))
            }
        }
    }

    /// A step of a run's streamed output as a `chat.event`.
    async fn on_stream(&self, frame: StreamFrame) {
        let run_id = frame.event_id.as_str();
        let sent = if let Some(end) = frame.end {
            let (state, text) = match end {
                StreamEnd::Aborted => (wire::state::ABORTED, None),
                StreamEnd::Error => (
                    wire::state::ERROR,
                    Some(frame.message.clone().unwrap_or_else(|| "the run failed".into())),
                ),
            };
            let ending = if end == StreamEnd::Aborted { Ending::Aborted } else { Ending::Error };
            self.chat_event(run_id, state, text.as_deref(), Some(ending)).await
        } else if let Some(text) = &frame.text {
            self.chat_event(run_id, wire::state::DELTA, Some(text), None).await
        } else if let Some(tool) = frame.tool {
            let (state, extra) = convert::tool_event(&tool.name, &tool.status, tool.rest);
            self.chat_event_with(run_id, state, None, None, extra).await
        } else {
            return;
        };
        if let Err(err) = sent {
            debug!(%run_id, seq = frame.seq, error = %err, "stream step not sent");
        }
    }
}

/// The Avernet BCN bot driver.
#[derive(Debug)]
pub struct BcnDriver {
    shared: Arc<Shared>,
    queue: Mutex<Option<mpsc::Receiver<Job>>>,
}

impl BcnDriver {
    /// Builds the driver; nothing connects until the SDK calls [`Driver::run`].
    pub fn new(config: BcnConfig) -> Self {
        let (jobs, queue) = mpsc::channel(DISPATCH_QUEUE);
        let (current, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            config: Arc::new(config),
            current,
            runs: Runs::default(),
            context: Mutex::default(),
            deprecation: Mutex::default(),
            hub: Mutex::default(),
            jobs,
        });
        Self { shared, queue: Mutex::new(Some(queue)) }
    }

    /// Keeps a connection up until `shutdown`.
    async fn connect(&self, hub: &Hub, shutdown: &CancellationToken) {
        let config = &self.shared.config;
        let mut reconnect = Reconnect::new(ReconnectPolicy {
            initial: Duration::from_secs(1),
            max: config.reconnect_max,
            reset_after: Duration::from_secs(60),
            operator_initial: config.auth_retry,
            operator_max: config.auth_retry.max(Duration::from_secs(3600)),
        });
        let mut refusals = 0u32;
        loop {
            hub.link_state(LinkState::Connecting { attempt: reconnect.attempt() });
            let end = session::run(config, self.shared.as_ref(), shutdown, &mut reconnect).await;
            match end {
                End::Stopped => return,
                End::AuthRejected(detail) => {
                    refusals += 1;
                    if refusals == 1 {
                        error!(%detail, "BCN refused the bot; retrying slowly");
                    } else {
                        warn!(%detail, refusals, "BCN still refuses the bot");
                    }
                    hub.link_state(LinkState::AuthRejected { detail });
                    if !reconnect.wait(Failure::Operator, shutdown).await {
                        return;
                    }
                }
                End::Unsupported(detail) => {
                    refusals = 0;
                    error!(%detail, "BCN and this driver share no protocol version; retrying slowly");
                    hub.link_state(LinkState::SetupRefused { detail });
                    if !reconnect.wait(Failure::Operator, shutdown).await {
                        return;
                    }
                }
                End::Lost(error) => {
                    refusals = 0;
                    let attempt = reconnect.attempt() + 1;
                    if attempt == 1 || attempt.is_multiple_of(10) {
                        warn!(%error, attempt, "BCN connection lost or unreachable; reconnecting");
                    } else {
                        debug!(%error, attempt, "BCN still unreachable");
                    }
                    hub.link_state(LinkState::Retrying { attempt, error });
                    if !reconnect.wait(Failure::Transient, shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// Reports queued messages to the hub in arrival order.
    async fn dispatch(
        &self,
        hub: &Hub,
        pending: &PendingAcks,
        queue: &mut mpsc::Receiver<Job>,
        shutdown: &CancellationToken,
    ) {
        loop {
            let job = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                job = queue.recv() => match job {
                    Some(job) => job,
                    None => return,
                },
            };
            let reported = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                reported = hub.inbound(job.message) => reported,
            };
            match reported {
                Ok(ticket) => pending
                    .track(ticket, Refusal { shared: self.shared.clone(), run_id: job.run_id }),
                Err(HubError::ShuttingDown) => return,
                Err(err) => {
                    warn!(run_id = %job.run_id, error = %err, "message cannot be passed to the hub");
                    // Said here, not in a task of its own: nothing outlives the intake loop.
                    let text = format!("the hub could not take the message: {err}");
                    let _ = self
                        .shared
                        .chat_event(
                            &job.run_id,
                            wire::state::ERROR,
                            Some(&text),
                            Some(Ending::Error),
                        )
                        .await;
                }
            }
        }
    }
}

/// Tells BCN a run failed when the hub refused its message.
#[derive(Debug)]
struct Refusal {
    shared: Arc<Shared>,
    run_id: String,
}

impl Settle for Refusal {
    async fn settle(self, outcome: &Acceptance) {
        let text = match outcome {
            Acceptance::Rejected { code, message } => {
                format!("the hub refused the message ({code}): {message}")
            }
            _ => return,
        };
        if let Err(err) = self
            .shared
            .chat_event(&self.run_id, wire::state::ERROR, Some(&text), Some(Ending::Error))
            .await
        {
            debug!(run_id = %self.run_id, error = %err, "run error not reported");
        }
    }
}

impl Driver for BcnDriver {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities {
            // `send` is for proactive messages, which BCN bots cannot make; replies to
            // `chat.send` need no capability.
            receive: true,
            group: true,
            websocket: true,
            ..Capabilities::default()
        })
    }

    fn extensions(&self) -> Extensions {
        Extensions::all()
    }

    async fn stream(&self, frame: StreamFrame) {
        self.shared.on_stream(frame).await;
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let Some(mut queue) = lock(&self.queue).take() else {
            return Err(DriverError::platform("run is already running"));
        };
        *lock(&self.shared.hub) = Some(hub.clone());
        let pending = PendingAcks::new();
        tokio::join!(
            self.connect(&hub, &shutdown),
            self.dispatch(&hub, &pending, &mut queue, &shutdown),
        );
        pending.drain(Duration::from_secs(1)).await;
        *lock(&self.shared.hub) = None;
        *lock(&self.queue) = Some(queue);
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = &post.message.target;
        if target.channel != self.shared.config.channel {
            return Err(PostError::failed(format!("target is channel {}", target.channel), false));
        }
        let PostKind::Reply { event_id } = &post.kind else {
            return Err(PostError::failed(
                "BCN bots only answer chat.send; there are no proactive messages",
                false,
            ));
        };
        let run_id = event_id.as_str();
        let Some(run) = self.shared.runs.get(run_id) else {
            return Err(PostError::failed(
                format!(
                    "run {run_id} is unknown to this driver process; BCN cannot take its reply"
                ),
                false,
            ));
        };
        if run.ended.is_some() {
            return Err(PostError::failed(
                format!("run {run_id} has ended; reply suppressed"),
                false,
            ));
        }
        if run.session_key != target.conversation.as_str() {
            return Err(PostError::failed(
                format!("run {run_id} belongs to another session_key"),
                false,
            ));
        }
        let text = post.message.body.text_str();
        let extra = convert::final_extra(&post.message.metadata);
        match self
            .shared
            .chat_event_with(run_id, wire::state::FINAL, Some(text), Some(Ending::Final), extra)
            .await
        {
            Ok(seq) => Ok(DeliveryReceipt {
                channel: target.channel.clone(),
                message_id: channeld_driver_sdk::protocol::Id::new(format!("{run_id}:{seq}"))
                    .map_err(|err| PostError::unknown(err.to_string()))?,
                target: target.clone(),
                timestamp_ms: Some(wire::now_ms()),
            }),
            Err(reason) => Err(PostError::failed(reason, true)),
        }
    }
}
