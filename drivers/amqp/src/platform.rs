//! The broker side of the driver: one connection with lapin's automatic recovery, the declared
//! topology, a consume loop that acknowledges each delivery only after the hub has answered
//! for it, and publishing with publisher confirms and `mandatory`.
//!
//! Delivery model:
//! * at-least-once from the broker: a delivery is acked after the hub's `accepted` (the hub
//!   has recorded it), so a crash of the driver, the hub or the broker before that point makes
//!   the broker redeliver it; the hub drops the copy by event id (`message_id`).
//! * acks happen on acceptance, not when the agent's run ends, so long runs never hit
//!   RabbitMQ's `consumer_timeout`.
//! * after a connection recovery the old deliveries' ackers are stale: acking one returns
//!   `false`, which is logged; the broker redelivers those messages on the new channel.
//!
//! Two loops keep the link up: lapin's automatic recovery restores the connection, channels,
//! QoS, confirm mode and consumer after a network error or a forced close; if it gives up, or
//! makes no progress for 10 s (lapin 4.12.3 can stall for good when the socket breaks while a
//! frame is half written), [`AmqpDriver::run`] opens a new connection with the kit's
//! [`Reconnect`] (a slow lane when the broker refuses the credentials or the topology). A
//! connection given up on is closed should it come back later, so it never keeps a consumer
//! nobody reads. A publishing channel the broker closed (e.g. over a missing exchange) is
//! opened again on the live connection. The acks wait in the kit's [`PendingAcks`]; when the
//! run stops, the connection stays up until the hub's requests in flight are done
//! ([`Hub::requests_done`]), then closes.

use std::collections::{HashMap, VecDeque};
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{Capabilities, DeliveryReceipt};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, Failure, Hub, HubError,
    LinkState, PendingAcks, Post, PostError, PostKind, Reconnect, ReconnectPolicy, Settle,
};
use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Acker, Channel, Connection, ConnectionProperties, Consumer, ErrorKind, ExchangeKind};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::timeout_at;
use tracing::{debug, error, info, warn};

use crate::config::{AmqpConfig, is_tls};
use crate::convert::{self, Disconnect, Publication, Received, Settlement};

/// Reconnection attempts lapin makes on its own before [`AmqpDriver::run`] takes over. With
/// the delays below lapin gives up on a refusing broker within about 20 s; longer outages are
/// the outer loop's.
const RECOVERY_ATTEMPTS: usize = 4;
/// lapin's recovery backoff: first and largest delay.
const RECOVERY_MIN_DELAY: Duration = Duration::from_millis(250);
const RECOVERY_MAX_DELAY: Duration = Duration::from_secs(2);
/// A recovery still not done after this long is abandoned for a fresh connection.
const RECOVERY_WATCHDOG: Duration = Duration::from_secs(10);
/// How long an abandoned connection is watched in case its recovery completes after all.
const RETIRE_WATCH: Duration = Duration::from_secs(600);
/// Correlation ids remembered for replies (oldest forgotten first). A reply whose request is
/// forgotten correlates by the request's `message_id` instead.
const REMEMBERED_CORRELATIONS: usize = 4096;
/// How often the consume loop reads the connection's status (recovery starting or done).
const LINK_CHECK: Duration = Duration::from_millis(250);
/// How long a post waits before trying again to get a publishing channel.
const REOPEN_PAUSE: Duration = Duration::from_millis(250);
/// How long a stopping driver waits for the broker to confirm the consuming channel's close.
const CLOSE_WITHIN: Duration = Duration::from_secs(2);
/// The reply code of a normal channel close.
const REPLY_SUCCESS: u16 = 200;

/// Why a connection attempt failed. Never contains the broker URL.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("cannot connect to the broker: {0}")]
    Connect(lapin::Error),
    #[error("cannot declare the queue, exchanges or bindings: {0}")]
    Topology(lapin::Error),
    #[error("cannot set up the channels: {0}")]
    Setup(lapin::Error),
}

impl BrokerError {
    fn cause(&self) -> Disconnect {
        match self {
            BrokerError::Connect(err) => match amqp_code(err) {
                Some(403 | 530) => Disconnect::AuthRefused,
                _ => Disconnect::Unreachable,
            },
            BrokerError::Topology(err) | BrokerError::Setup(err) => match amqp_code(err) {
                Some(403) => Disconnect::AuthRefused,
                Some(_) => Disconnect::Topology,
                None => Disconnect::Unreachable,
            },
        }
    }
}

/// The AMQP error code the broker sent, if the error is one.
fn amqp_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// How the consume loop ended.
enum ConsumeEnd {
    Shutdown,
    Lost(String),
}

/// One open connection: the consuming channel with its consumer, and the publishing channel
/// (in confirm mode).
struct Session {
    connection: Arc<Connection>,
    consume: Channel,
    publish: Channel,
    consumer: Consumer,
}

/// Correlation ids of recent requests, by event id, for their replies.
#[derive(Debug, Default)]
struct Correlations {
    by_event: HashMap<Id, String>,
    order: VecDeque<Id>,
}

impl Correlations {
    fn remember(&mut self, event_id: Id, correlation_id: String) {
        if self.by_event.insert(event_id.clone(), correlation_id).is_none() {
            self.order.push_back(event_id);
        }
        while self.order.len() > REMEMBERED_CORRELATIONS {
            if let Some(old) = self.order.pop_front() {
                self.by_event.remove(&old);
            }
        }
    }

    fn get(&self, event_id: &Id) -> Option<String> {
        self.by_event.get(event_id).cloned()
    }
}

/// The AMQP driver.
#[derive(Debug)]
pub struct AmqpDriver {
    config: AmqpConfig,
    /// The publishing channel of the live connection; `None` while there is none.
    publisher: watch::Sender<Option<Channel>>,
    /// The live connection: closed when it is replaced, and where a publishing channel the
    /// broker closed is opened again.
    connection: Mutex<Option<Arc<Connection>>>,
    /// Held while a closed publishing channel is replaced, so concurrent posts open one.
    reopening: tokio::sync::Mutex<()>,
    correlations: Mutex<Correlations>,
    /// Watches over connections given up on (see [`retire`]); aborted when the run ends.
    retiring: Mutex<JoinSet<()>>,
}

impl AmqpDriver {
    pub fn new(config: AmqpConfig) -> Self {
        Self {
            config,
            publisher: watch::Sender::new(None),
            connection: Mutex::new(None),
            reopening: tokio::sync::Mutex::new(()),
            correlations: Mutex::new(Correlations::default()),
            retiring: Mutex::new(JoinSet::new()),
        }
    }

    /// Closes a connection the driver has given up on, watched in a tracked task.
    fn retire(&self, connection: Arc<Connection>) {
        let mut retiring = lock(&self.retiring);
        while retiring.try_join_next().is_some() {}
        retiring.spawn(retire(connection));
    }

    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// Connects, declares the topology and starts consuming.
    async fn open(&self) -> Result<Session, BrokerError> {
        let config = &self.config;
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(format!("channeld-amqp {}", config.channel)))
            .enable_auto_recover()
            .configure_backoff(|backoff| {
                backoff
                    .with_min_delay(RECOVERY_MIN_DELAY)
                    .with_max_delay(RECOVERY_MAX_DELAY)
                    .with_max_times(RECOVERY_ATTEMPTS)
            });
        let connection = Connection::connect_uri(config.url.expose().clone(), properties)
            .await
            .map_err(BrokerError::Connect)?;
        let connection = Arc::new(connection);
        match self.set_up(&connection).await {
            Ok((consume, publish, consumer)) => {
                Ok(Session { connection, consume, publish, consumer })
            }
            Err(err) => {
                self.retire(connection);
                Err(err)
            }
        }
    }

    /// Declares the topology, then opens the consuming and publishing channels.
    async fn set_up(
        &self,
        connection: &Connection,
    ) -> Result<(Channel, Channel, Consumer), BrokerError> {
        let config = &self.config;
        let consume = connection.create_channel().await.map_err(BrokerError::Setup)?;
        self.declare(&consume).await.map_err(BrokerError::Topology)?;
        consume
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await
            .map_err(BrokerError::Setup)?;
        let publish = open_publisher(connection).await.map_err(BrokerError::Setup)?;
        let consumer = consume
            .basic_consume(
                ShortString::from(config.queue.as_str()),
                ShortString::from(config.consumer_tag()),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(BrokerError::Setup)?;
        Ok((consume, publish, consumer))
    }

    /// Declares the dead-letter exchange and queue, the queue, the exchange and the bindings.
    /// Declarations are idempotent; with `CHANNELD_AMQP_DECLARE=false` the queue is only
    /// checked (passive declare).
    async fn declare(&self, channel: &Channel) -> lapin::Result<()> {
        let config = &self.config;
        let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        if !config.declare {
            let passive = QueueDeclareOptions { passive: true, ..durable };
            channel
                .queue_declare(config.queue.as_str().into(), passive, FieldTable::default())
                .await?;
            return Ok(());
        }
        let durable_exchange =
            ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        let mut arguments = FieldTable::default();
        if let Some(dead_letter) = &config.dead_letter {
            channel
                .exchange_declare(
                    dead_letter.exchange.as_str().into(),
                    ExchangeKind::Fanout,
                    durable_exchange,
                    FieldTable::default(),
                )
                .await?;
            if let Some(queue) = &dead_letter.queue {
                channel
                    .queue_declare(queue.as_str().into(), durable, FieldTable::default())
                    .await?;
                channel
                    .queue_bind(
                        queue.as_str().into(),
                        dead_letter.exchange.as_str().into(),
                        "".into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
            }
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(dead_letter.exchange.as_str().into()),
            );
        }
        channel.queue_declare(config.queue.as_str().into(), durable, arguments).await?;
        if let Some(binding) = &config.binding {
            channel
                .exchange_declare(
                    binding.exchange.as_str().into(),
                    binding.kind.clone(),
                    durable_exchange,
                    FieldTable::default(),
                )
                .await?;
            for key in &binding.keys {
                channel
                    .queue_bind(
                        config.queue.as_str().into(),
                        binding.exchange.as_str().into(),
                        key.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
            }
        }
        Ok(())
    }

    /// Consumes until shutdown or until the connection is lost for good.
    async fn consume(
        &self,
        session: Session,
        hub: &Hub,
        shutdown: &CancellationToken,
    ) -> ConsumeEnd {
        let Session { connection, consume: channel, publish, mut consumer } = session;
        let previous = lock(&self.connection).replace(connection.clone());
        drop(previous);
        self.publisher.send_replace(Some(publish));
        hub.link_state(LinkState::up_as(format!("consuming queue {}", self.config.queue)));
        info!(
            channel = %self.config.channel,
            queue = %self.config.queue,
            prefetch = self.config.prefetch,
            tls = is_tls(&self.config.url),
            "consuming from the broker"
        );

        // The acks of deliveries waiting for the hub's answer; at most `prefetch` per channel.
        let acks = PendingAcks::new();
        // lapin recovers without a word to the consumer stream: its state is read from the
        // connection and channel status.
        let mut check = tokio::time::interval(LINK_CHECK);
        let mut up = true;
        let mut down_since = Instant::now();
        let end = loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break ConsumeEnd::Shutdown,
                _ = check.tick() => {
                    let status = connection.status();
                    if status.errored() || status.closed() {
                        break ConsumeEnd::Lost("the connection closed and was not recovered".into());
                    }
                    let now_up = status.connected() && channel.status().connected();
                    if now_up != up {
                        up = now_up;
                        down_since = Instant::now();
                        self.on_link_change(hub, up);
                    }
                    if !up && down_since.elapsed() > RECOVERY_WATCHDOG {
                        // lapin 4.12.3 can stall for good when the socket breaks while a
                        // frame is half written (its I/O loop waits on the dead socket).
                        break ConsumeEnd::Lost(format!(
                            "automatic recovery made no progress within {RECOVERY_WATCHDOG:?}"
                        ));
                    }
                }
                item = next_delivery(&mut consumer) => match item {
                    Some(Ok(delivery)) => self.on_delivery(delivery, hub, &acks).await,
                    Some(Err(err)) => {
                        if up {
                            up = false;
                            down_since = Instant::now();
                            self.on_link_change(hub, up);
                        }
                        debug!(channel = %self.config.channel, error = %err, "consumer interrupted; waiting for recovery");
                        let recovered = tokio::select! {
                            recovered = channel.wait_for_recovery(err) => recovered,
                            () = shutdown.cancelled() => break ConsumeEnd::Shutdown,
                        };
                        if let Err(err) = recovered {
                            break ConsumeEnd::Lost(format!("recovery failed: {err}"));
                        }
                    }
                    None => break ConsumeEnd::Lost("the broker cancelled the consumer".into()),
                },
            }
        };

        match end {
            ConsumeEnd::Shutdown => {
                self.stop_consuming(hub, &channel, acks).await;
            }
            ConsumeEnd::Lost(_) => {
                // The ackers of these deliveries are stale: settle them now (they log it).
                acks.drain(Duration::ZERO).await;
                self.publisher.send_replace(None);
                let connection = lock(&self.connection).take();
                if let Some(connection) = connection {
                    self.retire(connection);
                }
            }
        }
        end
    }

    /// Reports a recovery starting or ending.
    fn on_link_change(&self, hub: &Hub, up: bool) {
        let channel = &self.config.channel;
        if up {
            info!(%channel, "broker connection recovered");
            hub.link_state(LinkState::up_as(format!("consuming queue {}", self.config.queue)));
        } else {
            warn!(%channel, "broker connection interrupted; recovering");
            let error = "the broker connection was interrupted; recovering it".to_owned();
            hub.link_state(LinkState::Retrying { attempt: 1, error });
        }
    }

    /// Stops taking deliveries, gives the hub a moment to answer the ones it has, and closes
    /// the consuming channel, which requeues whatever is still unacknowledged. The connection
    /// and the publishing channel stay up for replies sent while the driver drains.
    async fn stop_consuming(&self, hub: &Hub, channel: &Channel, acks: PendingAcks) {
        let deadline = tokio::time::Instant::now() + hub.stop_budget(self.config.drain_grace);
        let tag = ShortString::from(self.config.consumer_tag());
        match timeout_at(deadline, channel.basic_cancel(tag, BasicCancelOptions::default())).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => debug!(error = %err, "cancelling the consumer failed"),
            Err(_) => debug!("cancelling the consumer timed out"),
        }
        let unanswered =
            acks.drain(deadline.saturating_duration_since(tokio::time::Instant::now())).await;
        if unanswered > 0 {
            warn!(
                unanswered,
                "the hub did not answer every delivery in time; the broker will redeliver them"
            );
        }
        let closing = tokio::time::Instant::now() + hub.stop_budget(CLOSE_WITHIN);
        match timeout_at(closing, channel.close(REPLY_SUCCESS, "OK".into())).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => debug!(error = %err, "closing the consuming channel failed"),
            Err(_) => debug!("closing the consuming channel timed out"),
        }
    }

    /// Converts a delivery and hands it to the hub; its ack waits in `acks` for the hub's
    /// answer.
    async fn on_delivery(&self, delivery: Delivery, hub: &Hub, acks: &PendingAcks) {
        let Delivery { delivery_tag, exchange, routing_key, redelivered, properties, data, acker } =
            delivery;
        let channel = &self.config.channel;
        let received = Received {
            exchange: exchange.as_str(),
            routing_key: routing_key.as_str(),
            properties: &properties,
            body: &data,
        };
        let message = match convert::inbound(channel, &self.config.inbound, &received) {
            Ok(message) => message,
            Err(refusal) => {
                warn!(
                    %channel,
                    delivery_tag,
                    code = refusal.code(),
                    reason = %refusal,
                    dead_letter = self.config.dead_letter.is_some(),
                    "message refused; rejecting it without requeue"
                );
                let refused = Acceptance::Rejected {
                    code: refusal.code().into(),
                    message: refusal.to_string(),
                };
                acks.settle_now(BrokerAck { acker, event_id: None, delivery_tag }, refused);
                return;
            }
        };
        let event_id = message.id.clone();
        debug!(%channel, %event_id, delivery_tag, redelivered, "delivery received");
        if let Some(correlation) = properties.correlation_id().as_ref() {
            lock(&self.correlations).remember(event_id.clone(), correlation.to_string());
        }
        let ack = BrokerAck { acker, event_id: Some(event_id.clone()), delivery_tag };
        match hub.inbound(message).await {
            Ok(ticket) => acks.track(ticket, ack),
            Err(HubError::ShuttingDown) => acks.settle_now(ack, Acceptance::Unresolved),
            Err(err) => {
                warn!(%event_id, error = %err, "message refused; rejecting it without requeue");
                let refused =
                    Acceptance::Rejected { code: "invalid".into(), message: err.to_string() };
                acks.settle_now(ack, refused);
            }
        }
    }

    /// Replaces a publishing channel the broker closed; false when there is no open
    /// connection to open one on.
    async fn reopen_publisher(&self) -> bool {
        let _one_at_a_time = self.reopening.lock().await;
        if self.publisher.borrow().as_ref().is_some_and(|channel| channel.status().connected()) {
            return true;
        }
        let connection = lock(&self.connection).clone();
        let Some(connection) = connection.filter(|c| c.status().connected()) else {
            return false;
        };
        match open_publisher(&connection).await {
            Ok(channel) => {
                info!(channel = %self.config.channel, "publishing channel reopened");
                self.publisher.send_replace(Some(channel));
                true
            }
            Err(err) => {
                warn!(channel = %self.config.channel, error = %err, "cannot reopen the publishing channel");
                false
            }
        }
    }

    /// Publishes with `mandatory` and waits for the publisher confirm. Waits for a connection
    /// (or its recovery) while nothing has been sent; once sent, a lost connection makes the
    /// outcome unknown rather than failed.
    async fn publish(&self, publication: &Publication) -> Result<(), PostError> {
        let deadline = tokio::time::Instant::now() + self.config.confirm_timeout;
        let mut publisher = self.publisher.subscribe();
        loop {
            let channel = match timeout_at(deadline, publisher.wait_for(Option::is_some)).await {
                Ok(Ok(current)) => current.clone().expect("wait_for checked it is set"),
                Ok(Err(_)) => return Err(PostError::failed("driver is shutting down", true)),
                Err(_) => return Err(PostError::failed("not connected to the broker", true)),
            };
            let published = channel
                .basic_publish(
                    publication.exchange.as_str().into(),
                    publication.routing_key.as_str().into(),
                    BasicPublishOptions { mandatory: true, immediate: false },
                    &publication.payload,
                    publication.properties.clone(),
                )
                .await;
            let confirm = match published {
                Ok(confirm) => confirm,
                Err(err) if not_sent(&err) => {
                    debug!(error = %err, "publishing channel not ready; waiting for it");
                    let waited = timeout_at(deadline, async {
                        tokio::select! {
                            recovered = channel.wait_for_recovery(err) => Some(recovered),
                            // A new connection replaced this channel.
                            _ = publisher.changed() => None,
                        }
                    })
                    .await;
                    match waited {
                        Ok(None | Some(Ok(()))) => continue,
                        Ok(Some(Err(_))) => {
                            // Closed for good (the broker closes a channel over an error such
                            // as a missing exchange): open another one on the connection, or
                            // wait for the next connection.
                            if !self.reopen_publisher().await {
                                let pause =
                                    (tokio::time::Instant::now() + REOPEN_PAUSE).min(deadline);
                                let _ = timeout_at(pause, publisher.changed()).await;
                                if tokio::time::Instant::now() >= deadline {
                                    return Err(PostError::failed(
                                        "not connected to the broker",
                                        true,
                                    ));
                                }
                            }
                            continue;
                        }
                        Err(_) => {
                            return Err(PostError::failed(
                                "the broker connection did not recover in time",
                                true,
                            ));
                        }
                    }
                }
                Err(err) => {
                    return Err(PostError::unknown(format!(
                        "connection failed while publishing: {err}"
                    )));
                }
            };
            return match timeout_at(deadline, confirm).await {
                Err(_) => Err(PostError::unknown("no publisher confirm in time")),
                Ok(Err(err)) if err.is_amqp_soft_error() => {
                    Err(PostError::failed(format!("the broker refused the message: {err}"), false))
                }
                Ok(Err(err)) => Err(PostError::unknown(format!(
                    "connection lost before the broker confirmed: {err}"
                ))),
                Ok(Ok(confirmation)) => convert::confirmation(confirmation),
            };
        }
    }
}

/// Closes a connection the driver has given up on. One still recovering is watched: should
/// it come back after all, it is closed at once, so its consumer cannot hold deliveries that
/// nobody reads (the broker requeues them for the new connection).
async fn retire(connection: Arc<Connection>) {
    let deadline = Instant::now() + RETIRE_WATCH;
    loop {
        let status = connection.status();
        if status.connected() {
            if let Err(err) = connection.close(REPLY_SUCCESS, "replaced".into()).await {
                debug!(error = %err, "closing a replaced connection failed");
            }
            return;
        }
        if status.errored() || status.closed() || Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(LINK_CHECK).await;
    }
}

/// A channel in confirm mode for publishing.
async fn open_publisher(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(channel)
}

/// The consumer's next delivery; `None` when the broker cancelled it.
fn next_delivery(
    consumer: &mut Consumer,
) -> impl Future<Output = Option<lapin::Result<Delivery>>> + '_ {
    poll_fn(move |cx| Pin::new(&mut *consumer).poll_next(cx))
}

/// True for errors lapin raises before sending anything (the channel is not open).
fn not_sent(err: &lapin::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::InvalidChannelState(..)
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannel(_)
    )
}

/// The acknowledgement of one delivery, settled with the hub's answer.
struct BrokerAck {
    acker: Acker,
    event_id: Option<Id>,
    delivery_tag: u64,
}

impl Settle for BrokerAck {
    /// Accepted: `basic.ack`; refused for good: `basic.reject` without requeue (dead-lettered
    /// when configured); no answer: `basic.nack` with requeue. Checks that the broker took it.
    async fn settle(self, outcome: &Acceptance) {
        let BrokerAck { acker, event_id, delivery_tag } = self;
        let settlement = convert::settlement(outcome);
        let event_id = event_id.as_ref().map_or("-", Id::as_str);
        let result = match settlement {
            Settlement::Ack => acker.ack(BasicAckOptions::default()).await,
            Settlement::Reject => acker.reject(BasicRejectOptions { requeue: false }).await,
            Settlement::Requeue => {
                acker.nack(BasicNackOptions { requeue: true, multiple: false }).await
            }
        };
        match result {
            Ok(true) => debug!(event_id, delivery_tag, ?settlement, "delivery settled"),
            Ok(false) => info!(
                event_id,
                delivery_tag,
                ?settlement,
                "delivery belongs to a channel that was recovered since; the broker redelivers it and the hub drops the copy"
            ),
            Err(err) => warn!(
                event_id,
                delivery_tag,
                ?settlement,
                error = %err,
                "acknowledgement failed; the broker redelivers the message and the hub drops the copy"
            ),
        }
    }
}

impl Driver for AmqpDriver {
    /// lapin logs a returned (unroutable) message with its body at WARN and reports recoveries
    /// the driver handles at ERROR; the driver logs those events itself, at the level they
    /// deserve (`CHANNELD_LOG=info,lapin=debug` shows lapin's own lines).
    const LOG_FILTER: &'static str = "info,lapin=off";

    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities {
            receive: true,
            send: true,
            threads: true,
            receive_attachments: true,
            send_attachments: true,
            ..Capabilities::default()
        })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let channel = &self.config.channel;
        let mut reconnect = Reconnect::new(ReconnectPolicy::default());
        hub.link_state(LinkState::Connecting { attempt: 0 });
        loop {
            let opened = tokio::select! {
                opened = self.open() => opened,
                () = shutdown.cancelled() => break,
            };
            let (cause, error) = match opened {
                Ok(session) => {
                    reconnect.connected();
                    match self.consume(session, &hub, &shutdown).await {
                        ConsumeEnd::Shutdown => break,
                        ConsumeEnd::Lost(reason) => {
                            warn!(%channel, %reason, "broker connection lost; reconnecting");
                            (Disconnect::Unreachable, reason)
                        }
                    }
                }
                Err(err) => {
                    let cause = err.cause();
                    let attempt = reconnect.attempt() + 1;
                    match cause {
                        Disconnect::AuthRefused | Disconnect::Topology => {
                            error!(%channel, attempt, error = %err, "the broker refused the driver's setup; retrying slowly")
                        }
                        Disconnect::Unreachable if attempt == 1 => {
                            warn!(%channel, error = %err, "cannot reach the broker; retrying")
                        }
                        Disconnect::Unreachable => {
                            debug!(%channel, attempt, error = %err, "broker still unreachable")
                        }
                    }
                    (cause, err.to_string())
                }
            };
            let failure = match cause {
                Disconnect::Unreachable => Failure::Transient,
                Disconnect::AuthRefused | Disconnect::Topology => Failure::Operator,
            };
            let delay = reconnect.failed(failure);
            let (state, _) = convert::link_state(cause, reconnect.attempt(), error);
            hub.link_state(state);
            if !reconnect.sleep(delay, &shutdown).await {
                break;
            }
        }
        // Posts still in flight publish on this connection: close it once they are done.
        hub.requests_done().await;
        lock(&self.retiring).abort_all();
        self.publisher.send_replace(None);
        let connection = lock(&self.connection).take();
        if let Some(connection) = connection {
            let closing = connection.close(REPLY_SUCCESS, "driver stopping".into());
            match tokio::time::timeout(hub.stop_budget(CLOSE_WITHIN), closing).await {
                Ok(Ok(())) => debug!(%channel, "broker connection closed"),
                Ok(Err(err)) => {
                    debug!(%channel, error = %err, "closing the broker connection failed")
                }
                Err(_) => debug!(%channel, "closing the broker connection timed out"),
            }
        }
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let now = now_ms();
        let correlation = match &post.kind {
            PostKind::Reply { event_id } => lock(&self.correlations).get(event_id),
            PostKind::Proactive { .. } => None,
        };
        let publication = convert::publication(
            &self.config.channel,
            &self.config.outbound,
            &post,
            correlation.as_deref(),
            now,
        )?;
        self.publish(&publication).await?;
        debug!(
            message_id = %publication.message_id,
            exchange = %publication.exchange,
            routing_key = %publication.routing_key,
            "published"
        );
        Ok(convert::receipt(&self.config.channel, &post, publication.message_id, now))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
