//! The MQTT driver: a rumqttc client whose event loop runs in its own task. Inbound messages
//! go to the hub and are acknowledged (PUBACK) only after its answer; posts are published at
//! QoS 1 and receipted after their PUBACK.
//!
//! Three kinds of task share the client:
//! * the **session** polls rumqttc's event loop for the driver's whole life (also while
//!   draining, so late PUBACKs and acks still flow), reconnects with capped exponential
//!   backoff, resubscribes on every ConnAck, reports health and puts received publishes into
//!   a bounded backlog. It never waits for the hub: the hub's progress can depend on a post,
//!   and a post on a PUBACK only this task reads;
//! * the **dispatcher** ([`Driver::run`]) turns each publish into an inbound frame, hands it to
//!   the hub in arrival order and leaves one waiter per message that acks once the hub has
//!   answered `accepted` (or refused it for good);
//! * **posts** register with the [`Outbox`] and enqueue their publish one at a time, so
//!   rumqttc's packet ids can be matched to them.
//!
//! Acks are keyed by packet id *and* delivery: a PUBACK is sent only for a publish received on
//! the current connection and only once, so a late ack can never acknowledge another message
//! the broker gave the same packet id after a reconnect.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use channeld_driver_sdk::protocol::MAX_LINE_BYTES;
use channeld_driver_sdk::protocol::types::{
    Capabilities, DeliveryReceipt, Health, HealthState, HealthStatus,
};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, Hub, HubError, Post, PostError,
};
use channeld_link::Backoff;
use rumqttc::{
    AsyncClient, ConnectReturnCode, ConnectionError, Event, EventLoop, MqttOptions, NetworkOptions,
    Outgoing, Packet, Publish, QoS, Request, StateError, SubscribeFilter, SubscribeReasonCode,
    TlsConfiguration, Transport,
};
use tokio::sync::{Notify, oneshot, watch};
use tracing::{debug, error, info, warn};

use crate::config::{InboundQos, MqttConfig};
use crate::convert;
use crate::outbox::Outbox;

/// Largest publish the driver sends: a frame's worth of text plus topic and JSON headroom.
pub const MAX_OUTGOING_PACKET: usize = MAX_LINE_BYTES + 64 * 1024;
/// Largest publish the driver reads. Bigger than any usable message, so that one a little too
/// large is read and acknowledged away; a larger one breaks the connection each time the broker
/// redelivers it (cap publishes on the broker, e.g. mosquitto's `max_packet_size`).
pub const MAX_INCOMING_PACKET: usize = 1024 * 1024;
/// rumqttc's request channel (publishes, acks, subscriptions). A full channel makes
/// publishing and acking wait for the event loop.
pub const REQUEST_QUEUE: usize = 64;
/// Received publishes waiting for the dispatcher. The broker's in-flight window (mosquitto:
/// 20 unacknowledged QoS 1 messages per client) keeps it far from full. Beyond it a QoS 1
/// message is left unacknowledged (the broker redelivers it after the next reconnect) and a
/// QoS 0 one is lost, as QoS 0 allows; either is logged as an error.
pub const INBOUND_BACKLOG: usize = 1024;
/// The backlog's limit in payload bytes.
pub const INBOUND_BACKLOG_BYTES: usize = 64 * 1024 * 1024;
/// Outbound publishes awaiting their PUBACK at once (rumqttc's default window).
pub const OUTBOUND_INFLIGHT: u16 = 100;
/// TCP (and TLS) connect plus CONNACK timeout.
const CONNECT_TIMEOUT_SECS: u64 = 10;
/// First reconnect delay; it doubles up to the configured maximum.
const RECONNECT_INITIAL: Duration = Duration::from_millis(500);
/// A connection that lasted this long resets the backoff.
const RECONNECT_RESET_AFTER: Duration = Duration::from_secs(60);

type PostOutcome = Result<(), PostError>;
type PostWaiter = oneshot::Sender<PostOutcome>;

/// Received publishes, oldest first, and their payload bytes.
#[derive(Debug, Default)]
struct Backlog {
    items: VecDeque<Received>,
    bytes: usize,
}

/// Connection state shared by the session, the ack waiters and posts.
#[derive(Debug)]
struct Link {
    outbox: Outbox<PostWaiter>,
    /// QoS 1 publishes received on the current connection and not yet acked: packet id →
    /// delivery sequence number. Cleared when the connection drops.
    unacked: HashMap<u16, u64>,
    health: Health,
}

/// What the session, the dispatcher, the ack waiters and posts share.
#[derive(Debug)]
struct Shared {
    link: Mutex<Link>,
    /// True from a ConnAck until the connection drops; posts wait for it.
    connected: watch::Sender<bool>,
    backlog: Mutex<Backlog>,
    /// Wakes the dispatcher after a push to the backlog.
    received: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a received publish to the backlog; false when it is full.
    fn push_received(&self, received: Received) -> bool {
        {
            let mut backlog = self.backlog.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let len = received.publish.payload.len();
            if backlog.items.len() >= INBOUND_BACKLOG || backlog.bytes + len > INBOUND_BACKLOG_BYTES
            {
                return false;
            }
            backlog.bytes += len;
            backlog.items.push_back(received);
        }
        self.received.notify_one();
        true
    }

    fn pop_received(&self) -> Option<Received> {
        let mut backlog = self.backlog.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let received = backlog.items.pop_front()?;
        backlog.bytes -= received.publish.payload.len();
        Some(received)
    }

    /// Claims the PUBACK of a delivery: true once, and only while its connection lasts.
    fn claim_ack(&self, pkid: u16, seq: u64) -> bool {
        let mut link = self.lock();
        if link.unacked.get(&pkid) == Some(&seq) {
            link.unacked.remove(&pkid);
            true
        } else {
            false
        }
    }
}

/// A publish received from the broker, numbered in arrival order.
#[derive(Debug)]
struct Received {
    publish: Publish,
    seq: u64,
}

/// The MQTT platform driver.
pub struct MqttDriver {
    config: Arc<MqttConfig>,
    client: AsyncClient,
    /// Taken by [`Driver::run`], which starts the session task with it.
    eventloop: Mutex<Option<EventLoop>>,
    shared: Arc<Shared>,
    /// Held while a post registers with the outbox and enters rumqttc's channel, so both
    /// orders agree.
    submit: Arc<tokio::sync::Mutex<()>>,
    ids: IdSource,
    /// Ends the session task when the driver is dropped.
    stop: CancellationToken,
}

impl std::fmt::Debug for MqttDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttDriver")
            .field("channel", &self.config.channel)
            .field("broker", &self.config.broker)
            .field("client_id", &self.config.client_id)
            .finish_non_exhaustive()
    }
}

impl Drop for MqttDriver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl MqttDriver {
    /// Builds the client; nothing connects until [`Driver::run`].
    pub fn new(config: MqttConfig) -> Result<Self, DriverError> {
        let options = mqtt_options(&config)?;
        let (client, mut eventloop) = AsyncClient::new(options, REQUEST_QUEUE);
        let mut network = NetworkOptions::new();
        network.set_tcp_nodelay(true);
        network.set_connection_timeout(CONNECT_TIMEOUT_SECS);
        eventloop.set_network_options(network);
        let health = connecting_health(&config, 0, None);
        let (connected, _) = watch::channel(false);
        Ok(Self {
            config: Arc::new(config),
            client,
            eventloop: Mutex::new(Some(eventloop)),
            shared: Arc::new(Shared {
                link: Mutex::new(Link {
                    outbox: Outbox::default(),
                    unacked: HashMap::new(),
                    health,
                }),
                connected,
                backlog: Mutex::new(Backlog::default()),
                received: Notify::new(),
            }),
            submit: Arc::new(tokio::sync::Mutex::new(())),
            ids: IdSource::new(),
            stop: CancellationToken::new(),
        })
    }

    /// Registers a publish with the outbox and enqueues it. Runs as its own task so that a
    /// cancelled post cannot leave the outbox and rumqttc's channel out of step.
    async fn enqueue(
        &self,
        topic: String,
        payload: Vec<u8>,
    ) -> Result<oneshot::Receiver<PostOutcome>, PostError> {
        let client = self.client.clone();
        let shared = self.shared.clone();
        let submit = self.submit.clone();
        let task = tokio::spawn(async move {
            let _turn = submit.lock().await;
            let (tx, rx) = oneshot::channel();
            shared.lock().outbox.submit(tx);
            if let Err(err) = client.publish(topic, QoS::AtLeastOnce, false, payload).await {
                shared.lock().outbox.withdraw_last();
                return Err(PostError::failed(format!("the MQTT client refused it: {err}"), false));
            }
            Ok(rx)
        });
        task.await.unwrap_or_else(|_| Err(PostError::failed("the publish task failed", false)))
    }
}

impl Driver for MqttDriver {
    fn declaration(&self) -> Declaration {
        let capabilities =
            Capabilities { receive: true, send: true, threads: true, ..Capabilities::default() };
        Declaration { capabilities, actions: Default::default() }
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let eventloop = self
            .eventloop
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .ok_or_else(|| DriverError::Platform("the MQTT driver can run only once".into()))?;
        hub.health(self.shared.lock().health.clone());
        let session = Session {
            config: self.config.clone(),
            client: self.client.clone(),
            shared: self.shared.clone(),
            hub: hub.clone(),
            closing: shutdown.clone(),
            stop: self.stop.clone(),
            backoff: Backoff::new(
                RECONNECT_INITIAL,
                self.config.reconnect_max,
                RECONNECT_RESET_AFTER,
            ),
            seq: 0,
            attempt: 0,
            connected_at: None,
            subscribe_due: false,
        };
        // Not aborted when `run` returns: the session outlives it to finish the drain.
        let mut session = tokio::spawn(session.run(eventloop));
        let dispatcher = Dispatcher {
            config: self.config.clone(),
            client: self.client.clone(),
            shared: self.shared.clone(),
            hub,
            ids: &self.ids,
        };
        tokio::select! {
            () = dispatcher.run(shutdown) => Ok(()),
            // The session ends only when the driver is dropped, which cannot happen while
            // `run` borrows it: anything else is a panic, and without it nothing moves.
            ended = &mut session => Err(DriverError::Platform(match ended {
                Err(err) if err.is_panic() => "the MQTT session task panicked".into(),
                _ => "the MQTT session task ended".into(),
            })),
        }
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = post.message.target.clone();
        if target.channel != self.config.channel {
            return Err(PostError::failed(format!("target is channel {}", target.channel), false));
        }
        let topic = self
            .config
            .outbound
            .render(target.conversation.as_str())
            .map_err(|err| PostError::failed(err.to_string(), false))?;
        let message_id = convert::outbound_message_id(&post.kind);
        let payload = convert::outbound_payload(&message_id, &post.message);
        // Fixed header, topic length, packet id: an oversize packet would break the connection.
        if topic.len() + payload.len() + 16 > MAX_OUTGOING_PACKET {
            return Err(PostError::failed("message too large for one MQTT publish", false));
        }
        let deadline = tokio::time::Instant::now() + self.config.publish_timeout;
        let mut connected = self.shared.connected.subscribe();
        match tokio::time::timeout_at(deadline, connected.wait_for(|up| *up)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return Err(PostError::failed("the MQTT driver stopped", false)),
            Err(_) => {
                return Err(PostError::failed(
                    format!(
                        "not connected to {} within {:?}",
                        self.config.broker, self.config.publish_timeout
                    ),
                    true,
                ));
            }
        }
        let acked = self.enqueue(topic.clone(), payload).await?;
        match tokio::time::timeout_at(deadline, acked).await {
            Ok(Ok(Ok(()))) => {
                debug!(%message_id, %topic, "published and acknowledged by the broker");
                Ok(DeliveryReceipt {
                    channel: self.config.channel.clone(),
                    message_id,
                    target,
                    timestamp_ms: Some(now_ms()),
                })
            }
            Ok(Ok(Err(err))) => Err(err),
            Ok(Err(_)) => Err(PostError::unknown("the MQTT session stopped before the PUBACK")),
            Err(_) => Err(PostError::unknown(format!(
                "no PUBACK within {:?}",
                self.config.publish_timeout
            ))),
        }
    }

    fn health(&self) -> Health {
        self.shared.lock().health.clone()
    }
}

/// The event-loop task: polls rumqttc until the driver is dropped.
struct Session {
    config: Arc<MqttConfig>,
    client: AsyncClient,
    shared: Arc<Shared>,
    hub: Hub,
    /// The driver is draining: received publishes are left unacknowledged for redelivery.
    closing: CancellationToken,
    stop: CancellationToken,
    backoff: Backoff,
    seq: u64,
    /// Failed connection attempts since the last ConnAck.
    attempt: u32,
    connected_at: Option<Instant>,
    /// The subscriptions of this connection are not in rumqttc's channel yet.
    subscribe_due: bool,
}

impl Session {
    async fn run(mut self, mut eventloop: EventLoop) {
        loop {
            // Cancelling a poll can drop a half-written packet; only `stop`, which ends the
            // connection anyway, does it.
            let polled = tokio::select! {
                biased;
                () = self.stop.cancelled() => return,
                polled = eventloop.poll() => polled,
            };
            match polled {
                Ok(event) => self.on_event(event),
                Err(err) => {
                    self.on_connection_error(&mut eventloop, &err);
                    let delay = self.backoff.next_delay();
                    tokio::select! {
                        () = self.stop.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
            if self.subscribe_due {
                self.subscribe();
            }
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Incoming(Packet::ConnAck(ack)) => self.on_connected(ack.session_present),
            Event::Incoming(Packet::Publish(publish)) => self.on_publish(publish),
            Event::Incoming(Packet::PubAck(ack)) => {
                let waiter = self.shared.lock().outbox.acked(ack.pkid);
                match waiter {
                    Some(waiter) => {
                        let _ = waiter.send(Ok(()));
                    }
                    None => debug!(pkid = ack.pkid, "PUBACK for no waiting post"),
                }
            }
            Event::Incoming(Packet::SubAck(ack)) => {
                let refused = ack
                    .return_codes
                    .iter()
                    .filter(|code| matches!(code, SubscribeReasonCode::Failure))
                    .count();
                if refused > 0 {
                    error!(
                        broker = %self.config.broker,
                        filters = ?self.config.subscriptions,
                        refused,
                        "the broker refused a subscription (check its ACL); those messages never arrive"
                    );
                }
            }
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                if let Err(err) = self.shared.lock().outbox.sent(pkid) {
                    warn!(pkid, error = %err, "publish without a waiting post");
                }
            }
            Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                if let Err(err) = self.shared.lock().outbox.collided(pkid) {
                    warn!(pkid, error = %err, "packet id collision without a waiting post");
                }
            }
            _ => {}
        }
    }

    fn on_connected(&mut self, session_present: bool) {
        self.attempt = 0;
        self.connected_at = Some(Instant::now());
        let health = Health {
            state: HealthState::Ready,
            detail: None,
            status: Some(HealthStatus {
                transport: Some("connected".into()),
                auth: Some("ok".into()),
                ..HealthStatus::default()
            }),
        };
        {
            let mut link = self.shared.lock();
            link.health = health.clone();
        }
        self.shared.connected.send_replace(true);
        self.hub.health(health);
        info!(
            broker = %self.config.broker,
            client_id = %self.config.client_id,
            session_present,
            "connected to the broker"
        );
        // The broker may have forgotten the session; subscribing again is idempotent.
        self.subscribe_due = true;
    }

    /// Puts this connection's subscriptions into rumqttc's channel; retried after the next
    /// event when the channel is full (the session cannot wait on its own channel).
    fn subscribe(&mut self) {
        let qos = match self.config.qos {
            InboundQos::AtMostOnce => QoS::AtMostOnce,
            InboundQos::AtLeastOnce => QoS::AtLeastOnce,
        };
        let filters = self
            .config
            .subscriptions
            .iter()
            .map(|filter| SubscribeFilter::new(filter.clone(), qos));
        match self.client.try_subscribe_many(filters) {
            Ok(()) => self.subscribe_due = false,
            Err(err) => {
                debug!(error = %err, "request channel full, subscribing after the next event")
            }
        }
    }

    fn on_publish(&mut self, publish: Publish) {
        if self.closing.is_cancelled() {
            debug!(topic = %publish.topic, "draining: left unacknowledged for redelivery");
            return;
        }
        self.seq += 1;
        let (pkid, qos, topic) = (publish.pkid, publish.qos, publish.topic.clone());
        if qos != QoS::AtMostOnce {
            self.shared.lock().unacked.insert(pkid, self.seq);
        }
        if !self.shared.push_received(Received { publish, seq: self.seq }) {
            self.shared.lock().unacked.remove(&pkid);
            error!(
                %topic,
                ?qos,
                limit = INBOUND_BACKLOG,
                "inbound backlog full: the broker sends more unacknowledged messages than the driver holds \
                 (lower its in-flight window); this one waits for a redelivery after the next reconnect (QoS 1) or is lost (QoS 0)"
            );
        }
    }

    fn on_connection_error(&mut self, eventloop: &mut EventLoop, err: &ConnectionError) {
        let was_up = self.connected_at.take();
        if let Some(since) = was_up {
            self.backoff.record_uptime(since.elapsed());
        }
        self.attempt = self.attempt.saturating_add(1);
        let auth_refused = matches!(
            err,
            ConnectionError::ConnectionRefused(
                ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized
            )
        );
        let health = connecting_health(&self.config, self.attempt, Some((err, auth_refused)));
        let (acked, lost) = {
            let mut link = self.shared.lock();
            link.health = health.clone();
            link.unacked.clear();
            // Events rumqttc buffered before the error still happened: a PUBACK among them
            // is a real acknowledgement, a publish among them did get its packet id.
            let mut acked = Vec::new();
            for event in eventloop.state.events.drain(..) {
                match event {
                    Event::Incoming(Packet::PubAck(ack)) => {
                        acked.extend(link.outbox.acked(ack.pkid))
                    }
                    Event::Outgoing(Outgoing::Publish(pkid)) => {
                        let _ = link.outbox.sent(pkid);
                    }
                    Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                        let _ = link.outbox.collided(pkid);
                    }
                    _ => {}
                }
            }
            // rumqttc would replay these on a resumed session; the posts waiting for them are
            // answered now instead, and the hub decides whether to send again.
            let unsent = eventloop
                .pending
                .iter()
                .filter(|request| matches!(request, Request::Publish(p) if p.pkid == 0))
                .count();
            eventloop.pending.retain(|request| !matches!(request, Request::Publish(_)));
            eventloop.state.collision = None;
            (acked, link.outbox.connection_lost(unsent))
        };
        for waiter in acked {
            let _ = waiter.send(Ok(()));
        }
        let (failed, unknown) = (lost.failed.len(), lost.unknown.len());
        for waiter in lost.failed {
            let _ = waiter.send(Err(PostError::failed(
                "the broker connection dropped before the message was sent",
                true,
            )));
        }
        for waiter in lost.unknown {
            let _ = waiter
                .send(Err(PostError::unknown("the broker connection dropped before its PUBACK")));
        }
        self.shared.connected.send_replace(false);
        self.hub.health(health);

        let broker = &self.config.broker;
        if too_large(err) {
            error!(%broker, error = %err, limit = MAX_INCOMING_PACKET, "the broker sent a message over the size limit; it comes back on every reconnect until the broker drops it");
        } else if auth_refused && self.attempt == 1 {
            error!(%broker, error = %err, "the broker refused the credentials");
        } else if was_up.is_some() {
            warn!(%broker, error = %err, failed, unknown, "lost the broker connection, reconnecting");
        } else if self.attempt == 1 || self.attempt.is_multiple_of(10) {
            warn!(%broker, error = %err, attempt = self.attempt, "cannot reach the broker, retrying");
        } else {
            debug!(%broker, error = %err, attempt = self.attempt, "broker still unreachable");
        }
    }
}

fn too_large(err: &ConnectionError) -> bool {
    matches!(
        err,
        ConnectionError::MqttState(StateError::Deserialization(
            rumqttc::Error::PayloadSizeLimitExceeded(_)
        ))
    )
}

/// Health while not connected: Degraded with the reason, never a secret (rumqttc's errors
/// carry addresses and return codes, not credentials).
fn connecting_health(
    config: &MqttConfig,
    attempt: u32,
    error: Option<(&ConnectionError, bool)>,
) -> Health {
    let (transport, detail, auth) = match error {
        None => ("connecting", format!("connecting to {}", config.broker), None),
        Some((err, auth_refused)) => (
            "disconnected",
            format!("broker {} unreachable: {err}", config.broker),
            auth_refused.then(|| "rejected".to_owned()),
        ),
    };
    Health {
        state: HealthState::Degraded,
        detail: Some(detail),
        status: Some(HealthStatus {
            transport: Some(transport.into()),
            auth,
            attempt: Some(attempt),
            ..HealthStatus::default()
        }),
    }
}

/// Hands received publishes to the hub, in order, and acks each once the hub has answered.
struct Dispatcher<'a> {
    config: Arc<MqttConfig>,
    client: AsyncClient,
    shared: Arc<Shared>,
    hub: Hub,
    ids: &'a IdSource,
}

impl Dispatcher<'_> {
    async fn run(self, shutdown: CancellationToken) {
        loop {
            let Some(next) = self.shared.pop_received() else {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return,
                    () = self.shared.received.notified() => continue,
                }
            };
            if shutdown.is_cancelled() || !self.dispatch(next).await {
                return;
            }
        }
    }

    /// Returns false once the hub handle is shutting down.
    async fn dispatch(&self, received: Received) -> bool {
        let acker = Acker { client: self.client.clone(), shared: self.shared.clone() };
        let topic = received.publish.topic.as_str();
        // The broker sets `retain` only when a (re)subscription replays a topic's last
        // retained message: old state, not a new message, and replayed on every reconnect.
        if received.publish.retain {
            info!(%topic, "retained message replayed by the subscription; acknowledged and ignored");
            acker.ack(&received).await;
            return true;
        }
        let Some(identity) = self.config.inbound.identify(topic) else {
            warn!(%topic, "topic does not match the inbound template; acknowledged and dropped");
            acker.ack(&received).await;
            return true;
        };
        let payload = match convert::parse_payload(&received.publish.payload) {
            Ok(payload) => payload,
            Err(err) => {
                warn!(%topic, error = %err, "unusable payload; acknowledged and dropped");
                acker.ack(&received).await;
                return true;
            }
        };
        if let Some(claimed) = payload.claimed_sender.as_deref()
            && claimed != identity.sender
        {
            debug!(%topic, claimed, sender = identity.sender, "payload names another sender; the topic wins");
        }
        let generated = self.ids.next();
        let message = match convert::inbound_message(
            &self.config.channel,
            topic,
            identity,
            payload,
            &generated,
        ) {
            Ok(message) => message,
            Err(err) => {
                warn!(%topic, error = %err, "message cannot become an inbound frame; acknowledged and dropped");
                acker.ack(&received).await;
                return true;
            }
        };
        let event_id = message.id.clone();
        match self.hub.inbound(message).await {
            Ok(ticket) => {
                tokio::spawn(async move {
                    match ticket.outcome().await {
                        Acceptance::Accepted { duplicate } => {
                            debug!(%event_id, duplicate, "hub accepted; acknowledging");
                            acker.ack(&received).await;
                        }
                        Acceptance::Rejected { code, message } => {
                            info!(%event_id, %code, %message, "hub refused the message; acknowledged and dropped");
                            acker.ack(&received).await;
                        }
                        Acceptance::Unresolved => {
                            debug!(%event_id, "no answer from the hub; left for the broker to redeliver");
                        }
                    }
                });
                true
            }
            Err(HubError::ShuttingDown) => {
                debug!(%event_id, "draining: left unacknowledged for redelivery");
                false
            }
            Err(err @ HubError::TooLarge(_)) => {
                warn!(%event_id, error = %err, "message does not fit in a frame; acknowledged and dropped");
                acker.ack(&received).await;
                true
            }
            Err(err @ HubError::WrongChannel { .. }) => {
                error!(%event_id, error = %err, "hub handle refused the message; left unacknowledged");
                true
            }
        }
    }
}

/// Sends PUBACKs for deliveries of the current connection.
struct Acker {
    client: AsyncClient,
    shared: Arc<Shared>,
}

impl Acker {
    async fn ack(&self, received: &Received) {
        let publish = &received.publish;
        if publish.qos == QoS::AtMostOnce {
            return;
        }
        if !self.shared.claim_ack(publish.pkid, received.seq) {
            debug!(
                pkid = publish.pkid,
                "received on an earlier connection; the broker redelivers it"
            );
            return;
        }
        if let Err(err) = self.client.ack(publish).await {
            debug!(error = %err, "MQTT client stopped before the PUBACK");
        }
    }
}

/// Event ids for messages without a payload id: unique per process start and delivery.
#[derive(Debug)]
struct IdSource {
    prefix: String,
    next: AtomicU64,
}

impl IdSource {
    fn new() -> Self {
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
        Self {
            prefix: format!("mqtt-{started:x}-{:x}", std::process::id()),
            next: AtomicU64::new(1),
        }
    }

    fn next(&self) -> String {
        format!("{}-{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn mqtt_options(config: &MqttConfig) -> Result<MqttOptions, DriverError> {
    if config.client_id.is_empty() {
        return Err(DriverError::Config("the MQTT client id is empty".into()));
    }
    let mut options =
        MqttOptions::new(config.client_id.clone(), config.broker.host.clone(), config.broker.port);
    options
        .set_keep_alive(config.keep_alive)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(MAX_INCOMING_PACKET, MAX_OUTGOING_PACKET)
        .set_request_channel_capacity(REQUEST_QUEUE)
        .set_inflight(OUTBOUND_INFLIGHT);
    if let Some(username) = &config.username {
        let password = config.password.as_ref().map_or("", |secret| secret.expose());
        options.set_credentials(username.clone(), password);
    }
    if config.broker.tls {
        let tls = tls_config(config)?;
        options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(Arc::new(tls))));
    }
    Ok(options)
}

/// rustls with the ring provider chosen explicitly (not the process default), trusting the
/// configured CA file or the system's roots.
fn tls_config(config: &MqttConfig) -> Result<rustls::ClientConfig, DriverError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let mut roots = rustls::RootCertStore::empty();
    match &config.ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|err| {
                    DriverError::Config(format!("CHANNELD_MQTT_CA_FILE {}: {err}", path.display()))
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(DriverError::Config(format!(
                    "CHANNELD_MQTT_CA_FILE {} holds no usable certificate",
                    path.display()
                )));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for err in &native.errors {
                warn!(error = %err, "could not load some system CA certificates");
            }
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                return Err(DriverError::Config(
                    "no system CA certificates found; set CHANNELD_MQTT_CA_FILE".into(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| DriverError::Config(format!("TLS setup: {err}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tls)
}
