//! The console driver: each line read from its input is an inbound message; replies and
//! proactive messages are printed on its output.
//!
//! Generic over its input and output so tests run it over in-memory pipes. At the end of its
//! input the driver waits (bounded by the reply timeout) until every line has its reply, so
//! `echo hi | channeld-console` prints the answer before exiting.

use std::collections::HashSet;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::framing::{LineEvent, LineFramer};
use channeld_driver_sdk::protocol::types::{Actions, Capabilities, DeliveryReceipt, Effect};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, EffectError, EffectRequest,
    Hub, HubError, Post, PostError, PostKind,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::config::ConsoleConfig;
use crate::convert;

type StatusWriter = Box<dyn AsyncWrite + Send + Unpin>;

/// A channeld driver for a terminal or a pipe.
pub struct ConsoleDriver<R, W> {
    config: ConsoleConfig,
    interactive: bool,
    /// Taken by `run` and handed back when it stops before the end of input (the hub may
    /// accept the driver again and call `run` anew): there is one reader of the input.
    input: Mutex<Option<LineReader<R>>>,
    output: tokio::sync::Mutex<W>,
    /// Where typing and previews show in interactive mode (stderr by default).
    status: tokio::sync::Mutex<StatusWriter>,
    /// Event ids of lines still waiting for their reply.
    awaiting: Arc<watch::Sender<HashSet<Id>>>,
    id_prefix: String,
    next_line: AtomicU64,
    next_message: AtomicU64,
}

impl<R, W> std::fmt::Debug for ConsoleDriver<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleDriver")
            .field("config", &self.config)
            .field("interactive", &self.interactive)
            .field("id_prefix", &self.id_prefix)
            .finish_non_exhaustive()
    }
}

impl<R, W> ConsoleDriver<R, W>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    /// A driver reading lines from `input` and printing to `output`. `interactive` (output is
    /// a terminal) adds a prompt, a marker before each message and a status line for effects.
    pub fn new(config: ConsoleConfig, input: R, output: W, interactive: bool) -> Self {
        Self {
            config,
            interactive,
            input: Mutex::new(Some(LineReader::new(input))),
            output: tokio::sync::Mutex::new(output),
            status: tokio::sync::Mutex::new(Box::new(tokio::io::stderr())),
            awaiting: Arc::new(watch::Sender::new(HashSet::new())),
            id_prefix: convert::event_id_prefix(std::process::id(), now_ms()),
            next_line: AtomicU64::new(1),
            next_message: AtomicU64::new(1),
        }
    }

    /// Shows the interactive status line on `status` instead of stderr.
    pub fn with_status(mut self, status: impl AsyncWrite + Send + Unpin + 'static) -> Self {
        self.status = tokio::sync::Mutex::new(Box::new(status));
        self
    }

    /// Reports one line; false when the driver is shutting down.
    async fn submit(
        &self,
        hub: &Hub,
        text: &str,
        outcomes: &mut JoinSet<()>,
    ) -> Result<bool, DriverError> {
        let Some(text) = convert::line_text(text) else {
            return Ok(true);
        };
        let n = self.next_line.fetch_add(1, Ordering::Relaxed);
        let event_id = convert::event_id(&self.id_prefix, n);
        let message = match convert::inbound_message(text, event_id.clone(), &self.config, now_ms())
        {
            Ok(message) => message,
            Err(err) => {
                warn!(error = %err, "input line skipped");
                return Ok(true);
            }
        };
        self.awaiting.send_modify(|awaiting| {
            awaiting.insert(event_id.clone());
        });
        let ticket = match hub.inbound(message).await {
            Ok(ticket) => ticket,
            Err(err) => {
                self.stop_awaiting(&event_id);
                return match err {
                    HubError::ShuttingDown => Ok(false),
                    other => Err(DriverError::Platform(other.to_string())),
                };
            }
        };
        debug!(%event_id, "line reported");
        let awaiting = self.awaiting.clone();
        // A refused or abandoned line will get no reply: stop waiting for one.
        outcomes.spawn(async move {
            match ticket.outcome().await {
                Acceptance::Accepted { .. } => return,
                Acceptance::Rejected { code, message } => {
                    warn!(%event_id, %code, %message, "the hub refused a line");
                }
                Acceptance::Unresolved => debug!(%event_id, "the hub never took a line"),
            }
            awaiting.send_if_modified(|awaiting| awaiting.remove(&event_id));
        });
        Ok(true)
    }

    fn stop_awaiting(&self, event_id: &Id) {
        self.awaiting.send_if_modified(|awaiting| awaiting.remove(event_id));
    }

    /// After the input ended: waits until every line has its reply, the reply timeout passes
    /// or shutdown is requested.
    async fn wait_for_replies(&self, limit: Duration, shutdown: &CancellationToken) {
        let mut awaiting = self.awaiting.subscribe();
        let waiting = awaiting.borrow().len();
        if waiting == 0 {
            return;
        }
        info!(waiting, "input ended, waiting for replies");
        let all_answered = async {
            let _ = awaiting.wait_for(HashSet::is_empty).await;
        };
        tokio::select! {
            () = shutdown.cancelled() => {}
            answered = tokio::time::timeout(limit, all_answered) => {
                if answered.is_err() {
                    let unanswered = self.awaiting.borrow().len();
                    warn!(unanswered, ?limit, "gave up waiting for replies");
                }
            }
        }
    }

    /// Reports each line until the input ends (then waits for the replies) or `shutdown`.
    async fn read(
        &self,
        hub: &Hub,
        shutdown: &CancellationToken,
        lines: &mut LineReader<R>,
    ) -> Result<(), DriverError> {
        let mut outcomes = JoinSet::new();
        self.prompt().await;
        loop {
            let line = tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                Some(_) = outcomes.join_next(), if !outcomes.is_empty() => continue,
                line = lines.next() => line,
            };
            let line = line.map_err(|err| {
                DriverError::Platform(format!("cannot read the console input: {err}"))
            })?;
            match line {
                None => break,
                Some(Line::TooLong) => {
                    warn!(max_bytes = convert::MAX_INPUT_LINE, "input line too long, skipped");
                }
                Some(Line::Text(text)) => {
                    if !self.submit(hub, &text, &mut outcomes).await? {
                        return Ok(());
                    }
                    self.prompt().await;
                }
            }
        }
        self.wait_for_replies(hub.launch().reply_timeout, shutdown).await;
        Ok(())
    }

    async fn prompt(&self) {
        if !self.interactive {
            return;
        }
        let mut output = self.output.lock().await;
        if let Err(err) = write_flush(&mut *output, convert::PROMPT.as_bytes()).await {
            debug!(error = %err, "cannot show the prompt");
        }
    }
}

impl<R, W> Driver for ConsoleDriver<R, W>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, send: true, ..Default::default() })
            .with_actions(Actions { typing: true, preview: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let input = self.input.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(mut lines) = input else {
            return Err(DriverError::Platform("console input is already being read".into()));
        };
        let result = self.read(&hub, &shutdown, &mut lines).await;
        if !lines.eof {
            *self.input.lock().unwrap_or_else(PoisonError::into_inner) = Some(lines);
        }
        result
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let text = if self.interactive {
            convert::render_interactive(&post.message.body)
        } else {
            convert::render_plain(&post.message.body)
        };
        let written = {
            let mut output = self.output.lock().await;
            write_flush(&mut *output, text.as_bytes()).await
        };
        if let PostKind::Reply { event_id } = &post.kind {
            self.stop_awaiting(event_id);
        }
        if let Err(err) = written {
            return Err(PostError::failed(format!("cannot write to the console: {err}"), false));
        }
        let n = self.next_message.fetch_add(1, Ordering::Relaxed);
        Ok(DeliveryReceipt {
            channel: self.config.channel.clone(),
            message_id: convert::outbound_id(n),
            target: post.message.target,
            timestamp_ms: Some(now_ms()),
        })
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        if !self.interactive {
            return Ok(());
        }
        let Some(status) = convert::status_line(&request.effect) else {
            return Err(EffectError::Unsupported);
        };
        {
            let mut writer = self.status.lock().await;
            write_flush(&mut *writer, status.as_bytes())
                .await
                .map_err(|err| EffectError::Failed(format!("cannot show the status: {err}")))?;
        }
        if matches!(request.effect, Effect::Typing { active: false }) {
            self.prompt().await;
        }
        Ok(())
    }
}

async fn write_flush<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    bytes: &[u8],
) -> io::Result<()> {
    writer.write_all(bytes).await?;
    writer.flush().await
}

enum Line {
    Text(String),
    TooLong,
}

/// Reads bounded lines: memory stays below one maximum line plus one read chunk, however long
/// a line the input sends.
struct LineReader<R> {
    inner: R,
    framer: LineFramer,
    eof: bool,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    fn new(inner: R) -> Self {
        Self { inner, framer: LineFramer::new(convert::MAX_INPUT_LINE), eof: false }
    }

    /// The next line (invalid UTF-8 replaced), or `None` at the end of the input. Cancel-safe.
    async fn next(&mut self) -> io::Result<Option<Line>> {
        loop {
            match self.framer.next_line() {
                Some(LineEvent::Line(bytes)) => {
                    return Ok(Some(Line::Text(String::from_utf8_lossy(bytes).into_owned())));
                }
                Some(LineEvent::TooLong) => return Ok(Some(Line::TooLong)),
                None => {}
            }
            if self.eof {
                let rest = self.framer.take_remainder();
                return Ok(rest.map(|rest| Line::Text(String::from_utf8_lossy(&rest).into_owned())));
            }
            if self.inner.read_buf(self.framer.buffer_for_read()).await? == 0 {
                self.eof = true;
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_all(input: &'static [u8]) -> Vec<String> {
        let mut reader = LineReader::new(input);
        let mut lines = Vec::new();
        while let Some(line) = reader.next().await.unwrap() {
            lines.push(match line {
                Line::Text(text) => text,
                Line::TooLong => "<too long>".to_owned(),
            });
        }
        lines
    }

    #[tokio::test]
    async fn lines_are_split_and_the_last_needs_no_newline() {
        assert_eq!(read_all(b"one\ntwo\r\nthree").await, ["one", "two\r", "three"]);
    }

    #[tokio::test]
    async fn an_overlong_line_is_reported_once_and_reading_goes_on() {
        let mut input = vec![b'x'; convert::MAX_INPUT_LINE * 2];
        input.extend_from_slice(b"\nafter\n");
        let input: &'static [u8] = Box::leak(input.into_boxed_slice());
        assert_eq!(read_all(input).await, ["<too long>", "after"]);
    }

    #[tokio::test]
    async fn invalid_utf8_is_replaced_not_fatal() {
        assert_eq!(read_all(b"caf\xe9\n").await, ["caf\u{fffd}"]);
    }
}
