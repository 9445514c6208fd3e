//! A WebSocket connection for platform event streams (tokio-tungstenite, rustls with the
//! process's provider and the system's trust store), with its own keepalive: the receiver
//! sends a ping every `ping_interval` and gives up with [`TransportError::Idle`] when nothing
//! at all (message, ping or pong) arrived for `idle_timeout`, so a half-open connection (the
//! peer gone without a FIN) is noticed instead of waited on forever.
//!
//! [`connect`] returns a cloneable [`WsSender`] (posts can write while the input loop reads)
//! and a [`WsReceiver`]. Keepalive runs while `recv` is awaited, so a driver reads in a loop.
//!
//! ```no_run
//! # async fn example() -> Result<(), channeld_driver_sdk::transport::TransportError> {
//! use channeld_driver_sdk::Url;
//! use channeld_driver_sdk::transport::websocket::{WsMessage, WsOptions, connect};
//! let url = Url::parse("ws://127.0.0.1:9/socket").unwrap();
//! let (sender, mut receiver) = connect(&url, &WsOptions::default()).await?;
//! sender.send_text(r#"{"cmd":"subscribe"}"#).await?;
//! while let Some(message) = receiver.recv().await? {
//!     if let WsMessage::Text(text) = message { println!("{text}"); }
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use url::Url;

use crate::secret::Secret;
use crate::transport::{TransportError, host_of};

/// Frames queued for the writer task; senders wait beyond this (backpressure, nothing
/// dropped).
pub const SEND_QUEUE: usize = 64;

type Stream = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How the connection behaves.
#[derive(Debug, Clone)]
pub struct WsOptions {
    /// TCP, TLS and the upgrade, together.
    pub connect_timeout: Duration,
    /// The receiver pings this often.
    pub ping_interval: Duration,
    /// No traffic at all for this long ends the connection with [`TransportError::Idle`].
    /// Keep it above the platform's own heartbeat period and `ping_interval`.
    pub idle_timeout: Duration,
    /// The largest message accepted; a larger one ends the connection.
    pub max_message_bytes: usize,
    /// Headers sent with the upgrade (`Authorization`, …); values print as `***`.
    pub headers: Vec<(String, Secret)>,
}

impl Default for WsOptions {
    /// 10 s to connect, a ping every 20 s, dead after 60 s of silence, 16 MiB messages.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(60),
            max_message_bytes: 16 * 1024 * 1024,
            headers: Vec::new(),
        }
    }
}

/// A message from the platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WsMessage {
    Text(String),
    Binary(Vec<u8>),
}

/// Writes to the connection. Cheap to clone; every clone feeds the one writer task.
#[derive(Debug, Clone)]
pub struct WsSender {
    queue: mpsc::Sender<Message>,
}

impl WsSender {
    /// Queues a text message; waits while [`SEND_QUEUE`] are queued. `Closed` once the
    /// connection is gone (the message was not sent).
    pub async fn send_text(&self, text: impl Into<String>) -> Result<(), TransportError> {
        self.send(Message::text(text.into())).await
    }

    /// Queues a binary message.
    pub async fn send_binary(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.send(Message::binary(bytes)).await
    }

    /// Queues a close frame; the receiver then sees the peer's close (or the end).
    pub async fn close(&self) {
        let _ = self.send(Message::Close(None)).await;
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.queue.send(message).await.map_err(|_| TransportError::Closed)
    }
}

/// Reads from the connection, keeps it alive and notices when it is dead. Dropping it ends
/// the connection (its writer task is aborted).
#[derive(Debug)]
pub struct WsReceiver {
    stream: SplitStream<Stream>,
    sender: WsSender,
    writer: JoinHandle<()>,
    ping_interval: Duration,
    idle_timeout: Duration,
    last_seen: Instant,
    next_ping: Instant,
}

impl Drop for WsReceiver {
    fn drop(&mut self) {
        self.writer.abort();
    }
}

impl WsReceiver {
    /// The next text or binary message; `Ok(None)` when the peer closed the connection.
    /// Pings are answered (by tungstenite) and sent (by the receiver) while waiting.
    /// Cancel-safe: a message is never half-read.
    pub async fn recv(&mut self) -> Result<Option<WsMessage>, TransportError> {
        loop {
            let dead_at = self.last_seen + self.idle_timeout;
            tokio::select! {
                item = self.stream.next() => {
                    self.last_seen = Instant::now();
                    match item {
                        None | Some(Ok(Message::Close(_))) => return Ok(None),
                        Some(Ok(Message::Text(text))) => return Ok(Some(WsMessage::Text(text.to_string()))),
                        Some(Ok(Message::Binary(bytes))) => return Ok(Some(WsMessage::Binary(bytes.to_vec()))),
                        Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                        Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed)) => return Ok(None),
                        Some(Err(err)) => return Err(TransportError::WebSocket(err.to_string())),
                    }
                }
                () = tokio::time::sleep_until(self.next_ping) => {
                    self.next_ping = Instant::now() + self.ping_interval;
                    // A full queue means the writer is behind; the idle check still decides.
                    let _ = self.sender.queue.try_send(Message::Ping(Vec::new().into()));
                }
                () = tokio::time::sleep_until(dead_at) => {
                    return Err(TransportError::Idle(self.idle_timeout));
                }
            }
        }
    }

    /// A sender for this connection.
    pub fn sender(&self) -> WsSender {
        self.sender.clone()
    }
}

/// Opens a WebSocket to `url` (`ws://` or `wss://`).
pub async fn connect(
    url: &Url,
    options: &WsOptions,
) -> Result<(WsSender, WsReceiver), TransportError> {
    crate::install_crypto_provider();
    let host = host_of(url);
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(TransportError::Url(format!("scheme {} is not ws or wss", url.scheme())));
    }
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|err| TransportError::Url(format!("not a WebSocket URL: {}", redact(&err))))?;
    for (name, value) in &options.headers {
        let name = tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| TransportError::Url(format!("{name:?} is not a header name")))?;
        let value = HeaderValue::from_str(value.as_str())
            .map_err(|_| TransportError::Url(format!("the value of header {name} is invalid")))?;
        request.headers_mut().insert(name, value);
    }
    let config = WebSocketConfig::default()
        .max_message_size(Some(options.max_message_bytes))
        .max_frame_size(Some(options.max_message_bytes));
    let connecting = tokio_tungstenite::connect_async_with_config(request, Some(config), true);
    let stream = match tokio::time::timeout(options.connect_timeout, connecting).await {
        Err(_) => {
            return Err(TransportError::ConnectTimeout { host, after: options.connect_timeout });
        }
        Ok(Err(WsError::Http(response))) => {
            return Err(TransportError::Rejected { host, status: response.status().as_u16() });
        }
        Ok(Err(err)) => return Err(TransportError::Connect { host, reason: redact(&err) }),
        Ok(Ok((stream, _response))) => stream,
    };
    let (sink, stream) = stream.split();
    let (queue, rx) = mpsc::channel(SEND_QUEUE);
    let writer = tokio::spawn(write_loop(sink, rx));
    let sender = WsSender { queue };
    let now = Instant::now();
    let receiver = WsReceiver {
        stream,
        sender: sender.clone(),
        writer,
        ping_interval: options.ping_interval,
        idle_timeout: options.idle_timeout,
        last_seen: now,
        next_ping: now + options.ping_interval,
    };
    Ok((sender, receiver))
}

/// Writes queued messages until the queue closes or a write fails; a failed write ends the
/// connection, which the receiver then reports.
async fn write_loop(mut sink: SplitSink<Stream, Message>, mut rx: mpsc::Receiver<Message>) {
    while let Some(message) = rx.recv().await {
        let closing = matches!(message, Message::Close(_));
        if let Err(err) = sink.send(message).await {
            tracing::debug!(error = %err, "websocket write failed");
            return;
        }
        if closing {
            return;
        }
    }
    let _ = sink.close().await;
}

/// An error's text without any URL it may quote (tickets and tokens ride in query strings).
fn redact(err: &impl std::fmt::Display) -> String {
    let text = err.to_string();
    text.split_whitespace()
        .map(|word| if word.contains("://") { "<url>" } else { word })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::net::TcpListener;
    use tokio_tungstenite::accept_async;

    use super::*;

    fn fast() -> WsOptions {
        WsOptions {
            ping_interval: Duration::from_millis(50),
            idle_timeout: Duration::from_millis(400),
            ..WsOptions::default()
        }
    }

    async fn local() -> (TcpListener, Url) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        (listener, Url::parse(&format!("ws://{addr}/socket?ticket=s3cret")).unwrap())
    }

    #[tokio::test]
    async fn messages_flow_both_ways_and_a_close_ends_the_receiver() {
        let (listener, url) = local().await;
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut ws = accept_async(tcp).await.unwrap();
            while let Some(Ok(message)) = ws.next().await {
                match message {
                    Message::Text(text) if text.as_str() == "bye" => break,
                    Message::Text(text) => {
                        ws.send(Message::text(format!("echo {text}"))).await.unwrap()
                    }
                    _ => {}
                }
            }
            ws.close(None).await.unwrap();
        });
        let (sender, mut receiver) = connect(&url, &WsOptions::default()).await.unwrap();
        sender.send_text("hello").await.unwrap();
        assert_eq!(receiver.recv().await.unwrap(), Some(WsMessage::Text("echo hello".into())));
        sender.send_text("bye").await.unwrap();
        assert_eq!(receiver.recv().await.unwrap(), None);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_quiet_peer_that_answers_pings_stays_connected() {
        let (listener, url) = local().await;
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut ws = accept_async(tcp).await.unwrap();
            // Reading answers pings; the only data message comes after several idle periods.
            let started = Instant::now();
            while started.elapsed() < Duration::from_millis(1200) {
                let _ = tokio::time::timeout(Duration::from_millis(20), ws.next()).await;
            }
            ws.send(Message::text("still here")).await.unwrap();
            while ws.next().await.is_some() {}
        });
        let (_sender, mut receiver) = connect(&url, &fast()).await.unwrap();
        assert_eq!(receiver.recv().await.unwrap(), Some(WsMessage::Text("still here".into())));
        drop(receiver);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_half_open_connection_is_reported_idle() {
        let (listener, url) = local().await;
        let (hold_tx, hold_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let ws = accept_async(tcp).await.unwrap();
            // Never reads again: pings go unanswered, as with a peer that vanished.
            let _ = hold_rx.await;
            drop(ws);
        });
        let (_sender, mut receiver) = connect(&url, &fast()).await.unwrap();
        let err = receiver.recv().await.unwrap_err();
        assert!(matches!(err, TransportError::Idle(_)), "{err}");
        let _ = hold_tx.send(());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_refused_upgrade_names_the_status_and_never_the_url() {
        let (listener, url) = local().await;
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = tcp.read(&mut buf).await;
            let _ = tcp.write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n").await;
        });
        let err = connect(&url, &fast()).await.unwrap_err();
        assert!(err.is_auth(), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");

        let (listener, url) = local().await;
        drop(listener);
        let err = connect(&url, &fast()).await.unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[tokio::test]
    #[allow(clippy::result_large_err, reason = "tungstenite's callback signature")]
    async fn headers_go_with_the_upgrade() {
        let (listener, url) = local().await;
        let server = tokio::spawn(async move {
            use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
            let (tcp, _) = listener.accept().await.unwrap();
            let mut seen = None;
            let callback = |request: &Request, response: Response| {
                seen =
                    request.headers().get("authorization").map(|v| v.to_str().unwrap().to_owned());
                Ok(response)
            };
            let ws = tokio_tungstenite::accept_hdr_async(tcp, callback).await.unwrap();
            drop(ws);
            seen
        });
        let options = WsOptions {
            headers: vec![("Authorization".into(), Secret::new("Bearer t0ken".into()))],
            ..fast()
        };
        let (_sender, _receiver) = connect(&url, &options).await.unwrap();
        assert_eq!(server.await.unwrap().as_deref(), Some("Bearer t0ken"));
    }
}
