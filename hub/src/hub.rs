//! The hub: binds the sockets, serves driver, controller and control connections, supervises
//! spawned drivers, probes health, and shuts down gracefully.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use channeld_protocol::ext::{CommandRefusal, Extensions};
use channeld_protocol::frame::{CommandFrame, Delivery, Lifecycle};
use channeld_protocol::types::{
    Command, DeliveryReceipt, Health, HealthState, MessageTarget, OutboundMessage,
};
use channeld_protocol::{ChannelId, Frame, Id};
use tokio::net::UnixListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::config::HubConfig;
use crate::instance::{Connection, Counters, Instance, ReceiptOutcome};
use crate::ledger::Ledger;
use crate::outbox::OutboxOutcome;
use crate::runtime::CommandAnswer;

/// Extensions this hub implements and offers to peers that declare them.
pub const HUB_EXTENSIONS: Extensions = Extensions {
    accepted: true,
    control_result: true,
    responder: true,
    health_status: true,
    reply_receipt: true,
    operator_action: false,
};

/// The hub's name and version, sent in `hello_ack`.
pub const HUB_NAME: &str = concat!("channeld/", env!("CARGO_PKG_VERSION"));

/// Why the hub could not start.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot bind {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("another hub is already listening on {0}")]
    InUse(PathBuf),
}

/// Sockets bound before the hub runs (bind outside, run inside).
#[derive(Debug)]
pub struct Listeners {
    pub control: UnixListener,
    pub instances: Vec<(ChannelId, UnixListener)>,
    paths: Vec<PathBuf>,
}

/// Binds the control socket and one socket per instance (mode 0660), removing stale socket
/// files left by a hub that died. Fails if another hub is listening on any of them.
///
/// The control socket is bound last, so a client that can connect to it knows every instance
/// socket is there too.
pub fn bind(config: &HubConfig) -> Result<Listeners, HubError> {
    let mut paths = Vec::new();
    let mut instances = Vec::new();
    for instance in &config.instances {
        let listener = match bind_one(&instance.socket) {
            Ok(listener) => listener,
            Err(err) => {
                remove_sockets(&paths);
                return Err(err);
            }
        };
        paths.push(instance.socket.clone());
        instances.push((instance.id.clone(), listener));
    }
    let control = match bind_one(&config.control_socket) {
        Ok(control) => control,
        Err(err) => {
            remove_sockets(&paths);
            return Err(err);
        }
    };
    paths.push(config.control_socket.clone());
    Ok(Listeners { control, instances, paths })
}

fn bind_one(path: &Path) -> Result<UnixListener, HubError> {
    let bind_err = |source| HubError::Bind { path: path.to_owned(), source };
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(bind_err)?;
    }
    if path.exists() {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(HubError::InUse(path.to_owned())),
            Err(_) => std::fs::remove_file(path).map_err(bind_err)?,
        }
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
    Ok(listener)
}

fn remove_sockets(paths: &[PathBuf]) {
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}

/// Where a proactive send stands when the caller gets its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendState {
    /// The driver posted it (the receipt is attached).
    Receipted,
    /// Handed to the driver; the caller did not wait for the receipt.
    Handed,
    /// In the outbox, waiting for the driver to connect.
    Queued,
}

impl SendState {
    pub fn as_str(self) -> &'static str {
        match self {
            SendState::Receipted => "receipted",
            SendState::Handed => "handed",
            SendState::Queued => "queued",
        }
    }
}

/// How a proactive send went, from the caller's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendOutcome {
    pub request_id: Id,
    /// The outbox record, when the ledger is on.
    pub outbox_id: Option<i64>,
    pub state: SendState,
    pub receipt: Option<DeliveryReceipt>,
}

impl SendOutcome {
    pub fn receipted(request_id: Id, outbox_id: Option<i64>, receipt: DeliveryReceipt) -> Self {
        Self { request_id, outbox_id, state: SendState::Receipted, receipt: Some(receipt) }
    }

    pub fn handed(request_id: Id, outbox_id: Option<i64>) -> Self {
        Self { request_id, outbox_id, state: SendState::Handed, receipt: None }
    }

    pub fn queued(request_id: Id, outbox_id: Option<i64>) -> Self {
        Self { request_id, outbox_id, state: SendState::Queued, receipt: None }
    }
}

/// Why a proactive send did not produce a receipt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    #[error("no instance named {0}")]
    UnknownInstance(String),
    #[error("target channel {found} does not match instance {expected}")]
    WrongChannel { expected: String, found: String },
    #[error("driver for {0} is not connected")]
    Offline(String),
    #[error("driver did not declare {0}")]
    NotDeclared(&'static str),
    #[error("message does not fit in a frame: {0}")]
    TooLarge(String),
    #[error("driver reported failure: {code}: {message}")]
    Failed { request_id: Id, code: String, message: String },
    #[error("delivery outcome unknown: {reason}")]
    Unknown { request_id: Id, reason: String },
    #[error("idempotency keys need the ledger: configure hub.state_dir")]
    NeedsLedger,
    #[error("ledger: {0}")]
    Ledger(#[from] crate::ledger::LedgerError),
}

impl SendError {
    /// The machine-readable code used by the control protocol.
    pub fn code(&self) -> &'static str {
        match self {
            SendError::UnknownInstance(_) => "unknown_instance",
            SendError::WrongChannel { .. } => "invalid_target",
            SendError::Offline(_) => "driver_offline",
            SendError::NotDeclared(_) => "not_declared",
            SendError::TooLarge(_) => "too_large",
            SendError::Failed { .. } => "send_failed",
            SendError::Unknown { .. } => "outcome_unknown",
            SendError::NeedsLedger => "invalid_request",
            SendError::Ledger(_) => "ledger_unavailable",
        }
    }
}

/// Why a command did not get an answer from a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Refused(#[from] CommandRefusal),
    #[error("driver disconnected before answering")]
    Disconnected,
    #[error("no answer within {0} s")]
    Timeout(u64),
    #[error("command could not be sent: {0}")]
    Send(String),
}

/// The running hub, shared by every task.
#[derive(Debug)]
pub struct Hub {
    pub(crate) self_ref: std::sync::Weak<Hub>,
    pub config: HubConfig,
    pub instances: BTreeMap<ChannelId, Arc<Instance>>,
    /// Cancelled when the hub starts shutting down.
    pub shutdown: CancellationToken,
    /// Cancelled after runs drained: connection handlers say `stop` and close.
    pub close_connections: CancellationToken,
    /// Cancelled once every listener is served ("hub ready"; systemd's `READY=1`).
    pub ready: CancellationToken,
    /// Inbound runs in flight (drained on shutdown).
    pub runs: TaskTracker,
    pub started: SystemTime,
    pub ledger: Ledger,
    /// Callers waiting for an outbox record to settle, by record id.
    pub outbox_waiters: std::sync::Mutex<HashMap<i64, Vec<oneshot::Sender<OutboxOutcome>>>>,
    /// Exit status of an interactive child (the demo's console), once it exited.
    pub child_exit: std::sync::Mutex<Option<i32>>,
    next_conn: AtomicU64,
    next_request: AtomicU64,
    boot: String,
}

impl Hub {
    pub fn new(config: HubConfig, ledger: Ledger, shutdown: CancellationToken) -> Arc<Self> {
        let instances = config
            .instances
            .iter()
            .map(|inst| {
                let runtime = config.runtime_for(inst).clone();
                (inst.id.clone(), Arc::new(Instance::new(inst.clone(), runtime)))
            })
            .collect();
        Arc::new_cyclic(|self_ref| Self {
            self_ref: self_ref.clone(),
            config,
            instances,
            shutdown,
            close_connections: CancellationToken::new(),
            ready: CancellationToken::new(),
            runs: TaskTracker::new(),
            started: SystemTime::now(),
            ledger,
            outbox_waiters: std::sync::Mutex::new(HashMap::new()),
            child_exit: std::sync::Mutex::new(None),
            next_conn: AtomicU64::new(1),
            next_request: AtomicU64::new(1),
            boot: boot_nonce(),
        })
    }

    pub fn instance(&self, id: &str) -> Option<&Arc<Instance>> {
        self.instances.get(id)
    }

    pub fn next_connection_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// A request id unique across hub restarts: `<kind>-<boot nonce>-<sequence>`.
    pub fn request_id(&self, kind: &str) -> Id {
        let seq = self.next_request.fetch_add(1, Ordering::Relaxed);
        Id::new(format!("{kind}-{}-{seq}", self.boot)).expect("generated ids are short and valid")
    }

    /// Hands an `outbound` to `conn` and registers for its receipt. Fails without sending
    /// when the driver did not declare `send` or the connection is gone.
    pub async fn handover(
        &self,
        inst: &Instance,
        conn: &Arc<Connection>,
        request_id: &Id,
        message: OutboundMessage,
    ) -> Result<oneshot::Receiver<ReceiptOutcome>, SendError> {
        if !conn.declaration.can_send() {
            return Err(SendError::NotDeclared("send"));
        }
        let waiter = conn
            .expect_receipt(request_id.clone())
            .ok_or_else(|| SendError::Offline(inst.config.id.to_string()))?;
        let frame = Frame::Outbound(Delivery { request_id: request_id.clone(), message });
        if let Err(err) = conn.sink.send(&frame).await {
            conn.forget_receipt(request_id);
            return Err(match err {
                channeld_link::SinkError::Encode(err) => SendError::TooLarge(err.to_string()),
                _ => SendError::Offline(inst.config.id.to_string()),
            });
        }
        Counters::bump(&inst.counters.outbound);
        Ok(waiter)
    }

    /// Waits up to `timeout` for the receipt of a handed-over `outbound`.
    pub async fn settle(
        conn: &Connection,
        request_id: Id,
        waiter: oneshot::Receiver<ReceiptOutcome>,
        timeout: Duration,
    ) -> Result<DeliveryReceipt, SendError> {
        match tokio::time::timeout(timeout, waiter).await {
            Ok(Ok(ReceiptOutcome::Receipted(receipt))) => Ok(receipt),
            Ok(Ok(ReceiptOutcome::Failed { code, message })) => {
                Err(SendError::Failed { request_id, code, message })
            }
            Ok(Ok(ReceiptOutcome::Unknown { reason })) => {
                Err(SendError::Unknown { request_id, reason })
            }
            Ok(Err(_)) => {
                Err(SendError::Unknown { request_id, reason: "driver disconnected".into() })
            }
            Err(_) => {
                conn.forget_receipt(&request_id);
                Err(SendError::Unknown {
                    request_id,
                    reason: format!("no receipt within {} s", timeout.as_secs()),
                })
            }
        }
    }

    /// Sends an `outbound` with a given request id on a given connection; with `wait`, waits
    /// up to that long for the receipt.
    pub async fn send_on(
        &self,
        inst: &Instance,
        conn: &Arc<Connection>,
        request_id: Id,
        message: OutboundMessage,
        wait: Option<Duration>,
    ) -> Result<SendOutcome, SendError> {
        let waiter = self.handover(inst, conn, &request_id, message).await?;
        let Some(timeout) = wait else {
            // Nobody waits: the receipt is still counted when it arrives.
            return Ok(SendOutcome::handed(request_id, None));
        };
        let receipt = Self::settle(conn, request_id.clone(), waiter, timeout).await?;
        Ok(SendOutcome::receipted(request_id, None, receipt))
    }

    /// Presents a command on `conn` and waits for the answer (fails closed).
    pub async fn command(
        &self,
        conn: &Arc<Connection>,
        session: Id,
        command_id: Id,
        command: Command,
        target: Option<MessageTarget>,
        timeout: Duration,
    ) -> Result<CommandAnswer, CommandError> {
        conn.declaration.command_gate(&command)?;
        let request_id = self.request_id("cmd");
        let waiter = conn.expect_command(request_id.clone()).ok_or(CommandError::Disconnected)?;
        let frame = Frame::Command(CommandFrame {
            request_id: request_id.clone(),
            session: session.clone(),
            command_id: command_id.clone(),
            command,
            target,
        });
        if let Err(err) = conn.sink.send(&frame).await {
            conn.forget_command(&request_id);
            return Err(CommandError::Send(err.to_string()));
        }
        match tokio::time::timeout(timeout, waiter).await {
            Ok(Ok(result)) => {
                if result.session != session || result.command_id != command_id {
                    warn!(%request_id, "command_result does not match its command; treated as rejected");
                    return Ok(CommandAnswer::rejected("mismatched command result"));
                }
                Ok(CommandAnswer { result: result.result, responder: result.responder })
            }
            Ok(Err(_)) => Err(CommandError::Disconnected),
            Err(_) => {
                conn.forget_command(&request_id);
                Err(CommandError::Timeout(timeout.as_secs()))
            }
        }
    }

    /// Asks the live driver for its health; a missing driver or a timeout is `Unavailable`.
    pub async fn probe(&self, inst: &Instance) -> Health {
        let Some(conn) = inst.live() else {
            return Health::new(HealthState::Unavailable, Some("no driver connected".into()));
        };
        let request_id = self.request_id("health");
        let Some(waiter) = conn.expect_health(request_id.clone()) else {
            return Health::new(HealthState::Unavailable, Some("driver disconnected".into()));
        };
        let frame = Frame::HealthRequest(Lifecycle { request_id: request_id.clone() });
        if conn.sink.send(&frame).await.is_err() {
            conn.forget_health(&request_id);
            return Health::new(HealthState::Unavailable, Some("driver disconnected".into()));
        }
        let timeout = self.config.health_probe_timeout;
        let health = match tokio::time::timeout(timeout, waiter).await {
            Ok(Ok(health)) => health,
            Ok(Err(_)) => Health::new(HealthState::Unavailable, Some("driver disconnected".into())),
            Err(_) => {
                conn.forget_health(&request_id);
                Health::new(
                    HealthState::Unavailable,
                    Some(format!("no health_response within {} s", timeout.as_secs())),
                )
            }
        };
        inst.set_health(health.clone());
        health
    }
}

/// Runs the hub on already-bound listeners until `shutdown` is cancelled, then drains and
/// removes its sockets.
pub async fn run(
    config: HubConfig,
    ledger: Ledger,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let hub = Hub::new(config, ledger, shutdown.clone());
    run_hub(hub, listeners).await
}

/// Opens the ledger named by the config: on with a state directory, off without one.
pub fn open_ledger(config: &HubConfig) -> Result<Ledger, crate::ledger::LedgerError> {
    match &config.state_dir {
        Some(dir) => {
            let durability = match config.durability {
                crate::config::DurabilityMode::Full => crate::ledger::Durability::Full,
                crate::config::DurabilityMode::Normal => crate::ledger::Durability::Normal,
            };
            Ledger::open(dir, durability)
        }
        None => Ok(Ledger::off()),
    }
}

/// [`run`] for a hub built by the caller (the demo keeps a handle).
pub async fn run_hub(hub: Arc<Hub>, listeners: Listeners) -> io::Result<()> {
    for inst in hub.instances.values() {
        if inst.config.allow.denies_everyone() {
            warn!(
                instance = %inst.config.id,
                "sender allowlist is empty: every inbound message will be denied (set allow = [...] or allow_all = true)"
            );
        }
    }
    match hub.ledger.path() {
        Some(path) => info!(ledger = %path.display(), "ledger on"),
        None => warn!(
            "no state directory: the ledger is off, so inbound dedupe, the outbox and /new sessions do not survive a restart"
        ),
    }
    crate::recovery::restore(&hub).await;
    let tasks = TaskTracker::new();
    let Listeners { control, instances, paths } = listeners;
    for (id, listener) in instances {
        let inst = hub.instances[&id].clone();
        tasks.spawn(crate::conn::accept_loop(hub.clone(), inst, listener, tasks.clone()));
    }
    tasks.spawn(crate::control::accept_loop(hub.clone(), control, tasks.clone()));
    let supervisors = TaskTracker::new();
    for inst in hub.instances.values() {
        if !inst.config.spawn.is_empty() {
            supervisors.spawn(crate::supervisor::supervise(hub.clone(), inst.clone()));
        }
    }
    tasks.spawn(crate::health::probe_loop(hub.clone()));
    tasks.spawn(crate::recovery::housekeeping(hub.clone()));
    info!(
        instances = hub.instances.len(),
        control = %hub.config.control_socket.display(),
        "hub ready"
    );
    hub.ready.cancel();

    hub.shutdown.cancelled().await;
    info!("shutting down: no new connections, draining runs");
    hub.runs.close();
    if tokio::time::timeout(hub.config.drain_timeout, hub.runs.wait()).await.is_err() {
        warn!(
            runs = hub.runs.len(),
            "runs still in flight after the drain deadline; abandoning them"
        );
    }
    hub.close_connections.cancel();
    supervisors.close();
    supervisors.wait().await;
    tasks.close();
    if tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await.is_err() {
        warn!("some connections did not close in time");
    }
    remove_sockets(&paths);
    info!("hub stopped");
    Ok(())
}

pub(crate) fn boot_nonce() -> String {
    let mut bytes = [0u8; 6];
    let from_urandom = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| io::Read::read_exact(&mut f, &mut bytes))
        .is_ok();
    if !from_urandom {
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let mixed = nanos ^ (u128::from(std::process::id()) << 64);
        bytes.copy_from_slice(&mixed.to_le_bytes()[..6]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
