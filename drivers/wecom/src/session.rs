//! One connection to WeCom, from the WebSocket handshake to its end: `aibot_subscribe` first,
//! then reading frames (acknowledgements to the [`Link`], callbacks to the dispatcher) and an
//! application `ping` every interval. Two pings in a row without an acknowledgement mean the
//! connection is dead; a `disconnected_event` means another client took the bot.
//!
//! The session never waits for the hub itself: callbacks go to the dispatcher through a
//! bounded queue, so a slow hub slows reading only once that queue is full.

use std::collections::HashSet;

use channeld_driver_sdk::transport::websocket::{self, WsMessage, WsOptions, WsReceiver, WsSender};
use channeld_driver_sdk::{CancellationToken, Hub, LinkState, Reconnect};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, info, warn};

use crate::config::WeComConfig;
use crate::link::{Connection, Link, Outgoing};
use crate::wire::{self, Incoming, cmd};

/// Unanswered pings in a row after which the connection counts as dead.
pub const MISSED_PINGS: usize = 2;
/// Callbacks waiting for the dispatcher. When full, the session stops reading until there
/// is room (nothing is dropped; WeCom's own buffering and its repeats cover the pause).
pub const DISPATCH_QUEUE: usize = 1024;
/// The largest frame read from WeCom (callbacks are a few kilobytes).
const MAX_FRAME_BYTES: usize = 1024 * 1024;

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The driver is stopping.
    Stopped,
    /// `disconnected_event`: another client subscribed the bot and WeCom dropped this one.
    Fenced,
    /// WeCom refused the subscribe (bot id or secret); the text says why, without a secret.
    AuthRejected(String),
    /// The connection failed, dropped or went silent; retrying may help.
    Lost(String),
}

/// What a session works with.
#[derive(Debug)]
pub struct Context<'a> {
    pub config: &'a WeComConfig,
    pub link: &'a Link,
    pub hub: &'a Hub,
    pub dispatch: &'a mpsc::Sender<Incoming>,
    pub shutdown: &'a CancellationToken,
}

/// Connects, subscribes and serves until the connection ends.
pub async fn run(cx: &Context<'_>, reconnect: &mut Reconnect) -> End {
    let config = cx.config;
    let options = WsOptions {
        connect_timeout: config.connect_timeout,
        // WeCom's liveness is the application ping below; WebSocket pings only catch a
        // half-open socket when even that falls silent.
        ping_interval: config.ping_interval * 2,
        idle_timeout: config.ping_interval * 3 + config.ack_timeout,
        max_message_bytes: MAX_FRAME_BYTES,
        headers: Vec::new(),
    };
    let connected = tokio::select! {
        biased;
        () = cx.shutdown.cancelled() => return End::Stopped,
        connected = websocket::connect(&config.ws_url, &options) => connected,
    };
    let (sender, mut receiver) = match connected {
        Ok(pair) => pair,
        Err(err) if err.is_auth() => return End::AuthRejected(err.to_string()),
        Err(err) => return End::Lost(err.to_string()),
    };
    if let Err(end) = subscribe(cx, &sender, &mut receiver).await {
        sender.close().await;
        return end;
    }
    reconnect.connected();
    cx.hub.link_state(up(config));
    info!(bot_id = %config.bot_id, host = config.ws_url.host_str().unwrap_or_default(), "subscribed to WeCom");
    let (connection, outgoing) = cx.link.attach();
    let end = serve(cx, &sender, &mut receiver, &connection, outgoing).await;
    cx.link.detach(&connection);
    if matches!(end, End::Stopped | End::Fenced) {
        sender.close().await;
    }
    end
}

/// Sends `aibot_subscribe` and waits for its acknowledgement.
async fn subscribe(
    cx: &Context<'_>,
    sender: &WsSender,
    receiver: &mut WsReceiver,
) -> Result<(), End> {
    let config = cx.config;
    let req_id = wire::req_id(cmd::SUBSCRIBE);
    let body = wire::Subscribe { bot_id: &config.bot_id, secret: config.secret.as_str() };
    // The frame carries the secret: it is written, never logged.
    if sender.send_text(wire::encode(cmd::SUBSCRIBE, &req_id, Some(&body))).await.is_err() {
        return Err(End::Lost("the connection closed before the subscribe".into()));
    }
    let deadline = Instant::now() + config.connect_timeout;
    loop {
        let message = tokio::select! {
            biased;
            () = cx.shutdown.cancelled() => return Err(End::Stopped),
            () = tokio::time::sleep_until(deadline) => {
                return Err(End::Lost(format!(
                    "no answer to aibot_subscribe within {:?}",
                    config.connect_timeout
                )));
            }
            message = receiver.recv() => message,
        };
        match message {
            Ok(Some(WsMessage::Text(text))) => match wire::decode(&text) {
                Ok(Incoming::Ack(ack)) if ack.req_id == req_id => {
                    return if ack.is_ok() {
                        Ok(())
                    } else {
                        Err(End::AuthRejected(format!(
                            "WeCom refused the subscribe: {}",
                            ack.describe()
                        )))
                    };
                }
                Ok(Incoming::Ack(ack)) => {
                    debug!(req_id = %ack.req_id, "acknowledgement before the subscribe's")
                }
                Ok(callback @ (Incoming::Message { .. } | Incoming::Event { .. })) => {
                    if cx.dispatch.send(callback).await.is_err() {
                        return Err(End::Stopped);
                    }
                }
                Ok(Incoming::Other { cmd }) => debug!(%cmd, "unknown command from WeCom"),
                Err(err) => warn!(error = %err, "unreadable frame from WeCom"),
            },
            Ok(Some(WsMessage::Binary(_))) => debug!("binary frame from WeCom ignored"),
            Ok(None) => {
                return Err(End::Lost("WeCom closed the connection before subscribing".into()));
            }
            Err(err) => return Err(End::Lost(err.to_string())),
        }
    }
}

/// Reads and pings until the connection ends.
async fn serve(
    cx: &Context<'_>,
    sender: &WsSender,
    receiver: &mut WsReceiver,
    connection: &Connection,
    outgoing: mpsc::Receiver<Outgoing>,
) -> End {
    // One task writes what posts, effects and pings queue; it ends with the session.
    let mut writer = JoinSet::new();
    writer.spawn(write(outgoing, sender.clone()));
    let mut pings =
        tokio::time::interval_at(Instant::now() + cx.config.ping_interval, cx.config.ping_interval);
    pings.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut unanswered: HashSet<String> = HashSet::new();
    let mut last_answer = Instant::now();
    loop {
        tokio::select! {
            biased;
            () = cx.shutdown.cancelled() => return End::Stopped,
            _ = writer.join_next() => return End::Lost("writing to WeCom failed".into()),
            _ = pings.tick() => {
                if unanswered.len() >= MISSED_PINGS {
                    return End::Lost(format!(
                        "{} pings in a row got no acknowledgement (last answer {:?} ago)",
                        unanswered.len(),
                        last_answer.elapsed()
                    ));
                }
                if !unanswered.is_empty() {
                    cx.hub.link_state(LinkState::Stalled { idle: last_answer.elapsed() });
                }
                let req_id = wire::req_id(cmd::PING);
                // A full queue skips the beat; it still counts as unanswered.
                connection.try_send(wire::encode::<()>(cmd::PING, &req_id, None));
                unanswered.insert(req_id);
            }
            message = receiver.recv() => match message {
                Ok(Some(WsMessage::Text(text))) => match wire::decode(&text) {
                    Ok(Incoming::Ack(ack)) if unanswered.contains(&ack.req_id) => {
                        if !ack.is_ok() {
                            warn!(error = %ack.describe(), "WeCom answered a ping with an error");
                        }
                        unanswered.clear();
                        last_answer = Instant::now();
                        cx.hub.link_state(up(cx.config));
                    }
                    Ok(Incoming::Ack(ack)) => {
                        let req_id = ack.req_id.clone();
                        if !connection.acknowledge(ack) {
                            debug!(%req_id, "acknowledgement nobody waits for (too late)");
                        }
                    }
                    Ok(Incoming::Event { callback, .. })
                        if callback.event.eventtype == wire::event::DISCONNECTED =>
                    {
                        return End::Fenced;
                    }
                    Ok(callback @ (Incoming::Message { .. } | Incoming::Event { .. })) => {
                        if cx.dispatch.send(callback).await.is_err() {
                            return End::Stopped;
                        }
                    }
                    Ok(Incoming::Other { cmd }) => debug!(%cmd, "unknown command from WeCom"),
                    Err(err) => warn!(error = %err, "unreadable frame from WeCom"),
                },
                Ok(Some(WsMessage::Binary(_))) => debug!("binary frame from WeCom ignored"),
                Ok(None) => return End::Lost("WeCom closed the connection".into()),
                Err(err) => return End::Lost(err.to_string()),
            },
        }
    }
}

/// Writes queued frames in order and tells each waiter once its frame is handed to the
/// socket.
async fn write(mut outgoing: mpsc::Receiver<Outgoing>, sender: WsSender) {
    while let Some(frame) = outgoing.recv().await {
        if sender.send_text(frame.text).await.is_err() {
            return;
        }
        if let Some(written) = frame.written {
            let _ = written.send(());
        }
    }
}

/// Subscribed and answering pings.
fn up(config: &WeComConfig) -> LinkState {
    LinkState::up_as(format!("subscribed as bot {}", config.bot_id))
}
