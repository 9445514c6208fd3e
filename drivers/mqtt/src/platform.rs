//! The MQTT driver: [`Driver::run`] starts the broker session (see `session`) and dispatches
//! what it receives to the hub, acknowledging each message (PUBACK) only after the hub's
//! answer; [`Driver::post`] publishes at QoS 1 and receipts after the PUBACK.
//!
//! The dispatcher turns each publish into an inbound frame, hands it to the hub in arrival
//! order, and leaves its PUBACK with the kit's [`PendingAcks`], which sends it once the hub
//! has answered `accepted` (or refused it for good) and drains when the run stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::MAX_LINE_BYTES;
use channeld_driver_sdk::protocol::types::{Capabilities, DeliveryReceipt};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, ConfigError, Declaration, Driver, DriverError, Hub, HubError,
    PendingAcks, Post, PostError, Settle,
};
use rumqttc::{MqttOptions, QoS, TlsConfiguration, Transport};
use tokio::sync::{oneshot, watch};
use tracing::{debug, error, info, warn};

use crate::config::{MqttConfig, VAR_CA_FILE};
use crate::convert;
use crate::session::{
    Backlog, Live, MAX_INCOMING_PACKET, OUTBOUND_INFLIGHT, PublishJob, REQUEST_QUEUE, Received,
    Session, claim_ack,
};

/// Largest publish the driver sends: a frame's worth of text plus topic and JSON headroom.
pub const MAX_OUTGOING_PACKET: usize = MAX_LINE_BYTES + 64 * 1024;

/// The MQTT platform driver.
pub struct MqttDriver {
    config: Arc<MqttConfig>,
    options: MqttOptions,
    /// The live connection of the current run, where posts go.
    live: Arc<watch::Sender<Option<Live>>>,
    ids: IdSource,
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

impl MqttDriver {
    /// Checks the settings and prepares the client options; nothing connects until
    /// [`Driver::run`].
    pub fn new(config: MqttConfig) -> Result<Self, DriverError> {
        let options = mqtt_options(&config)?;
        Ok(Self {
            config: Arc::new(config),
            options,
            live: Arc::new(watch::Sender::new(None)),
            ids: IdSource::new(),
        })
    }
}

impl Driver for MqttDriver {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities {
            receive: true,
            send: true,
            threads: true,
            ..Default::default()
        })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let stop = CancellationToken::new();
        let session = Session::new(
            self.config.clone(),
            self.options.clone(),
            hub.clone(),
            self.live.clone(),
            shutdown.clone(),
            stop.clone(),
        );
        let backlog = session.backlog.clone();
        let mut session = tokio::spawn(session.run());
        let acks = PendingAcks::new();
        let dispatcher =
            Dispatcher { config: &self.config, hub: &hub, ids: &self.ids, acks: &acks };
        let result = tokio::select! {
            () = dispatcher.run(&backlog, &shutdown) => Ok(()),
            // The session ends only when told to; anything else is a panic.
            ended = &mut session => Err(DriverError::Platform(match ended {
                Err(err) if err.is_panic() => "the MQTT session task panicked".into(),
                _ => "the MQTT session task ended".into(),
            })),
        };
        // Stopping: settle what the hub has answered while the connection is still up, let
        // posts in flight get their PUBACKs, then close the connection.
        let unanswered = acks.drain(self.config.drain_grace).await;
        if unanswered > 0 {
            info!(unanswered, "left unacknowledged for the broker to redeliver");
        }
        hub.requests_done().await;
        stop.cancel();
        if !session.is_finished() {
            let _ = session.await;
        }
        result
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
        let timeout = self.config.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut live = self.live.subscribe();
        let jobs = match tokio::time::timeout_at(deadline, live.wait_for(Option::is_some)).await {
            Ok(Ok(live)) => live.as_ref().map(|live| live.jobs.clone()),
            Ok(Err(_)) | Err(_) => None,
        };
        let Some(jobs) = jobs else {
            let reason = format!("not connected to {} within {timeout:?}", self.config.broker);
            return Err(PostError::failed(reason, true));
        };
        let (waiter, acked) = oneshot::channel();
        let job = PublishJob { topic: topic.clone(), payload, waiter };
        match tokio::time::timeout_at(deadline, jobs.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                return Err(PostError::failed(
                    "the broker connection dropped before the message was sent",
                    true,
                ));
            }
            Err(_) => {
                return Err(PostError::failed("the publisher stayed busy; not sent", true));
            }
        }
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
            // Dropped before it was handed to rumqttc (the connection went first).
            Ok(Err(_)) => Err(PostError::failed(
                "the broker connection dropped before the message was sent",
                true,
            )),
            Err(_) => Err(PostError::unknown(format!("no PUBACK within {timeout:?}"))),
        }
    }
}

/// Hands received publishes to the hub, in order; their PUBACKs wait in [`PendingAcks`].
struct Dispatcher<'a> {
    config: &'a MqttConfig,
    hub: &'a Hub,
    ids: &'a IdSource,
    acks: &'a PendingAcks,
}

impl Dispatcher<'_> {
    async fn run(self, backlog: &Backlog, shutdown: &CancellationToken) {
        loop {
            let Some(next) = backlog.pop() else {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return,
                    () = backlog.received.notified() => continue,
                }
            };
            if shutdown.is_cancelled() || !self.dispatch(next).await {
                return;
            }
        }
    }

    /// Returns false once the hub handle stopped taking input.
    async fn dispatch(&self, received: Received) -> bool {
        let ack = Puback(received);
        let topic = ack.0.publish.topic.as_str();
        // The broker sets `retain` only when a (re)subscription replays a topic's last
        // retained message: old state, not a new message, and replayed on every reconnect.
        if ack.0.publish.retain {
            info!(%topic, "retained message replayed by the subscription; acknowledged and ignored");
            ack.send().await;
            return true;
        }
        let Some(identity) = self.config.inbound.identify(topic) else {
            warn!(%topic, "topic does not match the inbound template; acknowledged and dropped");
            ack.send().await;
            return true;
        };
        let payload = match convert::parse_payload(&ack.0.publish.payload) {
            Ok(payload) => payload,
            Err(err) => {
                warn!(%topic, error = %err, "unusable payload; acknowledged and dropped");
                ack.send().await;
                return true;
            }
        };
        if let Some(claimed) = payload.claimed_sender.as_deref()
            && claimed != identity.sender
        {
            debug!(%topic, claimed, sender = identity.sender, "payload names another sender; the topic wins");
        }
        let generated = self.ids.next();
        let converted =
            convert::inbound_message(&self.config.channel, topic, identity, payload, &generated);
        let message = match converted {
            Ok(message) => message,
            Err(err) => {
                warn!(%topic, error = %err, "message cannot become an inbound frame; acknowledged and dropped");
                ack.send().await;
                return true;
            }
        };
        let event_id = message.id.clone();
        match self.hub.inbound(message).await {
            Ok(ticket) => {
                self.acks.track(ticket, ack);
                true
            }
            Err(HubError::ShuttingDown) => {
                debug!(%event_id, "not taking input: left unacknowledged for redelivery");
                false
            }
            Err(err) => {
                error!(%event_id, error = %err, "the hub handle refused the message; acknowledged and dropped");
                ack.send().await;
                true
            }
        }
    }
}

/// The PUBACK of one received publish.
struct Puback(Received);

impl Puback {
    /// Sends it if its connection is still the one it arrived on (and only once).
    async fn send(self) {
        let Received { publish, seq, client, conn } = self.0;
        if publish.qos == QoS::AtMostOnce {
            return;
        }
        if !claim_ack(&conn, publish.pkid, seq) {
            debug!(
                pkid = publish.pkid,
                "received on an earlier connection; the broker redelivers it"
            );
            return;
        }
        if let Err(err) = client.ack(&publish).await {
            debug!(error = %err, "MQTT connection gone before the PUBACK");
        }
    }
}

impl Settle for Puback {
    /// Accepted (also a duplicate) or refused for good: acknowledged. No answer: left for the
    /// broker to redeliver.
    async fn settle(self, outcome: &Acceptance) {
        match outcome {
            Acceptance::Accepted { .. } | Acceptance::Rejected { .. } => self.send().await,
            Acceptance::Unresolved => {}
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
    let mut options = MqttOptions::new(
        config.client_id.clone(),
        config.broker.connect_host(),
        config.broker.port,
    );
    options
        .set_keep_alive(config.keep_alive)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(MAX_INCOMING_PACKET, MAX_OUTGOING_PACKET)
        .set_request_channel_capacity(REQUEST_QUEUE)
        .set_inflight(OUTBOUND_INFLIGHT);
    if let Some(username) = &config.username {
        let password = config.password.as_ref().map_or("", |secret| secret.as_str());
        options.set_credentials(username.clone(), password);
    }
    if config.broker.tls {
        let tls = channeld_driver_sdk::tls::client_config(config.ca_file.as_deref())
            .map_err(|err| ConfigError::invalid(setting_var(VAR_CA_FILE), err.to_string()))?;
        options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(Arc::new(tls))));
    }
    Ok(options)
}
