//! `channeld-wechat login`: the QR login. Fetch a QR code (`get_bot_qrcode`), show it in the
//! terminal with its URL, poll `get_qrcode_status` through every status — a scan, a
//! verification code typed from the phone, a redirect to another host, an expired or blocked
//! code (a new one, at most [`MAX_QR_CODES`]), "already bound" — and store the confirmed bot
//! token, bot id, user id and base URL in the state directory.
//!
//! [`LoginMachine`] decides what each answer means without I/O; [`login`] runs it.

use std::io::Write;
use std::time::{Duration, Instant};

use channeld_driver_sdk::Secret;

use crate::client::{CallError, IlinkClient};
use crate::config::{self, LoginConfig};
use crate::ilink::{QrStatus, QrStatusResponse};
use crate::state::{StateDir, StateError, StoredLogin};

/// QR codes one login may go through (the official client's limit).
pub const MAX_QR_CODES: u32 = 3;
/// Pause between status polls that returned at once.
pub const POLL_PAUSE: Duration = Duration::from_secs(1);
/// Client timeout of one status poll (the server holds it).
pub const POLL_TIMEOUT: Duration = Duration::from_secs(35);
/// Timeout of the QR code request.
pub const QR_TIMEOUT: Duration = Duration::from_secs(15);
/// The whole login gives up after this.
pub const LOGIN_DEADLINE: Duration = Duration::from_secs(480);
/// Polls in a row that fail (network, unreadable or unknown answers) before giving up.
pub const MAX_POLL_ERRORS: u32 = 10;

/// What a confirmed login returned.
#[derive(Debug, Clone)]
pub struct Confirmed {
    pub token: Secret,
    pub bot_id: String,
    pub user_id: Option<String>,
    /// A valid `http(s)` base URL, when the server named one.
    pub base_url: Option<String>,
}

/// What to do after a status answer.
#[derive(Debug, Clone)]
pub enum Step {
    /// Poll again after this pause.
    Poll {
        after: Duration,
    },
    /// Ask the person for the code their phone shows (`again`: the last one was wrong).
    AskCode {
        again: bool,
    },
    /// The QR code is dead: fetch and show a new one.
    NewQrCode,
    Confirmed(Confirmed),
    /// The bot is already bound to this host: no new credentials.
    AlreadyBound,
    Fail(String),
}

/// The login's decisions.
#[derive(Debug)]
pub struct LoginMachine {
    initial_base: String,
    /// Where status polls go (a redirect moves it).
    pub base: String,
    qr_codes: u32,
    code_sent: bool,
    errors: u32,
}

impl LoginMachine {
    pub fn new(base: &str) -> Self {
        Self {
            initial_base: base.to_owned(),
            base: base.to_owned(),
            qr_codes: 1,
            code_sent: false,
            errors: 0,
        }
    }

    /// The next poll carries a verification code.
    pub fn code_sent(&mut self) {
        self.code_sent = true;
    }

    /// A poll failed (network, timeout, unreadable answer).
    pub fn on_error(&mut self, error: &CallError) -> Step {
        self.errors += 1;
        if self.errors >= MAX_POLL_ERRORS {
            return Step::Fail(format!("{MAX_POLL_ERRORS} status polls in a row failed: {error}"));
        }
        Step::Poll { after: POLL_PAUSE }
    }

    pub fn on_status(&mut self, answer: QrStatusResponse) -> Step {
        let Some(status) = answer.status.as_deref().map(QrStatus::parse) else {
            return self.odd("an answer without a status");
        };
        match status {
            QrStatus::Wait => self.ok(Step::Poll { after: POLL_PAUSE }),
            QrStatus::Scanned => {
                self.code_sent = false;
                self.ok(Step::Poll { after: POLL_PAUSE })
            }
            QrStatus::NeedVerifyCode => {
                let again = std::mem::take(&mut self.code_sent);
                self.ok(Step::AskCode { again })
            }
            QrStatus::Expired | QrStatus::VerifyCodeBlocked => {
                self.errors = 0;
                self.code_sent = false;
                self.qr_codes += 1;
                if self.qr_codes > MAX_QR_CODES {
                    let why = if status == QrStatus::Expired {
                        "expired"
                    } else {
                        "was blocked after wrong verification codes"
                    };
                    return Step::Fail(format!(
                        "the QR code {why} {MAX_QR_CODES} times; run the login again"
                    ));
                }
                self.base = self.initial_base.clone();
                Step::NewQrCode
            }
            QrStatus::ScannedButRedirect => {
                match answer.redirect_host.as_deref().filter(|host| valid_host(host)) {
                    Some(host) => {
                        // Same scheme as the configured base: https in production, http
                        // against a local test server.
                        let scheme = self.initial_base.split("://").next().unwrap_or("https");
                        self.base = format!("{scheme}://{host}");
                        self.ok(Step::Poll { after: Duration::ZERO })
                    }
                    None => self.ok(Step::Poll { after: POLL_PAUSE }),
                }
            }
            QrStatus::AlreadyBound => Step::AlreadyBound,
            QrStatus::Confirmed => {
                let token = answer.bot_token.map(|t| t.0).filter(|t| !t.is_empty());
                let bot_id = answer.ilink_bot_id.filter(|id| !id.is_empty());
                let (Some(token), Some(bot_id)) = (token, bot_id) else {
                    return Step::Fail(
                        "the login was confirmed without a bot token or bot id".into(),
                    );
                };
                let base_url = answer
                    .baseurl
                    .as_deref()
                    .and_then(|url| config::base_url(Some(url), config::VAR_BASE_URL, "").ok());
                Step::Confirmed(Confirmed {
                    token: Secret::new(token),
                    bot_id,
                    user_id: answer.ilink_user_id.filter(|id| !id.is_empty()),
                    base_url,
                })
            }
            QrStatus::Other(other) => self.odd(&format!("the unknown status {other:?}")),
        }
    }

    fn ok(&mut self, step: Step) -> Step {
        self.errors = 0;
        step
    }

    fn odd(&mut self, what: &str) -> Step {
        self.errors += 1;
        if self.errors >= MAX_POLL_ERRORS {
            return Step::Fail(format!("the server kept answering {what}"));
        }
        Step::Poll { after: POLL_PAUSE }
    }
}

/// `host` or `host:port`, nothing else.
fn valid_host(host: &str) -> bool {
    !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
}

/// How a login ended.
#[derive(Debug)]
pub enum LoginOutcome {
    LoggedIn(StoredLogin),
    /// Already bound; the stored login stays.
    AlreadyBound(StoredLogin),
}

/// Why the login failed. Never contains a token or a QR code.
#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("{0}")]
    Call(#[from] CallError),
    #[error("{0}")]
    State(#[from] StateError),
    #[error("login failed: {0}")]
    Failed(String),
    #[error(
        "the server says this WeChat account is already bound to the bot, but {0} holds no login: unbind the bot in WeChat or use its existing token"
    )]
    BoundWithoutLogin(String),
    #[error("cannot talk to the terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

/// Runs the QR login, writing instructions to `out` and asking `ask_code` (given the
/// prompt) for verification codes; stores the result in the state directory.
pub async fn login(
    client: &IlinkClient,
    config: &LoginConfig,
    out: &mut dyn Write,
    ask_code: &mut dyn FnMut(&str) -> std::io::Result<Option<String>>,
) -> Result<LoginOutcome, LoginError> {
    let state = StateDir::open(&config.state_dir)?;
    let previous = state.load_login()?;
    let local_tokens: Vec<&str> = previous
        .iter()
        .flat_map(|p| {
            std::iter::once(p.bot_token.as_str())
                .chain(p.previous_tokens.iter().map(String::as_str))
        })
        .collect();
    let mut machine = LoginMachine::new(&config.base_url);
    let mut qrcode = show_new_code(client, &config.base_url, &local_tokens, out).await?;
    let mut verify_code: Option<String> = None;
    let mut scanned_shown = false;
    let deadline = Instant::now() + LOGIN_DEADLINE;
    loop {
        if Instant::now() >= deadline {
            return Err(LoginError::Failed(format!(
                "nobody confirmed the login within {} minutes",
                LOGIN_DEADLINE.as_secs() / 60
            )));
        }
        let polled =
            client.qr_status(&machine.base, &qrcode, verify_code.as_deref(), POLL_TIMEOUT).await;
        let step = match polled {
            Ok(answer) => {
                if answer.status.as_deref() == Some("scaned") && !scanned_shown {
                    writeln!(out, "Scanned. Confirm the login on the phone.")?;
                    scanned_shown = true;
                }
                machine.on_status(answer)
            }
            // The server holds the poll; a client timeout just means "still waiting".
            Err(CallError::Timeout { .. }) => Step::Poll { after: Duration::ZERO },
            Err(err) => machine.on_error(&err),
        };
        verify_code = None;
        match step {
            Step::Poll { after } => tokio::time::sleep(after).await,
            Step::AskCode { again } => {
                let prompt = if again {
                    "That code did not match. Enter the number shown on the phone: "
                } else {
                    "Enter the number shown on the phone: "
                };
                match ask_code(prompt)? {
                    Some(code) if !code.trim().is_empty() => {
                        verify_code = Some(code.trim().to_owned());
                        machine.code_sent();
                    }
                    _ => return Err(LoginError::Failed("no verification code was entered".into())),
                }
            }
            Step::NewQrCode => {
                writeln!(out, "The QR code is no longer valid; here is a new one.")?;
                scanned_shown = false;
                qrcode = show_new_code(client, &config.base_url, &local_tokens, out).await?;
            }
            Step::AlreadyBound => {
                return match previous {
                    Some(stored) => {
                        writeln!(
                            out,
                            "This WeChat account is already bound to the bot; the stored login stays valid."
                        )?;
                        Ok(LoginOutcome::AlreadyBound(stored))
                    }
                    None => {
                        Err(LoginError::BoundWithoutLogin(config.state_dir.display().to_string()))
                    }
                };
            }
            Step::Confirmed(confirmed) => {
                let stored = stored_login(confirmed, previous);
                state.save_login(&stored)?;
                writeln!(
                    out,
                    "Logged in as bot {}{}. Stored in {}.",
                    stored.bot_id,
                    stored
                        .user_id
                        .as_deref()
                        .map(|u| format!(" (bound by {u})"))
                        .unwrap_or_default(),
                    state.file(crate::state::LOGIN_FILE).display()
                )?;
                return Ok(LoginOutcome::LoggedIn(stored));
            }
            Step::Fail(reason) => return Err(LoginError::Failed(reason)),
        }
    }
}

/// The new login, remembering earlier tokens (newest first) for the next QR request.
fn stored_login(confirmed: Confirmed, previous: Option<StoredLogin>) -> StoredLogin {
    let token = confirmed.token.expose().to_owned();
    let mut previous_tokens: Vec<String> = previous
        .map(|p| std::iter::once(p.bot_token).chain(p.previous_tokens).collect())
        .unwrap_or_default();
    previous_tokens.retain(|old| *old != token);
    previous_tokens.dedup();
    previous_tokens.truncate(crate::ilink::MAX_LOCAL_TOKENS - 1);
    StoredLogin {
        bot_token: token,
        bot_id: confirmed.bot_id,
        user_id: confirmed.user_id,
        base_url: confirmed.base_url,
        saved_at_ms: now_ms(),
        previous_tokens,
    }
}

async fn show_new_code(
    client: &IlinkClient,
    base: &str,
    local_tokens: &[&str],
    out: &mut dyn Write,
) -> Result<String, LoginError> {
    let (qrcode, content) = client.qr_code(base, local_tokens, QR_TIMEOUT).await?;
    writeln!(out, "Scan this QR code with WeChat on the phone of the bot's owner:\n")?;
    if let Some(picture) = render_qr(&content) {
        writeln!(out, "{picture}")?;
    }
    writeln!(out, "If the code does not show or scan, open this link: {content}")?;
    Ok(qrcode)
}

/// The QR code as text for a dark terminal (light modules drawn as blocks).
pub fn render_qr(content: &str) -> Option<String> {
    use qrcode::render::unicode::Dense1x2;
    let code = qrcode::QrCode::new(content.as_bytes()).ok()?;
    Some(
        code.render::<Dense1x2>()
            .dark_color(Dense1x2::Light)
            .light_color(Dense1x2::Dark)
            .quiet_zone(true)
            .build(),
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn answer(value: serde_json::Value) -> QrStatusResponse {
        serde_json::from_value(value).unwrap()
    }

    fn status(raw: &str) -> QrStatusResponse {
        answer(json!({ "status": raw }))
    }

    #[test]
    fn waiting_and_scanning_keep_polling() {
        let mut machine = LoginMachine::new("https://ilinkai.weixin.qq.com");
        assert!(
            matches!(machine.on_status(status("wait")), Step::Poll { after } if after == POLL_PAUSE)
        );
        assert!(matches!(machine.on_status(status("scaned")), Step::Poll { .. }));
    }

    #[test]
    fn a_verification_code_is_asked_for_again_only_after_a_wrong_one() {
        let mut machine = LoginMachine::new("https://x");
        assert!(matches!(
            machine.on_status(status("need_verifycode")),
            Step::AskCode { again: false }
        ));
        machine.code_sent();
        assert!(matches!(
            machine.on_status(status("need_verifycode")),
            Step::AskCode { again: true }
        ));
        machine.code_sent();
        assert!(matches!(machine.on_status(status("scaned")), Step::Poll { .. }), "accepted");
    }

    #[test]
    fn a_redirect_moves_polling_to_the_named_host_with_the_same_scheme() {
        let mut machine = LoginMachine::new("http://127.0.0.1:4000");
        let step = machine.on_status(answer(
            json!({"status": "scaned_but_redirect", "redirect_host": "localhost:4000"}),
        ));
        assert!(matches!(step, Step::Poll { after } if after.is_zero()));
        assert_eq!(machine.base, "http://localhost:4000");
        let bad = machine.on_status(answer(
            json!({"status": "scaned_but_redirect", "redirect_host": "evil/x@y"}),
        ));
        assert!(matches!(bad, Step::Poll { .. }));
        assert_eq!(machine.base, "http://localhost:4000", "an unusable host is ignored");
    }

    #[test]
    fn dead_codes_are_replaced_up_to_the_limit_and_reset_the_redirect() {
        let mut machine = LoginMachine::new("https://a");
        machine.on_status(answer(json!({"status": "scaned_but_redirect", "redirect_host": "b"})));
        assert!(matches!(machine.on_status(status("expired")), Step::NewQrCode));
        assert_eq!(machine.base, "https://a");
        assert!(matches!(machine.on_status(status("verify_code_blocked")), Step::NewQrCode));
        match machine.on_status(status("expired")) {
            Step::Fail(reason) => assert!(reason.contains("3 times"), "{reason}"),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn a_confirmation_needs_a_token_and_a_bot_id() {
        let mut machine = LoginMachine::new("https://a");
        let confirmed = machine.on_status(answer(json!({
            "status": "confirmed", "bot_token": "t", "ilink_bot_id": "b@im.bot",
            "ilink_user_id": "u@im.wechat", "baseurl": "https://idc2.example/"
        })));
        let Step::Confirmed(confirmed) = confirmed else { panic!("not confirmed") };
        assert_eq!(confirmed.token.expose(), "t");
        assert_eq!(confirmed.bot_id, "b@im.bot");
        assert_eq!(confirmed.base_url.as_deref(), Some("https://idc2.example"));
        let odd_url = LoginMachine::new("https://a").on_status(answer(json!({
            "status": "confirmed", "bot_token": "t", "ilink_bot_id": "b", "baseurl": "ftp://x"
        })));
        assert!(matches!(odd_url, Step::Confirmed(Confirmed { base_url: None, .. })));
        let missing =
            LoginMachine::new("https://a").on_status(answer(json!({"status": "confirmed"})));
        assert!(matches!(missing, Step::Fail(_)));
        assert!(matches!(
            LoginMachine::new("https://a").on_status(status("binded_redirect")),
            Step::AlreadyBound
        ));
    }

    #[test]
    fn repeated_errors_or_unknown_answers_give_up() {
        let mut machine = LoginMachine::new("https://a");
        for _ in 1..MAX_POLL_ERRORS {
            assert!(matches!(machine.on_status(status("mystery")), Step::Poll { .. }));
        }
        assert!(matches!(machine.on_status(answer(json!({}))), Step::Fail(_)));
        let mut machine = LoginMachine::new("https://a");
        let err = CallError::Http { op: "x", status: 502 };
        for _ in 1..MAX_POLL_ERRORS {
            machine.on_error(&err);
        }
        assert!(
            matches!(machine.on_status(status("wait")), Step::Poll { .. }),
            "a good answer resets"
        );
        assert!(matches!(machine.on_error(&err), Step::Poll { .. }));
    }

    #[test]
    fn a_new_login_remembers_earlier_tokens_newest_first() {
        let previous = StoredLogin {
            bot_token: "t2".into(),
            bot_id: "b".into(),
            user_id: None,
            base_url: None,
            saved_at_ms: 1,
            previous_tokens: vec!["t1".into(), "t3".into()],
        };
        let confirmed = Confirmed {
            token: Secret::new("t3".into()),
            bot_id: "b".into(),
            user_id: None,
            base_url: None,
        };
        let stored = stored_login(confirmed, Some(previous));
        assert_eq!(stored.bot_token, "t3");
        assert_eq!(stored.previous_tokens, ["t2", "t1"]);
    }

    #[test]
    fn the_qr_code_renders_for_a_terminal() {
        let picture = render_qr("https://liteapp.weixin.qq.com/q/abc?qrcode=x&bot_type=3").unwrap();
        assert!(picture.lines().count() > 10);
        assert!(picture.contains('█') || picture.contains('▀') || picture.contains('▄'));
    }
}
