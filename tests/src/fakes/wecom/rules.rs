//! The platform's rules as the fake applies them, without sockets: subscribe and the
//! one-live-connection rule, acknowledgements by `req_id`, stream replacement with its expiry,
//! the welcome and card-update windows, proactive sends only to known conversations, the
//! per-conversation rate limit, and the modes a test switches on. [`Platform`] turns a
//! client's frame into [`Effect`]s the server executes and records everything.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::payloads;
use super::record::{
    AckRecord, ConnId, ConnectionRecord, PingRecord, Pushed, Received, Record, ReplyRecord,
    SentRecord, StreamFrame, StreamRecord, SubscribeRecord,
};

/// Update of a stream after its window (6 minutes on the real platform).
pub const ERR_STREAM_EXPIRED: i64 = 846608;
/// A reply on a `req_id` the platform does not know, has expired, or that does not take this
/// kind of reply.
pub const ERR_UNKNOWN_REQ_ID: i64 = 846605;
// The public docs name no codes for the cases below; these are the fake's own, stable so
// tests can match them.
/// `aibot_subscribe` with a wrong `bot_id` or `secret`.
pub const ERR_BAD_CREDENTIALS: i64 = 40001;
/// A command other than `aibot_subscribe` on a connection that is not subscribed.
pub const ERR_NOT_SUBSCRIBED: i64 = 40002;
/// A frame missing a required field, or an unknown `cmd`.
pub const ERR_INVALID_FRAME: i64 = 40003;
/// Content over [`MAX_CONTENT_BYTES`].
pub const ERR_CONTENT_TOO_LONG: i64 = 40058;
/// `aibot_send_msg` to a conversation that never messaged the bot.
pub const ERR_UNKNOWN_CHAT: i64 = 93006;
/// Over the per-conversation message limit.
pub const ERR_RATE_LIMITED: i64 = 45009;

/// Largest `content` in UTF-8 bytes (stream frames and markdown messages).
pub const MAX_CONTENT_BYTES: usize = 20_480;
/// The real stream window.
pub const STREAM_EXPIRY: Duration = Duration::from_secs(6 * 60);
/// Welcome texts and card updates must answer their event within this.
pub const REPLY_WINDOW: Duration = Duration::from_secs(5);

/// The bot the fake serves and its timers.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    pub bot_id: String,
    pub secret: String,
    /// Stream updates after this (from the stream's first frame) get 846608.
    pub stream_expiry: Duration,
    /// Welcome texts and card updates after this (from the event) get 846605.
    pub reply_window: Duration,
}

impl FakeConfig {
    pub fn new(bot_id: &str, secret: &str) -> Self {
        Self {
            bot_id: bot_id.to_owned(),
            secret: secret.to_owned(),
            stream_expiry: STREAM_EXPIRY,
            reply_window: REPLY_WINDOW,
        }
    }
}

/// How the fake answers `ping`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PingMode {
    #[default]
    Ack,
    /// Pings are recorded but never acknowledged; everything else works.
    Ignore,
}

/// At most `max` messages per conversation in any `per` window (the real limit: 30 per
/// minute and 1,000 per hour, replies and proactive messages together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub max: usize,
    pub per: Duration,
}

/// Switches a test flips.
#[derive(Debug, Clone, Default)]
pub struct Modes {
    pub ping: PingMode,
    /// Every acknowledgement is sent this late.
    pub slow: Option<Duration>,
    pub rate_limit: Option<RateLimit>,
    /// Errors injected for the next commands of a kind: `(cmd, errcode, errmsg)`, oldest first.
    pub fail_next: VecDeque<(String, i64, String)>,
}

/// What the server must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Send a text frame now.
    Send { conn: ConnId, text: String },
    /// Send an acknowledgement after `delay` (slow mode), then call [`Platform::ack_sent`].
    AckLater { conn: ConnId, req_id: String, text: String, delay: Duration },
    /// Close the connection (after any frames queued before it).
    Close { conn: ConnId },
}

/// Why a push found nobody to push to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoLiveConnection;

impl std::fmt::Display for NoLiveConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no subscribed connection to push to")
    }
}

impl std::error::Error for NoLiveConnection {}

#[derive(Debug, Clone)]
enum CallbackKind {
    Message,
    EnterChat,
    CardEvent { task_id: String },
    OtherEvent,
}

#[derive(Debug, Clone)]
struct Callback {
    kind: CallbackKind,
    chat: String,
    pushed_at: Instant,
    /// A welcome or card update already answered it (each takes one).
    answered: bool,
    cmd: String,
    body: Value,
}

#[derive(Debug)]
struct Stream {
    index: usize,
    started: Instant,
    finished: bool,
}

/// The fake platform's state.
#[derive(Debug)]
pub struct Platform {
    config: FakeConfig,
    pub modes: Modes,
    pub record: Record,
    /// The connection that holds the bot.
    live: Option<ConnId>,
    subscribed: HashSet<ConnId>,
    callbacks: HashMap<String, Callback>,
    streams: HashMap<(String, String), Stream>,
    /// Conversations that messaged the bot (proactive sends may go there).
    known_chats: HashSet<String>,
    sent_cards: HashSet<String>,
    /// Message times per conversation, for the rate limit.
    counted: HashMap<String, VecDeque<Instant>>,
    /// `req_id`s whose frame has not been acknowledged yet (slow mode): a second frame on
    /// one breaks the one-at-a-time rule.
    awaiting_ack: HashSet<String>,
    next_push: u64,
}

impl Platform {
    pub fn new(config: FakeConfig) -> Self {
        Self {
            config,
            modes: Modes::default(),
            record: Record::default(),
            live: None,
            subscribed: HashSet::new(),
            callbacks: HashMap::new(),
            streams: HashMap::new(),
            known_chats: HashSet::new(),
            sent_cards: HashSet::new(),
            counted: HashMap::new(),
            awaiting_ack: HashSet::new(),
            next_push: 0,
        }
    }

    pub fn config_mut(&mut self) -> &mut FakeConfig {
        &mut self.config
    }

    /// Marks `chat` as a conversation that messaged the bot before (proactive sends may go
    /// there), as if it had happened before the test.
    pub fn know_chat(&mut self, chat: &str) {
        self.known_chats.insert(chat.to_owned());
    }

    /// The connection holding the bot, if any.
    pub fn live(&self) -> Option<ConnId> {
        self.live
    }

    pub fn on_open(&mut self, conn: ConnId, now: Instant) {
        self.record.connections.push(ConnectionRecord {
            id: conn,
            opened: now,
            closed: None,
            kicked: false,
        });
    }

    pub fn on_close(&mut self, conn: ConnId, now: Instant) {
        self.subscribed.remove(&conn);
        if self.live == Some(conn) {
            self.live = None;
        }
        if let Some(record) = self.connection(conn)
            && record.closed.is_none()
        {
            record.closed = Some(now);
        }
    }

    fn connection(&mut self, conn: ConnId) -> Option<&mut ConnectionRecord> {
        self.record.connections.iter_mut().find(|record| record.id == conn)
    }

    /// A delayed acknowledgement went out: the next frame on `req_id` may come.
    pub fn ack_sent(&mut self, req_id: &str) {
        self.awaiting_ack.remove(req_id);
    }

    /// Handles one text frame from a client.
    pub fn on_text(&mut self, conn: ConnId, text: &str, now: Instant) -> Vec<Effect> {
        let frame: Value = match serde_json::from_str(text) {
            Ok(frame @ Value::Object(_)) => frame,
            _ => {
                self.violation(format!("connection {conn} sent a frame that is not a JSON object"));
                return Vec::new();
            }
        };
        self.record.received.push(Received { conn, at: now, frame: frame.clone() });
        let Some(req_id) = frame["headers"]["req_id"].as_str().filter(|id| !id.is_empty()) else {
            self.violation(format!("a frame without headers.req_id: {frame}"));
            return Vec::new();
        };
        let req_id = req_id.to_owned();
        let cmd = frame["cmd"].as_str().unwrap_or_default().to_owned();
        if self.awaiting_ack.contains(&req_id) {
            self.violation(format!(
                "{cmd} on req_id {req_id} before the previous frame on it was acknowledged"
            ));
        }
        let body = &frame["body"];
        let mut effects = Vec::new();
        let (errcode, errmsg) = if cmd == "aibot_subscribe" {
            self.subscribe(conn, body, now, &mut effects)
        } else if !self.subscribed.contains(&conn) {
            self.violation(format!("{cmd} on connection {conn} before a successful subscribe"));
            (ERR_NOT_SUBSCRIBED, "not subscribed".to_owned())
        } else if let Some((code, message)) = self.injected(&cmd) {
            (code, message)
        } else {
            match cmd.as_str() {
                "ping" => {
                    let acked = self.modes.ping == PingMode::Ack;
                    self.record.pings.push(PingRecord { conn, at: now, acked });
                    if !acked {
                        return effects;
                    }
                    ok()
                }
                "aibot_respond_msg" => self.respond(&req_id, body, now),
                "aibot_respond_welcome_msg" => self.welcome(&req_id, body, now),
                "aibot_respond_update_msg" => self.update_card(&req_id, body, now),
                "aibot_send_msg" => self.send(&req_id, body, now),
                other => {
                    self.violation(format!("unknown cmd {other:?}"));
                    (ERR_INVALID_FRAME, format!("unknown cmd {other:?}"))
                }
            }
        };
        self.record.acks.push(AckRecord { conn, at: now, req_id: req_id.clone(), cmd, errcode });
        let ack = json!({"headers": {"req_id": req_id}, "errcode": errcode, "errmsg": errmsg})
            .to_string();
        // The subscribe answer goes before the kick of the old connection.
        let answer = match self.modes.slow {
            Some(delay) => {
                self.awaiting_ack.insert(req_id.clone());
                Effect::AckLater { conn, req_id, text: ack, delay }
            }
            None => Effect::Send { conn, text: ack },
        };
        effects.insert(0, answer);
        effects
    }

    fn injected(&mut self, cmd: &str) -> Option<(i64, String)> {
        let index = self.modes.fail_next.iter().position(|(kind, _, _)| kind == cmd)?;
        let (_, code, message) = self.modes.fail_next.remove(index)?;
        Some((code, message))
    }

    fn subscribe(
        &mut self,
        conn: ConnId,
        body: &Value,
        now: Instant,
        effects: &mut Vec<Effect>,
    ) -> (i64, String) {
        let bot_id = body["bot_id"].as_str().unwrap_or_default().to_owned();
        let secret = body["secret"].as_str().unwrap_or_default();
        let accepted = bot_id == self.config.bot_id && secret == self.config.secret;
        self.record.subscribes.push(SubscribeRecord { conn, at: now, bot_id, accepted });
        if !accepted {
            return (ERR_BAD_CREDENTIALS, "invalid bot_id or secret".to_owned());
        }
        if let Some((code, message)) = self.injected("aibot_subscribe") {
            return (code, message);
        }
        self.subscribed.insert(conn);
        if let Some(old) = self.live.replace(conn)
            && old != conn
        {
            effects.extend(self.kick_connection(old, now));
        }
        ok()
    }

    /// Another client took the bot: `disconnected_event` to `old`, then close it.
    fn kick_connection(&mut self, old: ConnId, now: Instant) -> Vec<Effect> {
        self.subscribed.remove(&old);
        if self.live == Some(old) {
            self.live = None;
        }
        if let Some(record) = self.connection(old) {
            record.kicked = true;
        }
        let msgid = format!("disconnect-{}", self.next_id());
        let req_id = format!("aibot_event_callback_{}", self.next_id());
        let mut body = payloads::disconnected(&msgid);
        self.fill(&mut body);
        let frame =
            json!({"cmd": "aibot_event_callback", "headers": {"req_id": req_id}, "body": body});
        self.record.pushed.push(Pushed { conn: old, at: now, req_id, frame: frame.clone() });
        vec![Effect::Send { conn: old, text: frame.to_string() }, Effect::Close { conn: old }]
    }

    /// Kicks the live connection as a second client subscribing would.
    pub fn kick(&mut self, now: Instant) -> Result<Vec<Effect>, NoLiveConnection> {
        let live = self.live.ok_or(NoLiveConnection)?;
        Ok(self.kick_connection(live, now))
    }

    /// Pushes a callback (`aibot_msg_callback` or `aibot_event_callback`) to the live
    /// connection; returns its `req_id`.
    pub fn push(
        &mut self,
        cmd: &str,
        mut body: Value,
        now: Instant,
    ) -> Result<(String, Vec<Effect>), NoLiveConnection> {
        let live = self.live.ok_or(NoLiveConnection)?;
        self.fill(&mut body);
        let req_id = format!("{cmd}_{}_{:08x}", self.next_id(), fastrand::u32(..));
        let chat = body["chatid"]
            .as_str()
            .or_else(|| body["from"]["userid"].as_str())
            .unwrap_or_default()
            .to_owned();
        let kind = match (cmd, body["event"]["eventtype"].as_str()) {
            ("aibot_msg_callback", _) => CallbackKind::Message,
            (_, Some("enter_chat")) => CallbackKind::EnterChat,
            (_, Some("template_card_event")) => CallbackKind::CardEvent {
                task_id: body["event"]["template_card_event"]["task_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            },
            _ => CallbackKind::OtherEvent,
        };
        if matches!(kind, CallbackKind::Message) {
            self.known_chats.insert(chat.clone());
        }
        let frame = json!({"cmd": cmd, "headers": {"req_id": req_id}, "body": body});
        self.callbacks.insert(
            req_id.clone(),
            Callback {
                kind,
                chat,
                pushed_at: now,
                answered: false,
                cmd: cmd.to_owned(),
                body: body.clone(),
            },
        );
        self.record.pushed.push(Pushed {
            conn: live,
            at: now,
            req_id: req_id.clone(),
            frame: frame.clone(),
        });
        Ok((req_id.clone(), vec![Effect::Send { conn: live, text: frame.to_string() }]))
    }

    /// Pushes an earlier callback again, as the platform does when it retries: the same
    /// body (same `msgid`) under a new `req_id`.
    pub fn repeat(
        &mut self,
        req_id: &str,
        now: Instant,
    ) -> Option<Result<(String, Vec<Effect>), NoLiveConnection>> {
        let callback = self.callbacks.get(req_id)?.clone();
        Some(self.push(&callback.cmd, callback.body, now))
    }

    fn fill(&self, body: &mut Value) {
        if body.get("aibotid").is_none() {
            body["aibotid"] = json!(self.config.bot_id);
        }
        if body.get("create_time").is_none() {
            let seconds = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            body["create_time"] = json!(seconds);
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_push += 1;
        self.next_push
    }

    /// `aibot_respond_msg`: stream frames (and template-card replies) on a message callback.
    fn respond(&mut self, req_id: &str, body: &Value, now: Instant) -> (i64, String) {
        let Some(callback) = self.callbacks.get(req_id) else {
            return (ERR_UNKNOWN_REQ_ID, "unknown req_id".to_owned());
        };
        if !matches!(callback.kind, CallbackKind::Message) {
            return (ERR_UNKNOWN_REQ_ID, "this req_id takes no message reply".to_owned());
        }
        let chat = callback.chat.clone();
        match body["msgtype"].as_str() {
            Some("stream") => self.stream(req_id, &chat, &body["stream"], now),
            Some("template_card") => {
                let verdict = self.count(&chat, now);
                self.record.reply_cards.push(ReplyRecord {
                    at: now,
                    req_id: req_id.to_owned(),
                    body: body.clone(),
                    errcode: verdict.0,
                });
                verdict
            }
            other => {
                self.violation(format!("aibot_respond_msg with msgtype {other:?}"));
                (ERR_INVALID_FRAME, "unsupported msgtype".to_owned())
            }
        }
    }

    fn stream(&mut self, req_id: &str, chat: &str, stream: &Value, now: Instant) -> (i64, String) {
        let Some(stream_id) = stream["id"].as_str().filter(|id| !id.is_empty()) else {
            self.violation(format!("stream frame on {req_id} without stream.id"));
            return (ERR_INVALID_FRAME, "stream.id is required".to_owned());
        };
        let content = stream["content"].as_str().unwrap_or_default().to_owned();
        let finish = stream["finish"].as_bool().unwrap_or(false);
        let key = (req_id.to_owned(), stream_id.to_owned());
        let (index, verdict) = match self.streams.get(&key) {
            None => {
                self.record.streams.push(StreamRecord {
                    req_id: req_id.to_owned(),
                    stream_id: stream_id.to_owned(),
                    chat: chat.to_owned(),
                    frames: Vec::new(),
                });
                let index = self.record.streams.len() - 1;
                let verdict = self.check_content(&content, req_id);
                let verdict = if verdict.0 == 0 { self.count(chat, now) } else { verdict };
                if verdict.0 == 0 {
                    self.streams
                        .insert(key.clone(), Stream { index, started: now, finished: finish });
                }
                (index, verdict)
            }
            Some(existing) if existing.finished => {
                let index = existing.index;
                self.violation(format!("stream {stream_id} on {req_id} updated after finish"));
                (index, (ERR_STREAM_EXPIRED, "stream already finished".to_owned()))
            }
            Some(existing) if now.duration_since(existing.started) > self.config.stream_expiry => {
                (existing.index, (ERR_STREAM_EXPIRED, "stream message update expired".to_owned()))
            }
            Some(existing) => {
                let index = existing.index;
                let verdict = self.check_content(&content, req_id);
                if verdict.0 == 0
                    && let Some(stream) = self.streams.get_mut(&key)
                {
                    stream.finished = finish;
                }
                (index, verdict)
            }
        };
        self.record.streams[index].frames.push(StreamFrame {
            at: now,
            content,
            finish,
            errcode: verdict.0,
        });
        verdict
    }

    fn check_content(&mut self, content: &str, req_id: &str) -> (i64, String) {
        if content.len() > MAX_CONTENT_BYTES {
            self.violation(format!(
                "content of {} bytes on {req_id} (limit {MAX_CONTENT_BYTES})",
                content.len()
            ));
            return (ERR_CONTENT_TOO_LONG, "content too long".to_owned());
        }
        ok()
    }

    /// Counts one message to `chat` against the rate limit; refuses it when over.
    fn count(&mut self, chat: &str, now: Instant) -> (i64, String) {
        let Some(limit) = self.modes.rate_limit else { return ok() };
        let times = self.counted.entry(chat.to_owned()).or_default();
        while times.front().is_some_and(|at| now.duration_since(*at) >= limit.per) {
            times.pop_front();
        }
        if times.len() >= limit.max {
            return (ERR_RATE_LIMITED, "api freq out of limit".to_owned());
        }
        times.push_back(now);
        ok()
    }

    /// `aibot_respond_welcome_msg` on an `enter_chat` event, once, within the reply window.
    fn welcome(&mut self, req_id: &str, body: &Value, now: Instant) -> (i64, String) {
        let verdict = self.event_reply(req_id, now, |kind| matches!(kind, CallbackKind::EnterChat));
        let verdict = if verdict.0 != 0 {
            verdict
        } else {
            match body["msgtype"].as_str() {
                Some("text") if body["text"]["content"].as_str().is_some_and(|t| !t.is_empty()) => {
                    let chat = self.callbacks[req_id].chat.clone();
                    self.count(&chat, now)
                }
                Some("template_card") => ok(),
                _ => {
                    self.violation(format!("welcome on {req_id} is neither text nor a card"));
                    (ERR_INVALID_FRAME, "invalid welcome body".to_owned())
                }
            }
        };
        self.record.welcomes.push(ReplyRecord {
            at: now,
            req_id: req_id.to_owned(),
            body: body.clone(),
            errcode: verdict.0,
        });
        verdict
    }

    /// `aibot_respond_update_msg` on a `template_card_event`, once, within the reply window,
    /// with the card's own `task_id`.
    fn update_card(&mut self, req_id: &str, body: &Value, now: Instant) -> (i64, String) {
        let verdict =
            self.event_reply(req_id, now, |kind| matches!(kind, CallbackKind::CardEvent { .. }));
        let verdict = if verdict.0 != 0 {
            verdict
        } else {
            let task_id = match &self.callbacks[req_id].kind {
                CallbackKind::CardEvent { task_id } => task_id.clone(),
                _ => String::new(),
            };
            if body["response_type"] != "update_template_card" {
                self.violation(format!("card update on {req_id} without response_type"));
                (ERR_INVALID_FRAME, "response_type must be update_template_card".to_owned())
            } else if body["template_card"]["task_id"] != task_id.as_str() {
                self.violation(format!("card update on {req_id} for another task_id"));
                (ERR_INVALID_FRAME, "task_id does not match the event".to_owned())
            } else {
                ok()
            }
        };
        self.record.card_updates.push(ReplyRecord {
            at: now,
            req_id: req_id.to_owned(),
            body: body.clone(),
            errcode: verdict.0,
        });
        verdict
    }

    fn event_reply(
        &mut self,
        req_id: &str,
        now: Instant,
        wanted: impl Fn(&CallbackKind) -> bool,
    ) -> (i64, String) {
        let window = self.config.reply_window;
        let Some(callback) = self.callbacks.get_mut(req_id) else {
            return (ERR_UNKNOWN_REQ_ID, "unknown req_id".to_owned());
        };
        if !wanted(&callback.kind) {
            return (ERR_UNKNOWN_REQ_ID, "this req_id takes no such reply".to_owned());
        }
        if callback.answered || now.duration_since(callback.pushed_at) > window {
            return (ERR_UNKNOWN_REQ_ID, "req_id expired".to_owned());
        }
        callback.answered = true;
        ok()
    }

    /// `aibot_send_msg`: markdown or a template card to a conversation that messaged the bot.
    fn send(&mut self, req_id: &str, body: &Value, now: Instant) -> (i64, String) {
        let chatid = body["chatid"].as_str().unwrap_or_default().to_owned();
        let msgtype = body["msgtype"].as_str().unwrap_or_default().to_owned();
        let content = body["markdown"]["content"].as_str().map(str::to_owned);
        let card = body.get("template_card").cloned();
        let verdict = if chatid.is_empty() {
            self.violation(format!("aibot_send_msg {req_id} without chatid"));
            (ERR_INVALID_FRAME, "chatid is required".to_owned())
        } else {
            match msgtype.as_str() {
                "markdown" => match &content {
                    Some(text) if !text.is_empty() => self.check_content(text, req_id),
                    _ => {
                        self.violation(format!("markdown send {req_id} without content"));
                        (ERR_INVALID_FRAME, "markdown.content is required".to_owned())
                    }
                },
                "template_card" => self.check_card(req_id, card.as_ref()),
                other => {
                    self.violation(format!("aibot_send_msg with msgtype {other:?}"));
                    (ERR_INVALID_FRAME, "unsupported msgtype".to_owned())
                }
            }
        };
        let verdict = if verdict.0 != 0 {
            verdict
        } else if !self.known_chats.contains(&chatid) {
            (ERR_UNKNOWN_CHAT, "the conversation has not messaged the bot".to_owned())
        } else {
            self.count(&chatid, now)
        };
        if verdict.0 == 0
            && let Some(task_id) = card.as_ref().and_then(|card| card["task_id"].as_str())
        {
            self.sent_cards.insert(task_id.to_owned());
        }
        self.record.sent.push(SentRecord {
            at: now,
            req_id: req_id.to_owned(),
            chatid,
            chat_type: body["chat_type"].as_i64(),
            msgtype,
            content,
            template_card: card,
            errcode: verdict.0,
        });
        verdict
    }

    fn check_card(&mut self, req_id: &str, card: Option<&Value>) -> (i64, String) {
        let Some(card) = card else {
            self.violation(format!("card send {req_id} without template_card"));
            return (ERR_INVALID_FRAME, "template_card is required".to_owned());
        };
        let task_id = card["task_id"].as_str().unwrap_or_default();
        let valid_task = !task_id.is_empty()
            && task_id.len() <= 128
            && task_id.chars().all(|c| c.is_ascii_alphanumeric() || "_-@".contains(c));
        if card["card_type"].as_str().is_none() || !valid_task {
            self.violation(format!("card send {req_id} without card_type or a valid task_id"));
            return (ERR_INVALID_FRAME, "card_type and task_id are required".to_owned());
        }
        if self.sent_cards.contains(task_id) {
            self.violation(format!("card send {req_id} reuses task_id {task_id}"));
            return (ERR_INVALID_FRAME, "task_id already used".to_owned());
        }
        if let Some(buttons) = card["button_list"].as_array()
            && (buttons.len() > 6 || buttons.iter().any(|b| b["key"].as_str().is_none()))
        {
            self.violation(format!("card send {req_id} with more than 6 buttons or a keyless one"));
            return (ERR_INVALID_FRAME, "invalid button_list".to_owned());
        }
        ok()
    }

    fn violation(&mut self, what: String) {
        self.record.violations.push(what);
    }
}

fn ok() -> (i64, String) {
    (0, "ok".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subscribed() -> (Platform, Instant) {
        let mut platform = Platform::new(FakeConfig::new("bot", "s3cret"));
        let now = Instant::now();
        platform.on_open(1, now);
        let effects = platform.on_text(1, &subscribe("bot", "s3cret", "sub-1"), now);
        assert_eq!(errcode(&effects[0]), 0);
        (platform, now)
    }

    fn subscribe(bot: &str, secret: &str, req_id: &str) -> String {
        json!({"cmd": "aibot_subscribe", "headers": {"req_id": req_id}, "body": {"bot_id": bot, "secret": secret}}).to_string()
    }

    fn stream(req_id: &str, id: &str, content: &str, finish: bool) -> String {
        json!({"cmd": "aibot_respond_msg", "headers": {"req_id": req_id},
               "body": {"msgtype": "stream", "stream": {"id": id, "finish": finish, "content": content}}})
        .to_string()
    }

    fn errcode(effect: &Effect) -> i64 {
        let text = match effect {
            Effect::Send { text, .. } | Effect::AckLater { text, .. } => text,
            Effect::Close { .. } => panic!("expected an ack, got a close"),
        };
        serde_json::from_str::<Value>(text).unwrap()["errcode"].as_i64().unwrap()
    }

    #[test]
    fn a_stream_replaces_its_content_until_finish_then_refuses_updates() {
        let (mut platform, now) = subscribed();
        let (req_id, _) =
            platform.push("aibot_msg_callback", payloads::text("m1", "alice", "hi"), now).unwrap();
        for (content, finish) in [("…", false), ("draft", false), ("final", true)] {
            let effects = platform.on_text(1, &stream(&req_id, "s1", content, finish), now);
            assert_eq!(errcode(&effects[0]), 0, "{content}");
        }
        let effects = platform.on_text(1, &stream(&req_id, "s1", "late", true), now);
        assert_eq!(errcode(&effects[0]), ERR_STREAM_EXPIRED);
        let record = &platform.record.streams_on(&req_id)[0];
        assert_eq!(record.content(), Some("final"));
        assert!(record.finished());
        assert_eq!(platform.record.violations.len(), 1, "{:?}", platform.record.violations);
    }

    #[test]
    fn a_stream_update_after_the_window_gets_846608_and_unknown_req_ids_846605() {
        let (mut platform, now) = subscribed();
        platform.config_mut().stream_expiry = Duration::from_secs(1);
        let (req_id, _) =
            platform.push("aibot_msg_callback", payloads::text("m1", "alice", "hi"), now).unwrap();
        assert_eq!(errcode(&platform.on_text(1, &stream(&req_id, "s1", "…", false), now)[0]), 0);
        let later = now + Duration::from_secs(2);
        assert_eq!(
            errcode(&platform.on_text(1, &stream(&req_id, "s1", "final", true), later)[0]),
            ERR_STREAM_EXPIRED
        );
        assert_eq!(
            errcode(&platform.on_text(1, &stream("nope", "s1", "x", true), later)[0]),
            ERR_UNKNOWN_REQ_ID
        );
        assert!(platform.record.violations.is_empty());
    }

    #[test]
    fn the_rate_limit_counts_new_streams_and_sends_per_conversation() {
        let (mut platform, now) = subscribed();
        platform.modes.rate_limit = Some(RateLimit { max: 2, per: Duration::from_secs(60) });
        let (r1, _) =
            platform.push("aibot_msg_callback", payloads::text("m1", "alice", "a"), now).unwrap();
        assert_eq!(errcode(&platform.on_text(1, &stream(&r1, "s1", "x", false), now)[0]), 0);
        // Updates of the same stream are free.
        assert_eq!(errcode(&platform.on_text(1, &stream(&r1, "s1", "y", true), now)[0]), 0);
        let send = |id: &str| {
            json!({"cmd": "aibot_send_msg", "headers": {"req_id": id},
                   "body": {"chatid": "alice", "msgtype": "markdown", "markdown": {"content": "hello"}}})
            .to_string()
        };
        assert_eq!(errcode(&platform.on_text(1, &send("p1"), now)[0]), 0);
        assert_eq!(errcode(&platform.on_text(1, &send("p2"), now)[0]), ERR_RATE_LIMITED);
        let later = now + Duration::from_secs(61);
        assert_eq!(errcode(&platform.on_text(1, &send("p3"), later)[0]), 0);
        assert_eq!(platform.record.rate_limited(), 1);
    }

    #[test]
    fn a_second_subscribe_kicks_the_first_connection() {
        let (mut platform, now) = subscribed();
        platform.on_open(2, now);
        let effects = platform.on_text(2, &subscribe("bot", "s3cret", "sub-2"), now);
        assert_eq!(errcode(&effects[0]), 0);
        assert!(
            matches!(&effects[1], Effect::Send { conn: 1, text } if text.contains("disconnected_event"))
        );
        assert_eq!(effects[2], Effect::Close { conn: 1 });
        assert_eq!(platform.live(), Some(2));
        assert!(platform.record.connections[0].kicked);
    }
}
