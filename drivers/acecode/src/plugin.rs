//! One running plugin process: started in its manifest directory, requests matched to
//! responses by id (each with its method's timeout), events handed on in order, stderr
//! logged at debug (rate-limited), and the seed's shutdown: `shutdown` request, stdin
//! closed, 3 s, kill.
//!
//! A line that is not a JSON object (or is longer than 1 MiB) ends the process: the host
//! kills it and the restart loop starts it again.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::acecode::{
    self as wire, Event, MAX_LINE_BYTES, Notification, PluginLine, Request, Response, method,
};
use channeld_driver_sdk::protocol::framing::{LineEvent, LineFramer};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use channeld_driver_sdk::protocol::acecode::Manifest;

/// Events queued from the plugin; its reader waits beyond this (the plugin blocks on its
/// stdout, which is the backpressure the protocol has).
pub const EVENT_QUEUE: usize = 256;
/// Lines queued for the plugin's stdin; senders wait.
const STDIN_QUEUE: usize = 64;
/// Stderr lines logged per window; the rest are counted.
const STDERR_LINES_PER_WINDOW: u32 = 20;
const STDERR_WINDOW: Duration = Duration::from_secs(10);
/// Longest stderr line kept in the log.
const STDERR_LINE_BYTES: usize = 1024;
/// After `shutdown` and closing stdin, how long the process may take to exit.
pub const EXIT_GRACE: Duration = Duration::from_secs(3);

/// Why a request got no usable answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginError {
    #[error("the plugin did not answer {method} within {secs} s")]
    Timeout { method: String, secs: u64 },
    #[error("the plugin refused {method}: {reason}")]
    Refused { method: String, reason: String },
    #[error("the plugin is not running: {0}")]
    Gone(String),
    #[error("cannot start the plugin: {0}")]
    Spawn(String),
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

/// A running plugin.
#[derive(Debug)]
pub struct Plugin {
    stdin: mpsc::Sender<Vec<u8>>,
    waiters: Waiters,
    next_id: AtomicU64,
    /// Cancelled when the process ended (or was found broken); `reason` says why.
    pub ended: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
    child: Arc<tokio::sync::Mutex<Child>>,
    tasks: TaskTracker,
    pub started: Instant,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Plugin {
    /// Starts the manifest's command in its directory; returns it and its event stream.
    pub fn spawn(manifest: &Manifest) -> Result<(Arc<Self>, mpsc::Receiver<Event>), PluginError> {
        let mut child = Command::new(&manifest.command)
            .args(&manifest.args)
            .current_dir(&manifest.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| PluginError::Spawn(format!("{}: {err}", manifest.command.display())))?;
        let pid = child.id();
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let tasks = TaskTracker::new();
        let ended = CancellationToken::new();
        let reason = Arc::new(Mutex::new(None));
        let waiters: Waiters = Arc::default();
        let (stdin_tx, stdin_rx) = mpsc::channel(STDIN_QUEUE);
        let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
        let child = Arc::new(tokio::sync::Mutex::new(child));
        tasks.spawn(write_stdin(stdin, stdin_rx));
        tasks.spawn(read_stderr(stderr, manifest.name.clone()));
        tasks.spawn(read_stdout(
            stdout,
            waiters.clone(),
            events_tx,
            ended.clone(),
            reason.clone(),
            child.clone(),
        ));
        {
            let (child, ended, reason, waiters) =
                (child.clone(), ended.clone(), reason.clone(), waiters.clone());
            tasks.spawn(async move {
                let status = loop {
                    // Poll without holding the lock across the wait, so `kill` can take it.
                    if let Ok(Some(status)) = child.lock().await.try_wait() {
                        break status.to_string();
                    }
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(50)) => {}
                        () = ended.cancelled() => {
                            let mut child = child.lock().await;
                            let _ = child.kill().await;
                            break child.wait().await.map_or_else(|e| e.to_string(), |s| s.to_string());
                        }
                    }
                };
                end(&ended, &reason, format!("the plugin exited ({status})"));
                // Nobody will answer now.
                locked(&waiters).clear();
            });
        }
        info!(plugin = %manifest.name, pid = ?pid, "plugin started");
        let plugin = Arc::new(Self {
            stdin: stdin_tx,
            waiters,
            next_id: AtomicU64::new(1),
            ended,
            reason,
            child,
            tasks,
            started: Instant::now(),
        });
        Ok((plugin, events_rx))
    }

    /// Why the process ended (once `ended` fired).
    pub fn end_reason(&self) -> String {
        locked(&self.reason).clone().unwrap_or_else(|| "the plugin is running".into())
    }

    /// Sends a request and waits up to `timeout` for its response. A timed-out request is
    /// never resent: its outcome is unknown.
    pub async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, PluginError> {
        if self.ended.is_cancelled() {
            return Err(PluginError::Gone(self.end_reason()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        locked(&self.waiters).insert(id, tx);
        let request = Request { id, method: method.to_owned(), params };
        if self.write(&request).await.is_err() {
            locked(&self.waiters).remove(&id);
            return Err(PluginError::Gone(self.end_reason()));
        }
        let answer = tokio::select! {
            answer = tokio::time::timeout(timeout, rx) => answer,
            () = self.ended.cancelled() => {
                locked(&self.waiters).remove(&id);
                return Err(PluginError::Gone(self.end_reason()));
            }
        };
        match answer {
            Ok(Ok(response)) if response.ok => Ok(response.result.unwrap_or(Value::Null)),
            Ok(Ok(response)) => Err(PluginError::Refused {
                method: method.to_owned(),
                reason: response.error.unwrap_or_else(|| "no reason given".into()),
            }),
            Ok(Err(_)) => Err(PluginError::Gone(self.end_reason())),
            Err(_) => {
                locked(&self.waiters).remove(&id);
                Err(PluginError::Timeout { method: method.to_owned(), secs: timeout.as_secs() })
            }
        }
    }

    /// Sends a notification (no response).
    pub async fn notify(&self, method: &str, params: Value) {
        let _ = self.write(&Notification { method: method.to_owned(), params }).await;
    }

    async fn write(&self, value: &impl serde::Serialize) -> Result<(), ()> {
        let mut line = serde_json::to_vec(value).map_err(|_| ())?;
        line.push(b'\n');
        self.stdin.send(line).await.map_err(|_| ())
    }

    /// The seed's shutdown: `shutdown` (3 s), close stdin, wait 3 s, kill.
    pub async fn shutdown(&self) {
        if !self.ended.is_cancelled() {
            let timeout = wire::method_timeout(method::SHUTDOWN);
            if let Err(err) = self.request(method::SHUTDOWN, serde_json::json!({}), timeout).await {
                debug!(error = %err, "shutdown request unanswered");
            }
            // Closing stdin: the writer ends once its queue is dropped.
            let _ = self.stdin.send(Vec::new()).await;
            if tokio::time::timeout(EXIT_GRACE, self.ended.cancelled()).await.is_err() {
                warn!("the plugin did not exit within 3 s of shutdown; killing it");
                end(&self.ended, &self.reason, "killed after shutdown".into());
            }
        }
        self.tasks.close();
        let _ = tokio::time::timeout(EXIT_GRACE, self.tasks.wait()).await;
    }

    /// Kills the process now (a protocol violation, an operator's restart).
    pub async fn kill(&self, why: &str) {
        end(&self.ended, &self.reason, why.to_owned());
        self.tasks.close();
        let _ = tokio::time::timeout(EXIT_GRACE, self.tasks.wait()).await;
        let _ = self.child.lock().await.start_kill();
    }
}

/// Marks the process ended with `why` (the first reason wins).
fn end(ended: &CancellationToken, reason: &Mutex<Option<String>>, why: String) {
    locked(reason).get_or_insert(why);
    ended.cancel();
}

/// Writes queued lines; an empty line closes stdin.
async fn write_stdin(mut stdin: ChildStdin, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(line) = lines.recv().await {
        if line.is_empty() || stdin.write_all(&line).await.is_err() || stdin.flush().await.is_err()
        {
            break;
        }
    }
}

async fn read_stdout<R: AsyncRead + Unpin>(
    mut stdout: R,
    waiters: Waiters,
    events: mpsc::Sender<Event>,
    ended: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
    child: Arc<tokio::sync::Mutex<Child>>,
) {
    let mut framer = LineFramer::new(MAX_LINE_BYTES);
    let violation = loop {
        let line = match framer.next_line() {
            Some(LineEvent::Line(line)) => wire::parse_plugin_line(line),
            Some(LineEvent::TooLong) => break "a line longer than 1 MiB".to_owned(),
            None => {
                tokio::select! {
                    read = stdout.read_buf(framer.buffer_for_read()) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(_) => continue,
                    },
                    () = ended.cancelled() => return,
                }
            }
        };
        match line {
            Ok(PluginLine::Response(response)) => {
                if let Some(tx) = locked(&waiters).remove(&response.id) {
                    let _ = tx.send(response);
                } else {
                    debug!(id = response.id, "a response nobody waits for (timed out?)");
                }
            }
            Ok(PluginLine::Event(event)) => {
                if events.send(event).await.is_err() {
                    return;
                }
            }
            Ok(PluginLine::Other) => {}
            Err(err) => break err.to_string(),
        }
    };
    warn!(error = %violation, "the plugin broke the protocol; stopping it");
    end(&ended, &reason, format!("protocol violation: {violation}"));
    let _ = child.lock().await.start_kill();
}

/// Logs the plugin's stderr at debug: at most 20 lines per 10 s, then how many were skipped.
async fn read_stderr<R: AsyncRead + Unpin>(stderr: R, plugin: String) {
    let mut lines = BufReader::new(stderr).take(u64::MAX);
    let mut window = Instant::now();
    let (mut logged, mut skipped) = (0u32, 0u64);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut lines).take(STDERR_LINE_BYTES as u64 * 64).read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if window.elapsed() >= STDERR_WINDOW {
            if skipped > 0 {
                debug!(%plugin, skipped, "plugin stderr lines skipped (rate limit)");
            }
            window = Instant::now();
            logged = 0;
            skipped = 0;
        }
        if logged < STDERR_LINES_PER_WINDOW {
            logged += 1;
            let text = String::from_utf8_lossy(&buf[..buf.len().min(STDERR_LINE_BYTES)]);
            debug!(%plugin, line = %text.trim_end(), "plugin stderr");
        } else {
            skipped += 1;
        }
    }
}
