//! The WeCom AI Bot long-connection wire format. Every frame is one JSON text message
//! `{"cmd": "…", "headers": {"req_id": "…"}, "body": {…}}`; an acknowledgement carries no
//! `cmd` and answers a command under the command's own `req_id` with `errcode`/`errmsg`.
//! Replies to a callback reuse the callback's `req_id`, so one `req_id` can see several
//! frames and acknowledgements, one at a time.
//!
//! Only the fields the driver uses are typed; unknown fields are ignored.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The production endpoint.
pub const DEFAULT_WS_URL: &str = "wss://openws.work.weixin.qq.com";

/// Commands the driver sends.
pub mod cmd {
    /// Authenticates the connection with the bot id and secret; must come first.
    pub const SUBSCRIBE: &str = "aibot_subscribe";
    /// Application-level heartbeat; the platform drops connections that stop sending it.
    pub const PING: &str = "ping";
    /// A reply (stream frame or card) on a message callback's `req_id`.
    pub const RESPOND_MSG: &str = "aibot_respond_msg";
    /// A welcome text on an `enter_chat` event's `req_id`, within 5 s.
    pub const RESPOND_WELCOME: &str = "aibot_respond_welcome_msg";
    /// A card update on a `template_card_event`'s `req_id`, within 5 s.
    pub const RESPOND_UPDATE: &str = "aibot_respond_update_msg";
    /// A proactive message to a conversation that messaged the bot before.
    pub const SEND_MSG: &str = "aibot_send_msg";
    /// Pushed by the platform: a user's message.
    pub const MSG_CALLBACK: &str = "aibot_msg_callback";
    /// Pushed by the platform: an event (enter_chat, template_card_event, …).
    pub const EVENT_CALLBACK: &str = "aibot_event_callback";
}

/// A stream frame after the stream's window (6 minutes from its first frame).
pub const ERR_STREAM_EXPIRED: i64 = 846608;
/// A reply on an unknown or expired `req_id`.
pub const ERR_UNKNOWN_REQ_ID: i64 = 846605;
/// The largest `content` of a stream frame or markdown message, in UTF-8 bytes.
pub const MAX_CONTENT_BYTES: usize = 20_480;
/// The longest template card `task_id` (digits, ASCII letters and `_-@` only).
pub const MAX_TASK_ID_BYTES: usize = 128;
/// The most buttons a `button_interaction` card holds.
pub const MAX_CARD_BUTTONS: usize = 6;

/// A fresh request id in the official SDK's style, `<cmd>_<unix ms>_<8 hex digits>`.
pub fn req_id(cmd: &str) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis());
    format!("{cmd}_{millis}_{:08x}", fastrand::u32(..))
}

#[derive(Serialize)]
struct Envelope<'a, B> {
    cmd: &'a str,
    headers: Headers<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<&'a B>,
}

#[derive(Serialize)]
struct Headers<'a> {
    req_id: &'a str,
}

/// One command frame as JSON text.
pub fn encode<B: Serialize>(cmd: &str, req_id: &str, body: Option<&B>) -> String {
    let envelope = Envelope { cmd, headers: Headers { req_id }, body };
    // Strings, numbers, booleans and string-keyed objects only: serialisation cannot fail.
    serde_json::to_string(&envelope).unwrap_or_default()
}

/// `aibot_subscribe`'s body. Its `Debug` hides the secret; the encoded frame must never be
/// logged.
#[derive(Serialize)]
pub struct Subscribe<'a> {
    pub bot_id: &'a str,
    pub secret: &'a str,
}

impl fmt::Debug for Subscribe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscribe").field("bot_id", &self.bot_id).field("secret", &"***").finish()
    }
}

/// `{"content": "…"}`, the text object of several bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Text {
    #[serde(default)]
    pub content: String,
}

/// One frame of a streamed reply: the whole text shown so far (never a delta).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamFrame {
    pub id: String,
    pub finish: bool,
    pub content: String,
}

/// The body of `aibot_respond_msg`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "msgtype", rename_all = "snake_case")]
pub enum ReplyBody {
    Stream { stream: StreamFrame },
}

/// The body of `aibot_respond_welcome_msg`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "msgtype", rename_all = "snake_case")]
pub enum WelcomeBody {
    Text { text: Text },
}

/// What `aibot_send_msg` carries.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "msgtype", rename_all = "snake_case")]
pub enum SendContent {
    Markdown { markdown: Text },
    TemplateCard { template_card: TemplateCard },
}

/// The body of `aibot_send_msg`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SendMsg {
    /// A user id for a single chat, a group's `chatid` for a group.
    pub chatid: String,
    /// 1 single, 2 group; optional on the wire (sent when the driver knows it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_type: Option<u8>,
    #[serde(flatten)]
    pub content: SendContent,
}

/// The body of `aibot_respond_update_msg`: replaces a card after a click.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateCard {
    /// Always `update_template_card`.
    pub response_type: &'static str,
    pub template_card: TemplateCard,
}

impl UpdateCard {
    pub fn new(template_card: TemplateCard) -> Self {
        Self { response_type: "update_template_card", template_card }
    }
}

/// A template card; the driver uses `button_interaction` cards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateCard {
    pub card_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_title: Option<MainTitle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_title_text: Option<String>,
    /// Always written: an empty list in a card update takes the buttons away.
    #[serde(default)]
    pub button_list: Vec<Button>,
    pub task_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MainTitle {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desc: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Button {
    pub text: String,
    /// 1 to 4 (1: the default style, 2: a neutral one).
    pub style: u8,
    /// Comes back as the click's `event_key`; unique within the card.
    pub key: String,
}

/// Why a frame from the platform could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("not a JSON frame: {0}")]
    Json(String),
    #[error("{0} frame without headers.req_id")]
    NoReqId(&'static str),
    #[error("{cmd} frame with an unreadable body: {reason}")]
    Body { cmd: &'static str, reason: String },
}

/// A frame from the platform.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// The answer to one of the driver's commands.
    Ack(Ack),
    /// `aibot_msg_callback`: a user's message; replies go on `req_id`.
    Message { req_id: String, callback: Box<MessageCallback> },
    /// `aibot_event_callback`.
    Event { req_id: String, callback: Box<EventCallback> },
    /// A `cmd` the driver does not know (logged and ignored).
    Other { cmd: String },
}

/// An acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub req_id: String,
    /// `None` when the platform sent none; the official SDK counts that as a failure too.
    pub errcode: Option<i64>,
    pub errmsg: String,
}

impl Ack {
    pub fn is_ok(&self) -> bool {
        self.errcode == Some(0)
    }

    /// `errcode N: errmsg`, for errors and logs.
    pub fn describe(&self) -> String {
        match self.errcode {
            Some(code) => format!("errcode {code}: {}", self.errmsg),
            None => format!("acknowledgement without errcode: {}", self.errmsg),
        }
    }
}

#[derive(Deserialize)]
struct RawFrame {
    #[serde(default)]
    cmd: Option<String>,
    #[serde(default)]
    headers: RawHeaders,
    #[serde(default)]
    body: Option<Value>,
    #[serde(default)]
    errcode: Option<i64>,
    #[serde(default)]
    errmsg: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawHeaders {
    #[serde(default)]
    req_id: Option<String>,
}

/// Reads one text frame from the platform.
pub fn decode(text: &str) -> Result<Incoming, WireError> {
    let raw: RawFrame =
        serde_json::from_str(text).map_err(|err| WireError::Json(err.to_string()))?;
    let req_id = raw.headers.req_id.filter(|id| !id.is_empty());
    match raw.cmd.as_deref() {
        None | Some("") => Ok(Incoming::Ack(Ack {
            req_id: req_id.ok_or(WireError::NoReqId("acknowledgement"))?,
            errcode: raw.errcode,
            errmsg: raw.errmsg.unwrap_or_default(),
        })),
        Some(cmd::MSG_CALLBACK) => {
            let req_id = req_id.ok_or(WireError::NoReqId(cmd::MSG_CALLBACK))?;
            let callback = body(cmd::MSG_CALLBACK, raw.body)?;
            Ok(Incoming::Message { req_id, callback: Box::new(callback) })
        }
        Some(cmd::EVENT_CALLBACK) => {
            let req_id = req_id.ok_or(WireError::NoReqId(cmd::EVENT_CALLBACK))?;
            let callback = body(cmd::EVENT_CALLBACK, raw.body)?;
            Ok(Incoming::Event { req_id, callback: Box::new(callback) })
        }
        Some(other) => Ok(Incoming::Other { cmd: other.to_owned() }),
    }
}

fn body<T: serde::de::DeserializeOwned>(
    cmd: &'static str,
    body: Option<Value>,
) -> Result<T, WireError> {
    serde_json::from_value(body.unwrap_or(Value::Null))
        .map_err(|err| WireError::Body { cmd, reason: err.to_string() })
}

/// Who sent a message or caused an event.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Sender {
    pub userid: String,
}

/// An encrypted media download: the URL is valid for five minutes, `aeskey` (long
/// connection only) decrypts it (AES-256-CBC).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Media {
    pub url: String,
    #[serde(default)]
    pub aeskey: Option<String>,
}

/// The parts of a `mixed` message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Mixed {
    #[serde(default)]
    pub msg_item: Vec<MixedItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MixedItem {
    pub msgtype: String,
    #[serde(default)]
    pub text: Option<Text>,
    #[serde(default)]
    pub image: Option<Media>,
}

/// A quoted message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Quote {
    #[serde(default)]
    pub msgtype: String,
    #[serde(default)]
    pub text: Option<Text>,
    #[serde(default)]
    pub voice: Option<Text>,
    #[serde(default)]
    pub mixed: Option<Mixed>,
}

/// The body of `aibot_msg_callback`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MessageCallback {
    /// Unique per message; repeated callbacks carry the same one.
    pub msgid: String,
    #[serde(default)]
    pub aibotid: Option<String>,
    /// Group chats only.
    #[serde(default)]
    pub chatid: Option<String>,
    /// `single` or `group`.
    #[serde(default)]
    pub chattype: Option<String>,
    pub from: Sender,
    /// Unix seconds.
    #[serde(default)]
    pub create_time: Option<u64>,
    pub msgtype: String,
    #[serde(default)]
    pub text: Option<Text>,
    #[serde(default)]
    pub image: Option<Media>,
    /// The transcript: WeCom converts voice to text itself.
    #[serde(default)]
    pub voice: Option<Text>,
    #[serde(default)]
    pub file: Option<Media>,
    #[serde(default)]
    pub video: Option<Media>,
    #[serde(default)]
    pub mixed: Option<Mixed>,
    #[serde(default)]
    pub quote: Option<Quote>,
}

/// The body of `aibot_event_callback`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct EventCallback {
    #[serde(default)]
    pub msgid: Option<String>,
    #[serde(default)]
    pub create_time: Option<u64>,
    #[serde(default)]
    pub chatid: Option<String>,
    #[serde(default)]
    pub chattype: Option<String>,
    #[serde(default)]
    pub from: Option<Sender>,
    pub event: Event,
}

/// `body.event`. A card click's details sit in `template_card_event` (the documented shape);
/// some SDK versions type them directly on the event, so both are read.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Event {
    pub eventtype: String,
    #[serde(default)]
    pub template_card_event: Option<CardEvent>,
    #[serde(default)]
    pub event_key: Option<String>,
    #[serde(default)]
    pub task_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CardEvent {
    #[serde(default)]
    pub card_type: Option<String>,
    #[serde(default)]
    pub event_key: Option<String>,
    #[serde(default)]
    pub task_id: Option<String>,
}

/// Event types.
pub mod event {
    /// The user opened the single chat with the bot (first time that day).
    pub const ENTER_CHAT: &str = "enter_chat";
    /// A click on a template card button.
    pub const TEMPLATE_CARD: &str = "template_card_event";
    /// A rating of a reply.
    pub const FEEDBACK: &str = "feedback_event";
    /// Another connection subscribed the bot; this one is about to be closed.
    pub const DISCONNECTED: &str = "disconnected_event";
}

/// A card click: which card and which button.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardClick {
    pub task_id: String,
    pub event_key: String,
}

impl Event {
    /// The click of a `template_card_event`, from either shape.
    pub fn card_click(&self) -> Option<CardClick> {
        let nested = self.template_card_event.as_ref();
        let task_id =
            nested.and_then(|card| card.task_id.clone()).or_else(|| self.task_id.clone())?;
        let event_key =
            nested.and_then(|card| card.event_key.clone()).or_else(|| self.event_key.clone())?;
        Some(CardClick { task_id, event_key })
    }
}
