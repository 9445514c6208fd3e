//! The broker side of one `run`: a connection loop that gives every broker connection its own
//! rumqttc client, event loop, publisher task and outbox, and drops them all when the
//! connection ends, so nothing is replayed behind the hub's back and no rumqttc state is
//! patched by hand.
//!
//! * The **event loop** (this task) polls rumqttc, reconnects with the kit's [`Reconnect`]
//!   (a slow lane for refused credentials), resubscribes on every ConnAck, reports the link
//!   state, and puts received publishes into the run's bounded [`Backlog`]. It never waits for
//!   the hub: the hub's progress can depend on a post, and a post on a PUBACK only this task
//!   reads.
//! * The **publisher** of a connection takes posts from a bounded queue one at a time,
//!   registers each with the connection's [`Outbox`] and hands it to rumqttc, so rumqttc's
//!   packet ids can be matched to posts (see `outbox`).
//!
//! Acks are keyed by packet id *and* delivery: a PUBACK is sent only for a publish received on
//! the connection it travels on and only once (see [`claim_ack`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::{
    CancellationToken, Failure, Hub, LinkState, PostError, Reconnect, ReconnectPolicy,
};
use rumqttc::{
    AsyncClient, ConnectReturnCode, ConnectionError, Event, EventLoop, MqttOptions, NetworkOptions,
    Outgoing, Packet, Publish, QoS, StateError, SubscribeFilter, SubscribeReasonCode,
};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tracing::{debug, error, info, warn};

use crate::config::{InboundQos, MqttConfig};
use crate::outbox::Outbox;

/// Largest publish the driver reads. Bigger than any usable message, so that one a little too
/// large is read and acknowledged away; a larger one breaks the connection each time the broker
/// redelivers it (cap publishes on the broker, e.g. mosquitto's `max_packet_size`).
pub const MAX_INCOMING_PACKET: usize = 1024 * 1024;
/// rumqttc's request channel (publishes, acks, subscriptions). A full channel makes
/// publishing and acking wait for the event loop.
pub const REQUEST_QUEUE: usize = 64;
/// Posts waiting for a connection's publisher; a post waits for room (within its publish
/// timeout) beyond this.
pub const PUBLISH_QUEUE: usize = 64;
/// Received publishes waiting for the dispatcher. Each is acknowledged once the hub
/// answered, which it does when the message is recorded and queued for its run, so in a burst
/// the broker can have many messages unacknowledged with the driver: mosquitto 2.0.11 was
/// seen sending more than 1,024 to a connected QoS 1 subscriber during a 10,000-message
/// burst. The backlog holds a 10,000-message burst; the byte bound below limits its memory.
/// Beyond either, a QoS 1 message is left unacknowledged (the broker redelivers it after the
/// next reconnect) and a QoS 0 one is lost, as QoS 0 allows; either is logged as an error.
pub const INBOUND_BACKLOG: usize = 16 * 1024;
/// The backlog's limit in payload bytes.
pub const INBOUND_BACKLOG_BYTES: usize = 64 * 1024 * 1024;
/// Outbound publishes awaiting their PUBACK at once (rumqttc's default window).
pub const OUTBOUND_INFLIGHT: u16 = 100;
/// TCP (and TLS) connect plus CONNACK timeout.
const CONNECT_TIMEOUT_SECS: u64 = 10;
/// How long a stopping connection waits for its DISCONNECT to be written.
const DISCONNECT_WITHIN: Duration = Duration::from_secs(1);

/// The outcome a post waits for.
pub(crate) type PostOutcome = Result<(), PostError>;
pub(crate) type PostWaiter = oneshot::Sender<PostOutcome>;

/// One broker connection's state, shared by its event loop, its publisher and the acks of the
/// messages it delivered.
#[derive(Debug, Default)]
pub(crate) struct ConnState {
    outbox: Outbox<PostWaiter>,
    /// QoS 1 publishes received on this connection and not yet acked: packet id → delivery
    /// number. Emptied when the connection drops.
    unacked: HashMap<u16, u64>,
    /// The connection dropped: nothing more is submitted to it.
    lost: bool,
}

pub(crate) type Conn = Arc<Mutex<ConnState>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Claims the PUBACK of a delivery: true once, and only while its connection lasts.
pub(crate) fn claim_ack(conn: &Conn, pkid: u16, seq: u64) -> bool {
    let mut state = lock(conn);
    if state.unacked.get(&pkid) == Some(&seq) {
        state.unacked.remove(&pkid);
        true
    } else {
        false
    }
}

/// A post for the publisher.
#[derive(Debug)]
pub(crate) struct PublishJob {
    pub topic: String,
    pub payload: Vec<u8>,
    pub waiter: PostWaiter,
}

/// Where posts go while a connection is up.
#[derive(Debug, Clone)]
pub(crate) struct Live {
    pub jobs: mpsc::Sender<PublishJob>,
}

/// A publish received from the broker, with what its PUBACK needs.
#[derive(Debug)]
pub(crate) struct Received {
    pub publish: Publish,
    /// Its number among this run's deliveries.
    pub seq: u64,
    /// The client and state of the connection it arrived on.
    pub client: AsyncClient,
    pub conn: Conn,
}

/// Received publishes, oldest first, bounded by count and payload bytes.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    items: Mutex<(VecDeque<Received>, usize)>,
    /// Wakes the dispatcher after a push.
    pub received: Notify,
}

impl Backlog {
    /// Adds a received publish; false when it is full.
    fn push(&self, received: Received) -> bool {
        {
            let mut guard = lock(&self.items);
            let (items, bytes) = &mut *guard;
            let len = received.publish.payload.len();
            if items.len() >= INBOUND_BACKLOG || *bytes + len > INBOUND_BACKLOG_BYTES {
                return false;
            }
            *bytes += len;
            items.push_back(received);
        }
        self.received.notify_one();
        true
    }

    pub fn pop(&self) -> Option<Received> {
        let mut guard = lock(&self.items);
        let (items, bytes) = &mut *guard;
        let received = items.pop_front()?;
        *bytes -= received.publish.payload.len();
        Some(received)
    }
}

/// How one connection ended.
enum End {
    /// The run is over.
    Stopped,
    /// The connection failed; `was_up` when the broker had accepted it.
    Failed { err: ConnectionError, was_up: bool },
}

/// The connection loop of one `run`.
pub(crate) struct Session {
    pub config: Arc<MqttConfig>,
    pub options: MqttOptions,
    pub hub: Hub,
    /// Where posts find the live connection; `None` while there is none.
    pub live: Arc<watch::Sender<Option<Live>>>,
    pub backlog: Arc<Backlog>,
    /// Cancelled when the run stops taking input: later publishes are left unacknowledged
    /// for the broker to redeliver.
    pub input: CancellationToken,
    /// Cancelled when the connection must close for good.
    pub stop: CancellationToken,
    pub reconnect: Reconnect,
    pub seq: u64,
}

impl Session {
    pub fn new(
        config: Arc<MqttConfig>,
        options: MqttOptions,
        hub: Hub,
        live: Arc<watch::Sender<Option<Live>>>,
        input: CancellationToken,
        stop: CancellationToken,
    ) -> Self {
        let policy = ReconnectPolicy::default().with_max(config.reconnect_max);
        Self {
            config,
            options,
            hub,
            live,
            backlog: Arc::default(),
            input,
            stop,
            reconnect: Reconnect::new(policy),
            seq: 0,
        }
    }

    /// Connects, serves, reconnects, until `stop`.
    pub async fn run(mut self) {
        self.hub.link_state(LinkState::Connecting { attempt: 0 });
        loop {
            let (client, mut eventloop) = AsyncClient::new(self.options.clone(), REQUEST_QUEUE);
            let mut network = NetworkOptions::new();
            network.set_tcp_nodelay(true);
            network.set_connection_timeout(CONNECT_TIMEOUT_SECS);
            eventloop.set_network_options(network);
            let conn = Conn::default();
            let lost = CancellationToken::new();
            let (jobs, queued) = mpsc::channel(PUBLISH_QUEUE);
            let publisher =
                tokio::spawn(publish_loop(client.clone(), conn.clone(), queued, lost.clone()));

            let end = self.serve(&mut eventloop, &client, &conn, jobs).await;
            self.live.send_replace(None);
            let (failed, unknown) = connection_lost(&eventloop, &conn);
            lost.cancel();
            let _ = publisher.await;
            drop(eventloop);
            match end {
                End::Stopped => return,
                End::Failed { err, was_up } => {
                    if !self.after_failure(&err, was_up, failed, unknown).await {
                        return;
                    }
                }
            }
        }
    }

    /// Polls one connection until it fails or the run stops.
    async fn serve(
        &mut self,
        eventloop: &mut EventLoop,
        client: &AsyncClient,
        conn: &Conn,
        jobs: mpsc::Sender<PublishJob>,
    ) -> End {
        let mut subscribe_due = false;
        let mut was_up = false;
        loop {
            // Cancelling a poll can drop a half-written packet; only `stop`, which ends the
            // connection anyway, does it.
            let polled = tokio::select! {
                biased;
                () = self.stop.cancelled() => {
                    disconnect(eventloop, client).await;
                    return End::Stopped;
                }
                polled = eventloop.poll() => polled,
            };
            match polled {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    was_up = true;
                    self.reconnect.connected();
                    self.live.send_replace(Some(Live { jobs: jobs.clone() }));
                    self.hub.link_state(LinkState::up_as(format!(
                        "connected to {}",
                        self.config.broker
                    )));
                    info!(
                        broker = %self.config.broker,
                        client_id = %self.config.client_id,
                        session_present = ack.session_present,
                        "connected to the broker"
                    );
                    // The broker may have forgotten the session; subscribing again is idempotent.
                    subscribe_due = true;
                }
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    self.on_publish(publish, client, conn);
                }
                Ok(Event::Incoming(Packet::PubAck(ack))) => {
                    let waiter = lock(conn).outbox.acked(ack.pkid);
                    match waiter {
                        Some(waiter) => {
                            let _ = waiter.send(Ok(()));
                        }
                        None => debug!(pkid = ack.pkid, "PUBACK for no waiting post"),
                    }
                }
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
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
                Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                    if let Err(err) = lock(conn).outbox.sent(pkid) {
                        warn!(pkid, error = %err, "publish without a waiting post");
                    }
                }
                Ok(Event::Outgoing(Outgoing::AwaitAck(pkid))) => {
                    if let Err(err) = lock(conn).outbox.collided(pkid) {
                        warn!(pkid, error = %err, "packet id collision without a waiting post");
                    }
                }
                Ok(_) => {}
                Err(err) => return End::Failed { err, was_up },
            }
            if subscribe_due {
                subscribe_due = !subscribe(&self.config, client);
            }
        }
    }

    fn on_publish(&mut self, publish: Publish, client: &AsyncClient, conn: &Conn) {
        if self.input.is_cancelled() {
            debug!(topic = %publish.topic, "not taking input: left unacknowledged for redelivery");
            return;
        }
        self.seq += 1;
        let (pkid, qos, topic) = (publish.pkid, publish.qos, publish.topic.clone());
        if qos != QoS::AtMostOnce {
            lock(conn).unacked.insert(pkid, self.seq);
        }
        let received =
            Received { publish, seq: self.seq, client: client.clone(), conn: conn.clone() };
        if !self.backlog.push(received) {
            lock(conn).unacked.remove(&pkid);
            error!(
                %topic,
                ?qos,
                limit = INBOUND_BACKLOG,
                "inbound backlog full: the broker sends more unacknowledged messages than the driver holds \
                 (lower its in-flight window); this one waits for a redelivery after the next reconnect (QoS 1) or is lost (QoS 0)"
            );
        }
    }

    /// Reports a failed connection, answers its posts and waits before the next attempt;
    /// false when the run stopped meanwhile.
    async fn after_failure(
        &mut self,
        err: &ConnectionError,
        was_up: bool,
        failed: usize,
        unknown: usize,
    ) -> bool {
        let broker = &self.config.broker;
        let auth_refused = matches!(
            err,
            ConnectionError::ConnectionRefused(
                ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized
            )
        );
        let failure = if auth_refused { Failure::Operator } else { Failure::Transient };
        let first_failure = was_up || self.reconnect.attempt() == 0;
        let delay = self.reconnect.failed(failure);
        let attempt = self.reconnect.attempt();
        if auth_refused {
            self.hub.link_state(LinkState::AuthRejected {
                detail: format!("broker {broker} refused the credentials: {err}"),
            });
        } else {
            self.hub.link_state(LinkState::Retrying {
                attempt,
                error: format!("broker {broker}: {err}"),
            });
        }
        if too_large(err) {
            error!(%broker, error = %err, limit = MAX_INCOMING_PACKET, "the broker sent a message over the size limit; it comes back on every reconnect until the broker drops it");
        } else if auth_refused && first_failure {
            error!(%broker, error = %err, "the broker refused the credentials; retrying slowly");
        } else if was_up {
            warn!(%broker, error = %err, failed, unknown, "lost the broker connection, reconnecting");
        } else if attempt == 1 || attempt.is_multiple_of(10) {
            warn!(%broker, error = %err, attempt, "cannot reach the broker, retrying");
        } else {
            debug!(%broker, error = %err, attempt, "broker still unreachable");
        }
        self.reconnect.sleep(delay, &self.stop).await
    }
}

/// Puts the subscriptions into rumqttc's channel; false when it is full (the event loop
/// cannot wait on its own channel: tried again after the next event).
fn subscribe(config: &MqttConfig, client: &AsyncClient) -> bool {
    let qos = match config.qos {
        InboundQos::AtMostOnce => QoS::AtMostOnce,
        InboundQos::AtLeastOnce => QoS::AtLeastOnce,
    };
    let filters =
        config.subscriptions.iter().map(|filter| SubscribeFilter::new(filter.clone(), qos));
    match client.try_subscribe_many(filters) {
        Ok(()) => true,
        Err(err) => {
            debug!(error = %err, "request channel full, subscribing after the next event");
            false
        }
    }
}

/// Sends DISCONNECT and polls until it is written (bounded), so the broker sees a clean end.
async fn disconnect(eventloop: &mut EventLoop, client: &AsyncClient) {
    if client.try_disconnect().is_err() {
        return;
    }
    let _ = tokio::time::timeout(DISCONNECT_WITHIN, async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// Answers the posts of a connection that ended: events rumqttc read or wrote before the end
/// but had not handed out yet still happened (read, never modified: a PUBACK among them is a
/// real acknowledgement, a publish among them did get its packet id); then every waiter left
/// is failed (never written) or unknown (written, no PUBACK). Returns how many of each.
fn connection_lost(eventloop: &EventLoop, conn: &Conn) -> (usize, usize) {
    let (acked, lost) = {
        let mut state = lock(conn);
        state.lost = true;
        state.unacked.clear();
        let mut acked = Vec::new();
        for event in &eventloop.state.events {
            match event {
                Event::Incoming(Packet::PubAck(ack)) => acked.extend(state.outbox.acked(ack.pkid)),
                Event::Outgoing(Outgoing::Publish(pkid)) => {
                    let _ = state.outbox.sent(*pkid);
                }
                Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                    let _ = state.outbox.collided(*pkid);
                }
                _ => {}
            }
        }
        (acked, state.outbox.connection_lost())
    };
    for waiter in acked {
        let _ = waiter.send(Ok(()));
    }
    let counts = (lost.failed.len(), lost.unknown.len());
    for waiter in lost.failed {
        let _ = waiter.send(Err(PostError::failed(
            "the broker connection dropped before the message was sent",
            true,
        )));
    }
    for waiter in lost.unknown {
        let _ =
            waiter.send(Err(PostError::unknown("the broker connection dropped before its PUBACK")));
    }
    counts
}

/// Hands posts to rumqttc one at a time, each registered with the outbox just before it
/// enters rumqttc's channel, so both orders agree. Ends when the connection is lost; waiters
/// already registered are answered by [`connection_lost`], jobs still queued are dropped
/// (their posts see "not sent").
async fn publish_loop(
    client: AsyncClient,
    conn: Conn,
    mut jobs: mpsc::Receiver<PublishJob>,
    lost: CancellationToken,
) {
    loop {
        let job = tokio::select! {
            biased;
            () = lost.cancelled() => return,
            job = jobs.recv() => job,
        };
        let Some(job) = job else { return };
        if job.waiter.is_closed() {
            // The post gave up before its turn: never sent.
            continue;
        }
        {
            let mut state = lock(&conn);
            if state.lost {
                return;
            }
            state.outbox.submit(job.waiter);
        }
        let publish = client.publish(job.topic, QoS::AtLeastOnce, false, job.payload);
        tokio::select! {
            biased;
            () = lost.cancelled() => return,
            published = publish => if published.is_err() {
                // The event loop is gone; `connection_lost` answers the waiter.
                return;
            },
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
