//! Transports for platforms that speak HTTP or WebSocket, set up the same way in every driver:
//! rustls with the process's one crypto provider, timeouts on every step, a user agent, and
//! plain `http://`/`ws://` accepted so tests can point a driver at a local fake server.
//!
//! * [`http`] (feature `http`): a configured [`reqwest::Client`] and the mapping of a failed
//!   request to [`PostError`](crate::PostError) (not sent → failed, maybe sent → unknown).
//! * [`websocket`] (feature `websocket`): a connection split into a cloneable sender and a
//!   receiver that pings on its own and reports a silent (half-open) connection.

#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "websocket")]
pub mod websocket;

use std::time::Duration;

use url::Url;

/// Why a transport could not be set up or used. Never contains a full URL (platform URLs
/// carry tickets and tokens), only the host.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{0}")]
    Url(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("cannot connect to {host}: {reason}")]
    Connect { host: String, reason: String },
    #[error("connecting to {host} took longer than {after:?}")]
    ConnectTimeout { host: String, after: Duration },
    /// The server answered the WebSocket upgrade with an HTTP error (401/403: credentials).
    #[error("{host} refused the WebSocket upgrade with HTTP {status}")]
    Rejected { host: String, status: u16 },
    /// Nothing arrived (not even a pong) for this long: the connection is presumed dead.
    #[error("no traffic for {0:?}; the connection is presumed dead")]
    Idle(Duration),
    #[error("websocket: {0}")]
    WebSocket(String),
    #[error("the connection is closed")]
    Closed,
}

impl TransportError {
    /// True for an upgrade refused with 401 or 403: the credentials, not the network.
    pub fn is_auth(&self) -> bool {
        matches!(self, TransportError::Rejected { status: 401 | 403, .. })
    }
}

/// The user agent drivers send: `channeld-<family>/<version>`.
pub fn user_agent(family: &str) -> String {
    format!("channeld-{family}/{}", env!("CARGO_PKG_VERSION"))
}

/// A base URL for an API, checked for one of `schemes` (e.g. `["https", "http"]`) and with a
/// trailing slash, so [`endpoint`] joins paths under it rather than beside it.
pub fn base_url(raw: &Url, schemes: &[&str]) -> Result<Url, TransportError> {
    if !schemes.contains(&raw.scheme()) {
        return Err(TransportError::Url(format!(
            "scheme {} is not one of {}",
            raw.scheme(),
            schemes.join(", ")
        )));
    }
    if raw.host_str().is_none() {
        return Err(TransportError::Url("the URL has no host".into()));
    }
    let mut url = raw.clone();
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

/// `path` (relative, e.g. `chat.postMessage` or `cgi-bin/send`) under `base`.
pub fn endpoint(base: &Url, path: &str) -> Result<Url, TransportError> {
    base.join(path.trim_start_matches('/'))
        .map_err(|err| TransportError::Url(format!("cannot join {path:?} to the base URL: {err}")))
}

/// The host of `url`, for messages.
pub(crate) fn host_of(url: &Url) -> String {
    match (url.host_str(), url.port()) {
        (Some(host), Some(port)) => format!("{host}:{port}"),
        (Some(host), None) => host.to_owned(),
        (None, _) => "(no host)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_join_under_the_base_path() {
        let base =
            base_url(&Url::parse("http://127.0.0.1:9/api").unwrap(), &["http", "https"]).unwrap();
        assert_eq!(base.as_str(), "http://127.0.0.1:9/api/");
        assert_eq!(
            endpoint(&base, "/chat.postMessage").unwrap().as_str(),
            "http://127.0.0.1:9/api/chat.postMessage"
        );
        let err = base_url(&Url::parse("ftp://h/").unwrap(), &["http", "https"]).unwrap_err();
        assert_eq!(err.to_string(), "scheme ftp is not one of http, https");
        assert!(user_agent("slack").starts_with("channeld-slack/"));
    }
}
