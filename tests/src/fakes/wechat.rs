//! A fake WeChat iLink bot server (the HTTP JSON protocol of Tencent's `openclaw-weixin`
//! plugin), for testing `channeld-wechat` without Tencent.
//!
//! It speaks the real wire format on `127.0.0.1:0`: authenticated `POST`s under
//! `/ilink/bot/` with their headers checked (a bad or expired bot token gets `-14`), a
//! `getupdates` long poll held until a message is queued or the hold ends, with an opaque
//! cursor; `sendmessage` refused with `ret: -2` when the context token is missing, unknown,
//! revoked or used more than ten times; typing tickets from `getconfig` for `sendtyping`;
//! `msg/notifystart`/`msg/notifystop`; and the QR login (`get_bot_qrcode`,
//! `get_qrcode_status`) following a script of statuses. Modes make any operation slow,
//! silent (never answered), fail with an HTTP status, or fail with a `ret` code.
//!
//! Everything that arrives is recorded ([`Records`]); what breaks the protocol the official
//! client follows is recorded as a violation, so a test can assert there was none.

mod server;
mod world;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::task::JoinHandle;

pub use world::{CONTEXT_REFUSED, MAX_TEXT_CHARS, MAX_WRONG_CODES, SESSION_EXPIRED};

use server::Shared;

/// How the fake behaves before it starts.
#[derive(Debug, Clone)]
pub struct FakeOptions {
    /// The one bot token the fake accepts (a confirmed QR login replaces it).
    pub bot_token: String,
    /// The bot's account id (`to_user_id` of inbound messages, `ilink_bot_id` on login).
    pub bot_id: String,
    /// How long `getupdates` is held when there is nothing to return.
    pub hold: Duration,
    /// The `longpolling_timeout_ms` the fake tells clients.
    pub advertised_timeout: Duration,
    /// Most messages in one `getupdates` answer.
    pub batch_limit: usize,
    /// Sends one context token allows.
    pub context_token_uses: u32,
    /// How long a context token stays valid (WeChat: about a day).
    pub context_token_ttl: Duration,
}

impl Default for FakeOptions {
    fn default() -> Self {
        Self {
            bot_token: "fake-bot-token".into(),
            bot_id: "fakebot@im.bot".into(),
            hold: Duration::from_secs(35),
            advertised_timeout: Duration::from_secs(35),
            batch_limit: 20,
            context_token_uses: 10,
            context_token_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// How the fake answers an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// Processes the request, then waits this long before answering (a client that gives up
    /// first does not learn that it worked).
    Slow(Duration),
    /// Never answers (the request is recorded, not processed) until the mode changes.
    Silent,
    /// Answers this HTTP status with a gateway's HTML page, without processing.
    Http(u16),
    /// Answers HTTP 200 with this `ret` (and `errcode`), without processing.
    Ret(i64),
}

/// One status of the scripted QR login; each `get_qrcode_status` poll takes the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoginStep {
    Wait,
    Scaned,
    /// `need_verifycode` until a poll carries this `verify_code`; it is then answered
    /// `scaned`. [`MAX_WRONG_CODES`] wrong codes answer `verify_code_blocked` and kill the
    /// QR code.
    NeedVerifyCode {
        code: String,
    },
    /// Kills the QR code: the client must fetch a new one.
    Expired,
    /// Kills the QR code.
    VerifyCodeBlocked,
    /// Later polls must arrive with `Host: host`.
    ScanedButRedirect {
        host: String,
    },
    /// The bot is already bound; no credentials.
    BindedRedirect,
    /// The login succeeded; the fake now accepts `bot_token`. `base_url` defaults to the
    /// fake's own.
    Confirmed {
        bot_token: String,
        bot_id: String,
        user_id: String,
        base_url: Option<String>,
    },
}

/// A message for the update stream. `message_type` 1 is a user, 2 a bot; `message_state` 0
/// new, 1 generating, 2 finished.
#[derive(Debug, Clone)]
pub struct UserMessage {
    pub from: String,
    pub items: Vec<Value>,
    pub message_type: i64,
    pub message_state: i64,
    pub with_message_id: bool,
    pub client_id: Option<String>,
    pub group_id: Option<String>,
    pub create_time_ms: Option<u64>,
}

impl UserMessage {
    /// A finished user message with these items.
    pub fn with_items(from: &str, items: Vec<Value>) -> Self {
        Self {
            from: from.to_owned(),
            items,
            message_type: 1,
            message_state: 2,
            with_message_id: true,
            client_id: None,
            group_id: None,
            create_time_ms: None,
        }
    }

    /// A finished user text message.
    pub fn text(from: &str, text: &str) -> Self {
        Self::with_items(from, vec![items::text(text)])
    }

    pub fn state(mut self, state: i64) -> Self {
        self.message_state = state;
        self
    }

    pub fn message_type(mut self, message_type: i64) -> Self {
        self.message_type = message_type;
        self
    }

    /// Leaves `message_id` out (older servers), so a client falls back to `client_id`.
    pub fn without_message_id(mut self) -> Self {
        self.with_message_id = false;
        self
    }

    pub fn client_id(mut self, client_id: &str) -> Self {
        self.client_id = Some(client_id.to_owned());
        self
    }

    pub fn group(mut self, group_id: &str) -> Self {
        self.group_id = Some(group_id.to_owned());
        self
    }
}

/// Builders for `item_list` entries.
pub mod items {
    use serde_json::{Value, json};

    pub fn text(text: &str) -> Value {
        json!({"type": 1, "text_item": {"text": text}})
    }

    /// A voice note, with the server's transcript if any.
    pub fn voice(transcript: Option<&str>) -> Value {
        let mut voice = json!({
            "media": media(None),
            "encode_type": 6,
            "sample_rate": 16000,
            "playtime": 2300,
        });
        if let Some(text) = transcript {
            voice["text"] = json!(text);
        }
        json!({"type": 3, "voice_item": voice})
    }

    pub fn image(full_url: Option<&str>) -> Value {
        json!({"type": 2, "image_item": {"media": media(full_url), "mid_size": 48213}})
    }

    pub fn file(name: &str) -> Value {
        json!({"type": 4, "file_item": {"media": media(None), "file_name": name, "len": "1024"}})
    }

    pub fn video() -> Value {
        json!({"type": 5, "video_item": {"media": media(None), "video_size": 90210}})
    }

    /// A text item quoting another item.
    pub fn quoting(text: &str, title: &str, quoted: Value) -> Value {
        json!({
            "type": 1,
            "text_item": {"text": text},
            "ref_msg": {"title": title, "message_item": quoted},
        })
    }

    /// A CDN reference as the server sends it.
    pub fn media(full_url: Option<&str>) -> Value {
        let mut media = json!({
            "encrypt_query_param": "eqp%2Bfake/param==",
            "aes_key": "MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmY=",
            "encrypt_type": 1,
        });
        if let Some(url) = full_url {
            media["full_url"] = Value::String(url.to_owned());
        }
        media
    }
}

/// What [`FakeIlink::push`] put on the update stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    pub message_id: u64,
    pub seq: u64,
    /// The context token the message carries; replies must present it.
    pub context_token: String,
}

/// A request as it arrived.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// The path below `/ilink/bot/`.
    pub op: String,
    pub method: String,
    pub query: HashMap<String, String>,
    pub host: Option<String>,
    /// Lower-case names, sorted.
    pub headers: Vec<(String, String)>,
    pub body: Value,
    pub at: Instant,
}

impl RecordedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }
}

/// A `sendmessage` the fake accepted.
#[derive(Debug, Clone)]
pub struct SentMessage {
    pub to_user_id: String,
    pub client_id: String,
    pub context_token: String,
    /// The text of a text item.
    pub text: Option<String>,
    pub item: Value,
    pub at: Instant,
}

/// A `sendmessage` refused with `ret: -2`.
#[derive(Debug, Clone)]
pub struct RefusedSend {
    pub to_user_id: String,
    pub client_id: String,
    pub context_token: Option<String>,
    pub ret: i64,
    pub reason: String,
}

/// A `sendtyping` the fake accepted (`status` 1 typing, 2 cancel).
#[derive(Debug, Clone)]
pub struct TypingEvent {
    pub user: String,
    pub status: i64,
    pub at: Instant,
}

/// Everything the fake saw.
#[derive(Debug, Clone, Default)]
pub struct Records {
    pub requests: Vec<RecordedRequest>,
    pub sent: Vec<SentMessage>,
    pub refused: Vec<RefusedSend>,
    pub typing: Vec<TypingEvent>,
    /// Users `getconfig` was asked about.
    pub configs: Vec<String>,
    /// `msg/notifystart` and `msg/notifystop`, in order.
    pub notifications: Vec<String>,
    /// The `local_token_list` of each `get_bot_qrcode`.
    pub local_token_lists: Vec<Vec<String>>,
    /// Departures from what the official client does.
    pub violations: Vec<String>,
    /// Cursors the fake did not issue (answered from the last committed position).
    pub cursor_resets: usize,
    /// Non-empty `getupdates` answers.
    pub batches_handed_out: usize,
}

impl Records {
    /// Requests for one operation (e.g. `getupdates`, `msg/notifystart`).
    pub fn of(&self, op: &str) -> Vec<&RecordedRequest> {
        self.requests.iter().filter(|r| r.op == op).collect()
    }

    pub fn count(&self, op: &str) -> usize {
        self.requests.iter().filter(|r| r.op == op).count()
    }

    /// The texts sent to `user`, in order.
    pub fn texts_to(&self, user: &str) -> Vec<String> {
        self.sent.iter().filter(|s| s.to_user_id == user).filter_map(|s| s.text.clone()).collect()
    }
}

/// A running fake iLink server. Stops when dropped.
#[derive(Debug)]
pub struct FakeIlink {
    shared: Arc<Shared>,
    addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl FakeIlink {
    /// Starts with default options on a free loopback port.
    pub async fn start() -> Self {
        Self::start_with(FakeOptions::default()).await
    }

    pub async fn start_with(options: FakeOptions) -> Self {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind the fake iLink server on loopback");
        let addr = listener.local_addr().expect("fake iLink address");
        let shared = Arc::new(Shared::new(options, format!("http://{addr}")));
        let task = tokio::spawn(server::serve(listener, shared.clone()));
        Self { shared, addr, task: Some(task) }
    }

    /// `http://127.0.0.1:PORT`: the driver's `CHANNELD_WECHAT_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The options the fake started with.
    pub fn options(&self) -> FakeOptions {
        self.shared.with(|world| world.options.clone())
    }

    /// From now on only `token` is accepted.
    pub fn set_bot_token(&self, token: &str) {
        self.shared.update(|world| world.set_bot_token(Some(token.to_owned())));
    }

    /// The session expires: every authenticated request gets `-14` until a new token is set.
    pub fn expire_bot_token(&self) {
        self.shared.update(|world| world.set_bot_token(None));
    }

    /// Queues a message on the update stream (wakes held polls).
    pub fn push(&self, message: UserMessage) -> Pushed {
        self.shared.update(|world| world.push(message))
    }

    pub fn push_text(&self, from: &str, text: &str) -> Pushed {
        self.push(UserMessage::text(from, text))
    }

    /// A valid context token for `user` without a message on the update stream: the user
    /// wrote before the test began (seed it into the driver's state to send proactively).
    pub fn issue_context_token(&self, user: &str) -> String {
        self.shared.update(|world| world.issue_context_token(user))
    }

    /// Offers a pushed message again, as the real server does seconds or an hour later.
    pub fn replay(&self, message_id: u64) {
        let known = self.shared.update(|world| world.replay(message_id));
        assert!(known, "no pushed message has id {message_id}");
    }

    /// Offers everything handed out so far again; returns how many messages.
    pub fn replay_handed_out(&self) -> usize {
        self.shared.update(World::replay_handed_out)
    }

    /// Every operation behaves this way (per-operation modes are cleared).
    pub fn set_mode(&self, mode: Mode) {
        self.shared.update(|world| world.set_mode(None, mode));
    }

    /// One operation (`getupdates`, `sendmessage`, `msg/notifystart`, …) behaves this way.
    pub fn set_op_mode(&self, op: &str, mode: Mode) {
        self.shared.update(|world| world.set_mode(Some(op), mode));
    }

    /// Every context token issued to `user` so far is refused from now on.
    pub fn revoke_context_tokens(&self, user: &str) {
        self.shared.update(|world| world.revoke_context_tokens(user));
    }

    /// The statuses the next QR login goes through.
    pub fn script_login(&self, steps: Vec<LoginStep>) {
        self.shared.update(|world| world.set_login_script(steps));
    }

    /// A copy of everything recorded so far.
    pub fn records(&self) -> Records {
        self.shared.with(|world| world.records.clone())
    }

    /// Fails the test if any request departed from the official client's protocol.
    pub fn assert_no_violations(&self) {
        let violations = self.shared.with(|world| world.records.violations.clone());
        assert!(violations.is_empty(), "protocol violations seen by the fake: {violations:#?}");
    }

    /// Waits until `probe` returns `Some` over the records (re-checked after every change),
    /// or fails the test after `within`, naming `what` was awaited.
    pub async fn wait_for<T>(
        &self,
        within: Duration,
        what: &str,
        mut probe: impl FnMut(&Records) -> Option<T>,
    ) -> T {
        super::wait_until(
            "iLink server",
            what,
            within,
            self.shared.subscribe(),
            || self.shared.with(|world| probe(&world.records)),
            || self.shared.with(|world| summary(&world.records)),
        )
        .await
    }

    /// Stops serving and closes the port; held requests are answered 503.
    pub async fn stop(mut self) {
        self.shared.shutdown();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for FakeIlink {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

use world::World;

fn summary(records: &Records) -> String {
    let mut ops: Vec<(String, usize)> = Vec::new();
    for request in &records.requests {
        match ops.iter_mut().find(|(op, _)| *op == request.op) {
            Some((_, n)) => *n += 1,
            None => ops.push((request.op.clone(), 1)),
        }
    }
    json!({
        "requests": ops,
        "sent": records.sent.iter().map(|s| (&s.to_user_id, &s.text)).collect::<Vec<_>>(),
        "refused": records.refused.iter().map(|r| &r.reason).collect::<Vec<_>>(),
        "typing": records.typing.iter().map(|t| (&t.user, t.status)).collect::<Vec<_>>(),
        "violations": records.violations,
    })
    .to_string()
}

#[cfg(test)]
mod tests;
