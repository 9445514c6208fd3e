//! The iLink bot protocol's wire types: the request and response bodies of each operation,
//! the message model, the headers, and the codes that matter to the driver.
//!
//! Every bot call is a JSON `POST` to `<base URL>/ilink/bot/<op>`; the QR login's status poll
//! is a `GET`. Success is `ret: 0`; failures come as a non-zero `ret` and/or `errcode`, often
//! with an empty `errmsg`, on HTTP 200 — so every body is parsed before trusting the status.
//! Responses are read leniently (every field optional, numbers that may arrive as strings)
//! because the server omits what it does not use; requests are written exactly as the
//! official client writes them.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// The production API base URL.
pub const DEFAULT_BASE_URL: &str = "https://ilinkai.weixin.qq.com";
/// The production CDN for media, used when a media reference has no `full_url`.
pub const DEFAULT_CDN_BASE_URL: &str = "https://novac2c.cdn.weixin.qq.com/c2c";
/// `iLink-App-Id`.
pub const APP_ID: &str = "bot";
/// `bot_type` of the QR login for this kind of bot.
pub const BOT_TYPE: &str = "3";
/// `errcode`/`ret` of an expired or unknown bot token.
pub const SESSION_EXPIRED: i64 = -14;
/// The `ret` of a `sendmessage` refused for its context token (missing, stale, used up).
pub const CONTEXT_REFUSED: i64 = -2;
/// At most this many old tokens go in `local_token_list`.
pub const MAX_LOCAL_TOKENS: usize = 10;

/// Operation paths below the base URL.
pub mod op {
    pub const GET_UPDATES: &str = "ilink/bot/getupdates";
    pub const SEND_MESSAGE: &str = "ilink/bot/sendmessage";
    pub const GET_CONFIG: &str = "ilink/bot/getconfig";
    pub const SEND_TYPING: &str = "ilink/bot/sendtyping";
    pub const NOTIFY_START: &str = "ilink/bot/msg/notifystart";
    pub const NOTIFY_STOP: &str = "ilink/bot/msg/notifystop";
    pub const GET_BOT_QRCODE: &str = "ilink/bot/get_bot_qrcode";
    pub const GET_QRCODE_STATUS: &str = "ilink/bot/get_qrcode_status";
}

/// Header names.
pub mod header {
    pub const AUTHORIZATION_TYPE: &str = "AuthorizationType";
    /// The only `AuthorizationType`.
    pub const BOT_TOKEN_AUTH: &str = "ilink_bot_token";
    pub const UIN: &str = "X-WECHAT-UIN";
    pub const APP_ID: &str = "iLink-App-Id";
    pub const CLIENT_VERSION: &str = "iLink-App-ClientVersion";
    pub const ROUTE_TAG: &str = "SKRouteTag";
}

/// `message_type` of a message a person wrote.
pub const MESSAGE_TYPE_USER: i64 = 1;
/// `message_type` of a bot's message.
pub const MESSAGE_TYPE_BOT: i64 = 2;
/// `message_state` of a message still being generated.
pub const MESSAGE_STATE_GENERATING: i64 = 1;
/// `message_state` of a finished message (every message the driver sends).
pub const MESSAGE_STATE_FINISHED: i64 = 2;

/// `sendtyping` `status`: typing.
pub const TYPING_ON: i64 = 1;
/// `sendtyping` `status`: stop typing.
pub const TYPING_OFF: i64 = 2;

/// `type` of an item in `item_list`.
pub mod item_type {
    pub const TEXT: i64 = 1;
    pub const IMAGE: i64 = 2;
    pub const VOICE: i64 = 3;
    pub const FILE: i64 = 4;
    pub const VIDEO: i64 = 5;
}

/// `iLink-App-ClientVersion`: `0x00MMNNPP` of a `major.minor.patch` version, each part
/// truncated to a byte as the official client does.
pub fn client_version(version: &str) -> u32 {
    let mut parts = version.split('.').map(|part| part.parse::<u32>().unwrap_or(0) & 0xff);
    let (major, minor, patch) =
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major << 16) | (minor << 8) | patch
}

/// `X-WECHAT-UIN`: the base64 of the decimal string of a random u32, new per request.
pub fn uin_header(random: u32) -> String {
    BASE64.encode(random.to_string())
}

/// Whether `agent` follows the `bot_agent` grammar: space-separated `Name/Version` tokens
/// (`[A-Za-z0-9_.-]{1,32}` / `[A-Za-z0-9_.+-]{1,32}`), at most 256 bytes.
pub fn valid_bot_agent(agent: &str) -> bool {
    let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    let version_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-');
    !agent.is_empty()
        && agent.len() <= 256
        && agent.split(' ').all(|token| match token.split_once('/') {
            Some((name, version)) => {
                (1..=32).contains(&name.len())
                    && (1..=32).contains(&version.len())
                    && name.chars().all(name_char)
                    && version.chars().all(version_char)
            }
            None => false,
        })
}

/// `base_info`, carried by every authenticated body (observability only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BaseInfo {
    pub channel_version: String,
    pub bot_agent: String,
}

/// A bot token as it arrives in a login answer: never printed.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Token(pub String);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The status fields every response may carry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Status {
    #[serde(deserialize_with = "lenient_i64")]
    pub ret: Option<i64>,
    #[serde(deserialize_with = "lenient_i64")]
    pub errcode: Option<i64>,
    pub errmsg: Option<String>,
}

/// A refusal in a response body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `errcode` when non-zero, else `ret`.
    pub code: i64,
    /// `errmsg`, empty when the server said nothing.
    pub message: String,
}

impl Failure {
    pub fn session_expired(&self) -> bool {
        self.code == SESSION_EXPIRED
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "code {} (no message)", self.code)
        } else {
            write!(f, "code {}: {}", self.code, self.message)
        }
    }
}

impl Status {
    /// The refusal this status reports, if any: a non-zero `errcode` or `ret`.
    pub fn failure(&self) -> Option<Failure> {
        let code = match (self.errcode, self.ret) {
            (Some(code), _) if code != 0 => code,
            (_, Some(code)) if code != 0 => code,
            _ => return None,
        };
        Some(Failure { code, message: self.errmsg.clone().unwrap_or_default() })
    }
}

/// `getupdates` request.
#[derive(Debug, Serialize)]
pub struct GetUpdatesRequest<'a> {
    /// The previous answer's cursor; empty the first time.
    pub get_updates_buf: &'a str,
    pub base_info: &'a BaseInfo,
}

/// `getupdates` response. `msgs` stay raw so one malformed message cannot hide the batch.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct GetUpdatesResponse {
    #[serde(flatten)]
    pub status: Status,
    pub msgs: Vec<Value>,
    pub get_updates_buf: Option<String>,
    #[serde(deserialize_with = "lenient_u64")]
    pub longpolling_timeout_ms: Option<u64>,
}

/// A message in `msgs`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct WeixinMessage {
    #[serde(deserialize_with = "lenient_u64")]
    pub seq: Option<u64>,
    /// A u64 on the wire, beyond JavaScript's safe integers; a string is accepted too.
    #[serde(deserialize_with = "lenient_u64")]
    pub message_id: Option<u64>,
    pub from_user_id: Option<String>,
    pub to_user_id: Option<String>,
    pub client_id: Option<String>,
    #[serde(deserialize_with = "lenient_u64")]
    pub create_time_ms: Option<u64>,
    pub session_id: Option<String>,
    pub group_id: Option<String>,
    #[serde(deserialize_with = "lenient_i64")]
    pub message_type: Option<i64>,
    #[serde(deserialize_with = "lenient_i64")]
    pub message_state: Option<i64>,
    pub item_list: Vec<MessageItem>,
    pub context_token: Option<String>,
}

/// An entry of `item_list`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MessageItem {
    #[serde(rename = "type", deserialize_with = "lenient_i64")]
    pub kind: Option<i64>,
    pub text_item: Option<TextItem>,
    pub image_item: Option<MediaItem>,
    pub voice_item: Option<VoiceItem>,
    pub file_item: Option<FileItem>,
    pub video_item: Option<MediaItem>,
    pub ref_msg: Option<Box<RefMessage>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct TextItem {
    pub text: Option<String>,
}

/// A CDN reference: the content is AES-128-ECB encrypted with `aes_key`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct CdnMedia {
    pub encrypt_query_param: Option<String>,
    pub aes_key: Option<String>,
    #[serde(deserialize_with = "lenient_i64")]
    pub encrypt_type: Option<i64>,
    pub full_url: Option<String>,
}

/// An image or video item.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MediaItem {
    pub media: Option<CdnMedia>,
    /// Images: the raw AES key as hex, preferred over `media.aes_key`.
    pub aeskey: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct VoiceItem {
    pub media: Option<CdnMedia>,
    /// 1 pcm, 2 adpcm, 3 feature, 4 speex, 5 amr, 6 silk, 7 mp3, 8 ogg-speex.
    #[serde(deserialize_with = "lenient_i64")]
    pub encode_type: Option<i64>,
    /// The server's transcript.
    pub text: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct FileItem {
    pub media: Option<CdnMedia>,
    pub file_name: Option<String>,
}

/// A quoted message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct RefMessage {
    pub message_item: Option<MessageItem>,
    /// The server's summary of the quoted message.
    pub title: Option<String>,
}

/// `sendmessage` request: exactly one item per request.
#[derive(Debug, Serialize)]
pub struct SendMessageRequest<'a> {
    pub msg: OutgoingMessage<'a>,
    pub base_info: &'a BaseInfo,
}

#[derive(Debug, Serialize)]
pub struct OutgoingMessage<'a> {
    /// Always empty: the server fills in the bot.
    pub from_user_id: &'a str,
    pub to_user_id: &'a str,
    /// Unique per request; the driver's receipt names it.
    pub client_id: &'a str,
    pub message_type: i64,
    pub message_state: i64,
    pub context_token: &'a str,
    pub item_list: [OutgoingItem<'a>; 1],
}

#[derive(Debug, Serialize)]
pub struct OutgoingItem<'a> {
    #[serde(rename = "type")]
    pub kind: i64,
    pub text_item: OutgoingText<'a>,
}

#[derive(Debug, Serialize)]
pub struct OutgoingText<'a> {
    pub text: &'a str,
}

impl<'a> OutgoingMessage<'a> {
    /// A finished bot text message.
    pub fn text(to: &'a str, client_id: &'a str, context_token: &'a str, text: &'a str) -> Self {
        Self {
            from_user_id: "",
            to_user_id: to,
            client_id,
            message_type: MESSAGE_TYPE_BOT,
            message_state: MESSAGE_STATE_FINISHED,
            context_token,
            item_list: [OutgoingItem { kind: item_type::TEXT, text_item: OutgoingText { text } }],
        }
    }
}

/// `getconfig` request: the typing ticket for one user.
#[derive(Debug, Serialize)]
pub struct GetConfigRequest<'a> {
    pub ilink_user_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_token: Option<&'a str>,
    pub base_info: &'a BaseInfo,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct GetConfigResponse {
    #[serde(flatten)]
    pub status: Status,
    pub typing_ticket: Option<String>,
}

/// `sendtyping` request.
#[derive(Debug, Serialize)]
pub struct SendTypingRequest<'a> {
    pub ilink_user_id: &'a str,
    pub typing_ticket: &'a str,
    /// [`TYPING_ON`] or [`TYPING_OFF`].
    pub status: i64,
    pub base_info: &'a BaseInfo,
}

/// `msg/notifystart` and `msg/notifystop` request.
#[derive(Debug, Serialize)]
pub struct NotifyRequest<'a> {
    pub base_info: &'a BaseInfo,
}

/// `get_bot_qrcode` request.
#[derive(Debug, Serialize)]
pub struct QrCodeRequest<'a> {
    /// Up to [`MAX_LOCAL_TOKENS`] tokens this host was given before.
    pub local_token_list: Vec<&'a str>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct QrCodeResponse {
    #[serde(flatten)]
    pub status: Status,
    /// The value to poll with.
    pub qrcode: Option<String>,
    /// What to show as a QR code (a URL).
    pub qrcode_img_content: Option<String>,
}

/// `get_qrcode_status` response.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct QrStatusResponse {
    pub status: Option<String>,
    pub bot_token: Option<Token>,
    pub ilink_bot_id: Option<String>,
    pub baseurl: Option<String>,
    pub ilink_user_id: Option<String>,
    pub redirect_host: Option<String>,
}

/// The QR login statuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QrStatus {
    Wait,
    Scanned,
    Confirmed,
    Expired,
    NeedVerifyCode,
    VerifyCodeBlocked,
    ScannedButRedirect,
    AlreadyBound,
    Other(String),
}

impl QrStatus {
    pub fn parse(raw: &str) -> Self {
        match raw {
            "wait" => Self::Wait,
            "scaned" => Self::Scanned,
            "confirmed" => Self::Confirmed,
            "expired" => Self::Expired,
            "need_verifycode" => Self::NeedVerifyCode,
            "verify_code_blocked" => Self::VerifyCodeBlocked,
            "scaned_but_redirect" => Self::ScannedButRedirect,
            "binded_redirect" => Self::AlreadyBound,
            other => Self::Other(other.to_owned()),
        }
    }
}

/// A number that may arrive as a JSON number or a decimal string; anything else is absent.
fn lenient_u64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    Ok(match Value::deserialize(deserializer)? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    })
}

fn lenient_i64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<i64>, D::Error> {
    Ok(match Value::deserialize(deserializer)? {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn client_version_packs_major_minor_patch_into_0x00mmnnpp() {
        assert_eq!(client_version("1.0.11"), 0x0001_000B);
        assert_eq!(client_version("2.4.8"), 0x0002_0408);
        assert_eq!(client_version("0.1.0"), 256);
        assert_eq!(client_version("300.1"), (300 & 0xff) << 16 | 1 << 8);
    }

    #[test]
    fn the_uin_header_is_base64_of_the_decimal_string() {
        assert_eq!(uin_header(12345), "MTIzNDU=");
        let decoded = BASE64.decode(uin_header(u32::MAX)).unwrap();
        assert_eq!(decoded, b"4294967295");
    }

    #[test]
    fn bot_agents_follow_the_user_agent_grammar() {
        assert!(valid_bot_agent("channeld-wechat/0.1.0"));
        assert!(valid_bot_agent("Acme/1.2+build OtherBot/2"));
        for bad in ["", "NoVersion", "a/", "/1", "sp ace/1 x", "bad!/1", &"n".repeat(33)] {
            assert!(!valid_bot_agent(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_failure_is_a_non_zero_errcode_or_ret() {
        let status = |value: Value| serde_json::from_value::<Status>(value).unwrap().failure();
        assert_eq!(status(json!({"ret": 0, "errmsg": ""})), None);
        assert_eq!(status(json!({})), None);
        let expired = status(json!({"errcode": -14, "errmsg": ""})).unwrap();
        assert!(expired.session_expired());
        assert_eq!(expired.to_string(), "code -14 (no message)");
        let refused = status(json!({"ret": -2, "errmsg": "prepare failed"})).unwrap();
        assert_eq!((refused.code, refused.to_string()), (-2, "code -2: prepare failed".into()));
        assert_eq!(status(json!({"ret": "-14"})).unwrap().code, -14, "numbers as strings");
    }

    #[test]
    fn message_ids_beyond_javascript_integers_survive_as_numbers_or_strings() {
        let big = json!({"message_id": 7_000_000_000_000_000_123u64, "seq": "9"});
        let message: WeixinMessage = serde_json::from_value(big).unwrap();
        assert_eq!(message.message_id, Some(7_000_000_000_000_000_123));
        assert_eq!(message.seq, Some(9));
        let text: WeixinMessage =
            serde_json::from_value(json!({"message_id": "18446744073709551615"})).unwrap();
        assert_eq!(text.message_id, Some(u64::MAX));
        let odd: WeixinMessage = serde_json::from_value(json!({"message_id": null})).unwrap();
        assert_eq!(odd.message_id, None);
    }

    #[test]
    fn a_send_request_is_written_as_the_official_client_writes_it() {
        let base =
            BaseInfo { channel_version: "0.1.0".into(), bot_agent: "channeld-wechat/0.1.0".into() };
        let request = SendMessageRequest {
            msg: OutgoingMessage::text("u@im.wechat", "cid-1", "ctx", "hi"),
            base_info: &base,
        };
        assert_eq!(
            serde_json::to_value(&request).unwrap(),
            json!({
                "msg": {
                    "from_user_id": "",
                    "to_user_id": "u@im.wechat",
                    "client_id": "cid-1",
                    "message_type": 2,
                    "message_state": 2,
                    "context_token": "ctx",
                    "item_list": [{"type": 1, "text_item": {"text": "hi"}}],
                },
                "base_info": {"channel_version": "0.1.0", "bot_agent": "channeld-wechat/0.1.0"},
            })
        );
    }

    #[test]
    fn recorded_refusals_read_as_failures() {
        let expired: GetUpdatesResponse =
            serde_json::from_str(include_str!("../tests/fixtures/expired.json")).unwrap();
        assert!(expired.status.failure().is_some_and(|f| f.session_expired()));
        assert!(expired.msgs.is_empty() && expired.get_updates_buf.is_none());
        let refused: Status =
            serde_json::from_str(include_str!("../tests/fixtures/sendmessage-refused.json"))
                .unwrap();
        assert_eq!(refused.failure(), Some(Failure { code: CONTEXT_REFUSED, message: "".into() }));
        let confirmed: QrStatusResponse =
            serde_json::from_str(include_str!("../tests/fixtures/qrcode-confirmed.json")).unwrap();
        assert_eq!(confirmed.status.as_deref().map(QrStatus::parse), Some(QrStatus::Confirmed));
        assert_eq!(confirmed.ilink_bot_id.as_deref(), Some("a1b2c3d4e5f6@im.bot"));
        assert_eq!(confirmed.baseurl.as_deref(), Some("https://ilinkai.weixin.qq.com"));
        assert!(confirmed.bot_token.is_some());
    }

    #[test]
    fn a_login_answer_keeps_its_token_out_of_debug_output() {
        let answer: QrStatusResponse = serde_json::from_value(json!({
            "status": "confirmed", "bot_token": "tok-secret", "ilink_bot_id": "b", "baseurl": "https://x"
        }))
        .unwrap();
        assert_eq!(answer.bot_token.as_ref().map(|t| t.0.as_str()), Some("tok-secret"));
        assert!(!format!("{answer:?}").contains("tok-secret"));
        assert_eq!(QrStatus::parse("scaned_but_redirect"), QrStatus::ScannedButRedirect);
        assert_eq!(QrStatus::parse("binded_redirect"), QrStatus::AlreadyBound);
        assert_eq!(QrStatus::parse("new"), QrStatus::Other("new".into()));
    }
}
