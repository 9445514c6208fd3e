//! An HTTP client for platform APIs: reqwest with rustls (the process's ring provider and the
//! system's trust store), a connect timeout, a whole-request timeout, a user agent and JSON.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use channeld_driver_sdk::transport::http::{HttpOptions, client, post_error};
//! let http = client(&HttpOptions::for_driver("slack"))?;
//! let sent = http
//!     .post("http://127.0.0.1:9/api/chat.postMessage")
//!     .json(&serde_json::json!({"channel": "C1", "text": "hi"}))
//!     .send()
//!     .await;
//! match sent {
//!     Ok(response) => { let _body: serde_json::Value = response.json().await?; }
//!     Err(err) => return Err(post_error(&err).into()),
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

pub use reqwest;

use crate::driver::PostError;
use crate::transport::{TransportError, user_agent};

/// How the client behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// Sent as `User-Agent`.
    pub user_agent: String,
    /// TCP plus TLS connect.
    pub connect_timeout: Duration,
    /// The whole request, from sending to the end of the response body. A long poll needs a
    /// longer one: set it per request with `RequestBuilder::timeout`.
    pub timeout: Duration,
    /// Refuse plain `http://` (production); tests leave it off to reach a local fake.
    pub https_only: bool,
}

impl HttpOptions {
    /// `channeld-<family>/<version>`, 10 s to connect, 30 s per request, `http://` allowed.
    pub fn for_driver(family: &str) -> Self {
        Self {
            user_agent: user_agent(family),
            connect_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
            https_only: false,
        }
    }
}

/// The client. Build it once per driver and clone it (it pools connections).
pub fn client(options: &HttpOptions) -> Result<reqwest::Client, TransportError> {
    crate::install_crypto_provider();
    reqwest::Client::builder()
        .user_agent(options.user_agent.clone())
        .connect_timeout(options.connect_timeout)
        .timeout(options.timeout)
        .https_only(options.https_only)
        .build()
        .map_err(|err| TransportError::Client(err.to_string()))
}

/// Whether a failed request may have reached the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reached {
    /// It failed before anything was sent (no connection, an invalid request): certainly not
    /// processed.
    No,
    /// It failed after the request was (or may have been) sent: a timeout waiting for the
    /// answer, a broken connection mid-request, an unreadable answer.
    Maybe,
}

/// Classifies a failed request.
pub fn reached(err: &reqwest::Error) -> Reached {
    if err.is_builder() || err.is_connect() { Reached::No } else { Reached::Maybe }
}

/// The post error for a failed request: `Failed` (retryable) when it never left, `Unknown`
/// when it may have been processed. The message names what failed, never the URL's query.
pub fn post_error(err: &reqwest::Error) -> PostError {
    let what = if err.is_timeout() {
        "timed out"
    } else if err.is_connect() {
        "could not connect"
    } else if err.is_builder() {
        "could not be built"
    } else if err.is_decode() || err.is_body() {
        "answer unreadable"
    } else {
        "failed"
    };
    let host = err.url().and_then(|url| url.host_str().map(str::to_owned)).unwrap_or_default();
    let reason = format!("request to {host} {what}");
    match reached(err) {
        Reached::No => PostError::failed(reason, true),
        Reached::Maybe => PostError::unknown(reason),
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A one-request HTTP server: returns the request head it read and answers with `reply`
    /// (or never answers when `reply` is `None`).
    async fn one_shot(
        reply: Option<&'static str>,
    ) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut chunk = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut chunk).await.unwrap();
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&chunk[..n]);
            }
            match reply {
                Some(body) => {
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    socket.write_all(response.as_bytes()).await.unwrap();
                }
                // Hold the connection open without answering until the client gives up.
                None => while socket.read(&mut chunk).await.is_ok_and(|n| n > 0) {},
            }
            String::from_utf8_lossy(&request).into_owned()
        });
        (addr, server)
    }

    #[tokio::test]
    async fn requests_carry_the_user_agent_and_json_comes_back() {
        let (addr, server) = one_shot(Some(r#"{"ok":true,"ts":"1.2"}"#)).await;
        let http = client(&HttpOptions::for_driver("test")).unwrap();
        let body: serde_json::Value = http
            .post(format!("http://{addr}/api/chat.postMessage"))
            .json(&serde_json::json!({"text": "hi"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(body["ts"], "1.2");
        let head = server.await.unwrap().to_ascii_lowercase();
        assert!(head.contains(&format!("user-agent: {}", user_agent("test"))), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
    }

    #[tokio::test]
    async fn no_answer_in_time_is_an_unknown_outcome_and_no_connection_a_failure() {
        let (addr, _server) = one_shot(None).await;
        let options =
            HttpOptions { timeout: Duration::from_millis(300), ..HttpOptions::for_driver("test") };
        let http = client(&options).unwrap();
        let err = http.post(format!("http://{addr}/send")).body("x").send().await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(matches!(post_error(&err), PostError::Unknown { .. }));

        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let err = http.post(format!("http://{closed}/send")).send().await.unwrap_err();
        let mapped = post_error(&err);
        assert!(matches!(mapped, PostError::Failed { retryable: true, .. }), "{mapped:?}");
        assert_eq!(mapped.to_string(), "post failed: request to 127.0.0.1 could not connect");
    }

    #[tokio::test]
    async fn https_only_refuses_plain_http() {
        let options = HttpOptions { https_only: true, ..HttpOptions::for_driver("test") };
        let http = client(&options).unwrap();
        let err = http.get("http://127.0.0.1:9/").send().await.unwrap_err();
        assert_eq!(reached(&err), Reached::No, "{err}");
    }
}
