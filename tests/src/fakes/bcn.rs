//! A fake Avernet BCN (Bot Coordination Network) server speaking the bot protocol of the
//! platform's "Bot Integration Guide" over plain `ws://127.0.0.1:<port>/ws/bot`.
//!
//! It follows the guide: JSON text frames `req`/`res`/`event`; `bot.connect` must come first
//! (anything else first is answered `invalid_request` and the connection is closed); without a
//! token a new bot is registered (`is_new`, a fresh `token` and `bot_uuid`, `env`), with a
//! known token the bot is restored, with an unknown one `unauthorized`; the asked
//! `protocol_version` (default 1) is negotiated within the server's supported range, else
//! `unsupported_protocol_version`, with a `deprecation` notice for deprecated versions;
//! `bot.status` is answered, and a bot silent for the heartbeat TTL is marked offline and
//! disconnected; BCN sends `chat.send`, `chat.inject`, `chat.abort` and `chat.history`
//! requests and records the answers; `chat.event`s are checked against the guide's state
//! machine (a run id the bot answered, `seq` growing per run, nothing after a terminal state)
//! and every deviation is recorded as a violation. `restart` drops every connection, as a
//! BCN restart does; bots and tokens survive it.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A connection's number (1, 2, …).
pub type ConnId = u64;

/// Frames queued for one connection.
const CONNECTION_QUEUE: usize = 4096;

/// How the fake behaves.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    /// Protocol versions served: `min_supported_version..=max`.
    pub min_version: u32,
    pub max_version: u32,
    /// Versions answered with a `deprecation` notice.
    pub deprecated: Vec<u32>,
    /// Silence after which a bot is marked offline and disconnected (the guide: 5 minutes).
    pub heartbeat_ttl: Duration,
    /// New bots (a `bot.connect` without a token) are refused `unauthorized`.
    pub refuse_new_bots: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            min_version: 1,
            max_version: 3,
            deprecated: Vec::new(),
            heartbeat_ttl: Duration::from_secs(300),
            refuse_new_bots: false,
        }
    }
}

/// One `bot.connect` as the fake saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRecord {
    pub conn: ConnId,
    pub token: Option<String>,
    pub asked_version: Option<u32>,
    /// `Ok(bot_uuid)` or `Err(error code)`.
    pub outcome: Result<String, String>,
    pub is_new: bool,
}

/// Everything the fake saw.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub connects: Vec<ConnectRecord>,
    pub statuses: usize,
    /// Every frame the bots sent, in arrival order, with its connection.
    pub frames: Vec<(ConnId, Value)>,
    /// Answers to BCN's requests by request id.
    pub responses: HashMap<String, Value>,
    /// `chat.event` payloads by run id, with their `seq`, in arrival order.
    pub events: BTreeMap<String, Vec<(u64, Value)>>,
    /// Connections the fake ended because the bot fell silent.
    pub heartbeat_timeouts: usize,
    pub violations: Vec<String>,
}

impl Record {
    /// The states of a run's events in order.
    pub fn states(&self, run_id: &str) -> Vec<String> {
        self.events
            .get(run_id)
            .map(|events| {
                events
                    .iter()
                    .map(|(_, payload)| payload["state"].as_str().unwrap_or("").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The position in `frames` of the answer to request `id`.
    pub fn response_index(&self, id: &str) -> Option<usize> {
        self.frames.iter().position(|(_, frame)| frame["type"] == "res" && frame["id"] == id)
    }

    /// The position in `frames` of the first `chat.event` of `run_id` in `state`.
    pub fn event_index(&self, run_id: &str, state: &str) -> Option<usize> {
        self.frames.iter().position(|(_, frame)| {
            frame["type"] == "event"
                && frame["payload"]["run_id"] == run_id
                && frame["payload"]["state"] == state
        })
    }

    /// The last frames, for a failure message.
    pub fn summary(&self) -> String {
        let start = self.frames.len().saturating_sub(20);
        let mut out = format!(
            "connects: {:?}\nviolations: {:?}\nlast frames:\n",
            self.connects, self.violations
        );
        for (conn, frame) in &self.frames[start..] {
            out.push_str(&format!("  [{conn}] {frame}\n"));
        }
        out
    }
}

/// A registered bot.
#[derive(Debug, Clone)]
struct Bot {
    uuid: String,
    online: Option<ConnId>,
}

/// A `chat.send` BCN made, and what became of its run.
#[derive(Debug, Clone)]
struct Sent {
    session_key: String,
    run_id: Option<String>,
    ended: bool,
}

#[derive(Debug)]
struct Conn {
    out: mpsc::Sender<Out>,
    /// The bot, once `bot.connect` succeeded.
    bot: Option<String>,
    last_frame: Instant,
}

#[derive(Debug)]
enum Out {
    Text(String),
    Close,
}

#[derive(Debug)]
struct Platform {
    config: FakeConfig,
    /// Bots by token.
    bots: HashMap<String, Bot>,
    conns: HashMap<ConnId, Conn>,
    /// `chat.send` requests by request id.
    sent: HashMap<String, Sent>,
    record: Record,
    next: u64,
}

impl Platform {
    fn fresh(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}-{:04}-{:08x}", self.next, fastrand::u32(..))
    }

    fn send(&mut self, conn: ConnId, frame: &Value) {
        let Some(c) = self.conns.get(&conn) else { return };
        if c.out.try_send(Out::Text(frame.to_string())).is_err() {
            self.record
                .violations
                .push(format!("connection {conn} did not read its frames; one was lost"));
        }
    }

    fn close(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get(&conn) {
            let _ = c.out.try_send(Out::Close);
        }
    }

    fn refuse(&mut self, conn: ConnId, id: &Value, code: &str, message: &str) {
        let frame = json!({"type": "res", "id": id, "ok": false, "error": {
            "code": code, "message": message, "retryable": false, "retry_after_ms": null}});
        self.send(conn, &frame);
    }

    fn on_text(&mut self, conn: ConnId, text: &str) {
        let now = Instant::now();
        if let Some(c) = self.conns.get_mut(&conn) {
            c.last_frame = now;
        }
        let frame: Value = match serde_json::from_str(text) {
            Ok(frame @ Value::Object(_)) => frame,
            _ => {
                self.record.violations.push(format!("connection {conn} sent a non-JSON frame"));
                return;
            }
        };
        self.record.frames.push((conn, frame.clone()));
        let authenticated = self.conns.get(&conn).is_some_and(|c| c.bot.is_some());
        match frame["type"].as_str() {
            Some("req") if frame["method"] == "bot.connect" => self.connect(conn, &frame),
            _ if !authenticated => {
                self.record
                    .violations
                    .push(format!("connection {conn} sent {frame} before bot.connect"));
                self.refuse(conn, &frame["id"], "invalid_request", "bot.connect must come first");
                self.close(conn);
            }
            Some("req") if frame["method"] == "bot.status" => {
                self.record.statuses += 1;
                self.send(
                    conn,
                    &json!({"type": "res", "id": frame["id"], "ok": true, "payload": {}}),
                );
            }
            Some("req") => {
                let method = frame["method"].as_str().unwrap_or("").to_owned();
                self.refuse(
                    conn,
                    &frame["id"],
                    "unknown_method",
                    &format!("unknown method {method}"),
                );
            }
            Some("res") => self.on_response(&frame),
            Some("event") if frame["event"] == "chat.event" => self.on_event(&frame),
            _ => self
                .record
                .violations
                .push(format!("connection {conn} sent an unknown frame {frame}")),
        }
    }

    fn connect(&mut self, conn: ConnId, frame: &Value) {
        let params = &frame["params"];
        let token = params["token"].as_str().map(str::to_owned);
        let asked = params["protocol_version"].as_u64().map(|v| v as u32);
        let version = asked.unwrap_or(1);
        let mut record = ConnectRecord {
            conn,
            token: token.clone(),
            asked_version: asked,
            outcome: Err(String::new()),
            is_new: false,
        };
        let refused = |record: &mut ConnectRecord, code: &str| {
            record.outcome = Err(code.to_owned());
        };
        if version < self.config.min_version || version > self.config.max_version {
            refused(&mut record, "unsupported_protocol_version");
            self.record.connects.push(record);
            let message = format!(
                "protocol version {version} is not supported ({}-{})",
                self.config.min_version, self.config.max_version
            );
            self.refuse(conn, &frame["id"], "unsupported_protocol_version", &message);
            return;
        }
        let (token, is_new) = match token {
            Some(token) if self.bots.contains_key(&token) => (token, false),
            Some(_) => {
                refused(&mut record, "unauthorized");
                self.record.connects.push(record);
                self.refuse(conn, &frame["id"], "unauthorized", "unknown token");
                return;
            }
            None if self.config.refuse_new_bots => {
                refused(&mut record, "unauthorized");
                self.record.connects.push(record);
                self.refuse(conn, &frame["id"], "unauthorized", "registration is closed");
                return;
            }
            None => {
                let token = self.fresh("tok");
                let uuid = self.fresh("bot");
                self.bots.insert(token.clone(), Bot { uuid, online: None });
                (token, true)
            }
        };
        let bot = self.bots.get_mut(&token).expect("the bot exists");
        let previous = bot.online.replace(conn);
        let uuid = bot.uuid.clone();
        if let Some(previous) = previous.filter(|previous| *previous != conn) {
            self.close(previous);
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.bot = Some(token.clone());
        }
        record.outcome = Ok(uuid.clone());
        record.is_new = is_new;
        self.record.connects.push(record);
        let mut payload = json!({
            "is_new": is_new,
            "token": token,
            "bot_uuid": uuid,
            "protocol_version": version,
            "min_supported_version": self.config.min_version,
            "env": {"BCN_BOT_UUID": uuid, "BCN_BOT_TOKEN": token},
        });
        if self.config.deprecated.contains(&version) {
            payload["deprecation"] = json!({
                "message": format!("Protocol v{version} will be removed after 2026-06-01. Please upgrade to v{}.", version + 1),
                "sunset_date": "2026-06-01",
            });
        }
        self.send(conn, &json!({"type": "res", "id": frame["id"], "ok": true, "payload": payload}));
    }

    fn on_response(&mut self, frame: &Value) {
        let Some(id) = frame["id"].as_str() else {
            self.record.violations.push(format!("a response without an id: {frame}"));
            return;
        };
        if self.record.responses.contains_key(id) {
            self.record.violations.push(format!("request {id} was answered twice"));
        }
        self.record.responses.insert(id.to_owned(), frame.clone());
        if let Some(sent) = self.sent.get_mut(id) {
            match frame["payload"]["run_id"].as_str() {
                Some(run_id) if frame["ok"] == true => sent.run_id = Some(run_id.to_owned()),
                _ if frame["ok"] == true => self
                    .record
                    .violations
                    .push(format!("chat.send {id} was acknowledged without a run_id")),
                _ => {}
            }
        }
    }

    fn on_event(&mut self, frame: &Value) {
        let payload = &frame["payload"];
        let run_id = payload["run_id"].as_str().unwrap_or("").to_owned();
        let state = payload["state"].as_str().unwrap_or("").to_owned();
        let seq = frame["seq"].as_u64();
        let Some(seq) = seq else {
            self.record.violations.push(format!("chat.event without seq: {frame}"));
            return;
        };
        let sent = self.sent.values_mut().find(|sent| sent.run_id.as_deref() == Some(&run_id));
        match sent {
            None => self
                .record
                .violations
                .push(format!("chat.event for run {run_id:?} that no chat.send acknowledged")),
            Some(sent) if sent.ended => {
                self.record.violations.push(format!("chat.event {state} after run {run_id} ended"))
            }
            Some(sent) => {
                if matches!(state.as_str(), "final" | "error" | "aborted") {
                    sent.ended = true;
                }
                if !matches!(
                    state.as_str(),
                    "delta" | "final" | "error" | "aborted" | "tool_call_start" | "tool_call_end"
                ) {
                    self.record.violations.push(format!("chat.event with unknown state {state:?}"));
                }
                if matches!(state.as_str(), "delta" | "final") && payload["message"].is_null() {
                    self.record.violations.push(format!("chat.event {state} without a message"));
                }
            }
        }
        let events = self.record.events.entry(run_id.clone()).or_default();
        if events.last().is_some_and(|(last, _)| *last >= seq) {
            self.record.violations.push(format!("run {run_id}: seq {seq} does not grow"));
        }
        events.push((seq, payload.clone()));
    }

    /// The connection of the online bot (the only one, or the newest).
    fn online(&self) -> Option<ConnId> {
        self.bots.values().filter_map(|bot| bot.online).max()
    }

    fn on_close(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
        for bot in self.bots.values_mut() {
            if bot.online == Some(conn) {
                bot.online = None;
            }
        }
    }
}

#[derive(Debug)]
struct Shared {
    platform: Mutex<Platform>,
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
}

/// No bot is online to receive a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoBotOnline;

/// A running fake BCN. Stops when dropped.
#[derive(Debug)]
pub struct FakeBcn {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FakeBcn {
    /// Binds 127.0.0.1 on a free port and starts serving.
    pub async fn start(config: FakeConfig) -> Self {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind the fake BCN");
        let addr = listener.local_addr().expect("fake BCN address");
        let (version, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            platform: Mutex::new(Platform {
                config,
                bots: HashMap::new(),
                conns: HashMap::new(),
                sent: HashMap::new(),
                record: Record::default(),
                next: 0,
            }),
            version,
            next_conn: AtomicU64::new(1),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
        });
        let app = Router::new().route("/ws/bot", get(upgrade)).with_state(shared.clone());
        let stop = shared.shutdown.clone();
        shared.tasks.spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
        });
        // The heartbeat TTL: bots silent for it are marked offline and disconnected.
        let watchdog = shared.clone();
        shared.tasks.spawn(async move {
            loop {
                tokio::select! {
                    () = watchdog.shutdown.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                let mut platform = watchdog.platform();
                let ttl = platform.config.heartbeat_ttl;
                let silent: Vec<ConnId> = platform
                    .conns
                    .iter()
                    .filter(|(_, c)| c.last_frame.elapsed() > ttl)
                    .map(|(conn, _)| *conn)
                    .collect();
                for conn in silent {
                    platform.record.heartbeat_timeouts += 1;
                    platform.close(conn);
                    if let Some(c) = platform.conns.get_mut(&conn) {
                        // Counted once: the connection is on its way out.
                        c.last_frame = Instant::now() + Duration::from_secs(3600);
                    }
                }
                drop(platform);
                watchdog.changed();
            }
        });
        Self { addr, shared }
    }

    /// `ws://127.0.0.1:<port>/ws/bot`, the value for `CHANNELD_BCN_URL`.
    pub fn url(&self) -> String {
        format!("ws://{}/ws/bot", self.addr)
    }

    /// Sends `method` with `params` to the online bot; returns the request id.
    pub fn request(&self, method: &str, params: Value) -> Result<String, NoBotOnline> {
        let mut platform = self.shared.platform();
        let conn = platform.online().ok_or(NoBotOnline)?;
        let id = platform.fresh(method.split('.').next_back().unwrap_or("req"));
        if method == "chat.send" {
            let session_key = params["session_key"].as_str().unwrap_or("").to_owned();
            platform.sent.insert(id.clone(), Sent { session_key, run_id: None, ended: false });
        }
        platform.send(conn, &json!({"type": "req", "id": id, "method": method, "params": params}));
        drop(platform);
        self.shared.changed();
        Ok(id)
    }

    /// A `chat.send` of `text` in `session_key` (group `grp-1`, from `alice`).
    pub fn chat_send(&self, session_key: &str, text: &str) -> Result<String, NoBotOnline> {
        self.request("chat.send", chat_params(session_key, text))
    }

    /// Waits for the answer to request `id`.
    pub async fn response(&self, id: &str, within: Duration) -> Value {
        self.wait_for(&format!("the answer to {id}"), within, |record| {
            record.responses.get(id).cloned()
        })
        .await
    }

    /// Waits for the run id the bot answered `chat.send` `id` with.
    pub async fn run_id(&self, id: &str, within: Duration) -> String {
        let response = self.response(id, within).await;
        assert_eq!(response["ok"], true, "chat.send {id} was refused: {response}");
        response["payload"]["run_id"].as_str().expect("a run_id").to_owned()
    }

    /// The session key of the `chat.send` that started `run_id`.
    pub fn session_of(&self, run_id: &str) -> Option<String> {
        let platform = self.shared.platform();
        platform
            .sent
            .values()
            .find(|sent| sent.run_id.as_deref() == Some(run_id))
            .map(|sent| sent.session_key.clone())
    }

    /// BCN restarts: every connection is dropped (bots and tokens survive).
    pub fn restart(&self) {
        let mut platform = self.shared.platform();
        let conns: Vec<ConnId> = platform.conns.keys().copied().collect();
        for conn in conns {
            platform.close(conn);
        }
        drop(platform);
        self.shared.changed();
    }

    /// Forgets every bot: their tokens become unknown (`unauthorized`).
    pub fn revoke_all(&self) {
        self.shared.platform().bots.clear();
    }

    pub fn set_refuse_new_bots(&self, refuse: bool) {
        self.shared.platform().config.refuse_new_bots = refuse;
    }

    /// Whether a bot is online.
    pub fn is_online(&self) -> bool {
        self.shared.platform().online().is_some()
    }

    /// Waits until a bot is online (after a successful `bot.connect`).
    pub async fn wait_online(&self, within: Duration) -> ConnId {
        self.wait_platform("a bot online", within, Platform::online).await
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

    async fn wait_platform<T>(
        &self,
        what: &str,
        within: Duration,
        mut check: impl FnMut(&Platform) -> Option<T>,
    ) -> T {
        super::wait_until(
            "BCN",
            what,
            within,
            self.shared.version.subscribe(),
            || check(&self.shared.platform()),
            || self.shared.platform().record.summary(),
        )
        .await
    }
}

impl Drop for FakeBcn {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        self.shared.tasks.close();
    }
}

/// `chat.send` params as the guide shows them.
pub fn chat_params(session_key: &str, text: &str) -> Value {
    let group = session_key.split(':').next().unwrap_or(session_key);
    json!({
        "session_key": session_key,
        "bcs_group_id": group,
        "bcs_session_id": session_key,
        "message": {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1710960000000u64},
        "channel": {"source": "webui", "user_id": "user-001"},
        "session_context": {
            "session_id": group,
            "participants": ["alice", "dba"],
            "originator": "alice",
            "from": "user-001",
            "you_are_mentioned": true,
            "is_sender": false,
            "mentions": ["dba"],
            "message": text,
        },
        "timeout_ms": 300000,
    })
}

async fn upgrade(State(shared): State<Arc<Shared>>, ws: WebSocketUpgrade) -> Response {
    let tracker = shared.tasks.clone();
    ws.on_upgrade(move |socket| tracker.track_future(serve(shared, socket)))
}

/// One bot connection: frames in go to the platform, frames out to the socket.
async fn serve(shared: Arc<Shared>, mut socket: WebSocket) {
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (out, mut outgoing) = mpsc::channel(CONNECTION_QUEUE);
    shared.platform().conns.insert(conn, Conn { out, bot: None, last_frame: Instant::now() });
    shared.changed();
    loop {
        tokio::select! {
            biased;
            () = shared.shutdown.cancelled() => break,
            out = outgoing.recv() => match out {
                Some(Out::Text(text)) => {
                    if socket.send(Message::Text(text.into())).await.is_err() {
                        break;
                    }
                }
                Some(Out::Close) | None => {
                    let _ = socket.send(Message::Close(None)).await;
                    break;
                }
            },
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Text(text))) => {
                    shared.platform().on_text(conn, text.as_str());
                    shared.changed();
                }
                Some(Ok(Message::Binary(_))) => {
                    shared.platform().record.violations.push(format!(
                        "connection {conn} sent a binary frame (the protocol is JSON text)"
                    ));
                    shared.changed();
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
            },
        }
    }
    shared.platform().on_close(conn);
    shared.changed();
}
