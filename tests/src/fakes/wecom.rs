//! A fake WeCom AI Bot long-connection server (the real one is `wss://openws.work.weixin.qq.com`)
//! speaking the platform's JSON frames over plain `ws://127.0.0.1:<port>`.
//!
//! It follows the platform's rules ([`rules`]): `aibot_subscribe` first with a credential
//! check, one live connection per bot (a second subscribe sends the first a
//! `disconnected_event` and closes it), an acknowledgement `{headers:{req_id}, errcode,
//! errmsg}` for every command, stream frames that replace the shown content until `finish`,
//! 846608 for a stream updated after its (configurable) window, 846605 for unknown `req_id`s,
//! proactive sends only to conversations that messaged the bot, welcome and card-update
//! windows. A test steers it through [`FakeWeCom`]: push callbacks and events, kick the live
//! connection, switch modes (pings ignored, a silent half-open connection, slow
//! acknowledgements, a per-conversation rate limit, injected errors) and read the [`Record`]
//! of everything it saw, including the protocol rules a client broke.

pub mod payloads;
pub mod record;
pub mod rules;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use record::{ConnId, Record, StreamRecord};
pub use rules::{
    ERR_BAD_CREDENTIALS, ERR_CONTENT_TOO_LONG, ERR_INVALID_FRAME, ERR_NOT_SUBSCRIBED,
    ERR_RATE_LIMITED, ERR_STREAM_EXPIRED, ERR_UNKNOWN_CHAT, ERR_UNKNOWN_REQ_ID, FakeConfig,
    MAX_CONTENT_BYTES, NoLiveConnection, PingMode, RateLimit,
};

use rules::{Effect, Platform};

/// Frames queued for one connection. A client that stops reading for this long is recorded
/// as a violation and loses frames, so a test notices instead of the fake growing without
/// bound.
const CONNECTION_QUEUE: usize = 4096;

/// What a connection's task is told to do.
#[derive(Debug)]
enum Out {
    Text(String),
    /// A close frame, then the connection ends.
    Close,
    /// The connection ends without a close frame.
    Drop,
    /// Half-open: read nothing and send nothing until closed.
    Silence,
}

/// The state the server tasks and the handle share.
#[derive(Debug)]
struct Shared {
    platform: Mutex<Platform>,
    connections: Mutex<HashMap<ConnId, mpsc::Sender<Out>>>,
    /// Bumped after every change, so a waiting test looks again.
    version: watch::Sender<u64>,
    next_conn: AtomicU64,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl Shared {
    fn platform(&self) -> MutexGuard<'_, Platform> {
        self.platform.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn changed(&self) {
        self.version.send_modify(|version| *version += 1);
    }

    /// Executes what the platform decided.
    fn apply(self: &Arc<Self>, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Send { conn, text } => self.deliver(conn, Out::Text(text)),
                Effect::Close { conn } => self.deliver(conn, Out::Close),
                Effect::AckLater { conn, req_id, text, delay } => {
                    let shared = self.clone();
                    self.tasks.spawn(async move {
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = shared.shutdown.cancelled() => return,
                        }
                        let sender = shared.sender(conn);
                        if let Some(sender) = sender {
                            let _ = sender.send(Out::Text(text)).await;
                        }
                        shared.platform().ack_sent(&req_id);
                        shared.changed();
                    });
                }
            }
        }
        self.changed();
    }

    fn sender(&self, conn: ConnId) -> Option<mpsc::Sender<Out>> {
        self.connections.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&conn).cloned()
    }

    fn deliver(&self, conn: ConnId, out: Out) {
        let Some(sender) = self.sender(conn) else { return };
        if let Err(mpsc::error::TrySendError::Full(_)) = sender.try_send(out) {
            self.platform().record.violations.push(format!(
                "connection {conn} did not read its frames ({CONNECTION_QUEUE} queued); one was lost"
            ));
        }
    }
}

/// A running fake WeCom. Stops when dropped.
#[derive(Debug)]
pub struct FakeWeCom {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FakeWeCom {
    /// Binds 127.0.0.1 on a free port and starts serving `config`'s bot.
    pub async fn start(config: FakeConfig) -> Self {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind the fake WeCom");
        let addr = listener.local_addr().expect("fake WeCom address");
        let (version, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            platform: Mutex::new(Platform::new(config)),
            connections: Mutex::new(HashMap::new()),
            version,
            next_conn: AtomicU64::new(1),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
        });
        let app = Router::new().fallback(upgrade).with_state(shared.clone());
        let stop = shared.shutdown.clone();
        shared.tasks.spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
        });
        Self { addr, shared }
    }

    /// `ws://127.0.0.1:<port>`, the value for the driver's WS URL setting.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// Pushes an `aibot_msg_callback` with `body` (see [`payloads`]); returns its `req_id`.
    pub fn push_message(&self, body: Value) -> Result<String, NoLiveConnection> {
        self.push("aibot_msg_callback", body)
    }

    /// Pushes an `aibot_event_callback` with `body`; returns its `req_id`.
    pub fn push_event(&self, body: Value) -> Result<String, NoLiveConnection> {
        self.push("aibot_event_callback", body)
    }

    fn push(&self, cmd: &str, body: Value) -> Result<String, NoLiveConnection> {
        let (req_id, effects) = self.shared.platform().push(cmd, body, Instant::now())?;
        self.shared.apply(effects);
        Ok(req_id)
    }

    /// Pushes the callback `req_id` again (same body, same `msgid`, a new `req_id`), as the
    /// platform does when it retries; returns the new `req_id`. Panics if `req_id` is unknown.
    pub fn repeat(&self, req_id: &str) -> Result<String, NoLiveConnection> {
        let pushed = self.shared.platform().repeat(req_id, Instant::now());
        let (req_id, effects) =
            pushed.unwrap_or_else(|| panic!("no callback {req_id} to repeat"))?;
        self.shared.apply(effects);
        Ok(req_id)
    }

    /// Another client took the bot: the live connection gets `disconnected_event` and is
    /// closed.
    pub fn kick(&self) -> Result<(), NoLiveConnection> {
        let effects = self.shared.platform().kick(Instant::now())?;
        self.shared.apply(effects);
        Ok(())
    }

    /// Ends the live connection abruptly (no close frame, no event).
    pub fn drop_live(&self) -> Result<(), NoLiveConnection> {
        let live = self.shared.platform().live().ok_or(NoLiveConnection)?;
        self.shared.deliver(live, Out::Drop);
        Ok(())
    }

    /// Makes the live connection half-open: from now on the fake reads nothing from it
    /// (not even WebSocket pings) and sends nothing on it, until a new subscribe replaces it.
    pub fn silence_live(&self) -> Result<(), NoLiveConnection> {
        let live = self.shared.platform().live().ok_or(NoLiveConnection)?;
        self.shared.deliver(live, Out::Silence);
        Ok(())
    }

    pub fn set_ping_mode(&self, mode: PingMode) {
        self.shared.platform().modes.ping = mode;
    }

    /// Sends every acknowledgement `delay` late (`None`: at once).
    pub fn set_slow(&self, delay: Option<Duration>) {
        self.shared.platform().modes.slow = delay;
    }

    pub fn set_rate_limit(&self, limit: Option<RateLimit>) {
        self.shared.platform().modes.rate_limit = limit;
    }

    pub fn set_stream_expiry(&self, expiry: Duration) {
        self.shared.platform().config_mut().stream_expiry = expiry;
    }

    pub fn set_reply_window(&self, window: Duration) {
        self.shared.platform().config_mut().reply_window = window;
    }

    /// The next `cmd` command is refused with `errcode` (and not applied).
    pub fn fail_next(&self, cmd: &str, errcode: i64, errmsg: &str) {
        self.shared.platform().modes.fail_next.push_back((
            cmd.to_owned(),
            errcode,
            errmsg.to_owned(),
        ));
    }

    /// Marks `chat` (a user id or group chatid) as having messaged the bot before the test,
    /// so proactive sends to it are accepted.
    pub fn know_chat(&self, chat: &str) {
        self.shared.platform().know_chat(chat);
    }

    /// Whether a subscribed connection holds the bot.
    pub fn is_live(&self) -> bool {
        self.shared.platform().live().is_some()
    }

    /// A copy of everything seen so far.
    pub fn record(&self) -> Record {
        self.shared.platform().record.clone()
    }

    /// Waits until `check` finds something in the record; panics after `within`, naming
    /// `what` and showing the recent traffic.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        within: Duration,
        mut check: impl FnMut(&Record) -> Option<T>,
    ) -> T {
        self.wait_platform(what, within, |platform| check(&platform.record)).await
    }

    /// Waits for a subscribed connection and returns it.
    pub async fn wait_live(&self, within: Duration) -> ConnId {
        self.wait_platform("a subscribed connection", within, Platform::live).await
    }

    async fn wait_platform<T>(
        &self,
        what: &str,
        within: Duration,
        mut check: impl FnMut(&Platform) -> Option<T>,
    ) -> T {
        super::wait_until(
            "WeCom",
            what,
            within,
            self.shared.version.subscribe(),
            || check(&self.shared.platform()),
            || self.shared.platform().record.summary(),
        )
        .await
    }
}

impl Drop for FakeWeCom {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        self.shared.tasks.close();
    }
}

async fn upgrade(State(shared): State<Arc<Shared>>, ws: WebSocketUpgrade) -> Response {
    let tracker = shared.tasks.clone();
    ws.on_upgrade(move |socket| tracker.track_future(serve(shared, socket)))
}

/// One client connection: frames in go to the platform, effects out go to the socket.
async fn serve(shared: Arc<Shared>, mut socket: WebSocket) {
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (sender, mut outgoing) = mpsc::channel(CONNECTION_QUEUE);
    shared.connections.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(conn, sender);
    shared.platform().on_open(conn, Instant::now());
    shared.changed();
    'connection: loop {
        tokio::select! {
            biased;
            () = shared.shutdown.cancelled() => break,
            out = outgoing.recv() => match out {
                Some(Out::Text(text)) => {
                    if socket.send(Message::Text(text.into())).await.is_err() {
                        break;
                    }
                }
                Some(Out::Close) => {
                    let _ = socket.send(Message::Close(None)).await;
                    break;
                }
                Some(Out::Drop) | None => break,
                Some(Out::Silence) => loop {
                    tokio::select! {
                        () = shared.shutdown.cancelled() => break 'connection,
                        out = outgoing.recv() => match out {
                            Some(Out::Close | Out::Drop) | None => break 'connection,
                            Some(Out::Text(_) | Out::Silence) => {}
                        },
                    }
                },
            },
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Text(text))) => {
                    let effects = shared.platform().on_text(conn, text.as_str(), Instant::now());
                    shared.apply(effects);
                }
                Some(Ok(Message::Binary(_))) => {
                    shared.platform().record.violations.push(format!(
                        "connection {conn} sent a binary frame (the protocol is JSON text)"
                    ));
                    shared.changed();
                }
                // tungstenite answers pings by itself while the connection is read.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
            },
        }
    }
    shared.connections.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(&conn);
    shared.platform().on_close(conn, Instant::now());
    shared.changed();
}
