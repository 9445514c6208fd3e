//! The handle a driver's platform side uses to talk to the hub, and the state it shares with
//! the connection loop.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use channeld_link::FrameSink;
use std::sync::atomic::{AtomicU64, Ordering};

use channeld_protocol::ext::{
    AgentEnv, CANCEL, CancelRequest, CancelResult, Extensions, HISTORY, HistoryEntry,
    HistoryRequest,
};
use channeld_protocol::frame::{ErrorFrame, EventFrame, HealthReport, InboundEventFrame};
use channeld_protocol::types::{Health, InboundMessage, IncomingEvent, LifecycleEvent};
use channeld_protocol::{ChannelId, Frame, Id};
use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;

use crate::driver::Declaration;
use crate::health::LinkState;
use crate::inbound::{Inbound, InboundError};
use crate::launch::DriverLaunchConfig;
use crate::pending::{Acceptance, PendingTable};

/// Inbound messages that may wait for the hub at once; `Hub::inbound` waits beyond this.
pub const MAX_PENDING_INBOUND: usize = 256;

/// Why the hub handle refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    #[error("message is for channel {found}, this driver is {expected}")]
    WrongChannel { expected: ChannelId, found: ChannelId },
    /// The SDK asked `run` to stop (shutdown, or the hub refused this driver): leave the
    /// platform message unacknowledged so the platform redelivers it, and return.
    #[error("the driver is stopping its platform side")]
    ShuttingDown,
    /// The message does not fit in one protocol line; the platform message must be dropped
    /// (or split) by the driver.
    #[error("message does not fit in a frame: {0}")]
    TooLarge(String),
    /// An [`Inbound`] with an invalid part.
    #[error(transparent)]
    Invalid(#[from] InboundError),
    /// A request to the hub (history, cancel) needs an extension the hub did not agree to.
    #[error("the hub did not negotiate the {0} extension")]
    NotNegotiated(&'static str),
    /// No hub connection now, or it closed before the answer.
    #[error("not connected to the hub")]
    Disconnected,
    /// The hub answered the request with an `error` frame.
    #[error("the hub refused the request: {code}: {message}")]
    Refused { code: String, message: String, retryable: bool },
    /// No answer within the timeout.
    #[error("the hub did not answer within {0:?}")]
    Timeout(Duration),
}

/// How long [`Hub::history`] waits for the hub's answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

impl HubError {
    /// True when the platform message can never be delivered as it is (too large, invalid,
    /// for another channel): settle it as refused instead of leaving it for redelivery.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, HubError::ShuttingDown | HubError::Disconnected | HubError::Timeout(_))
    }
}

/// What [`Hub::inbound`] takes: a protocol [`InboundMessage`] or an [`Inbound`] builder.
pub trait IntoInbound {
    fn into_inbound(self, channel: &ChannelId) -> Result<InboundMessage, HubError>;
}

impl IntoInbound for InboundMessage {
    fn into_inbound(self, _channel: &ChannelId) -> Result<InboundMessage, HubError> {
        Ok(self)
    }
}

impl IntoInbound for Inbound {
    fn into_inbound(self, channel: &ChannelId) -> Result<InboundMessage, HubError> {
        Ok(self.build(channel)?)
    }
}

/// What [`Hub::stop_budget`] keeps of the stop deadline for `run` to return in.
pub const STOP_MARGIN: Duration = Duration::from_millis(500);

/// [`Hub::stop_budget`] at `now`. Pure.
pub(crate) fn stop_budget(now: Instant, deadline: Instant, wanted: Duration) -> Duration {
    deadline.saturating_duration_since(now).saturating_sub(STOP_MARGIN).min(wanted)
}

/// A handle to the hub, given to [`Driver::run`](crate::Driver::run). Cheap to clone.
///
/// Messages reported while the hub is unreachable wait (bounded) and are sent when the
/// connection is back; each ticket resolves when the hub has taken responsibility.
#[derive(Debug, Clone)]
pub struct Hub {
    pub(crate) shared: Arc<Shared>,
    /// Cancelled when this `run` must stop (shutdown or a refusal by the hub).
    pub(crate) stop: CancellationToken,
    /// Cancelled once the SDK hands this `run` no more hub requests and those in flight are
    /// done (see [`Hub::requests_done`]).
    pub(crate) idle: CancellationToken,
    /// When this `run` must have returned, fixed by the first to ask once it must stop (the
    /// SDK as it starts waiting, or [`Hub::stop_deadline`]): never after the SDK aborts it.
    pub(crate) stop_by: Arc<OnceLock<Instant>>,
}

/// Resolves when the hub has answered an inbound; see [`Acceptance`]. Hand it to
/// [`PendingAcks::track`](crate::PendingAcks::track) with the platform's acknowledgement.
#[derive(Debug)]
pub struct InboundTicket {
    event_id: Id,
    rx: oneshot::Receiver<Acceptance>,
}

impl InboundTicket {
    /// The event id the message was reported with.
    pub fn event_id(&self) -> &Id {
        &self.event_id
    }

    /// Waits for the hub's answer. Acknowledge to the platform only on `Accepted` (or
    /// `Rejected`, to drop a message the hub will never take).
    pub async fn outcome(self) -> Acceptance {
        self.rx.await.unwrap_or(Acceptance::Unresolved)
    }
}

impl Hub {
    /// The channel instance this driver serves.
    pub fn channel(&self) -> &ChannelId {
        &self.shared.launch.channel
    }

    /// The launch settings.
    pub fn launch(&self) -> &DriverLaunchConfig {
        &self.shared.launch
    }

    /// Inbound messages reported but not yet answered by the hub.
    pub fn pending_inbound(&self) -> usize {
        self.shared.lock().pending.len()
    }

    /// True while a hub connection is up and its handshake is done.
    pub fn is_connected(&self) -> bool {
        self.shared.is_connected()
    }

    /// The instant by which `run` must have returned, once it has been asked to stop (its
    /// shutdown token fired); `None` before. It is the launch's drain time
    /// ([`DriverLaunchConfig::drain_timeout`]) counted from the first time it is asked for
    /// (by `run`, or by the SDK as it starts waiting for `run`), and the SDK never aborts a
    /// `run` before it. Steps a driver takes after the request — a goodbye to the platform,
    /// closing its connection — fit in what is left, less a margin ([`Hub::stop_budget`]),
    /// so they never cost the rest of the stop.
    pub fn stop_deadline(&self) -> Option<Instant> {
        self.stop.is_cancelled().then(|| {
            *self.stop_by.get_or_init(|| Instant::now() + self.shared.launch.drain_timeout)
        })
    }

    /// How long a step of a stopping `run` may wait for the platform: `wanted`, but never
    /// past the [stop deadline](Hub::stop_deadline) less [`STOP_MARGIN`] (zero once that
    /// has passed); `wanted` while `run` has not been asked to stop.
    pub fn stop_budget(&self, wanted: Duration) -> Duration {
        match self.stop_deadline() {
            Some(deadline) => stop_budget(Instant::now(), deadline, wanted),
            None => wanted,
        }
    }

    /// Resolves once the SDK will hand this `run` no more posts, effects, commands or
    /// operator actions and the ones in flight have finished (within the drain deadline):
    /// at once after the hub refused the driver, after the in-flight work on shutdown. A
    /// driver whose posts travel on the connection `run` holds (an MQTT client, a WebSocket)
    /// awaits it after `shutdown` fired and before it disconnects.
    pub async fn requests_done(&self) {
        self.idle.cancelled().await;
    }

    /// Reports a platform message ([`Inbound`] or [`InboundMessage`]); the event id is the
    /// message id. Waits while [`MAX_PENDING_INBOUND`] messages are unanswered.
    pub async fn inbound(&self, message: impl IntoInbound) -> Result<InboundTicket, HubError> {
        let message = message.into_inbound(&self.shared.launch.channel)?;
        self.check_channel(&message.target.channel)?;
        let event_id = message.id.clone();
        let frame = Frame::Inbound(channeld_protocol::frame::Inbound {
            event_id: event_id.clone(),
            message,
        });
        self.submit(event_id, frame).await
    }

    /// Reports a platform event (reaction, typing, edit, delete, read).
    pub async fn inbound_event(
        &self,
        event_id: Id,
        event: IncomingEvent,
    ) -> Result<InboundTicket, HubError> {
        self.check_channel(&event.context().target.channel)?;
        let frame = Frame::InboundEvent(InboundEventFrame { event_id: event_id.clone(), event });
        self.submit(event_id, frame).await
    }

    /// Reports the platform link's state: the SDK turns it into the health the hub shows
    /// (see [`LinkState::health`]) and answers the hub's probes with it.
    pub fn link_state(&self, state: LinkState) {
        self.health(state.health());
    }

    /// Reports a health directly (prefer [`link_state`](Self::link_state)); sent now if
    /// connected, again after each reconnect, and the answer to the hub's probes.
    pub fn health(&self, health: Health) {
        let sink = {
            let mut state = self.shared.lock();
            if state.health.as_ref() == Some(&health) {
                return;
            }
            state.health = Some(health.clone());
            state.sink.clone().map(|sink| (sink, state.negotiated.unwrap_or_default()))
        };
        if let Some((sink, ext)) = sink {
            let _ = sink.try_send(&Frame::Health(HealthReport { health: sanitise(health, ext) }));
        }
    }

    /// What the hub agreed to on the current connection; `None` while not connected.
    pub fn negotiated(&self) -> Option<Extensions> {
        self.shared.lock().negotiated
    }

    /// Sets the environment of this instance's agent runs (extension `agent_env`): what the
    /// platform session hands its agent tools, such as BCN's `bot.connect` `env` with the bot
    /// token. The hub keeps it in memory only (never in its ledger or logs) and exports the
    /// entries in the driver family's namespace (`BCN_…` for `bcn`) to every run started
    /// after it. Replaces the previous set; sent now if connected and again after each
    /// reconnect, before any inbound is sent again. A hub without the extension gets nothing
    /// ([`HubError::NotNegotiated`]); it is kept for a later hub that has it.
    pub fn agent_env(
        &self,
        env: std::collections::BTreeMap<String, String>,
    ) -> Result<(), HubError> {
        let frame = AgentEnv { env };
        let sink = {
            let mut state = self.shared.lock();
            let unchanged = state.agent_env.as_ref() == Some(&frame);
            state.agent_env = Some(frame.clone());
            match state.negotiated {
                Some(ext) if !ext.agent_env => {
                    return Err(HubError::NotNegotiated(channeld_protocol::ext::AGENT_ENV));
                }
                Some(_) if !unchanged => state.sink.clone(),
                _ => None,
            }
        };
        if let Some(sink) = sink {
            let _ = sink.try_send(&Frame::AgentEnv(frame));
        }
        Ok(())
    }

    /// The newest `limit` entries (omitted: the hub's default, 50) of a conversation's history
    /// (and thread), oldest first, as the hub keeps them (extension `history`): the inbound
    /// texts it admitted and the replies posted. Empty when the hub knows nothing of it.
    pub async fn history(
        &self,
        conversation: Id,
        thread: Option<Id>,
        limit: Option<u32>,
    ) -> Result<Vec<HistoryEntry>, HubError> {
        let request_id = self.shared.next_request_id("history");
        let frame = Frame::HistoryRequest(HistoryRequest {
            request_id: request_id.clone(),
            conversation,
            thread,
            limit,
        });
        match self.request(request_id, frame, |ext| ext.history, HISTORY).await? {
            Frame::HistoryResult(result) => Ok(result.entries),
            other => Err(HubError::Refused {
                code: "unexpected_frame".into(),
                message: format!("the hub answered with {}", other.type_name()),
                retryable: false,
            }),
        }
    }

    /// Cancels the run the hub started for the inbound `event_id` (extension `cancel`; the
    /// event id names the run): answered once it is stopped and recorded, after the run's own
    /// ending (`error` `aborted`) reached this driver. `cancelled` is empty when it had
    /// already ended; an unknown event id is `Refused` with code `unknown_event`.
    pub async fn cancel(&self, event_id: Id) -> Result<CancelResult, HubError> {
        let request_id = self.shared.next_request_id("cancel");
        let frame = Frame::Cancel(CancelRequest { request_id: request_id.clone(), event_id });
        match self.request(request_id, frame, |ext| ext.cancel, CANCEL).await? {
            Frame::CancelResult(result) => Ok(result),
            other => Err(HubError::Refused {
                code: "unexpected_frame".into(),
                message: format!("the hub answered with {}", other.type_name()),
                retryable: false,
            }),
        }
    }

    /// Sends `frame` (a request the hub answers with one frame carrying `request_id`) and
    /// waits for that answer or an `error` frame.
    async fn request(
        &self,
        request_id: Id,
        frame: Frame,
        negotiated: fn(&Extensions) -> bool,
        extension: &'static str,
    ) -> Result<Frame, HubError> {
        channeld_protocol::encode(&frame).map_err(|err| HubError::TooLarge(err.to_string()))?;
        let (tx, rx) = oneshot::channel();
        let sink = {
            let mut state = self.shared.lock();
            let Some(ext) = state.negotiated else { return Err(HubError::Disconnected) };
            if !negotiated(&ext) {
                return Err(HubError::NotNegotiated(extension));
            }
            let sink = state.sink.clone().ok_or(HubError::Disconnected)?;
            state.requests.insert(request_id.clone(), tx);
            sink
        };
        if sink.send(&frame).await.is_err() {
            self.shared.lock().requests.remove(&request_id);
            return Err(HubError::Disconnected);
        }
        let answer = tokio::time::timeout(REQUEST_TIMEOUT, rx).await;
        self.shared.lock().requests.remove(&request_id);
        match answer {
            Ok(Ok(Ok(frame))) => Ok(frame),
            Ok(Ok(Err(err))) => Err(HubError::Refused {
                code: err.code,
                message: err.message,
                retryable: err.retryable,
            }),
            Ok(Err(_)) => Err(HubError::Disconnected),
            Err(_) => Err(HubError::Timeout(REQUEST_TIMEOUT)),
        }
    }

    /// Sends a lifecycle event (e.g. `retry_scheduled`) if connected.
    pub fn event(&self, event: LifecycleEvent) {
        if let Some(sink) = self.shared.lock().sink.clone() {
            let _ = sink.try_send(&Frame::Event(EventFrame { event }));
        }
    }

    fn check_channel(&self, channel: &ChannelId) -> Result<(), HubError> {
        if channel != &self.shared.launch.channel {
            return Err(HubError::WrongChannel {
                expected: self.shared.launch.channel.clone(),
                found: channel.clone(),
            });
        }
        Ok(())
    }

    async fn submit(&self, event_id: Id, frame: Frame) -> Result<InboundTicket, HubError> {
        // Encoded once: the size check and the write are the same line.
        let line =
            channeld_protocol::encode(&frame).map_err(|err| HubError::TooLarge(err.to_string()))?;
        if self.stop.is_cancelled() {
            return Err(HubError::ShuttingDown);
        }
        let permit = tokio::select! {
            permit = self.shared.slots.acquire() => permit.map_err(|_| HubError::ShuttingDown)?,
            () = self.stop.cancelled() => return Err(HubError::ShuttingDown),
        };
        let (tx, rx) = oneshot::channel();
        let is_event = matches!(frame, Frame::InboundEvent(_));
        let send_on = {
            let mut state = self.shared.lock();
            // The table keeps the frame for a resend after a reconnect.
            let fresh = state.pending.insert(event_id.clone(), frame, tx);
            if fresh {
                permit.forget();
            }
            if fresh && state.negotiated.is_some() { state.sink.clone() } else { None }
        };
        if let Some(sink) = send_on
            && sink.send_encoded(line).await.is_ok()
            && is_event
        {
            self.shared.event_written(&event_id);
        }
        Ok(InboundTicket { event_id, rx })
    }
}

/// Removes extension fields the peer did not negotiate.
pub(crate) fn sanitise(mut health: Health, ext: Extensions) -> Health {
    if !ext.health_status {
        health.status = None;
    }
    health
}

#[derive(Debug)]
pub(crate) struct SessionState {
    pub sink: Option<FrameSink>,
    /// Known once the handshake finished: what the hub agreed to.
    pub negotiated: Option<Extensions>,
    pub pending: PendingTable,
    pub health: Option<Health>,
    /// The runs' environment the driver set ([`Hub::agent_env`]), sent after each handshake
    /// that negotiated `agent_env`.
    pub agent_env: Option<AgentEnv>,
    pub connected_since: Option<Instant>,
    /// Requests to the hub waiting for their answer, by request id; dropped (answered
    /// `Disconnected`) when the connection ends.
    pub requests: foldhash::HashMap<Id, oneshot::Sender<Result<Frame, ErrorFrame>>>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub launch: DriverLaunchConfig,
    pub declaration: Declaration,
    pub wanted: Extensions,
    pub slots: Semaphore,
    /// Cancelled when the process stops taking platform input (shutdown).
    pub closing: CancellationToken,
    state: Mutex<SessionState>,
    next_request: AtomicU64,
}

impl Shared {
    pub fn new(launch: DriverLaunchConfig, declaration: Declaration, wanted: Extensions) -> Self {
        Self {
            launch,
            declaration,
            wanted,
            slots: Semaphore::new(MAX_PENDING_INBOUND),
            closing: CancellationToken::new(),
            state: Mutex::new(SessionState {
                sink: None,
                negotiated: None,
                pending: PendingTable::default(),
                health: None,
                agent_env: None,
                connected_since: None,
                requests: Default::default(),
            }),
            next_request: AtomicU64::new(1),
        }
    }

    /// A fresh request id: `<channel>-<kind>-<n>`.
    pub fn next_request_id(&self, kind: &str) -> Id {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        Id::new(format!("{}-{kind}-{n}", self.launch.channel)).expect("a channel id is short")
    }

    /// Completes the request waiting for `request_id`; false when none waits.
    pub fn complete_request(&self, request_id: &Id, answer: Result<Frame, ErrorFrame>) -> bool {
        match self.lock().requests.remove(request_id) {
            Some(tx) => {
                let _ = tx.send(answer);
                true
            }
            None => false,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// True while a hub session is up and its handshake is done.
    pub fn is_connected(&self) -> bool {
        self.lock().negotiated.is_some()
    }

    /// Resolves a pending inbound and frees its slot.
    pub fn resolve(&self, event_id: &str, outcome: Acceptance) {
        if self.lock().pending.resolve(event_id, outcome) {
            self.slots.add_permits(1);
        }
    }

    /// Without the `accepted` extension an `inbound_event` counts as taken once written: the
    /// reference hub sends nothing back for it.
    pub fn after_write(&self, frame: &Frame) {
        if let Frame::InboundEvent(event) = frame {
            self.event_written(&event.event_id);
        }
    }

    /// An `inbound_event` was written: without the `accepted` extension the hub answers
    /// nothing for it, so the write is its acceptance.
    fn event_written(&self, event_id: &Id) {
        let accepted_ext = self.lock().negotiated.is_some_and(|ext| ext.accepted);
        if !accepted_ext {
            self.resolve(event_id.as_str(), Acceptance::Accepted { duplicate: false });
        }
    }

    /// Resolves inbound entries older than the reply timeout as unresolved.
    pub fn expire(&self, max_age: Duration) {
        let freed = self.lock().pending.expire(Instant::now(), max_age);
        if freed > 0 {
            self.slots.add_permits(freed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_step_gets_what_it_wants_but_never_the_margin_before_the_deadline() {
        let now = Instant::now();
        let (s, ms) = (Duration::from_secs, Duration::from_millis);
        // A far deadline: the step's own time.
        assert_eq!(stop_budget(now, now + s(30), s(3)), s(3));
        // A near one: what is left, less the margin.
        assert_eq!(stop_budget(now, now + ms(2900), s(3)), ms(2400));
        assert_eq!(stop_budget(now, now + ms(1500), s(3)), ms(1000));
        // Less than the margin left, or past: nothing.
        assert_eq!(stop_budget(now, now + ms(400), s(3)), Duration::ZERO);
        assert_eq!(stop_budget(now + s(1), now, s(3)), Duration::ZERO);
    }
}
