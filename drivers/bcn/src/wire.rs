//! The BCN bot wire format (the platform's "Bot Integration Guide"): JSON text frames of three
//! types, `req` (`id`, `method`, `params`), `res` (`id`, `ok`, `payload` or `error`) and
//! `event` (`event`, `payload`, `seq`). Only the fields the driver uses are typed; unknown
//! fields are ignored, as the guide's versioning policy asks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Methods and events.
pub mod method {
    /// The handshake; must be the first frame.
    pub const CONNECT: &str = "bot.connect";
    /// The heartbeat.
    pub const STATUS: &str = "bot.status";
    /// A message that needs a reply.
    pub const SEND: &str = "chat.send";
    /// A message to observe only.
    pub const INJECT: &str = "chat.inject";
    /// Cancel one run.
    pub const ABORT: &str = "chat.abort";
    /// The bot's stored history of a session.
    pub const HISTORY: &str = "chat.history";
    /// The reply event.
    pub const CHAT_EVENT: &str = "chat.event";
}

/// The guide's error codes.
pub mod code {
    pub const INVALID_REQUEST: &str = "invalid_request";
    pub const UNAUTHORIZED: &str = "unauthorized";
    pub const NOT_FOUND: &str = "not_found";
    pub const UNAVAILABLE: &str = "unavailable";
    pub const UNKNOWN_METHOD: &str = "unknown_method";
    pub const INTERNAL_ERROR: &str = "internal_error";
    pub const UNSUPPORTED_PROTOCOL_VERSION: &str = "unsupported_protocol_version";
}

/// `chat.event` states.
pub mod state {
    pub const DELTA: &str = "delta";
    pub const FINAL: &str = "final";
    pub const ERROR: &str = "error";
    pub const ABORTED: &str = "aborted";
    pub const TOOL_CALL_START: &str = "tool_call_start";
    pub const TOOL_CALL_END: &str = "tool_call_end";
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a BCN frame: {0}")]
    Json(#[from] serde_json::Error),
}

/// A frame from BCN.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type")]
pub enum Incoming {
    #[serde(rename = "req")]
    Req(Request),
    #[serde(rename = "res")]
    Res(Response),
    #[serde(rename = "event")]
    Event {
        event: String,
        #[serde(default)]
        payload: Value,
    },
}

/// A request (BCN asks the bot).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Request {
    pub id: String,
    pub method: String,
    #[serde(default)]
    pub params: Value,
}

/// A response (BCN answers the bot).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Response {
    pub id: String,
    pub ok: bool,
    #[serde(default)]
    pub payload: Value,
    #[serde(default)]
    pub error: Option<ErrorBody>,
}

/// The `error` of a failed response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub retryable: bool,
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
}

impl ErrorBody {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            message: message.into(),
            retryable: false,
            retry_after_ms: None,
        }
    }
}

impl Response {
    /// `code: message` of a failed response.
    pub fn describe(&self) -> String {
        match &self.error {
            Some(error) => format!("{}: {}", error.code, error.message),
            None => "refused without an error".to_owned(),
        }
    }

    /// The error code of a failed response.
    pub fn code(&self) -> Option<&str> {
        self.error.as_ref().map(|error| error.code.as_str())
    }
}

/// Reads one text frame.
pub fn decode(text: &str) -> Result<Incoming, WireError> {
    Ok(serde_json::from_str(text)?)
}

/// A request frame.
pub fn request(id: &str, method: &str, params: Value) -> String {
    json!({"type": "req", "id": id, "method": method, "params": params}).to_string()
}

/// A successful response.
pub fn ok(id: &str, payload: Value) -> String {
    json!({"type": "res", "id": id, "ok": true, "payload": payload}).to_string()
}

/// A failed response.
pub fn refuse(id: &str, error: &ErrorBody) -> String {
    json!({"type": "res", "id": id, "ok": false, "error": error}).to_string()
}

/// An event frame.
pub fn event(event: &str, payload: Value, seq: u64) -> String {
    json!({"type": "event", "event": event, "payload": payload, "seq": seq}).to_string()
}

/// The `bot.connect` params: the token when the bot has one, and the version asked for.
pub fn connect_params(token: Option<&str>, protocol_version: u32) -> Value {
    match token {
        Some(token) => json!({"token": token, "protocol_version": protocol_version}),
        None => json!({"protocol_version": protocol_version}),
    }
}

/// The payload of a successful `bot.connect`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
pub struct Connected {
    #[serde(default)]
    pub is_new: bool,
    pub token: String,
    pub bot_uuid: String,
    /// Absent from old servers: the version asked for.
    #[serde(default)]
    pub protocol_version: Option<u32>,
    #[serde(default)]
    pub min_supported_version: Option<u32>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub deprecation: Option<Deprecation>,
}

impl std::fmt::Debug for Connected {
    /// The token and the env values (which may hold it) never print.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("is_new", &self.is_new)
            .field("bot_uuid", &self.bot_uuid)
            .field("protocol_version", &self.protocol_version)
            .field("min_supported_version", &self.min_supported_version)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("deprecation", &self.deprecation)
            .finish_non_exhaustive()
    }
}

/// A version deprecation notice.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Deprecation {
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub sunset_date: Option<String>,
}

/// A chat message as BCN sends it: `content` is a list of parts (or, leniently, a string).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ChatMessage {
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Value,
    #[serde(default)]
    pub timestamp: Option<u64>,
}

impl ChatMessage {
    /// The text parts joined with newlines (a plain string content is its own text).
    pub fn text(&self) -> String {
        match &self.content {
            Value::String(text) => text.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        }
    }
}

/// Who a Human Channel message is from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ChannelInfo {
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default)]
    pub user_id: Option<String>,
    #[serde(default)]
    pub actor_name: Option<String>,
    #[serde(default)]
    pub identity_forwarding: bool,
}

/// The params of `chat.send` and `chat.inject`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatParams {
    pub session_key: String,
    #[serde(default)]
    pub bcs_group_id: Option<String>,
    #[serde(default)]
    pub bcs_session_id: Option<String>,
    #[serde(default)]
    pub message: ChatMessage,
    #[serde(default)]
    pub channel: Option<ChannelInfo>,
    #[serde(default)]
    pub session_context: Option<Value>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// The params of `chat.abort`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct AbortParams {
    pub session_key: String,
    pub run_id: String,
}

/// The params of `chat.history`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HistoryParams {
    pub session_key: String,
    #[serde(default)]
    pub limit: Option<u64>,
}

/// A `chat.event` payload's `message`: the assistant's text.
pub fn assistant_message(text: &str, timestamp_ms: u64) -> Value {
    json!({
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "timestamp": timestamp_ms,
    })
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

/// A fresh request id for frames the bot sends, `<prefix>-<unix ms>-<8 hex>`.
pub fn request_id(prefix: &str) -> String {
    format!("{prefix}-{}-{:08x}", now_ms(), fastrand::u32(..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_of_the_guide_decode() {
        let send = r#"{"type":"req","id":"chat-001","method":"chat.send","params":{"session_key":"grp-456:channel_dingtalk_abcdef12","bcs_group_id":"grp-456","message":{"role":"user","content":[{"type":"text","text":"Please analyze this deadlock"}],"timestamp":1710960000000},"channel":{"source":"webui","user_id":"user-001"},"session_context":{"originator":"alice"},"timeout_ms":300000}}"#;
        let Incoming::Req(request) = decode(send).unwrap() else { panic!("a request") };
        assert_eq!((request.id.as_str(), request.method.as_str()), ("chat-001", method::SEND));
        let params: ChatParams = serde_json::from_value(request.params).unwrap();
        assert_eq!(params.message.text(), "Please analyze this deadlock");
        assert_eq!(params.channel.unwrap().user_id.as_deref(), Some("user-001"));

        let refused = r#"{"type":"res","id":"1","ok":false,"error":{"code":"unauthorized","message":"bad token","retryable":false,"retry_after_ms":null}}"#;
        let Incoming::Res(response) = decode(refused).unwrap() else { panic!("a response") };
        assert_eq!(response.code(), Some(code::UNAUTHORIZED));
        assert_eq!(response.describe(), "unauthorized: bad token");

        let connected = r#"{"is_new":true,"token":"tok-abc123","bot_uuid":"bot-xyz789","protocol_version":1,"min_supported_version":1,"env":{"BCN_BOT_TOKEN":"tok-abc123"},"deprecation":{"message":"v1 goes","sunset_date":"2026-06-01"}}"#;
        let connected: Connected = serde_json::from_str(connected).unwrap();
        assert_eq!(connected.deprecation.as_ref().unwrap().message, "v1 goes");
        assert!(!format!("{connected:?}").contains("tok-abc123"), "the token never prints");
    }

    #[test]
    fn frames_the_bot_sends_have_the_guide_shape() {
        let frame: Value = serde_json::from_str(&event(
            method::CHAT_EVENT,
            json!({"run_id": "r", "state": "final"}),
            3,
        ))
        .unwrap();
        assert_eq!(frame["type"], "event");
        assert_eq!(frame["seq"], 3);
        let refused: Value =
            serde_json::from_str(&refuse("x", &ErrorBody::new(code::NOT_FOUND, "no run"))).unwrap();
        assert_eq!(refused["ok"], false);
        assert_eq!(refused["error"]["code"], "not_found");
        assert_eq!(refused["error"]["retryable"], false);
        assert_eq!(connect_params(None, 2), json!({"protocol_version": 2}));
    }

    #[test]
    fn text_joins_text_parts_only() {
        let message = ChatMessage {
            content: json!([{"type":"text","text":"a"},{"type":"image","url":"u"},{"type":"text","text":"b"}]),
            ..ChatMessage::default()
        };
        assert_eq!(message.text(), "a\nb");
        assert_eq!(
            ChatMessage { content: json!("plain"), ..ChatMessage::default() }.text(),
            "plain"
        );
        assert_eq!(ChatMessage::default().text(), "");
    }
}
