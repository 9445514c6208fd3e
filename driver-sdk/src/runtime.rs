//! The driver runtime: keeps a hub session up (connect with backoff, handshake, reconnect),
//! starts the platform side ([`Driver::run`]) only once the hub has accepted the driver and
//! stops it while the hub refuses it, and drains on shutdown.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use channeld_link::Backoff;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::config::ConfigError;
use crate::driver::{DeclarationError, Driver, DriverError};
use crate::hub::{Hub, HubError, Shared};
use crate::launch::{DriverLaunchConfig, ENV_SOCKET, socket_problem};
use crate::session::{
    MAX_CONCURRENT_HANDLERS, MAX_QUEUED_REQUESTS, RecentPosts, Session, SessionEnd,
};

/// Interval of `heartbeat` events, so the hub can tell a live driver from a stuck one.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(15);
/// Admission changes (accepted / refused) queued from the hub session to the lifecycle loop;
/// the session waits beyond this (there is at most one change per connection attempt).
const ADMISSION_QUEUE: usize = 4;

/// Why the runtime stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("hub refused this driver: {code}: {message}")]
    Refused { code: String, message: String },
    #[error("invalid declaration: {0}")]
    Declaration(#[from] DeclarationError),
    /// `run` ignored its shutdown token and was aborted after the drain deadline.
    #[error("the platform side did not stop within {0:?} after it was asked to, and was aborted")]
    Aborted(Duration),
    #[error("driver task panicked")]
    Panicked,
}

impl RunError {
    /// The process exit status for this error: 78 (`EX_CONFIG`, not restarted) when restarting
    /// cannot help, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Driver(DriverError::Config(_))
            | RunError::Refused { .. }
            | RunError::Declaration(_) => 78,
            _ => 1,
        }
    }
}

/// What the hub said to a `hello`, told by the session to the lifecycle loop.
#[derive(Debug)]
pub(crate) enum Admission {
    /// The hub took this driver (its `hello_ack`, or a reference hub's silence).
    Accepted,
    /// The hub refused it for now (another driver serves the instance); the session retries.
    Refused { code: String },
}

/// Runs `driver` until `shutdown` is cancelled or its platform input ends, then drains:
/// stops taking platform input, finishes in-flight posts within the drain deadline, sends
/// `stop` and returns. See [`Driver`] for when `run` is called and stopped.
pub async fn run_driver<D: Driver>(
    driver: D,
    launch: DriverLaunchConfig,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    run(driver, launch, shutdown, Transport::Hub).await
}

/// Runs `driver` as an ACECode channel platform plugin: the plugin protocol on `input` /
/// `output` (the process's stdin and stdout) instead of a hub socket; see [`crate::acecode`].
/// ACECode's `shutdown` request (or the end of `input`) drains like `shutdown`.
pub async fn run_driver_acecode<D, R, W>(
    driver: D,
    launch: DriverLaunchConfig,
    shutdown: CancellationToken,
    input: R,
    output: W,
) -> Result<(), RunError>
where
    D: Driver,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let transport = Transport::Acecode { input: Box::new(input), output: Box::new(output) };
    run(driver, launch, shutdown, transport).await
}

/// Where the driver's hub session runs.
enum Transport {
    /// The hub's Unix socket, reconnected with backoff.
    Hub,
    /// An in-process bridge to ACECode on these streams.
    Acecode { input: Box<dyn AsyncRead + Unpin + Send>, output: Box<dyn AsyncWrite + Unpin + Send> },
}

async fn run<D: Driver>(
    driver: D,
    launch: DriverLaunchConfig,
    shutdown: CancellationToken,
    transport: Transport,
) -> Result<(), RunError> {
    let declaration = driver.declaration();
    declaration.check()?;
    let driver = Arc::new(driver);
    let drain = launch.drain_timeout;
    let shared = Arc::new(Shared::new(launch, declaration, driver.extensions()));
    let tracker = TaskTracker::new();
    let session_token = CancellationToken::new();
    let (admissions_tx, mut admissions) = mpsc::channel(ADMISSION_QUEUE);
    let mut connection = match transport {
        Transport::Hub => tokio::spawn(connection_loop(
            driver.clone(),
            shared.clone(),
            tracker.clone(),
            session_token.clone(),
            admissions_tx,
        )),
        Transport::Acecode { input, output } => tokio::spawn(crate::acecode::connection(
            driver.clone(),
            shared.clone(),
            tracker.clone(),
            session_token.clone(),
            admissions_tx,
            input,
            output,
            shutdown.clone(),
        )),
    };
    let mut platform = PlatformSide { driver, shared: shared.clone(), running: None };
    let channel = shared.launch.channel.clone();

    let mut outcome: Result<(), RunError> = Ok(());
    let mut connection_done = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => {
                info!(%channel, "shutting down: no more platform input");
                break;
            }
            Some(admission) = admissions.recv() => match admission {
                Admission::Accepted => platform.start(),
                Admission::Refused { code } => {
                    if let Err(err) = platform.stop_after_refusal(&code, drain).await {
                        outcome = Err(err);
                        break;
                    }
                }
            },
            result = platform.ended(), if platform.is_running() => {
                outcome = result;
                if outcome.is_ok() {
                    info!(%channel, "platform input ended, draining");
                }
                break;
            }
            result = &mut connection => {
                connection_done = true;
                outcome = result.unwrap_or(Err(RunError::Panicked));
                break;
            }
        }
    }

    // Drain: the platform side stops taking input (its token is a child of `closing`) while
    // hub requests in flight finish on its still-open platform connection; then it is told
    // no more come and must return.
    shared.closing.cancel();
    if !shared.is_connected() {
        // No hub to answer: let the platform side settle what it holds as unresolved now.
        abandon_pending(&shared);
    }
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        warn!(
            in_flight = tracker.len(),
            "in-flight requests did not finish within the drain deadline"
        );
    }
    if let Err(err) = platform.stop(drain).await {
        outcome = outcome.and(Err(err));
    }
    session_token.cancel();
    if !connection_done && let Ok(Err(err)) = connection.await {
        outcome = outcome.and(Err(err));
    }
    abandon_pending(&shared);
    outcome
}

/// Resolves every unanswered inbound as unresolved (the platform redelivers them).
fn abandon_pending(shared: &Shared) {
    let abandoned = shared.lock().pending.abandon_all();
    if abandoned > 0 {
        shared.slots.add_permits(abandoned);
        info!(
            abandoned,
            "inbound messages were never accepted by the hub; the platform redelivers them"
        );
    }
}

/// The platform side: at most one `run` at a time, started on admission and stopped on
/// refusal or shutdown.
struct PlatformSide<D> {
    driver: Arc<D>,
    shared: Arc<Shared>,
    running: Option<Running>,
}

/// A `run` in progress: its task, its stop token, its requests-done token and the deadline
/// of its stop ([`Hub::stop_deadline`]).
struct Running {
    task: JoinHandle<Result<(), DriverError>>,
    stop: CancellationToken,
    idle: CancellationToken,
    stop_by: Arc<OnceLock<std::time::Instant>>,
}

impl<D: Driver> PlatformSide<D> {
    fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Starts `run` unless it is running or the process is stopping.
    fn start(&mut self) {
        if self.running.is_some() || self.shared.closing.is_cancelled() {
            return;
        }
        let stop = self.shared.closing.child_token();
        let idle = CancellationToken::new();
        // A new run reports its own link state; an old one's is stale.
        self.shared.lock().health = None;
        let stop_by = Arc::new(OnceLock::new());
        let hub = Hub {
            shared: self.shared.clone(),
            stop: stop.clone(),
            idle: idle.clone(),
            stop_by: stop_by.clone(),
        };
        let driver = self.driver.clone();
        let token = stop.clone();
        debug!(channel = %self.shared.launch.channel, "the hub accepted the driver; starting the platform side");
        let task = tokio::spawn(async move { driver.run(hub, token).await });
        self.running = Some(Running { task, stop, idle, stop_by });
    }

    /// Waits for `run` to return by itself. Only polled while running.
    async fn ended(&mut self) -> Result<(), RunError> {
        let Some(running) = self.running.as_mut() else {
            return std::future::pending().await;
        };
        let result = (&mut running.task).await;
        self.running = None;
        run_result(result)
    }

    /// The hub refused this driver (another one serves the instance): stop the platform side
    /// so the two never share the platform session, and give up what it holds.
    async fn stop_after_refusal(&mut self, code: &str, drain: Duration) -> Result<(), RunError> {
        if self.running.is_none() {
            return Ok(());
        }
        warn!(
            channel = %self.shared.launch.channel,
            %code,
            "the hub refused this driver; disconnecting from the platform until it accepts it again"
        );
        if let Some(running) = &self.running {
            running.stop.cancel();
        }
        abandon_pending(&self.shared);
        self.stop(drain).await
    }

    /// Asks `run` to stop, tells it no more hub requests come, and waits up to `drain`;
    /// aborts it after that. The deadline `run` sees ([`Hub::stop_deadline`]) is never
    /// later: fixed now unless `run` asked for it earlier, when its token fired.
    async fn stop(&mut self, drain: Duration) -> Result<(), RunError> {
        let Some(Running { mut task, stop, idle, stop_by }) = self.running.take() else {
            return Ok(());
        };
        stop_by.get_or_init(|| std::time::Instant::now() + drain);
        stop.cancel();
        idle.cancel();
        match tokio::time::timeout(drain, &mut task).await {
            Ok(result) => run_result(result),
            Err(_) => {
                task.abort();
                error!(
                    channel = %self.shared.launch.channel,
                    ?drain,
                    "the platform side ignored the request to stop and was aborted"
                );
                Err(RunError::Aborted(drain))
            }
        }
    }
}

fn run_result(
    result: Result<Result<(), DriverError>, tokio::task::JoinError>,
) -> Result<(), RunError> {
    match result {
        Ok(Ok(())) | Ok(Err(DriverError::Hub(HubError::ShuttingDown))) => Ok(()),
        Ok(Err(err)) => Err(err.into()),
        Err(_) => Err(RunError::Panicked),
    }
}

async fn connection_loop<D: Driver>(
    driver: Arc<D>,
    shared: Arc<Shared>,
    tracker: TaskTracker,
    session_token: CancellationToken,
    admissions: mpsc::Sender<Admission>,
) -> Result<(), RunError> {
    let mut backoff = Backoff::hub_reconnect();
    let channel = shared.launch.channel.clone();
    let socket = shared.launch.socket.clone();
    let recent = Arc::new(Mutex::new(RecentPosts::default()));
    let mut failures = 0u32;
    let mut refusals = 0u32;
    loop {
        if session_token.is_cancelled() {
            return Ok(());
        }
        match UnixStream::connect(&socket).await {
            Ok(stream) => {
                failures = 0;
                let up = Instant::now();
                let session = Session {
                    driver: driver.clone(),
                    shared: shared.clone(),
                    tracker: tracker.clone(),
                    recent: recent.clone(),
                    handlers: Arc::new(Semaphore::new(MAX_CONCURRENT_HANDLERS)),
                    queued: Arc::new(Semaphore::new(MAX_QUEUED_REQUESTS)),
                };
                let end = session.run(stream, &session_token, &admissions).await;
                backoff.record_uptime(up.elapsed());
                match end {
                    SessionEnd::Finished => return Ok(()),
                    SessionEnd::Refused { code, message, retryable } => {
                        let _ = admissions.send(Admission::Refused { code: code.clone() }).await;
                        if !retryable {
                            return Err(RunError::Refused { code, message });
                        }
                        refusals += 1;
                        if refusals == 1 {
                            warn!(%channel, %code, %message, "the hub refused this driver for now; retrying");
                        } else {
                            debug!(%channel, %code, attempt = refusals, "the hub still refuses this driver");
                        }
                    }
                    SessionEnd::HubStopped => {
                        refusals = 0;
                        info!(%channel, "the hub is stopping; reconnecting when it is back");
                    }
                    SessionEnd::Lost(reason) => {
                        refusals = 0;
                        warn!(%channel, %reason, "lost the hub connection, reconnecting");
                    }
                }
            }
            Err(err) => {
                if let Some(problem) = socket_problem(&socket) {
                    return Err(
                        DriverError::Config(ConfigError::invalid(ENV_SOCKET[0], problem)).into()
                    );
                }
                failures += 1;
                if failures == 1 {
                    warn!(%channel, socket = %socket.display(), error = %err, "cannot reach the hub, retrying");
                } else {
                    debug!(%channel, error = %err, attempt = failures, "hub still unreachable");
                }
            }
        }
        let delay = backoff.next_delay();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = session_token.cancelled() => return Ok(()),
        }
    }
}
