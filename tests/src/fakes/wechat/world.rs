//! The fake iLink server's state and its answer to each request, without sockets: the
//! messages offered through `getupdates` and the cursors that see them, the bot and context
//! tokens, typing tickets, the scripted QR login, and the record of everything that arrived.
//!
//! The HTTP layer (`server.rs`) parses a request into an [`Incoming`], applies the mode, and
//! asks the world for an answer; only the long poll's holding happens outside.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use super::{
    FakeOptions, LoginStep, Mode, Pushed, RecordedRequest, Records, RefusedSend, SentMessage,
    TypingEvent, UserMessage,
};

/// The iLink `errcode`/`ret` for an expired or unknown bot token.
pub const SESSION_EXPIRED: i64 = -14;
/// The `ret` of a `sendmessage` whose context token is missing, unknown or used up.
pub const CONTEXT_REFUSED: i64 = -2;
/// The longest text item the fake accepts without recording a violation (the official
/// client chunks at 4,000 characters).
pub const MAX_TEXT_CHARS: usize = 4000;
/// Wrong verification codes before the QR code is blocked.
pub const MAX_WRONG_CODES: u32 = 3;

/// A request as the HTTP layer parsed it.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The path below `/ilink/bot/`, e.g. `getupdates` or `msg/notifystart`.
    pub op: String,
    pub method: String,
    pub query: HashMap<String, String>,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    /// The JSON body; `Null` when there was none.
    pub body: Value,
    /// The body was present but not JSON.
    pub body_invalid: bool,
}

impl Incoming {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// What the HTTP layer should send back.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// HTTP 200 with this JSON body.
    Json(Value),
    /// Another HTTP status with a raw body.
    Status(u16, String),
}

/// A context token the fake issued with an inbound message.
#[derive(Debug, Clone)]
struct ContextToken {
    user: String,
    uses: u32,
    revoked: bool,
    issued: Instant,
}

/// The scripted QR login.
#[derive(Debug, Default)]
struct Login {
    script: VecDeque<LoginStep>,
    current: Option<String>,
    dead: HashSet<String>,
    /// After `scaned_but_redirect`, polls must arrive with this `Host`.
    expected_host: Option<String>,
    wrong_codes: u32,
    issued: u64,
}

/// Everything the fake knows.
#[derive(Debug)]
pub struct World {
    pub options: FakeOptions,
    /// This server's base URL (`http://127.0.0.1:PORT`), returned as `baseurl` on login.
    pub base_url: String,
    /// Cursors from another server instance are not ours.
    nonce: u64,
    bot_token: Option<String>,
    /// Everything offered through `getupdates`, replays included, in order.
    deliveries: Vec<Value>,
    /// Every pushed message by `message_id`, for replays.
    messages: HashMap<u64, Value>,
    /// The furthest position a client presented in a cursor: an empty cursor resumes here.
    committed: usize,
    /// The furthest position handed out in a response.
    handed_out: usize,
    next_message_id: u64,
    next_seq: u64,
    context_tokens: HashMap<String, ContextToken>,
    typing_tickets: HashMap<String, String>,
    client_ids: HashSet<String>,
    /// The previous request's `X-WECHAT-UIN`: it must be new every time.
    last_uin: Option<String>,
    modes: HashMap<String, Mode>,
    default_mode: Mode,
    login: Login,
    pub records: Records,
}

impl World {
    pub fn new(options: FakeOptions, base_url: String) -> Self {
        Self {
            bot_token: Some(options.bot_token.clone()),
            options,
            base_url,
            nonce: fastrand::u64(..),
            deliveries: Vec::new(),
            messages: HashMap::new(),
            committed: 0,
            handed_out: 0,
            next_message_id: 7_000_000_000_000_000_001,
            next_seq: 1,
            context_tokens: HashMap::new(),
            typing_tickets: HashMap::new(),
            client_ids: HashSet::new(),
            last_uin: None,
            modes: HashMap::new(),
            default_mode: Mode::Normal,
            login: Login::default(),
            records: Records::default(),
        }
    }

    // ----- controls used by the test through the handle -----

    pub fn set_bot_token(&mut self, token: Option<String>) {
        self.bot_token = token;
    }

    pub fn set_mode(&mut self, op: Option<&str>, mode: Mode) {
        match op {
            Some(op) => {
                self.modes.insert(op.to_owned(), mode);
            }
            None => {
                self.modes.clear();
                self.default_mode = mode;
            }
        }
    }

    pub fn mode_for(&self, op: &str) -> Mode {
        self.modes.get(op).cloned().unwrap_or_else(|| self.default_mode.clone())
    }

    pub fn set_login_script(&mut self, steps: Vec<LoginStep>) {
        self.login.script = steps.into();
        self.login.expected_host = None;
        self.login.wrong_codes = 0;
    }

    pub fn revoke_context_tokens(&mut self, user: &str) {
        for token in self.context_tokens.values_mut().filter(|t| t.user == user) {
            token.revoked = true;
        }
    }

    /// Adds a user (or bot) message to the update stream.
    pub fn push(&mut self, message: UserMessage) -> Pushed {
        let message_id = self.next_message_id;
        self.next_message_id += 1;
        let seq = self.next_seq;
        self.next_seq += 1;
        let context_token = format!("ctx-{}-{:016x}", seq, fastrand::u64(..));
        self.context_tokens.insert(
            context_token.clone(),
            ContextToken {
                user: message.from.clone(),
                uses: 0,
                revoked: false,
                issued: Instant::now(),
            },
        );
        let mut wire = json!({
            "seq": seq,
            "from_user_id": message.from,
            "to_user_id": self.options.bot_id,
            "client_id": message.client_id.clone().unwrap_or_else(|| format!("wx-client-{seq}")),
            "create_time_ms": message.create_time_ms.unwrap_or_else(now_ms),
            "session_id": format!("session-{}", message.from),
            "message_type": message.message_type,
            "message_state": message.message_state,
            "context_token": context_token,
            "item_list": message.items,
        });
        if message.with_message_id {
            wire["message_id"] = json!(message_id);
        }
        if let Some(group) = &message.group_id {
            wire["group_id"] = json!(group);
        }
        self.messages.insert(message_id, wire.clone());
        self.deliveries.push(wire);
        Pushed { message_id, seq, context_token }
    }

    /// A context token for `user` as if they had written before the test began.
    pub fn issue_context_token(&mut self, user: &str) -> String {
        let token = format!("ctx-earlier-{:016x}", fastrand::u64(..));
        let issued = Instant::now();
        let known = ContextToken { user: user.to_owned(), uses: 0, revoked: false, issued };
        self.context_tokens.insert(token.clone(), known);
        token
    }

    /// Offers a pushed message again, exactly as first sent.
    pub fn replay(&mut self, message_id: u64) -> bool {
        match self.messages.get(&message_id) {
            Some(wire) => {
                self.deliveries.push(wire.clone());
                true
            }
            None => false,
        }
    }

    /// Offers every message handed out so far again, in order; returns how many.
    pub fn replay_handed_out(&mut self) -> usize {
        let again: Vec<Value> = self.deliveries[..self.handed_out].to_vec();
        let count = again.len();
        self.deliveries.extend(again);
        count
    }

    // ----- requests -----

    pub fn record(&mut self, incoming: &Incoming) {
        let mut headers: Vec<(String, String)> =
            incoming.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        headers.sort();
        self.records.requests.push(RecordedRequest {
            op: incoming.op.clone(),
            method: incoming.method.clone(),
            query: incoming.query.clone(),
            host: incoming.header("host").map(str::to_owned),
            headers,
            body: incoming.body.clone(),
            at: Instant::now(),
        });
    }

    fn violation(&mut self, what: String) {
        self.records.violations.push(what);
    }

    /// Records each problem as a violation; any problem refuses the request with HTTP 400.
    fn refuse_problems(&mut self, op: &str, problems: Vec<String>) -> Result<(), Answer> {
        let Some(first) = problems.first().cloned() else { return Ok(()) };
        for problem in problems {
            self.violation(format!("{op}: {problem}"));
        }
        Err(Answer::Status(400, format!("bad request: {first}")))
    }

    /// Checks what every request must carry; `Err` is the answer to send instead.
    pub fn check(&mut self, incoming: &Incoming) -> Result<(), Answer> {
        let op = incoming.op.clone();
        self.refuse_problems(&op, common_header_problems(incoming))?;
        if incoming.body_invalid {
            self.violation(format!("{op}: the body is not JSON"));
            return Err(Answer::Status(400, "bad request: body is not JSON".into()));
        }
        match op.as_str() {
            "get_qrcode_status" => {
                if incoming.method != "GET" {
                    self.violation(format!("{op}: method {} (expected GET)", incoming.method));
                    return Err(Answer::Status(405, "method not allowed".into()));
                }
                Ok(())
            }
            "get_bot_qrcode" => {
                if incoming.method != "POST" {
                    self.violation(format!("{op}: method {} (expected POST)", incoming.method));
                    return Err(Answer::Status(405, "method not allowed".into()));
                }
                Ok(())
            }
            _ => self.check_bot_request(incoming),
        }
    }

    fn check_bot_request(&mut self, incoming: &Incoming) -> Result<(), Answer> {
        let op = incoming.op.clone();
        if incoming.method != "POST" {
            self.violation(format!("{op}: method {} (expected POST)", incoming.method));
            return Err(Answer::Status(405, "method not allowed".into()));
        }
        self.refuse_problems(&op, bot_header_problems(incoming))?;
        let uin = incoming.header("x-wechat-uin").map(str::to_owned);
        if uin.is_some() && uin == self.last_uin {
            self.violation(format!("{op}: X-WECHAT-UIN repeated (it is new per request)"));
        }
        self.last_uin = uin;
        if incoming.body.get("base_info").and_then(|b| b.get("channel_version")).is_none() {
            // Observability only on the real server: recorded, not refused.
            self.violation(format!("{op}: body without base_info.channel_version"));
        }
        let presented = incoming.header("authorization").and_then(|v| v.strip_prefix("Bearer "));
        let valid = matches!((presented, &self.bot_token), (Some(p), Some(t)) if p == t);
        if !valid {
            return Err(Answer::Json(session_expired(&op)));
        }
        Ok(())
    }

    /// Answers everything except `getupdates`.
    pub fn answer(&mut self, incoming: &Incoming) -> Answer {
        match incoming.op.as_str() {
            "sendmessage" => self.send_message(&incoming.body),
            "getconfig" => self.get_config(&incoming.body),
            "sendtyping" => self.send_typing(&incoming.body),
            "msg/notifystart" | "msg/notifystop" => {
                self.records.notifications.push(incoming.op.clone());
                Answer::Json(json!({"ret": 0, "errmsg": ""}))
            }
            "get_bot_qrcode" => self.get_bot_qrcode(incoming),
            "get_qrcode_status" => self.get_qrcode_status(incoming),
            other => {
                self.violation(format!("unknown operation {other}"));
                Answer::Status(404, "not found".into())
            }
        }
    }

    /// One look at the update stream for a `getupdates` body. `None`: nothing to return
    /// yet, hold the request. At the deadline an empty answer is returned.
    pub fn poll_updates(&mut self, body: &Value, deadline_passed: bool) -> Option<Value> {
        let offset = match body.get("get_updates_buf") {
            Some(Value::String(cursor)) if cursor.is_empty() => self.committed,
            Some(Value::String(cursor)) => match self.decode_cursor(cursor) {
                Some(offset) => offset,
                None => {
                    self.records.cursor_resets += 1;
                    self.committed
                }
            },
            _ => {
                self.violation("getupdates: body without get_updates_buf".into());
                self.committed
            }
        };
        self.committed = self.committed.max(offset);
        let available = self.deliveries.len().saturating_sub(offset);
        if available == 0 && !deadline_passed {
            return None;
        }
        let take = available.min(self.options.batch_limit.max(1));
        let msgs: Vec<Value> = self.deliveries[offset..offset + take].to_vec();
        let next = offset + take;
        self.handed_out = self.handed_out.max(next);
        self.records.batches_handed_out += usize::from(take > 0);
        Some(json!({
            "ret": 0,
            "msgs": msgs,
            "get_updates_buf": self.encode_cursor(next),
            // The legacy alias older servers still send; clients ignore it.
            "sync_buf": self.encode_cursor(next),
            "longpolling_timeout_ms": self.options.advertised_timeout.as_millis() as u64,
        }))
    }

    fn encode_cursor(&self, offset: usize) -> String {
        BASE64.encode(json!({"n": self.nonce, "o": offset}).to_string())
    }

    fn decode_cursor(&self, cursor: &str) -> Option<usize> {
        let raw = BASE64.decode(cursor).ok()?;
        let value: Value = serde_json::from_slice(&raw).ok()?;
        if value.get("n")?.as_u64()? != self.nonce {
            return None;
        }
        let offset = usize::try_from(value.get("o")?.as_u64()?).ok()?;
        (offset <= self.deliveries.len()).then_some(offset)
    }

    fn send_message(&mut self, body: &Value) -> Answer {
        let Some(msg) = body.get("msg").filter(|m| m.is_object()) else {
            self.violation("sendmessage: body without msg".into());
            return Answer::Json(json!({"ret": -1, "errmsg": "invalid msg"}));
        };
        let to = str_field(msg, "to_user_id");
        let client_id = str_field(msg, "client_id");
        let context_token = msg.get("context_token").and_then(Value::as_str).map(str::to_owned);
        let items = msg.get("item_list").and_then(Value::as_array).cloned().unwrap_or_default();
        self.check_outgoing(msg, &client_id, &items);
        if to.is_empty() {
            self.violation("sendmessage: msg without to_user_id".into());
            return Answer::Json(json!({"ret": -1, "errmsg": "invalid to_user_id"}));
        }
        let refusal = match context_token.as_deref().filter(|t| !t.is_empty()) {
            None => Some("no context_token"),
            Some(token) => match self.context_tokens.get_mut(token) {
                None => Some("unknown context_token"),
                Some(known) if known.user != to => Some("context_token of another user"),
                Some(known) if known.revoked => Some("context_token expired"),
                Some(known) if known.issued.elapsed() > self.options.context_token_ttl => {
                    Some("context_token expired")
                }
                Some(known) if known.uses >= self.options.context_token_uses => {
                    Some("context_token used up")
                }
                Some(known) => {
                    known.uses += 1;
                    None
                }
            },
        };
        if let Some(reason) = refusal {
            self.records.refused.push(RefusedSend {
                to_user_id: to,
                client_id,
                context_token,
                ret: CONTEXT_REFUSED,
                reason: reason.to_owned(),
            });
            // The real server explains a used-up token as often as not with nothing at all.
            let errmsg = if reason == "context_token used up" { "prepare failed" } else { "" };
            return Answer::Json(json!({"ret": CONTEXT_REFUSED, "errmsg": errmsg}));
        }
        let item = items.first().cloned().unwrap_or(Value::Null);
        let text = item
            .get("text_item")
            .and_then(|t| t.get("text"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        self.records.sent.push(SentMessage {
            to_user_id: to,
            client_id,
            context_token: context_token.unwrap_or_default(),
            text,
            item,
            at: Instant::now(),
        });
        Answer::Json(json!({"ret": 0, "errmsg": ""}))
    }

    /// What the official client always does with an outgoing message; anything else is
    /// recorded (the server's reaction to it is not documented).
    fn check_outgoing(&mut self, msg: &Value, client_id: &str, items: &[Value]) {
        if msg.get("message_type").and_then(Value::as_i64) != Some(2) {
            self.violation("sendmessage: message_type is not 2 (bot)".into());
        }
        if msg.get("message_state").and_then(Value::as_i64) != Some(2) {
            self.violation("sendmessage: message_state is not 2 (finished)".into());
        }
        if client_id.is_empty() {
            self.violation("sendmessage: msg without client_id".into());
        } else if !self.client_ids.insert(client_id.to_owned()) {
            self.violation(format!("sendmessage: client_id {client_id} used twice"));
        }
        if items.len() != 1 {
            self.violation(format!("sendmessage: {} items (one per request)", items.len()));
        }
        for item in items {
            if let Some(text) = item.get("text_item").and_then(|t| t.get("text")) {
                let chars = text.as_str().map_or(0, |t| t.chars().count());
                if chars > MAX_TEXT_CHARS {
                    self.violation(format!("sendmessage: text of {chars} characters"));
                }
            }
        }
    }

    fn get_config(&mut self, body: &Value) -> Answer {
        let user = str_field(body, "ilink_user_id");
        if user.is_empty() {
            self.violation("getconfig: body without ilink_user_id".into());
            return Answer::Json(json!({"ret": -1, "errmsg": "invalid ilink_user_id"}));
        }
        let ticket = BASE64.encode(fastrand::u128(..).to_be_bytes());
        self.typing_tickets.insert(ticket.clone(), user.clone());
        self.records.configs.push(user);
        Answer::Json(json!({"ret": 0, "errmsg": "", "typing_ticket": ticket}))
    }

    fn send_typing(&mut self, body: &Value) -> Answer {
        let user = str_field(body, "ilink_user_id");
        let ticket = str_field(body, "typing_ticket");
        let status = body.get("status").and_then(Value::as_i64).unwrap_or(0);
        if self.typing_tickets.get(&ticket) != Some(&user) {
            self.violation(format!("sendtyping: ticket not issued to {user:?}"));
            return Answer::Json(json!({"ret": -1, "errmsg": "invalid typing_ticket"}));
        }
        if !matches!(status, 1 | 2) {
            self.violation(format!("sendtyping: status {status} (1 typing, 2 cancel)"));
            return Answer::Json(json!({"ret": -1, "errmsg": "invalid status"}));
        }
        self.records.typing.push(TypingEvent { user, status, at: Instant::now() });
        Answer::Json(json!({"ret": 0, "errmsg": ""}))
    }

    fn get_bot_qrcode(&mut self, incoming: &Incoming) -> Answer {
        if incoming.query.get("bot_type").map(String::as_str) != Some("3") {
            self.violation("get_bot_qrcode: bot_type is not 3".into());
        }
        let tokens: Vec<String> = match incoming.body.get("local_token_list") {
            Some(Value::Array(list)) => {
                list.iter().filter_map(Value::as_str).map(str::to_owned).collect()
            }
            _ => {
                self.violation("get_bot_qrcode: body without local_token_list".into());
                Vec::new()
            }
        };
        if tokens.len() > 10 {
            self.violation(format!("get_bot_qrcode: {} local tokens (at most 10)", tokens.len()));
        }
        self.records.local_token_lists.push(tokens);
        self.login.issued += 1;
        let qrcode = format!("qr-{}-{:08x}", self.login.issued, fastrand::u32(..));
        if let Some(old) = self.login.current.replace(qrcode.clone()) {
            self.login.dead.insert(old);
        }
        self.login.wrong_codes = 0;
        let image = format!("https://liteapp.weixin.qq.com/q/fake?qrcode={qrcode}&bot_type=3");
        Answer::Json(json!({"qrcode": qrcode, "qrcode_img_content": image}))
    }

    fn get_qrcode_status(&mut self, incoming: &Incoming) -> Answer {
        let qrcode = incoming.query.get("qrcode").cloned().unwrap_or_default();
        if self.login.current.as_deref() != Some(qrcode.as_str()) {
            if self.login.dead.contains(&qrcode) {
                self.violation(format!("get_qrcode_status: polled the dead QR code {qrcode}"));
            } else {
                self.violation(format!("get_qrcode_status: unknown QR code {qrcode:?}"));
            }
            return Answer::Json(json!({"status": "expired"}));
        }
        if let Some(expected) = &self.login.expected_host {
            let host = incoming.header("host").unwrap_or_default().to_owned();
            if &host != expected {
                let expected = expected.clone();
                self.violation(format!(
                    "get_qrcode_status: polled {host} after the redirect to {expected}"
                ));
            }
        }
        let verify_code = incoming.query.get("verify_code").cloned();
        let Some(step) = self.login.script.front().cloned() else {
            return Answer::Json(json!({"status": "wait"}));
        };
        let status = match step {
            LoginStep::NeedVerifyCode { code } => match verify_code {
                Some(given) if given == code => {
                    self.login.script.pop_front();
                    self.login.wrong_codes = 0;
                    json!({"status": "scaned"})
                }
                Some(_) => {
                    self.login.wrong_codes += 1;
                    if self.login.wrong_codes >= MAX_WRONG_CODES {
                        self.login.script.pop_front();
                        self.kill_current_qr();
                        json!({"status": "verify_code_blocked"})
                    } else {
                        json!({"status": "need_verifycode"})
                    }
                }
                None => json!({"status": "need_verifycode"}),
            },
            other => {
                self.login.script.pop_front();
                self.status_of(other)
            }
        };
        Answer::Json(status)
    }

    fn status_of(&mut self, step: LoginStep) -> Value {
        match step {
            LoginStep::Wait => json!({"status": "wait"}),
            LoginStep::Scaned => json!({"status": "scaned"}),
            LoginStep::Expired => {
                self.kill_current_qr();
                json!({"status": "expired"})
            }
            LoginStep::VerifyCodeBlocked => {
                self.kill_current_qr();
                json!({"status": "verify_code_blocked"})
            }
            LoginStep::ScanedButRedirect { host } => {
                self.login.expected_host = Some(host.clone());
                json!({"status": "scaned_but_redirect", "redirect_host": host})
            }
            LoginStep::BindedRedirect => {
                self.kill_current_qr();
                json!({"status": "binded_redirect"})
            }
            LoginStep::Confirmed { bot_token, bot_id, user_id, base_url } => {
                self.kill_current_qr();
                self.bot_token = Some(bot_token.clone());
                json!({
                    "status": "confirmed",
                    "bot_token": bot_token,
                    "ilink_bot_id": bot_id,
                    "baseurl": base_url.unwrap_or_else(|| self.base_url.clone()),
                    "ilink_user_id": user_id,
                })
            }
            LoginStep::NeedVerifyCode { .. } => json!({"status": "need_verifycode"}),
        }
    }

    fn kill_current_qr(&mut self) {
        if let Some(old) = self.login.current.take() {
            self.login.dead.insert(old);
        }
        self.login.expected_host = None;
    }
}

/// The `-14` answer: `getupdates` carries it in `ret` and `errcode`, `sendmessage` in the
/// gateway's alternate envelope (`errcode` only), the rest in `ret`.
fn session_expired(op: &str) -> Value {
    match op {
        "getupdates" => {
            json!({"ret": SESSION_EXPIRED, "errcode": SESSION_EXPIRED, "errmsg": "session timeout"})
        }
        "sendmessage" => json!({"errcode": SESSION_EXPIRED, "errmsg": ""}),
        _ => json!({"ret": SESSION_EXPIRED, "errmsg": "session timeout"}),
    }
}

/// Headers every iLink request carries, authenticated or not.
fn common_header_problems(incoming: &Incoming) -> Vec<String> {
    let mut problems = Vec::new();
    if incoming.header("ilink-app-id").is_none_or(str::is_empty) {
        problems.push("no iLink-App-Id header".to_owned());
    }
    match incoming.header("ilink-app-clientversion").map(str::parse::<u32>) {
        Some(Ok(version)) if version <= 0x00FF_FFFF => {}
        Some(_) => problems.push("iLink-App-ClientVersion is not a 0x00MMNNPP number".to_owned()),
        None => problems.push("no iLink-App-ClientVersion header".to_owned()),
    }
    problems
}

/// Headers of an authenticated bot POST (the token itself is checked separately).
fn bot_header_problems(incoming: &Incoming) -> Vec<String> {
    let mut problems = Vec::new();
    if !incoming.header("content-type").is_some_and(|v| v.starts_with("application/json")) {
        problems.push("Content-Type is not application/json".to_owned());
    }
    if incoming.header("authorizationtype") != Some("ilink_bot_token") {
        problems.push("AuthorizationType is not ilink_bot_token".to_owned());
    }
    let uin = incoming
        .header("x-wechat-uin")
        .and_then(|v| BASE64.decode(v).ok())
        .and_then(|raw| String::from_utf8(raw).ok())
        .and_then(|decimal| decimal.parse::<u32>().ok());
    if uin.is_none() {
        problems.push("X-WECHAT-UIN is not base64 of a decimal u32".to_owned());
    }
    problems
}

fn str_field(value: &Value, name: &str) -> String {
    value.get(name).and_then(Value::as_str).unwrap_or_default().to_owned()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
