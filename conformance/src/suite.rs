//! The run: binds the hub socket, starts the driver, and runs the checks in [`CHECKS`] order
//! over as few sessions as possible. A driver that crashes or hangs up fails the check it was
//! in; the next check gets it back (reconnected, or restarted) so one fault fails one check.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::types::DeliveryReceipt;
use channeld_protocol::{ChannelId, Id};
use tokio::net::UnixListener;

use crate::cli::Options;
use crate::conn::{Conn, Handshake, HubMode, WaitError};
use crate::driver::{DriverProcess, Launch, SpawnError};
use crate::report::CheckResult;
use crate::secrets::{self, CANARY_VAR, Leaks, Place, Scanner, Watched};

/// Every check, in the order they run and are reported.
pub const CHECKS: [&str; 17] = [
    "hello",
    "health",
    "outbound",
    "outbound_repeat",
    "undeclared_effect",
    "undeclared_command",
    "error_frame",
    "invalid_line",
    "oversize_line",
    "inject_inbound",
    "deliver_once",
    "reference_hub",
    "inject_redelivery",
    "reconnect",
    "sigterm",
    "secret",
    "frames",
];

/// How long a driver whose connection the hub closed may take to come back. The SDK's third
/// wait is 4 s ± 25 %.
pub(crate) const RECONNECT_WAIT: Duration = Duration::from_secs(10);
/// How long a driver that closed its connection gets to exit, so a crash is reported as one.
const EXIT_NOTICE: Duration = Duration::from_secs(2);
/// How long a freshly started driver may take to connect, at least.
const FIRST_CONNECT: Duration = Duration::from_secs(10);

/// Why the checks could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    #[error("cannot create a directory for the hub socket: {0}")]
    TempDir(std::io::Error),
    #[error("cannot listen on {path}: {source}")]
    Bind { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Spawn(#[from] SpawnError),
}

/// One connection with its handshake.
#[derive(Debug)]
pub(crate) struct Session {
    pub conn: Conn,
    pub hs: Handshake,
}

/// An inbound the kit left unanswered so the driver has to resend it after a reconnect.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub event_id: Id,
    pub text: String,
}

pub(crate) struct Suite<'r> {
    pub opts: Options,
    listener: UnixListener,
    _dir: tempfile::TempDir,
    launch: Launch,
    pub driver: Option<DriverProcess>,
    pub session: Option<Session>,
    /// Undecodable lines from connections already closed.
    pub bad_lines: Vec<String>,
    pub nonce: String,
    /// The first `outbound`'s receipt, for `outbound_repeat`.
    pub receipt: Option<DeliveryReceipt>,
    pub pending: Option<Pending>,
    results: Vec<CheckResult>,
    on_result: Box<dyn FnMut(&CheckResult) + 'r>,
}

/// Runs every check against `opts.program`; `on_result` sees each result as it is decided.
pub async fn run<'r>(
    opts: Options,
    on_result: impl FnMut(&CheckResult) + 'r,
) -> Result<Vec<CheckResult>, KitError> {
    let mut suite = Suite::new(opts, Box::new(on_result))?;
    suite.restart().map_err(KitError::Spawn)?;
    suite.run_checks().await;
    Ok(suite.results)
}

impl<'r> Suite<'r> {
    fn new(opts: Options, on_result: Box<dyn FnMut(&CheckResult) + 'r>) -> Result<Self, KitError> {
        let dir = tempfile::Builder::new()
            .prefix("channeld-conformance-")
            .tempdir()
            .map_err(KitError::TempDir)?;
        let socket = dir.path().join("hub.sock");
        let listener = UnixListener::bind(&socket)
            .map_err(|source| KitError::Bind { path: socket.clone(), source })?;
        let canary = secrets::canary();
        let mut watched = vec![Watched::new(CANARY_VAR, canary.clone())];
        let mut env = vec![(CANARY_VAR.to_owned(), canary)];
        for var in &opts.secrets {
            match std::env::var(var) {
                Ok(value) if !value.is_empty() => watched.push(Watched::new(var, value)),
                _ => {
                    let value = secrets::canary();
                    env.push((var.clone(), value.clone()));
                    watched.push(Watched::new(var, value));
                }
            }
        }
        let socket_text = socket.display().to_string();
        let channel = opts.channel.to_string();
        env.extend([
            ("CHANNELD_CHANNEL_ID".to_owned(), channel.clone()),
            ("CORTEXFS_CHANNEL_ID".to_owned(), channel),
            ("CHANNELD_SOCKET".to_owned(), socket_text.clone()),
            ("CORTEXFS_CHANNEL_SOCKET".to_owned(), socket_text),
            ("CHANNELD_DRAIN_SECONDS".to_owned(), opts.drain.as_secs().to_string()),
        ]);
        let nonce = secrets::canary()["canary-".len()..].chars().take(12).collect::<String>();
        let launch = Launch {
            program: opts.program.clone(),
            args: opts.args.clone(),
            env,
            watched: Arc::from(watched),
            leaks: Leaks::default(),
        };
        Ok(Self {
            opts,
            listener,
            _dir: dir,
            launch,
            driver: None,
            session: None,
            bad_lines: Vec::new(),
            nonce,
            receipt: None,
            pending: None,
            results: Vec::new(),
            on_result,
        })
    }

    pub fn restart(&mut self) -> Result<(), SpawnError> {
        self.driver = Some(DriverProcess::spawn(&self.launch)?);
        Ok(())
    }

    async fn run_checks(&mut self) {
        match self.connect(HubMode::Extensions, self.first_connect()).await {
            Ok(session) => {
                let result = self.check_hello(&session.hs);
                self.session = Some(session);
                self.record(result);
            }
            Err(reason) => {
                self.record(CheckResult::fail("hello", reason));
                for name in &CHECKS[1..CHECKS.len() - 2] {
                    self.record(CheckResult::skip(name, "no session: the driver never said hello"));
                }
                self.finish_driver().await;
                let secret = self.check_secret();
                self.record(secret);
                let frames = self.check_frames();
                self.record(frames);
                return;
            }
        }
        let result = self.check_health().await;
        self.record(result);
        let result = self.check_outbound().await;
        self.record(result);
        let result = self.check_outbound_repeat().await;
        self.record(result);
        let result = self.check_undeclared_effect().await;
        self.record(result);
        let result = self.check_undeclared_command().await;
        self.record(result);
        let result = self.check_error_frame().await;
        self.record(result);
        let result = self.check_invalid_line().await;
        self.record(result);
        let result = self.check_oversize_line().await;
        self.record(result);
        let result = self.check_inject_inbound().await;
        self.record(result);
        let result = self.check_deliver_once().await;
        self.record(result);
        let [reference, redelivery, reconnect] = self.reconnect_phase().await;
        self.record(reference);
        self.record(redelivery);
        self.record(reconnect);
        let result = self.check_sigterm().await;
        self.record(result);
        self.finish_driver().await;
        let secret = self.check_secret();
        self.record(secret);
        let frames = self.check_frames();
        self.record(frames);
    }

    fn record(&mut self, result: CheckResult) {
        (self.on_result)(&result);
        self.results.push(result);
    }

    pub fn channel(&self) -> &ChannelId {
        &self.opts.channel
    }

    fn first_connect(&self) -> Duration {
        self.opts.timeout.max(FIRST_CONNECT)
    }

    /// The live session, reconnected or restarted if the last check lost it; the error says
    /// why there is none.
    pub async fn live(&mut self) -> Result<&mut Session, String> {
        let alive = self.session.as_ref().is_some_and(|s| !s.conn.is_closed());
        if !alive {
            self.drop_session();
            let running = match self.driver.as_mut() {
                Some(driver) => driver.exited_within(Duration::from_millis(300)).await.is_none(),
                None => false,
            };
            let back = if running {
                self.connect(HubMode::Extensions, RECONNECT_WAIT).await.ok()
            } else {
                None
            };
            let session = match back {
                Some(session) => session,
                None => {
                    self.finish_driver().await;
                    self.restart().map_err(|err| err.to_string())?;
                    self.connect(HubMode::Extensions, self.first_connect())
                        .await
                        .map_err(|reason| format!("restarted the driver, but: {reason}"))?
                }
            };
            self.session = Some(session);
        }
        self.session.as_mut().ok_or_else(|| "no session".to_owned())
    }

    /// Waits up to `limit` for the driver to connect and shakes hands as `mode` says.
    pub async fn connect(&mut self, mode: HubMode, limit: Duration) -> Result<Session, String> {
        let conn = self.accept(limit).await?;
        self.handshake(conn, mode).await
    }

    /// Waits up to `limit` for the driver to connect; gives up early when it exits first.
    pub async fn accept(&mut self, limit: Duration) -> Result<Conn, String> {
        let deadline = tokio::time::Instant::now() + limit;
        let accepted = loop {
            let slice = tokio::time::sleep(Duration::from_millis(100));
            tokio::select! {
                accepted = self.listener.accept() => break Some(accepted),
                () = slice => {}
            }
            let exited = self.driver.as_mut().is_none_or(|driver| driver.exited().is_some());
            if exited || tokio::time::Instant::now() >= deadline {
                break None;
            }
        };
        match accepted {
            Some(Ok((stream, _))) => {
                let scanner = Scanner::new(
                    self.launch.watched.clone(),
                    Place::Wire,
                    self.launch.leaks.clone(),
                );
                Ok(Conn::new(stream, scanner, self.opts.timeout))
            }
            Some(Err(err)) => Err(format!("accept failed: {err}")),
            None => {
                let exited =
                    self.driver.as_mut().map(|d| (d.exited().is_some(), d.describe_exit()));
                match exited {
                    Some((true, exit)) => Err(format!("no connection: {exit}")),
                    _ => Err(format!("the driver did not connect within {limit:?}")),
                }
            }
        }
    }

    pub async fn handshake(&mut self, mut conn: Conn, mode: HubMode) -> Result<Session, String> {
        match conn.handshake(mode).await {
            Ok(hs) => Ok(Session { conn, hs }),
            Err(reason) => {
                self.bad_lines.append(&mut conn.bad_lines);
                let exit = self.exit_note().await;
                Err(format!("{reason}{exit}"))
            }
        }
    }

    /// Closes the current connection from the hub's side.
    pub fn drop_session(&mut self) {
        if let Some(mut session) = self.session.take() {
            self.bad_lines.append(&mut session.conn.bad_lines);
        }
    }

    /// Stops the current driver process (killed if still running) and reads its output.
    pub async fn finish_driver(&mut self) {
        self.drop_session();
        if let Some(driver) = self.driver.take() {
            driver.finish().await;
        }
    }

    /// `; the driver exited (…)` when it has (or does within [`EXIT_NOTICE`]), for reasons.
    pub async fn exit_note(&mut self) -> String {
        let Some(driver) = self.driver.as_mut() else { return String::new() };
        match driver.exited_within(EXIT_NOTICE).await {
            Some(_) => format!("; {}", driver.describe_exit()),
            None => String::new(),
        }
    }

    /// A wait's failure as a reason, with the driver's exit when the connection ended.
    pub async fn explain(&mut self, err: WaitError) -> String {
        match err {
            WaitError::Closed { .. } => format!("{err}{}", self.exit_note().await),
            err => err.to_string(),
        }
    }

    /// Every variable watched for leaks.
    pub fn watched_vars(&self) -> Vec<String> {
        self.launch.watched.iter().map(|w| w.var.clone()).collect()
    }

    pub fn leaks(&self) -> &Leaks {
        &self.launch.leaks
    }
}
