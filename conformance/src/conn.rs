//! One driver connection as the kit's hub sees it: frames in (every byte scanned for secrets on
//! the way), frames and raw lines out, and waits that end in a [`WaitError`] naming what was
//! seen instead of a panic, so a misbehaving driver fails a check and the run goes on.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use channeld_link::FrameReader;
use channeld_protocol::ext::Extensions;
use channeld_protocol::frame::{Hello, HelloAck, Inbound};
use channeld_protocol::{Frame, encode};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::secrets::Scanner;

/// The `hub` name the kit sends in `hello_ack`.
pub const HUB_NAME: &str = concat!("channeld-conformance/", env!("CARGO_PKG_VERSION"));

/// How the kit answers a `hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HubMode {
    /// Like channeld: every extension offered, `hello_ack` for a hello that lists some.
    Extensions,
    /// Like the reference hub: no `hello_ack`, no extension in use.
    Reference,
}

/// Why a wait or a write ended without what it waited for.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("nothing within {limit:?}{}", seen_list(.seen))]
    Timeout { limit: Duration, seen: Vec<String> },
    #[error("the driver closed the connection{}", seen_list(.seen))]
    Closed { seen: Vec<String> },
    #[error("answered with {0}")]
    Answered(String),
    #[error("the connection failed: {0}")]
    Io(#[from] std::io::Error),
}

fn seen_list(seen: &[String]) -> String {
    if seen.is_empty() { String::new() } else { format!(" (got: {})", seen.join(", ")) }
}

/// An established connection with the driver's handshake read.
#[derive(Debug)]
pub struct Conn {
    reader: FrameReader<Tap>,
    writer: OwnedWriteHalf,
    timeout: Duration,
    closed: bool,
    /// `inbound` frames read while waiting for something else, oldest first.
    pub strays: Vec<Inbound>,
    /// Lines from the driver that did not decode: their error codes.
    pub bad_lines: Vec<String>,
}

/// A hello and what was agreed after it.
#[derive(Debug, Clone)]
pub struct Handshake {
    pub hello: Hello,
    pub negotiated: Extensions,
}

impl Conn {
    pub fn new(stream: UnixStream, scanner: Scanner, timeout: Duration) -> Self {
        let (read, writer) = stream.into_split();
        Self {
            reader: FrameReader::new(Tap { inner: read, scanner }),
            writer,
            timeout,
            closed: false,
            strays: Vec::new(),
            bad_lines: Vec::new(),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Reads `hello` (the first line) and `start`, answering `hello_ack` in between as `mode`
    /// says. The error says what was wrong with the handshake.
    pub async fn handshake(&mut self, mode: HubMode) -> Result<Handshake, String> {
        let deadline = Instant::now() + self.timeout;
        let hello = match self.next_line(deadline).await {
            Ok(Ok(Frame::Hello(hello))) => hello,
            Ok(Ok(other)) => {
                return Err(format!("the first frame was {}, not hello", other.type_name()));
            }
            Ok(Err(code_and_error)) => {
                return Err(format!("the first line did not decode ({code_and_error})"));
            }
            Err(err) => return Err(format!("no hello: {err}")),
        };
        let mut negotiated = Extensions::default();
        if mode == HubMode::Extensions && !hello.extensions.is_empty() {
            negotiated = Extensions::all().intersect(Extensions::from_names(&hello.extensions));
            let ack = HelloAck {
                request_id: hello.request_id.clone(),
                extensions: negotiated.names(),
                hub: HUB_NAME.to_owned(),
            };
            self.send(&Frame::HelloAck(ack)).await.map_err(|err| format!("hello_ack: {err}"))?;
        }
        loop {
            match self.next_line(deadline).await {
                Ok(Ok(Frame::Start(_))) => break,
                Ok(Ok(Frame::Event(_) | Frame::Health(_))) => {}
                Ok(Ok(other)) => {
                    return Err(format!("after hello came {}, not start", other.type_name()));
                }
                Ok(Err(err)) => return Err(format!("after hello came a bad line ({err})")),
                Err(err) => return Err(format!("no start after the hello: {err}")),
            }
        }
        Ok(Handshake { hello, negotiated })
    }

    /// Sends one frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), WaitError> {
        let line = encode(frame).map_err(|err| std::io::Error::other(err.to_string()))?;
        self.send_raw(&line).await
    }

    /// Sends raw bytes (include the newline).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), WaitError> {
        let write = async {
            self.writer.write_all(bytes).await?;
            self.writer.flush().await
        };
        match tokio::time::timeout(self.timeout, write).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => {
                self.closed = true;
                Err(match err.kind() {
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                        WaitError::Closed { seen: Vec::new() }
                    }
                    _ => WaitError::Io(err),
                })
            }
            Err(_) => Err(WaitError::Timeout {
                limit: self.timeout,
                seen: vec!["the driver stopped reading".into()],
            }),
        }
    }

    /// The next frame for which `wanted` is true, within the timeout. Heartbeats, health
    /// reports and unrelated frames are passed over (inbound ones kept in
    /// [`strays`](Self::strays)), undecodable lines recorded.
    pub async fn wait_for(
        &mut self,
        wanted: impl FnMut(&Frame) -> bool,
    ) -> Result<Frame, WaitError> {
        let deadline = Instant::now() + self.timeout;
        self.wait_until(deadline, wanted).await
    }

    /// As [`wait_for`](Self::wait_for), with an explicit deadline.
    pub async fn wait_until(
        &mut self,
        deadline: Instant,
        mut wanted: impl FnMut(&Frame) -> bool,
    ) -> Result<Frame, WaitError> {
        let mut seen = Vec::new();
        loop {
            match self.next_line(deadline).await {
                Ok(Ok(frame)) if wanted(&frame) => return Ok(frame),
                Ok(Ok(Frame::Event(_) | Frame::Health(_))) => {}
                Ok(Ok(Frame::Inbound(inbound))) => {
                    seen.push("inbound".to_owned());
                    self.strays.push(inbound);
                }
                Ok(Ok(frame)) => seen.push(describe(&frame)),
                Ok(Err(err)) => seen.push(format!("a bad line ({err})")),
                Err(WaitError::Timeout { limit, .. }) => {
                    return Err(WaitError::Timeout { limit, seen });
                }
                Err(WaitError::Closed { .. }) => return Err(WaitError::Closed { seen }),
                Err(err) => return Err(err),
            }
        }
    }

    /// Waits for the driver to close the connection, passing over anything it still sends.
    pub async fn wait_closed(&mut self, deadline: Instant) -> Result<(), WaitError> {
        match self.wait_until(deadline, |_| false).await {
            Err(WaitError::Closed { .. }) => Ok(()),
            Err(err) => Err(err),
            Ok(_) => unreachable!("nothing is wanted"),
        }
    }

    /// The next line: a frame, or the decode error's code and text.
    async fn next_line(&mut self, deadline: Instant) -> Result<Result<Frame, String>, WaitError> {
        if self.closed {
            return Err(WaitError::Closed { seen: Vec::new() });
        }
        let limit = self.timeout;
        match tokio::time::timeout_at(deadline, self.reader.next()).await {
            Err(_) => Err(WaitError::Timeout { limit, seen: Vec::new() }),
            Ok(Ok(None)) => {
                self.closed = true;
                Err(WaitError::Closed { seen: Vec::new() })
            }
            Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionReset => {
                self.closed = true;
                Err(WaitError::Closed { seen: Vec::new() })
            }
            Ok(Err(err)) => {
                self.closed = true;
                Err(WaitError::Io(err))
            }
            Ok(Ok(Some(Ok(frame)))) => Ok(Ok(frame)),
            Ok(Ok(Some(Err(err)))) => {
                self.bad_lines.push(err.code().to_owned());
                Ok(Err(format!("{}: {err}", err.code())))
            }
        }
    }
}

/// A frame named for a reason: its type, and its error code for an `error`.
pub fn describe(frame: &Frame) -> String {
    match frame {
        Frame::Error(err) => format!("error {}", err.code),
        other => other.type_name().to_owned(),
    }
}

/// The read half, with every byte shown to a secret scanner on its way to the framer.
#[derive(Debug)]
struct Tap {
    inner: OwnedReadHalf,
    scanner: Scanner,
}

impl AsyncRead for Tap {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let fresh = buf.filled()[before..].to_vec();
            self.scanner.feed(&fresh);
        }
        polled
    }
}
