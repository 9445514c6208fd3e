//! The iLink HTTP client: one method per operation, the official client's headers on every
//! request, and errors that say whether the server may have acted.
//!
//! The bot token travels only in the `Authorization` header (marked sensitive); errors carry
//! the operation and the HTTP status, never a URL (a QR status URL holds the QR code) or a
//! response body (a login answer holds the token).

use std::time::Duration;

use channeld_driver_sdk::transport::http::{self, HttpOptions, Reached, reqwest};
use channeld_driver_sdk::{Secret, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ilink::{
    self, BaseInfo, Failure, GetConfigRequest, GetConfigResponse, GetUpdatesRequest,
    GetUpdatesResponse, NotifyRequest, OutgoingMessage, QrCodeRequest, QrCodeResponse,
    QrStatusResponse, SendMessageRequest, SendTypingRequest, Status, header, op,
};

/// The largest answer read: a batch of messages is far smaller; more is a broken server, and
/// reading it whole would let it take the driver's memory.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Why a call did not succeed. [`CallError::may_have_acted`] tells a failure that certainly
/// changed nothing from one whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The request never reached the server (DNS, connect, TLS).
    #[error("{op}: cannot reach the server: {reason}")]
    Unreachable { op: &'static str, reason: String },
    /// No answer in time.
    #[error("{op}: no answer within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    /// The connection broke after the request was sent.
    #[error("{op}: the connection broke: {reason}")]
    Interrupted { op: &'static str, reason: String },
    /// An HTTP error status.
    #[error("{op}: HTTP {status}")]
    Http { op: &'static str, status: u16 },
    /// HTTP 200 with a body that is not the expected JSON.
    #[error("{op}: unreadable answer: {reason}")]
    Decode { op: &'static str, reason: String },
    /// HTTP 200 with a non-zero `ret`/`errcode`.
    #[error("{op}: refused with {failure}")]
    Refused { op: &'static str, failure: Failure },
}

impl CallError {
    /// Whether the server may have carried the request out despite the error.
    pub fn may_have_acted(&self) -> bool {
        match self {
            CallError::Unreachable { .. } | CallError::Refused { .. } => false,
            CallError::Timeout { .. }
            | CallError::Interrupted { .. }
            | CallError::Decode { .. } => true,
            // A gateway's 5xx can come after the backend acted; a 4xx is a refusal.
            CallError::Http { status, .. } => *status >= 500,
        }
    }

    /// `-14`: the bot token expired or is unknown.
    pub fn session_expired(&self) -> bool {
        matches!(self, CallError::Refused { failure, .. } if failure.session_expired())
    }

    /// The refusal, if the server answered with one.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            CallError::Refused { failure, .. } => Some(failure),
            _ => None,
        }
    }
}

/// Talks to one iLink deployment.
#[derive(Debug, Clone)]
pub struct IlinkClient {
    http: reqwest::Client,
    base_info: BaseInfo,
    client_version: String,
    route_tag: Option<String>,
}

impl IlinkClient {
    pub fn new(http: reqwest::Client, bot_agent: &str, route_tag: Option<String>) -> Self {
        let version = env!("CARGO_PKG_VERSION");
        Self {
            http,
            base_info: BaseInfo {
                channel_version: version.to_owned(),
                bot_agent: bot_agent.to_owned(),
            },
            client_version: ilink::client_version(version).to_string(),
            route_tag,
        }
    }

    /// One `getupdates` long poll. A client-side timeout is returned as
    /// [`CallError::Timeout`]; the caller treats it as an empty poll.
    pub async fn get_updates(
        &self,
        base: &str,
        token: &Secret,
        cursor: &str,
        timeout: Duration,
    ) -> Result<GetUpdatesResponse, CallError> {
        let body = GetUpdatesRequest { get_updates_buf: cursor, base_info: &self.base_info };
        let response: GetUpdatesResponse =
            self.post(base, op::GET_UPDATES, Some(token), &body, timeout).await?;
        refused(op::GET_UPDATES, &response.status)?;
        Ok(response)
    }

    /// Sends one text item.
    pub async fn send_text(
        &self,
        base: &str,
        token: &Secret,
        message: OutgoingMessage<'_>,
        timeout: Duration,
    ) -> Result<(), CallError> {
        let body = SendMessageRequest { msg: message, base_info: &self.base_info };
        let status: Status = self.post(base, op::SEND_MESSAGE, Some(token), &body, timeout).await?;
        refused(op::SEND_MESSAGE, &status)
    }

    /// A typing ticket for `user`.
    pub async fn get_config(
        &self,
        base: &str,
        token: &Secret,
        user: &str,
        context_token: Option<&str>,
        timeout: Duration,
    ) -> Result<String, CallError> {
        let body =
            GetConfigRequest { ilink_user_id: user, context_token, base_info: &self.base_info };
        let response: GetConfigResponse =
            self.post(base, op::GET_CONFIG, Some(token), &body, timeout).await?;
        refused(op::GET_CONFIG, &response.status)?;
        response
            .typing_ticket
            .filter(|t| !t.is_empty())
            .ok_or(CallError::Decode { op: op::GET_CONFIG, reason: "no typing_ticket".into() })
    }

    /// Typing on ([`ilink::TYPING_ON`]) or off ([`ilink::TYPING_OFF`]) for `user`.
    pub async fn send_typing(
        &self,
        base: &str,
        token: &Secret,
        user: &str,
        ticket: &str,
        status: i64,
        timeout: Duration,
    ) -> Result<(), CallError> {
        let body = SendTypingRequest {
            ilink_user_id: user,
            typing_ticket: ticket,
            status,
            base_info: &self.base_info,
        };
        let answer: Status = self.post(base, op::SEND_TYPING, Some(token), &body, timeout).await?;
        refused(op::SEND_TYPING, &answer)
    }

    /// `msg/notifystart` or `msg/notifystop`.
    pub async fn notify(
        &self,
        base: &str,
        token: &Secret,
        which: &'static str,
        timeout: Duration,
    ) -> Result<(), CallError> {
        let body = NotifyRequest { base_info: &self.base_info };
        let answer: Status = self.post(base, which, Some(token), &body, timeout).await?;
        refused(which, &answer)
    }

    /// A new login QR code: `(qrcode, what to display)`.
    pub async fn qr_code(
        &self,
        base: &str,
        local_tokens: &[&str],
        timeout: Duration,
    ) -> Result<(String, String), CallError> {
        let path = format!("{}?bot_type={}", op::GET_BOT_QRCODE, ilink::BOT_TYPE);
        let body = QrCodeRequest {
            local_token_list: local_tokens.iter().take(ilink::MAX_LOCAL_TOKENS).copied().collect(),
        };
        let response: QrCodeResponse =
            self.post_path(base, op::GET_BOT_QRCODE, &path, None, &body, timeout).await?;
        refused(op::GET_BOT_QRCODE, &response.status)?;
        match (response.qrcode, response.qrcode_img_content) {
            (Some(code), Some(image)) if !code.is_empty() && !image.is_empty() => Ok((code, image)),
            _ => Err(CallError::Decode { op: op::GET_BOT_QRCODE, reason: "no qrcode".into() }),
        }
    }

    /// One `get_qrcode_status` poll.
    pub async fn qr_status(
        &self,
        base: &str,
        qrcode: &str,
        verify_code: Option<&str>,
        timeout: Duration,
    ) -> Result<QrStatusResponse, CallError> {
        let mut url = Url::parse(&format!("{base}/{}", op::GET_QRCODE_STATUS)).map_err(|err| {
            CallError::Unreachable { op: op::GET_QRCODE_STATUS, reason: format!("bad URL: {err}") }
        })?;
        url.query_pairs_mut().append_pair("qrcode", qrcode);
        if let Some(code) = verify_code {
            url.query_pairs_mut().append_pair("verify_code", code);
        }
        let request = self.common(self.http.get(url)).timeout(timeout);
        self.read(op::GET_QRCODE_STATUS, request, timeout).await
    }

    async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        base: &str,
        op: &'static str,
        token: Option<&Secret>,
        body: &B,
        timeout: Duration,
    ) -> Result<R, CallError> {
        self.post_path(base, op, op, token, body, timeout).await
    }

    async fn post_path<B: Serialize, R: DeserializeOwned>(
        &self,
        base: &str,
        op: &'static str,
        path: &str,
        token: Option<&Secret>,
        body: &B,
        timeout: Duration,
    ) -> Result<R, CallError> {
        let mut request = self
            .common(self.http.post(format!("{base}/{path}")))
            .header(header::AUTHORIZATION_TYPE, header::BOT_TOKEN_AUTH)
            .header(header::UIN, ilink::uin_header(fastrand::u32(..)))
            .json(body)
            .timeout(timeout);
        if let Some(token) = token {
            request = request.bearer_auth(token.expose());
        }
        self.read(op, request, timeout).await
    }

    /// Headers every request carries.
    fn common(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let request = request
            .header(header::APP_ID, ilink::APP_ID)
            .header(header::CLIENT_VERSION, &self.client_version);
        match &self.route_tag {
            Some(tag) => request.header(header::ROUTE_TAG, tag),
            None => request,
        }
    }

    async fn read<R: DeserializeOwned>(
        &self,
        op: &'static str,
        request: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<R, CallError> {
        let response = request.send().await.map_err(|err| classify(op, timeout, err))?;
        let status = response.status();
        if !status.is_success() {
            return Err(CallError::Http { op, status: status.as_u16() });
        }
        let mut response = response;
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|err| classify(op, timeout, err))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(CallError::Decode {
                    op,
                    reason: format!("the answer is larger than {MAX_ANSWER_BYTES} bytes"),
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&bytes).map_err(|err| CallError::Decode {
            op,
            // serde's message names the position and what was expected, never the content.
            reason: err.to_string(),
        })
    }
}

fn refused(op: &'static str, status: &Status) -> Result<(), CallError> {
    match status.failure() {
        Some(failure) => Err(CallError::Refused { op, failure }),
        None => Ok(()),
    }
}

/// Sorts a transport error by whether the request can have reached the server.
fn classify(op: &'static str, timeout: Duration, err: reqwest::Error) -> CallError {
    let err = err.without_url();
    if err.is_timeout() {
        return CallError::Timeout { op, timeout };
    }
    match http::reached(&err) {
        Reached::No => CallError::Unreachable { op, reason: error_chain(&err) },
        Reached::Maybe => CallError::Interrupted { op, reason: error_chain(&err) },
    }
}

/// The HTTP client the driver and `login` use: the SDK's (rustls, connect timeout, user
/// agent); every call sets its own timeout.
pub fn http_client() -> Result<reqwest::Client, String> {
    http::client(&HttpOptions::for_driver("wechat")).map_err(|err| err.to_string())
}

/// An error and its sources, one line.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: i64) -> CallError {
        CallError::Refused {
            op: op::SEND_MESSAGE,
            failure: Failure { code, message: String::new() },
        }
    }

    #[test]
    fn only_errors_after_the_request_left_may_have_acted() {
        let timeout = Duration::from_secs(1);
        assert!(!CallError::Unreachable { op: "x", reason: String::new() }.may_have_acted());
        assert!(!failure(-2).may_have_acted());
        assert!(!CallError::Http { op: "x", status: 429 }.may_have_acted());
        assert!(CallError::Http { op: "x", status: 502 }.may_have_acted());
        assert!(CallError::Timeout { op: "x", timeout }.may_have_acted());
        assert!(CallError::Interrupted { op: "x", reason: String::new() }.may_have_acted());
        assert!(CallError::Decode { op: "x", reason: String::new() }.may_have_acted());
    }

    #[test]
    fn minus_14_is_an_expired_session() {
        assert!(failure(-14).session_expired());
        assert!(!failure(-2).session_expired());
        assert_eq!(
            failure(-2).to_string(),
            "ilink/bot/sendmessage: refused with code -2 (no message)"
        );
    }
}
