//! One connection to BCN, from the WebSocket handshake to its end: `bot.connect` first (the
//! stored token restores the bot's identity; a new one is stored), then reading frames and a
//! `bot.status` heartbeat every interval. Two heartbeats in a row without an answer mean the
//! connection is dead.
//!
//! Requests from BCN go to the [`Handler`]; it answers quick ones itself and hands work that
//! waits for the hub to the driver's dispatcher through a bounded queue, so a slow hub slows
//! reading only once that queue is full.

use std::collections::HashSet;

use channeld_driver_sdk::transport::websocket::{self, WsMessage, WsOptions, WsReceiver, WsSender};
use channeld_driver_sdk::{CancellationToken, Reconnect};
use serde_json::Value;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, warn};

use crate::config::{BcnConfig, MAX_PROTOCOL_VERSION};
use crate::token;
use crate::wire::{self, Connected, Incoming, Request, Response, code, method};

/// Unanswered `bot.status` in a row after which the connection counts as dead.
pub const MISSED_STATUS: usize = 2;
/// The largest frame read from BCN.
const MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The driver is stopping.
    Stopped,
    /// BCN answered `bot.connect` with `unauthorized`.
    AuthRejected(String),
    /// The versions cannot meet (`unsupported_protocol_version`, or BCN's minimum is above
    /// what the driver speaks): an operator must change `CHANNELD_BCN_PROTOCOL_VERSION` or
    /// upgrade.
    Unsupported(String),
    /// The connection failed, dropped or went silent; retrying may help.
    Lost(String),
}

/// What the driver does with a live connection's requests.
pub trait Handler: Send + Sync {
    /// A connection is up after `bot.connect`: frames for BCN now go to `sender`.
    fn connected(&self, sender: WsSender, connected: &Connected, negotiated: u32);
    /// The connection ended.
    fn disconnected(&self);
    /// A request from BCN; the handler answers it on `sender`.
    fn request(
        &self,
        sender: &WsSender,
        request: Request,
    ) -> impl std::future::Future<Output = ()> + Send;
}

/// Connects, says `bot.connect` and serves until the connection ends.
pub async fn run(
    config: &BcnConfig,
    handler: &impl Handler,
    shutdown: &CancellationToken,
    reconnect: &mut Reconnect,
) -> End {
    let options = WsOptions {
        connect_timeout: config.connect_timeout,
        ping_interval: config.status_interval,
        idle_timeout: config.status_interval * 3 + config.connect_timeout,
        max_message_bytes: MAX_FRAME_BYTES,
        headers: Vec::new(),
    };
    let connected = tokio::select! {
        biased;
        () = shutdown.cancelled() => return End::Stopped,
        connected = websocket::connect(&config.url, &options) => connected,
    };
    let (sender, mut receiver) = match connected {
        Ok(pair) => pair,
        Err(err) if err.is_auth() => return End::AuthRejected(err.to_string()),
        Err(err) => return End::Lost(err.to_string()),
    };
    let (connected, negotiated) = match handshake(config, &sender, &mut receiver, shutdown).await {
        Ok(done) => done,
        Err(end) => {
            sender.close().await;
            return end;
        }
    };
    reconnect.connected();
    handler.connected(sender.clone(), &connected, negotiated);
    let end = serve(config, handler, &sender, &mut receiver, shutdown).await;
    handler.disconnected();
    if end == End::Stopped {
        sender.close().await;
    }
    end
}

/// Sends `bot.connect` (with the stored token, if any), waits for its answer, checks the
/// versions and stores a new or changed token.
async fn handshake(
    config: &BcnConfig,
    sender: &WsSender,
    receiver: &mut WsReceiver,
    shutdown: &CancellationToken,
) -> Result<(Connected, u32), End> {
    let stored = token::load(&config.token_file).map_err(|err| End::Lost(err.to_string()))?;
    let id = wire::request_id("connect");
    let params = wire::connect_params(stored.as_ref().map(|t| t.as_str()), config.protocol_version);
    // The frame carries the token: it is written, never logged.
    if sender.send_text(wire::request(&id, method::CONNECT, params)).await.is_err() {
        return Err(End::Lost("the connection closed before bot.connect".into()));
    }
    let deadline = Instant::now() + config.connect_timeout;
    let response = loop {
        let message = tokio::select! {
            biased;
            () = shutdown.cancelled() => return Err(End::Stopped),
            () = tokio::time::sleep_until(deadline) => {
                return Err(End::Lost(format!(
                    "no answer to bot.connect within {:?}",
                    config.connect_timeout
                )));
            }
            message = receiver.recv() => message,
        };
        match message {
            Ok(Some(WsMessage::Text(text))) => match wire::decode(&text) {
                Ok(Incoming::Res(response)) if response.id == id => break response,
                Ok(other) => {
                    debug!(frame = ?kind(&other), "frame before the bot.connect answer ignored")
                }
                Err(err) => warn!(error = %err, "unreadable frame from BCN"),
            },
            Ok(Some(WsMessage::Binary(_))) => debug!("binary frame from BCN ignored"),
            Ok(None) => {
                return Err(End::Lost("BCN closed the connection during bot.connect".into()));
            }
            Err(err) => return Err(End::Lost(err.to_string())),
        }
    };
    let connected = accept(config, &response)?;
    let negotiated = connected.protocol_version.unwrap_or(config.protocol_version);
    if stored.as_ref().is_none_or(|token| token.as_str() != connected.token) {
        token::store(&config.token_file, &connected.token).map_err(|err| {
            // Without the token the next connection would be a new bot: not worth serving.
            End::Lost(err.to_string())
        })?;
    }
    Ok((connected, negotiated))
}

/// The `bot.connect` answer judged: refused (`unauthorized`, a version problem, anything
/// else) or connected with versions the driver can speak.
pub fn accept(config: &BcnConfig, response: &Response) -> Result<Connected, End> {
    if !response.ok {
        return Err(match response.code() {
            Some(code::UNAUTHORIZED) => {
                End::AuthRejected(format!("BCN refused bot.connect: {}", response.describe()))
            }
            Some(code::UNSUPPORTED_PROTOCOL_VERSION) => End::Unsupported(format!(
                "BCN does not support protocol version {}: {}",
                config.protocol_version,
                response.describe()
            )),
            _ => End::Lost(format!("BCN refused bot.connect: {}", response.describe())),
        });
    }
    let connected: Connected = serde_json::from_value(response.payload.clone())
        .map_err(|err| End::Lost(format!("unreadable bot.connect answer: {err}")))?;
    let negotiated = connected.protocol_version.unwrap_or(config.protocol_version);
    if negotiated == 0 || negotiated > MAX_PROTOCOL_VERSION {
        return Err(End::Unsupported(format!(
            "BCN negotiated protocol version {negotiated}; this driver speaks 1 to {MAX_PROTOCOL_VERSION}"
        )));
    }
    if let Some(min) = connected.min_supported_version
        && negotiated < min
    {
        return Err(End::Unsupported(format!(
            "BCN negotiated protocol version {negotiated} below its own minimum {min}; set CHANNELD_BCN_PROTOCOL_VERSION to {min} or later"
        )));
    }
    if connected.token.is_empty() || connected.bot_uuid.is_empty() {
        return Err(End::Lost("bot.connect answer without a token or bot_uuid".into()));
    }
    Ok(connected)
}

/// Reads and sends heartbeats until the connection ends.
async fn serve(
    config: &BcnConfig,
    handler: &impl Handler,
    sender: &WsSender,
    receiver: &mut WsReceiver,
    shutdown: &CancellationToken,
) -> End {
    let mut beats =
        tokio::time::interval_at(Instant::now() + config.status_interval, config.status_interval);
    beats.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut unanswered: HashSet<String> = HashSet::new();
    let mut last_answer = Instant::now();
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return End::Stopped,
            _ = beats.tick() => {
                if unanswered.len() >= MISSED_STATUS {
                    return End::Lost(format!(
                        "{} bot.status in a row got no answer (last answer {:?} ago)",
                        unanswered.len(),
                        last_answer.elapsed()
                    ));
                }
                let id = wire::request_id("status");
                let frame = wire::request(&id, method::STATUS, Value::Object(Default::default()));
                if sender.send_text(frame).await.is_err() {
                    return End::Lost("the connection closed".into());
                }
                unanswered.insert(id);
            }
            message = receiver.recv() => match message {
                Ok(Some(WsMessage::Text(text))) => match wire::decode(&text) {
                    Ok(Incoming::Res(response)) if unanswered.contains(&response.id) => {
                        if !response.ok {
                            warn!(error = %response.describe(), "BCN answered bot.status with an error");
                        }
                        unanswered.clear();
                        last_answer = Instant::now();
                    }
                    Ok(Incoming::Res(response)) => {
                        debug!(id = %response.id, "answer nobody waits for");
                    }
                    Ok(Incoming::Req(request)) => {
                        last_answer = Instant::now();
                        handler.request(sender, request).await;
                    }
                    Ok(Incoming::Event { event, .. }) => debug!(%event, "event from BCN ignored"),
                    Err(err) => warn!(error = %err, "unreadable frame from BCN"),
                },
                Ok(Some(WsMessage::Binary(_))) => debug!("binary frame from BCN ignored"),
                Ok(None) => return End::Lost("BCN closed the connection".into()),
                Err(err) => return End::Lost(err.to_string()),
            },
        }
    }
}

fn kind(frame: &Incoming) -> &'static str {
    match frame {
        Incoming::Req(_) => "req",
        Incoming::Res(_) => "res",
        Incoming::Event { .. } => "event",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    fn config(version: u32) -> BcnConfig {
        BcnConfig {
            channel: channeld_driver_sdk::protocol::ChannelId::new("bcn.lab").unwrap(),
            url: "ws://127.0.0.1:1/ws/bot".parse().unwrap(),
            protocol_version: version,
            token_file: "/tmp/none".into(),
            status_interval: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            reconnect_max: Duration::from_secs(30),
            auth_retry: Duration::from_secs(300),
            send_timeout: Duration::from_secs(25),
        }
    }

    fn response(ok: bool, payload: Value, error: Option<(&str, &str)>) -> Response {
        Response {
            id: "1".into(),
            ok,
            payload,
            error: error.map(|(code, message)| wire::ErrorBody::new(code, message)),
        }
    }

    #[test]
    fn refusals_are_told_apart() {
        let unauthorized = response(false, Value::Null, Some((code::UNAUTHORIZED, "bad token")));
        assert!(matches!(accept(&config(1), &unauthorized), Err(End::AuthRejected(_))));
        let version =
            response(false, Value::Null, Some((code::UNSUPPORTED_PROTOCOL_VERSION, "no")));
        assert!(matches!(accept(&config(1), &version), Err(End::Unsupported(_))));
        let busy = response(false, Value::Null, Some((code::UNAVAILABLE, "later")));
        assert!(matches!(accept(&config(1), &busy), Err(End::Lost(_))));
    }

    #[test]
    fn versions_are_checked() {
        let answer = |version: u32, min: u32| {
            response(
                true,
                json!({"token": "t", "bot_uuid": "b", "protocol_version": version, "min_supported_version": min}),
                None,
            )
        };
        assert!(accept(&config(2), &answer(2, 1)).is_ok());
        assert!(matches!(accept(&config(1), &answer(1, 2)), Err(End::Unsupported(_))));
        assert!(matches!(accept(&config(3), &answer(4, 1)), Err(End::Unsupported(_))));
        let old_server = response(true, json!({"token": "t", "bot_uuid": "b"}), None);
        assert!(accept(&config(1), &old_server).is_ok(), "no version fields: the one asked for");
    }
}
