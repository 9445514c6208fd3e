//! One run of the driver: the relay pool is built and connected, the inbox subscription
//! made (from the checkpoint minus the lookback), and the run loop hands each event to the
//! [`Inbox`], follows each relay's state into the health, publishes the bot's inbox relay
//! list to each relay as it connects, and moves the checkpoint. On stop it drains the
//! acknowledgements, lets posts in flight finish, closes the pool and writes the state.
//!
//! Tasks: the relay pool's own (one per relay, stopped by `Client::shutdown`), the state
//! writer and the announcements, tracked and awaited before `run` returns.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::{CancellationToken, DriverError, Hub, PendingAcks};
use nostr_sdk::pool::monitor::{Monitor, MonitorNotification};
use nostr_sdk::{
    Client, ClientOptions, EventBuilder, Filter, Kind, Metadata, RelayMessage, RelayOptions,
    RelayPoolNotification, RelayStatus, RelayUrl, SubscribeOptions, SubscriptionId, Tag, TagKind,
    Timestamp,
};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::inbox::{Held, Inbox};
use crate::platform::NostrDriver;
use crate::publish::relay_name;
use crate::relays::{Connection, RelayBoard};
use crate::state::{StateStore, next_checkpoint, unix_now};

/// The id of the inbox subscription on every relay.
pub const INBOX_SUBSCRIPTION: &str = "channeld-inbox";
/// Relay status changes queued for the run loop; on overflow it re-reads every relay.
const STATUS_QUEUE: usize = 256;
/// How often the checkpoint is recomputed.
const CHECKPOINT_TICK: Duration = Duration::from_secs(1);
/// The checkpoint is written only when it moved this far, since each write rewrites the file.
const CHECKPOINT_STEP: u64 = 60;

pub(crate) async fn run(
    driver: &NostrDriver,
    hub: Hub,
    shutdown: CancellationToken,
) -> Result<(), DriverError> {
    let config = &driver.config;
    let monitor = Monitor::new(STATUS_QUEUE);
    let mut statuses = monitor.subscribe();
    let client = Client::builder()
        .signer(config.keys.expose().clone())
        .monitor(monitor)
        .opts(ClientOptions::new().automatic_authentication(true))
        .build();
    let mut notifications = client.notifications();
    for url in &config.relays {
        let options = RelayOptions::new().retry_interval(config.reconnect);
        client.pool().add_relay(url.clone(), options).await.map_err(DriverError::platform)?;
    }
    let checkpoint = driver.state.read(|s| s.checkpoint);
    let mut board =
        RelayBoard::new(config.npub(), config.relays.iter().map(relay_name), checkpoint);
    hub.link_state(board.link_state());
    client.connect().await;
    let since = Timestamp::from_secs(checkpoint.saturating_sub(config.lookback.as_secs()));
    let subscription = SubscriptionId::new(INBOX_SUBSCRIPTION);
    subscribe(driver, &client, &subscription, since).await;
    driver.live.send_replace(Some(client.clone()));
    info!(npub = %config.npub(), relays = %board.describe(), since = since.as_secs(), "listening for direct messages");

    let tasks = TaskTracker::new();
    let stopping = CancellationToken::new();
    tasks.spawn(write_state(driver.state.clone(), stopping.clone()));
    let announcements = if config.publish_inbox { announcements(driver) } else { Vec::new() };
    let mut announced: HashSet<String> = HashSet::new();
    let acks = PendingAcks::new();
    let held = Arc::new(Mutex::new(Held::default()));
    let inbox = Inbox {
        config,
        hub: &hub,
        state: &driver.state,
        acks: &acks,
        held: &held,
        origins: &driver.origins,
    };
    let mut tick = tokio::time::interval(CHECKPOINT_TICK);
    let mut result = Ok(());
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            received = notifications.recv() => match received {
                Ok(RelayPoolNotification::Message { relay_url, message }) => {
                    let name = relay_name(&relay_url);
                    match message {
                        RelayMessage::Event { subscription_id, event } if *subscription_id == subscription => {
                            let taking_input = inbox.receive(&relay_url, event.into_owned()).await;
                            if !taking_input {
                                break;
                            }
                        }
                        RelayMessage::EndOfStoredEvents(id) if *id == subscription => {
                            board.end_of_stored(&name, unix_now());
                        }
                        RelayMessage::Closed { subscription_id, message } if *subscription_id == subscription => {
                            warn!(relay = %name, reason = %message, "the relay closed the inbox subscription");
                            board.closed(&name, &message);
                        }
                        RelayMessage::Notice(notice) => debug!(relay = %name, %notice, "relay notice"),
                        _ => {}
                    }
                    hub.link_state(board.link_state());
                }
                Ok(RelayPoolNotification::Event { .. }) => {}
                Ok(RelayPoolNotification::Shutdown) => {
                    result = Err(DriverError::platform("the relay pool shut down"));
                    break;
                }
                Err(RecvError::Lagged(missed)) => {
                    // Events were dropped from the queue: ask the relays for the window again.
                    warn!(missed, "fell behind the relays; subscribing again");
                    let since = driver.state.read(|s| s.checkpoint).saturating_sub(config.lookback.as_secs());
                    subscribe(driver, &client, &subscription, Timestamp::from_secs(since)).await;
                }
                Err(RecvError::Closed) => {
                    result = Err(DriverError::platform("the relay pool stopped reporting"));
                    break;
                }
            },
            status = statuses.recv() => {
                match status {
                    Ok(MonitorNotification::StatusChanged { relay_url, status }) => {
                        on_status(&mut board, &relay_url, status);
                        if status == RelayStatus::Connected && !announcements.is_empty() && announced.insert(relay_name(&relay_url)) {
                            let announcing = announce(client.clone(), relay_url, announcements.clone(), config.send_timeout);
                            let stopping = stopping.clone();
                            tasks.spawn(async move { stopping.run_until_cancelled(announcing).await; });
                        }
                    }
                    Err(RecvError::Lagged(_)) => {
                        for (url, relay) in client.pool().relays().await {
                            on_status(&mut board, &url, relay.status());
                        }
                    }
                    Err(RecvError::Closed) => {}
                }
                hub.link_state(board.link_state());
            }
            _ = tick.tick() => advance(driver, &mut board, &held),
        }
    }

    // Stopping: the hub's answers settle what was reported, posts in flight finish on
    // this pool, then it closes and the state is written a last time.
    let unanswered = acks.drain(hub.stop_budget(config.drain_grace)).await;
    if unanswered > 0 {
        info!(unanswered, "left unanswered; the relays bring them again after a restart");
    }
    hub.requests_done().await;
    driver.live.send_replace(None);
    driver.stragglers.close();
    let _ =
        tokio::time::timeout(hub.stop_budget(config.drain_grace), driver.stragglers.wait()).await;
    driver.stragglers.reopen();
    stopping.cancel();
    client.shutdown().await;
    tasks.close();
    tasks.wait().await;
    advance(driver, &mut board, &held);
    if let Err(err) = driver.state.flush().await {
        error!(error = %err, "cannot save the state; messages may be handled again after a restart");
    }
    result
}

/// The events announcing the bot: its kind-10050 inbox relays and its kind-0 name.
fn announcements(driver: &NostrDriver) -> Vec<nostr_sdk::Event> {
    let config = &driver.config;
    let keys = config.keys.expose();
    let mut builders = Vec::new();
    let relays = config.relays.iter().map(|url| Tag::custom(TagKind::Relay, [relay_name(url)]));
    builders.push(EventBuilder::new(Kind::InboxRelays, "").tags(relays));
    if let Some(name) = &config.name {
        builders.push(EventBuilder::metadata(&Metadata::new().name(name)));
    }
    builders
        .into_iter()
        .filter_map(|builder| match builder.sign_with_keys(keys) {
            Ok(event) => Some(event),
            Err(err) => {
                warn!(error = %err, "cannot sign an announcement");
                None
            }
        })
        .collect()
}

async fn subscribe(driver: &NostrDriver, client: &Client, id: &SubscriptionId, since: Timestamp) {
    let mut kinds = vec![Kind::GiftWrap];
    if driver.config.accept_nip04 {
        kinds.push(Kind::EncryptedDirectMessage);
    }
    let filter = Filter::new().kinds(kinds).pubkey(driver.config.public_key).since(since);
    let options = SubscribeOptions::default();
    match client.pool().subscribe_with_id(id.clone(), filter, options).await {
        Ok(output) => {
            for (url, reason) in output.failed {
                warn!(relay = %relay_name(&url), %reason, "cannot subscribe yet; the pool subscribes when it connects");
            }
        }
        Err(err) => warn!(error = %err, "cannot subscribe to the inbox"),
    }
}

fn on_status(board: &mut RelayBoard, url: &RelayUrl, status: RelayStatus) {
    let connection = match status {
        RelayStatus::Connected => Connection::Connected,
        RelayStatus::Disconnected => Connection::Disconnected,
        RelayStatus::Terminated | RelayStatus::Banned => Connection::Stopped,
        RelayStatus::Initialized
        | RelayStatus::Pending
        | RelayStatus::Connecting
        | RelayStatus::Sleeping => Connection::Connecting,
    };
    let name = relay_name(url);
    match connection {
        Connection::Connected => info!(relay = %name, "relay connected"),
        Connection::Disconnected | Connection::Stopped => {
            info!(relay = %name, %status, "relay lost")
        }
        Connection::Connecting => debug!(relay = %name, %status, "relay connecting"),
    }
    board.connection(&name, connection);
}

/// Recomputes the checkpoint; writes it (and prunes) once it moved far enough.
fn advance(driver: &NostrDriver, board: &mut RelayBoard, held: &Arc<Mutex<Held>>) {
    let now = unix_now();
    board.tick(now);
    let previous = driver.state.read(|s| s.checkpoint);
    let unsettled = lock(held).times();
    let next =
        next_checkpoint(previous, board.caught_up(), unsettled, driver.config.lookback.as_secs());
    if next >= previous + CHECKPOINT_STEP {
        let (ttl, max) = (driver.config.seen_ttl.as_secs(), driver.config.seen_max);
        let pruned = driver.state.update(|s| {
            s.advance(next);
            s.prune(now, ttl, max)
        });
        debug!(checkpoint = next, pruned, "checkpoint moved");
    }
}

/// Publishes the announcements to one relay that just connected.
async fn announce(
    client: Client,
    relay: RelayUrl,
    events: Vec<nostr_sdk::Event>,
    within: Duration,
) {
    let name = relay_name(&relay);
    for event in events {
        let sent =
            tokio::time::timeout(within, client.send_event_to([relay.clone()], &event)).await;
        match sent {
            Ok(Ok(output)) if output.success.contains(&relay) => {
                debug!(relay = %name, kind = event.kind.as_u16(), "announced")
            }
            Ok(Ok(output)) => {
                let reason = output.failed.values().next().cloned().unwrap_or_default();
                warn!(relay = %name, kind = event.kind.as_u16(), %reason, "the relay refused an announcement")
            }
            Ok(Err(err)) => warn!(relay = %name, error = %err, "cannot announce"),
            Err(_) => warn!(relay = %name, "no answer to an announcement"),
        }
    }
}

/// Writes the state whenever it changed, until `stop`.
async fn write_state(state: Arc<StateStore>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = state.changed() => {}
        }
        if let Err(err) = state.flush().await {
            error!(error = %err, "cannot save the state; messages may be handled again after a restart");
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
