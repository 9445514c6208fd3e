//! The hub's TOML configuration: hub settings, runtimes (who answers), and channel instances.
//!
//! Unknown keys are errors, and every error names the key (and line) it is about.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::ChannelId;
use serde::Deserialize;

pub use crate::peer::PeerRule;
use crate::peer::Principal;
pub use reload::{InstancePolicy, Reload};

pub mod reload;
mod warnings;

/// Runtime directory when neither the config nor `--runtime-dir` names one.
pub const DEFAULT_RUNTIME_DIR: &str = "/run/channeld";
/// The runtime every instance uses unless it names another.
pub const DEFAULT_RUNTIME: &str = "default";
/// Runs of one instance at once (across its sessions) unless `max_inflight` says otherwise.
pub const DEFAULT_MAX_INFLIGHT: usize = 4;
/// Accepted inbound of one instance waiting for their turn unless `max_queued` says
/// otherwise; beyond, an inbound is refused `busy`.
pub const DEFAULT_MAX_QUEUED: usize = 64;
/// A denied sender is told at most once an hour unless `deny_notice_interval_secs` says
/// otherwise.
pub const DEFAULT_DENY_NOTICE_INTERVAL_SECS: u64 = 3600;
/// A conversation keeps this many history entries unless `history_max` says otherwise.
pub const DEFAULT_HISTORY_MAX: usize = 200;
/// Longest deny notice: far below the line limit, so its `deliver` frame always fits.
pub const MAX_DENY_NOTICE_BYTES: usize = 16 * 1024;

/// Why a configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), message: message.into() }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    hub: RawHub,
    #[serde(default)]
    runtime: BTreeMap<String, RawRuntime>,
    #[serde(default)]
    instance: BTreeMap<String, RawInstance>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHub {
    runtime_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    control_socket: Option<PathBuf>,
    max_inflight: Option<usize>,
    max_queued: Option<usize>,
    history_max: Option<usize>,
    receipt_timeout_secs: Option<u64>,
    command_timeout_secs: Option<u64>,
    health_probe_interval_secs: Option<u64>,
    health_probe_timeout_secs: Option<u64>,
    liveness_secs: Option<u64>,
    stall_timeout_secs: Option<u64>,
    drain_timeout_secs: Option<u64>,
    agent_env_wait_secs: Option<u64>,
    durability: Option<DurabilityMode>,
    cpu_scheduling: Option<CpuScheduling>,
    retention_days: Option<u64>,
    outbox_ttl_secs: Option<u64>,
    reply_ttl_secs: Option<u64>,
    control_allow_uids: Option<Vec<Principal>>,
    control_allow_gids: Option<Vec<Principal>>,
    metrics_listen: Option<String>,
    amqp_sends: Option<RawAmqpSends>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAmqpSends {
    url: Option<String>,
    queue: Option<String>,
    prefetch: Option<u16>,
}

/// Send-queue messages worked on at once unless `[hub.amqp_sends] prefetch` says otherwise.
pub const DEFAULT_AMQP_SENDS_PREFETCH: u16 = 16;

/// `[hub.amqp_sends]`: the hub consumes a RabbitMQ send queue (PROTOCOL.md, "Sends over
/// RabbitMQ").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpSendsConfig {
    pub url: BrokerUrl,
    pub queue: String,
    /// Unacknowledged messages at once (the consumer's prefetch): the sends in progress.
    pub prefetch: u16,
}

/// `hub.metrics_listen`: where `/metrics` is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsListen {
    /// A TCP address, e.g. `127.0.0.1:9464`.
    Tcp(std::net::SocketAddr),
    /// A Unix socket path (absolute), mode 0660 like the hub's other sockets.
    Unix(PathBuf),
}

impl MetricsListen {
    /// An absolute path is a Unix socket; anything else must be `host:port` with an IP host.
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        const KEY: &str = "hub.metrics_listen";
        if value.starts_with('/') {
            return Ok(MetricsListen::Unix(PathBuf::from(value)));
        }
        value.parse().map(MetricsListen::Tcp).map_err(|_| {
            invalid(
                KEY,
                format!(
                    "{value:?} is neither ip:port (e.g. 127.0.0.1:9464) nor an absolute socket path"
                ),
            )
        })
    }
}

impl std::fmt::Display for MetricsListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsListen::Tcp(addr) => write!(f, "{addr}"),
            MetricsListen::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// `hub.durability`: how hard each ledger commit pushes to disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DurabilityMode {
    /// Every commit survives power loss (an fsync per batch).
    Strict,
    /// What a caller or platform was told survives power loss; intermediate records survive
    /// a hub crash at once and power loss within `FLUSH_DELAY` (see README).
    #[default]
    Full,
    /// Survives a crash of the hub, not of the machine (`synchronous = NORMAL`).
    Normal,
}

/// `hub.cpu_scheduling`: the CPU scheduling policy of the hub's threads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuScheduling {
    /// `SCHED_BATCH` when started under the default policy: a woken hub thread does not
    /// preempt the running one, so the hub's threads hand each other work in batches (a
    /// durable send at 16 in flight on one CPU takes a third less CPU); under full CPUs a
    /// woken hub thread waits for the running task's slice (milliseconds). A policy set from
    /// outside (`CPUSchedulingPolicy=`, `chrt`) is left as it is.
    #[default]
    Batch,
    /// The policy the hub was started with.
    Inherit,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    kind: RuntimeKind,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    timeout_secs: Option<u64>,
    max_output_bytes: Option<usize>,
    #[serde(default)]
    stdin: StdinMode,
    url: Option<String>,
    queue: Option<String>,
    reply_queue: Option<String>,
    #[serde(default)]
    wake: Wake,
    max_runs: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInstance {
    socket: Option<PathBuf>,
    #[serde(default)]
    spawn: Vec<String>,
    #[serde(default)]
    spawn_env: BTreeMap<String, String>,
    runtime: Option<String>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    allow_all: bool,
    #[serde(default)]
    identity_isolation: bool,
    max_inflight: Option<usize>,
    max_queued: Option<usize>,
    deny_notice: Option<String>,
    deny_notice_interval_secs: Option<u64>,
    history: Option<bool>,
    history_max: Option<usize>,
    allow_uids: Option<Vec<Principal>>,
    allow_gids: Option<Vec<Principal>>,
}

/// Which runtime answers inbound messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeKind {
    /// Built in: replies with the message text.
    Echo,
    /// Runs a command per inbound run.
    Exec,
    /// Hands each run to `channeld-worker`s through a RabbitMQ run queue.
    Amqp,
}

pub use channeld_agent_exec::StdinMode;

/// What the exec runtime's envelope tells the agent about the inbound that woke it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Wake {
    /// The whole inbound message or event (text, attachments, the sender's names).
    #[default]
    Full,
    /// Its locator, sender id and conversation only: no text, attachments or display
    /// names. The agent reads the content with `read`, marked untrusted.
    BodyFree,
}

/// A runtime binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    pub name: String,
    pub kind: RuntimeKind,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    pub max_output_bytes: usize,
    pub stdin: StdinMode,
    /// Where an `amqp` runtime hands its runs.
    pub amqp: Option<AmqpTarget>,
    pub wake: Wake,
    /// At most this many runs at once of an instance using this runtime (applied at start,
    /// as the lower of it and the instance's `max_inflight`).
    pub max_runs: Option<usize>,
}

/// The broker and queues of an `amqp` runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpTarget {
    pub url: BrokerUrl,
    /// The run queue the workers consume.
    pub queue: String,
    /// This hub's reply queue.
    pub reply_queue: String,
}

/// A broker URL (it may hold a password): prints as `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl(String);

impl BrokerUrl {
    /// The value, for the one call that connects.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// `url = "env:NAME"` or `url = "credential:NAME"` (a file in `$CREDENTIALS_DIRECTORY`):
/// the URL itself never sits in the config file.
fn broker_url(key: &str, setting: &str) -> Result<BrokerUrl, ConfigError> {
    let value = if let Some(name) = setting.strip_prefix("env:") {
        std::env::var(name)
            .map_err(|_| invalid(key, format!("the environment variable {name} is not set")))?
    } else if let Some(name) = setting.strip_prefix("credential:") {
        if name.is_empty() || name.contains('/') {
            return Err(invalid(key, "a credential name is a plain file name"));
        }
        let dir = std::env::var_os("CREDENTIALS_DIRECTORY").ok_or_else(|| {
            invalid(key, format!("credential {name}: $CREDENTIALS_DIRECTORY is not set"))
        })?;
        let text = std::fs::read_to_string(Path::new(&dir).join(name))
            .map_err(|err| invalid(key, format!("credential {name} could not be read: {err}")))?;
        text.trim_end_matches(['\n', '\r']).to_owned()
    } else {
        return Err(invalid(
            key,
            "must be \"env:VARIABLE\" or \"credential:NAME\"; a broker URL is a secret and never sits in the config file",
        ));
    };
    // One URL, or a cluster's nodes separated by commas (tried in order).
    let urls = channeld_agent_exec::amqp::broker_urls(&value);
    if urls.is_empty()
        || !urls.iter().all(|url| url.starts_with("amqp://") || url.starts_with("amqps://"))
    {
        return Err(invalid(
            key,
            "the value it names is not an amqp:// or amqps:// URL (or a comma-separated list of them)",
        ));
    }
    Ok(BrokerUrl(value))
}

/// A queue name (RabbitMQ: at most 255 bytes, not `amq.`-prefixed).
fn queue_name(key: &str, name: Option<String>) -> Result<String, ConfigError> {
    let name = name.ok_or_else(|| invalid(key, "an amqp runtime needs it"))?;
    checked_queue_name(key, name)
}

fn checked_queue_name(key: &str, name: String) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 200 || name.starts_with("amq.") {
        return Err(invalid(key, "must be 1 to 200 bytes and not start with \"amq.\""));
    }
    Ok(name)
}

impl RuntimeConfig {
    pub fn echo() -> Self {
        Self {
            name: DEFAULT_RUNTIME.into(),
            kind: RuntimeKind::Echo,
            command: Vec::new(),
            env: BTreeMap::new(),
            timeout: Duration::from_secs(300),
            max_output_bytes: 1024 * 1024,
            stdin: StdinMode::Envelope,
            amqp: None,
            wake: Wake::Full,
            max_runs: None,
        }
    }
}

/// Who may talk to an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allowlist {
    /// Everyone (an explicit `allow_all = true`).
    All,
    /// These sender ids; empty denies everyone.
    Senders(Vec<String>),
}

impl Allowlist {
    pub fn permits(&self, sender: &str) -> bool {
        match self {
            Allowlist::All => true,
            Allowlist::Senders(ids) => !sender.is_empty() && ids.iter().any(|id| id == sender),
        }
    }

    pub fn denies_everyone(&self) -> bool {
        matches!(self, Allowlist::Senders(ids) if ids.is_empty())
    }
}

/// One channel instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceConfig {
    pub id: ChannelId,
    pub socket: PathBuf,
    pub spawn: Vec<String>,
    pub spawn_env: BTreeMap<String, String>,
    pub runtime: String,
    pub allow: Allowlist,
    pub identity_isolation: bool,
    /// Runs at once, across the instance's sessions.
    pub max_inflight: usize,
    /// Accepted inbound waiting for their turn; beyond, `busy`.
    pub max_queued: usize,
    /// Reply sent to a denied sender; `None` (the default) answers nothing on the platform.
    pub deny_notice: Option<String>,
    /// A denied sender is sent the notice at most once per this interval.
    pub deny_notice_interval: Duration,
    /// Conversation history (`history`, `history_max`): the entries kept per conversation,
    /// `None` when `history = false`. Needs the ledger.
    pub history: Option<usize>,
    /// Which local processes may connect to the socket (`allow_uids` / `allow_gids`).
    pub peers: PeerRule,
}

impl InstanceConfig {
    /// An instance with every setting at its default: nobody allowed, the default runtime,
    /// no spawned driver.
    pub fn new(id: ChannelId, socket: PathBuf) -> Self {
        Self {
            id,
            socket,
            spawn: Vec::new(),
            spawn_env: BTreeMap::new(),
            runtime: DEFAULT_RUNTIME.to_owned(),
            allow: Allowlist::Senders(Vec::new()),
            identity_isolation: false,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            max_queued: DEFAULT_MAX_QUEUED,
            deny_notice: None,
            deny_notice_interval: Duration::from_secs(DEFAULT_DENY_NOTICE_INTERVAL_SECS),
            history: Some(DEFAULT_HISTORY_MAX),
            peers: PeerRule::SocketMode,
        }
    }
}

/// The whole, validated configuration.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub runtime_dir: PathBuf,
    /// Where the ledger lives; `None` turns it off.
    pub state_dir: Option<PathBuf>,
    pub durability: DurabilityMode,
    pub cpu_scheduling: CpuScheduling,
    /// How long finished inbound entries (for dedupe) and final outbox records are kept.
    pub retention: Duration,
    /// How long a proactive send may wait in the outbox for an offline driver.
    pub outbox_ttl: Duration,
    /// How long a reply that could not be posted is retried before it expires
    /// (`hub.reply_ttl_secs`).
    pub reply_ttl: Duration,
    pub control_socket: PathBuf,
    /// Which local processes may use the control socket (`control_allow_uids` /
    /// `control_allow_gids`); the default is the socket's mode, as for instance sockets.
    pub control_peers: PeerRule,
    pub receipt_timeout: Duration,
    pub command_timeout: Duration,
    pub health_probe_interval: Duration,
    pub health_probe_timeout: Duration,
    /// A driver that sends nothing (not even a heartbeat) for this long is Unavailable.
    pub liveness: Duration,
    /// A driver connection whose socket the hub could not write to for this long (the
    /// driver stopped reading) is closed; a third of it marks the instance Degraded.
    pub stall_timeout: Duration,
    pub drain_timeout: Duration,
    /// After a restart, how long the runs recovered for an instance whose driver gave them an
    /// environment (`agent_env`) wait for it once the driver said hello, at most.
    pub agent_env_wait: Duration,
    /// Where `/metrics` is served; `None` (the default) turns metrics off.
    pub metrics_listen: Option<MetricsListen>,
    /// The AMQP send queue the hub consumes; `None` (the default) consumes none.
    pub amqp_sends: Option<AmqpSendsConfig>,
    /// Shared with the instances bound to each (`InstancePolicy::runtime`).
    pub runtimes: BTreeMap<String, Arc<RuntimeConfig>>,
    pub instances: Vec<InstanceConfig>,
}

/// Command-line overrides applied on top of the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub runtime_dir: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
}

impl HubConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path, overrides)
    }

    /// Parses and validates config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path, overrides: &Overrides) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: origin.to_owned(),
            message: err.to_string().trim_end().to_owned(),
        })?;
        Self::from_raw(raw, overrides)
    }

    fn from_raw(raw: RawConfig, overrides: &Overrides) -> Result<Self, ConfigError> {
        let hub = raw.hub;
        let runtime_dir = overrides
            .runtime_dir
            .clone()
            .or(hub.runtime_dir)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_RUNTIME_DIR));
        let state_dir = overrides.state_dir.clone().or(hub.state_dir);
        let ledger_on = state_dir.is_some();
        let control_socket = hub.control_socket.unwrap_or_else(|| runtime_dir.join("control.sock"));
        let max_inflight =
            positive("hub.max_inflight", hub.max_inflight.unwrap_or(DEFAULT_MAX_INFLIGHT))?;
        let max_queued = hub.max_queued.unwrap_or(DEFAULT_MAX_QUEUED);
        let history_max =
            positive("hub.history_max", hub.history_max.unwrap_or(DEFAULT_HISTORY_MAX))?;
        let secs = |key: &str, value: Option<u64>, default: u64| -> Result<Duration, ConfigError> {
            let value = value.unwrap_or(default);
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
            Ok(Duration::from_secs(value))
        };

        let mut runtimes = BTreeMap::new();
        runtimes.insert(DEFAULT_RUNTIME.to_owned(), Arc::new(RuntimeConfig::echo()));
        for (name, rt) in raw.runtime {
            let key = format!("runtime.{name}");
            if rt.kind == RuntimeKind::Exec && rt.command.is_empty() {
                return Err(invalid(format!("{key}.command"), "an exec runtime needs a command"));
            }
            if rt.kind == RuntimeKind::Echo && !rt.command.is_empty() {
                return Err(invalid(format!("{key}.command"), "the echo runtime takes no command"));
            }
            if rt.kind == RuntimeKind::Amqp && !rt.command.is_empty() {
                return Err(invalid(
                    format!("{key}.command"),
                    "an amqp runtime takes no command: its workers run the agent",
                ));
            }
            let amqp = if rt.kind == RuntimeKind::Amqp {
                let url_key = format!("{key}.url");
                let url = rt
                    .url
                    .as_deref()
                    .ok_or_else(|| invalid(&url_key, "an amqp runtime needs it"))?;
                let queue = queue_name(&format!("{key}.queue"), rt.queue)?;
                let reply_queue = queue_name(&format!("{key}.reply_queue"), rt.reply_queue)?;
                if queue == reply_queue {
                    return Err(invalid(format!("{key}.reply_queue"), "must differ from queue"));
                }
                Some(AmqpTarget { url: broker_url(&url_key, url)?, queue, reply_queue })
            } else {
                for (field, set) in [
                    ("url", rt.url.is_some()),
                    ("queue", rt.queue.is_some()),
                    ("reply_queue", rt.reply_queue.is_some()),
                ] {
                    if set {
                        return Err(invalid(
                            format!("{key}.{field}"),
                            "only an amqp runtime takes it",
                        ));
                    }
                }
                None
            };
            let config = RuntimeConfig {
                name: name.clone(),
                kind: rt.kind,
                command: rt.command,
                env: rt.env,
                timeout: secs(&format!("{key}.timeout_secs"), rt.timeout_secs, 300)?,
                max_output_bytes: positive(
                    &format!("{key}.max_output_bytes"),
                    rt.max_output_bytes.unwrap_or(1024 * 1024),
                )?,
                stdin: rt.stdin,
                amqp,
                wake: rt.wake,
                max_runs: rt
                    .max_runs
                    .map(|max| positive(&format!("{key}.max_runs"), max))
                    .transpose()?,
            };
            runtimes.insert(name, Arc::new(config));
        }

        let mut instances = Vec::new();
        let mut sockets = BTreeMap::new();
        for (name, inst) in raw.instance {
            let key = format!("instance.\"{name}\"");
            let id = ChannelId::new(&name).map_err(|err| invalid(&key, err.to_string()))?;
            let runtime = inst.runtime.unwrap_or_else(|| DEFAULT_RUNTIME.to_owned());
            if !runtimes.contains_key(&runtime) {
                return Err(invalid(
                    format!("{key}.runtime"),
                    format!("no runtime named {runtime:?}"),
                ));
            }
            let allow = match (inst.allow_all, inst.allow.is_empty()) {
                (true, false) => {
                    return Err(invalid(
                        format!("{key}.allow"),
                        "set either allow or allow_all, not both",
                    ));
                }
                (true, true) => Allowlist::All,
                (false, _) => {
                    if inst.allow.iter().any(|s| s.is_empty()) {
                        return Err(invalid(
                            format!("{key}.allow"),
                            "sender ids must not be empty",
                        ));
                    }
                    Allowlist::Senders(inst.allow)
                }
            };
            let socket = inst.socket.unwrap_or_else(|| runtime_dir.join(format!("{id}.sock")));
            if let Some(other) = sockets.insert(socket.clone(), name.clone()) {
                return Err(invalid(
                    format!("{key}.socket"),
                    format!("{} is already used by instance {other:?}", socket.display()),
                ));
            }
            // A runtime's `max_runs` lowers it (1 serializes the runs of a resident agent).
            let max_inflight = positive(
                &format!("{key}.max_inflight"),
                inst.max_inflight.unwrap_or(max_inflight),
            )?
            .min(runtimes[&runtime].max_runs.unwrap_or(usize::MAX));
            instances.push(InstanceConfig {
                id,
                socket,
                spawn: inst.spawn,
                spawn_env: inst.spawn_env,
                runtime,
                allow,
                identity_isolation: inst.identity_isolation,
                max_inflight,
                max_queued: inst.max_queued.unwrap_or(max_queued),
                deny_notice: deny_notice(&key, inst.deny_notice)?,
                deny_notice_interval: secs(
                    &format!("{key}.deny_notice_interval_secs"),
                    inst.deny_notice_interval_secs,
                    DEFAULT_DENY_NOTICE_INTERVAL_SECS,
                )?,
                history: match inst.history {
                    Some(false) => None,
                    _ => Some(positive(
                        &format!("{key}.history_max"),
                        inst.history_max.unwrap_or(history_max),
                    )?),
                },
                peers: peer_rule(
                    &key,
                    "allow_uids",
                    inst.allow_uids,
                    "allow_gids",
                    inst.allow_gids,
                )?,
            });
        }

        Ok(Self {
            runtime_dir,
            state_dir,
            durability: hub.durability.unwrap_or_default(),
            cpu_scheduling: hub.cpu_scheduling.unwrap_or_default(),
            retention: Duration::from_secs(
                86_400
                    * positive("hub.retention_days", hub.retention_days.unwrap_or(7) as usize)?
                        as u64,
            ),
            outbox_ttl: secs("hub.outbox_ttl_secs", hub.outbox_ttl_secs, 86_400)?,
            reply_ttl: secs("hub.reply_ttl_secs", hub.reply_ttl_secs, 86_400)?,
            control_socket,
            control_peers: peer_rule(
                "hub",
                "control_allow_uids",
                hub.control_allow_uids,
                "control_allow_gids",
                hub.control_allow_gids,
            )?,
            receipt_timeout: secs("hub.receipt_timeout_secs", hub.receipt_timeout_secs, 30)?,
            command_timeout: secs("hub.command_timeout_secs", hub.command_timeout_secs, 300)?,
            health_probe_interval: secs(
                "hub.health_probe_interval_secs",
                hub.health_probe_interval_secs,
                30,
            )?,
            health_probe_timeout: secs(
                "hub.health_probe_timeout_secs",
                hub.health_probe_timeout_secs,
                5,
            )?,
            liveness: secs("hub.liveness_secs", hub.liveness_secs, 60)?,
            stall_timeout: secs("hub.stall_timeout_secs", hub.stall_timeout_secs, 60)?,
            drain_timeout: secs("hub.drain_timeout_secs", hub.drain_timeout_secs, 10)?,
            agent_env_wait: secs("hub.agent_env_wait_secs", hub.agent_env_wait_secs, 30)?,
            metrics_listen: hub.metrics_listen.as_deref().map(MetricsListen::parse).transpose()?,
            amqp_sends: hub.amqp_sends.map(|raw| amqp_sends(raw, ledger_on)).transpose()?,
            runtimes,
            instances,
        })
    }

    /// The runtime bound to `instance`.
    pub fn runtime_for(&self, instance: &InstanceConfig) -> &Arc<RuntimeConfig> {
        self.runtimes.get(&instance.runtime).unwrap_or_else(|| &self.runtimes[DEFAULT_RUNTIME])
    }
}

/// `[hub.amqp_sends]`: needs the ledger (every message carries an idempotency key).
fn amqp_sends(raw: RawAmqpSends, ledger: bool) -> Result<AmqpSendsConfig, ConfigError> {
    const KEY: &str = "hub.amqp_sends";
    let url = raw.url.ok_or_else(|| invalid(format!("{KEY}.url"), "the send queue needs it"))?;
    let url = broker_url(&format!("{KEY}.url"), &url)?;
    let queue = checked_queue_name(
        &format!("{KEY}.queue"),
        raw.queue.unwrap_or_else(|| channeld_control::DEFAULT_SEND_QUEUE.to_owned()),
    )?;
    let prefetch = raw.prefetch.unwrap_or(DEFAULT_AMQP_SENDS_PREFETCH);
    if prefetch == 0 {
        return Err(invalid(format!("{KEY}.prefetch"), "must be at least 1"));
    }
    if !ledger {
        return Err(invalid(
            KEY,
            "the send queue needs the ledger (hub.state_dir): its messages are idempotent by key",
        ));
    }
    Ok(AmqpSendsConfig { url, queue, prefetch })
}

/// `allow_uids` / `allow_gids` (or the control socket's): absent, the socket's mode decides;
/// present, only the listed users and group members may connect. Names are resolved now, so
/// a typo fails the start.
fn peer_rule(
    key: &str,
    uids_key: &str,
    uids: Option<Vec<Principal>>,
    gids_key: &str,
    gids: Option<Vec<Principal>>,
) -> Result<PeerRule, ConfigError> {
    PeerRule::from_lists(uids, gids).map_err(|err| {
        let field = if err.in_gids { gids_key } else { uids_key };
        invalid(format!("{key}.{field}"), err.message)
    })
}

/// A deny notice must be a message body that fits in a frame.
fn deny_notice(key: &str, notice: Option<String>) -> Result<Option<String>, ConfigError> {
    let key = format!("{key}.deny_notice");
    match notice {
        Some(text) if text.trim().is_empty() => Err(invalid(key, "must not be empty")),
        Some(text) if text.contains('\0') => Err(invalid(key, "must not contain NUL")),
        Some(text) if text.len() > MAX_DENY_NOTICE_BYTES => {
            Err(invalid(key, format!("must be at most {MAX_DENY_NOTICE_BYTES} bytes")))
        }
        other => Ok(other),
    }
}

fn positive(key: &str, value: usize) -> Result<usize, ConfigError> {
    if value == 0 {
        return Err(invalid(key, "must be at least 1"));
    }
    Ok(value)
}

#[cfg(test)]
mod tests;
