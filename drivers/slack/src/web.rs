//! The Slack Web API client: `POST <base><method>` with a bearer token, JSON bodies (form
//! bodies for the methods that take no JSON), and Slack's answer classified so callers know
//! whether the call certainly did nothing, may have done something, or should wait.
//!
//! Classification (what a caller may do next):
//! * [`CallError::Slack`]: HTTP 200 `{"ok":false,"error":code}`: Slack refused; nothing
//!   happened (except `internal_error`/`fatal_error`, which [`crate::convert::post_error`]
//!   treats as unknown).
//! * [`CallError::RateLimited`]: HTTP 429: not processed; wait `Retry-After` and call again.
//! * [`CallError::NotSent`]: the connection could not be made; nothing reached Slack.
//! * [`CallError::Unknown`]: the request may have reached Slack (timeout, connection lost,
//!   a 5xx, an unreadable answer): never retried blindly for posts.
//!
//! Tokens travel only in the `Authorization` header; errors never contain them.

use std::time::Duration;

use channeld_driver_sdk::Secret;
use channeld_driver_sdk::transport::http;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::wire::{self, ApiStatus};

/// `Retry-After` when Slack sends a 429 without one (what Slack's own SDKs assume).
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Why a Web API call did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error("slack error {0}")]
    Slack(String),
    #[error("rate limited for {0:?}")]
    RateLimited(Duration),
    #[error("cannot reach slack: {0}")]
    NotSent(String),
    #[error("no usable answer from slack: {0}")]
    Unknown(String),
}

impl CallError {
    /// Slack's error code, if Slack answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            CallError::Slack(code) => Some(code),
            _ => None,
        }
    }
}

/// Which token a call carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    /// The app-level token: `apps.connections.open` only.
    App,
    Bot,
}

/// The Web API with both tokens.
#[derive(Debug, Clone)]
pub struct WebApi {
    client: reqwest::Client,
    base: String,
    app_token: Secret,
    bot_token: Secret,
}

impl WebApi {
    /// `client` carries the timeouts; `base` ends in `/`.
    pub fn new(
        client: reqwest::Client,
        base: String,
        app_token: Secret,
        bot_token: Secret,
    ) -> Self {
        Self { client, base, app_token, bot_token }
    }

    fn request(&self, method: &str, token: Token) -> reqwest::RequestBuilder {
        let secret = match token {
            Token::App => &self.app_token,
            Token::Bot => &self.bot_token,
        };
        self.client.post(format!("{}{method}", self.base)).bearer_auth(secret.as_str())
    }

    /// A method with a JSON body (`application/json; charset=utf-8`, as Slack asks).
    pub async fn call<B: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        body: &B,
    ) -> Result<R, CallError> {
        let body = serde_json::to_vec(body).map_err(|err| CallError::NotSent(err.to_string()))?;
        let request = self
            .request(method, Token::Bot)
            .header(reqwest::header::CONTENT_TYPE, "application/json; charset=utf-8")
            .body(body);
        finish(request.send().await).await
    }

    /// A method with form arguments (Slack takes no JSON for reads such as `users.info`).
    pub async fn call_form<R: DeserializeOwned>(
        &self,
        method: &str,
        token: Token,
        form: &[(&str, &str)],
    ) -> Result<R, CallError> {
        finish(self.request(method, token).form(form).send().await).await
    }

    pub async fn auth_test(&self) -> Result<wire::AuthTest, CallError> {
        self.call_form("auth.test", Token::Bot, &[]).await
    }

    /// A fresh single-use Socket Mode URL.
    pub async fn connections_open(&self) -> Result<String, CallError> {
        let opened: wire::ConnectionsOpen =
            self.call_form("apps.connections.open", Token::App, &[]).await?;
        Ok(opened.url)
    }

    pub async fn users_info(&self, user: &str) -> Result<wire::UserInfo, CallError> {
        self.call_form("users.info", Token::Bot, &[("user", user)]).await
    }
}

/// Reads Slack's answer.
async fn finish<R: DeserializeOwned>(
    sent: reqwest::Result<reqwest::Response>,
) -> Result<R, CallError> {
    let response = sent.map_err(transport)?;
    let status = response.status();
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        let wait = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_RETRY_AFTER, Duration::from_secs);
        return Err(CallError::RateLimited(wait));
    }
    if !status.is_success() {
        return Err(CallError::Unknown(format!("HTTP {}", status.as_u16())));
    }
    let bytes = response.bytes().await.map_err(transport)?;
    let answer: ApiStatus = serde_json::from_slice(&bytes)
        .map_err(|err| CallError::Unknown(format!("unreadable answer: {err}")))?;
    if !answer.ok {
        return Err(CallError::Slack(answer.error.unwrap_or_else(|| "unknown_error".to_owned())));
    }
    serde_json::from_slice(&bytes)
        .map_err(|err| CallError::Unknown(format!("unexpected answer: {err}")))
}

/// A transport error: not sent when the connection was never made, unknown otherwise (the
/// kit's rule).
fn transport(err: reqwest::Error) -> CallError {
    let reached = http::reached(&err);
    // The URL is the configured base plus a method name: no secret, but keep it short.
    let text = error_chain(&err.without_url());
    match reached {
        http::Reached::No => CallError::NotSent(text),
        http::Reached::Maybe => CallError::Unknown(text),
    }
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
