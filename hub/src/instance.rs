//! Per-instance state: the one live driver connection, the live settings a reload may
//! change, health, counters, session generations, the run queue and the supervised driver
//! process; and the registry of the instances served.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use channeld_protocol::ext::{AgentEnv, MAX_AGENT_ENV_ENTRIES, MAX_AGENT_ENV_VALUE};
use channeld_protocol::types::{Health, HealthState};
use tokio_util::sync::CancellationToken;

use crate::cancels::SharedCancels;
use crate::config::{InstanceConfig, InstancePolicy};
use crate::connection::{Connection, lock};
use crate::metrics::InstanceMetrics;
use crate::notice::NoticeLimiter;
use crate::route::RouteKey;
use crate::runqueue::{RunQueue, Turn};

/// What starts a queued run once its turn comes (made by the inbound layer, called once,
/// outside the queue's lock, with the run's turn).
pub struct StartRun(Box<dyn FnOnce(Turn) + Send>);

impl StartRun {
    pub fn new(start: impl FnOnce(Turn) + Send + 'static) -> Self {
        Self(Box::new(start))
    }

    pub fn start(self, turn: Turn) {
        (self.0)(turn);
    }
}

impl std::fmt::Debug for StartRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StartRun")
    }
}

/// An instance's run queue: per conversation session, in arrival order.
pub type Runs = RunQueue<RouteKey, StartRun>;

/// Milliseconds since the Unix epoch.
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Monotonic counters shown by `channelctl status`.
#[derive(Debug, Default)]
pub struct Counters {
    pub inbound: AtomicU64,
    pub denied: AtomicU64,
    pub runs_failed: AtomicU64,
    pub replies: AtomicU64,
    pub outbound: AtomicU64,
    pub receipts: AtomicU64,
    pub errors: AtomicU64,
    pub busy: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Where a supervised driver process stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    Running,
    /// Exited; started again after its backoff.
    Restarting,
    /// Not restarted: it exited with 78 (invalid configuration) or the hub is stopping.
    Stopped,
}

impl ProcessState {
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Running => "running",
            ProcessState::Restarting => "restarting",
            ProcessState::Stopped => "stopped",
        }
    }
}

/// A supervised driver process, as `channelctl status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessView {
    pub state: ProcessState,
    pub pid: Option<u32>,
    pub starts: u64,
    pub last_exit: Option<String>,
}

/// The health the hub believes, and when it learnt it.
#[derive(Debug, Clone)]
pub struct HealthView {
    pub health: Health,
    pub updated: SystemTime,
}

/// One configured channel instance.
#[derive(Debug)]
pub struct Instance {
    /// As configured when the instance was created. A reload may change its live settings
    /// (`allow`, `deny_notice`, `deny_notice_interval`, the runtime): read those through
    /// [`Instance::policy`], never from here.
    pub config: InstanceConfig,
    pub counters: Counters,
    /// Its Prometheus series (empty when metrics are off).
    pub metrics: InstanceMetrics,
    policy: Mutex<Arc<InstancePolicy>>,
    /// Cancelled when a reload removes the instance: its accept loop ends, its driver is told
    /// `stop`, its supervised process is stopped.
    pub removed: CancellationToken,
    live: Mutex<Option<Arc<Connection>>>,
    health: Mutex<HealthView>,
    last_error: Mutex<Option<(SystemTime, String)>>,
    generations: Mutex<HashMap<String, u64>>,
    /// Inbound accepted and not finished: running, or waiting for their session's turn and a
    /// run slot (`max_inflight`, `max_queued`).
    pub runs: Mutex<Runs>,
    /// The cancellation of each accepted inbound until its run ended (extension `cancel`).
    pub cancels: SharedCancels,
    process: Mutex<Option<ProcessView>>,
    /// Which denied senders were sent the deny notice, and when.
    notices: Mutex<NoticeLimiter>,
    /// The environment the driver's platform session gives runs (extension `agent_env`):
    /// in memory only — never in the ledger, a log or `channelctl` — until the driver sends
    /// another or the hub stops. (The ledger keeps the names, for [`Self::agent_env_wait`].)
    agent_env: Mutex<Arc<BTreeMap<String, String>>>,
    /// Set at a restart when the driver had given its runs an environment: runs wait for it
    /// until it is settled (`settle_agent_env`), which cancels the token.
    agent_env_wait: Mutex<Option<CancellationToken>>,
}

impl Instance {
    pub fn new(config: InstanceConfig, policy: InstancePolicy, metrics: InstanceMetrics) -> Self {
        Self {
            runs: Mutex::new(RunQueue::new(config.max_inflight, config.max_queued)),
            cancels: SharedCancels::default(),
            config,
            counters: Counters::default(),
            metrics,
            policy: Mutex::new(Arc::new(policy)),
            removed: CancellationToken::new(),
            agent_env: Mutex::default(),
            agent_env_wait: Mutex::new(None),
            live: Mutex::new(None),
            health: Mutex::new(HealthView {
                health: Health::new(HealthState::Unavailable, Some("no driver connected".into())),
                updated: SystemTime::now(),
            }),
            last_error: Mutex::new(None),
            generations: Mutex::new(HashMap::new()),
            process: Mutex::new(None),
            notices: Mutex::new(NoticeLimiter::default()),
        }
    }

    /// The live settings: who may talk, the deny notice, the runtime. A run keeps the ones it
    /// started with.
    pub fn policy(&self) -> Arc<InstancePolicy> {
        lock(&self.policy).clone()
    }

    /// Applies reloaded live settings to what arrives from now on.
    pub fn set_policy(&self, policy: InstancePolicy) {
        *lock(&self.policy) = Arc::new(policy);
    }

    /// Whether denied `sender` is sent the deny notice now (once per interval).
    pub fn may_notify(&self, sender: &str) -> bool {
        let interval = self.policy().deny_notice_interval;
        lock(&self.notices).allow(sender, Instant::now(), interval)
    }

    /// Runs going on now (at most `max_inflight`).
    pub fn runs_running(&self) -> usize {
        lock(&self.runs).running()
    }

    /// Accepted inbound waiting for their turn (at most `max_queued`, restored ones aside).
    pub fn runs_waiting(&self) -> usize {
        lock(&self.runs).waiting()
    }

    /// The environment the driver gave its runs (extension `agent_env`); empty if none.
    pub fn agent_env(&self) -> Arc<BTreeMap<String, String>> {
        lock(&self.agent_env).clone()
    }

    /// Replaces the runs' environment with the driver's `agent_env`, or refuses it whole
    /// ([`check_agent_env`]).
    pub fn set_agent_env(&self, frame: AgentEnv) -> Result<(), String> {
        check_agent_env(self.config.id.family(), &frame)?;
        *lock(&self.agent_env) = Arc::new(frame.env);
        Ok(())
    }

    /// Makes runs wait for the driver's environment (the ledger says its driver gave one
    /// before the restart): until [`settle_agent_env`](Self::settle_agent_env).
    pub fn await_agent_env(&self) {
        lock(&self.agent_env_wait).get_or_insert_with(CancellationToken::new);
    }

    /// What a run waits for before it starts, if anything: cancelled once the driver's
    /// environment is settled.
    pub fn agent_env_wait(&self) -> Option<CancellationToken> {
        lock(&self.agent_env_wait).clone()
    }

    /// The driver's environment is settled: it sent one, or an inbound before any (it has
    /// none), or a hello without the extension, or nothing for `hub.agent_env_wait_secs` after a hello with it
    /// (`serve/driver.rs`). Runs waiting for it start.
    pub fn settle_agent_env(&self) {
        if let Some(wait) = lock(&self.agent_env_wait).take() {
            wait.cancel();
        }
    }

    /// The live driver connection, if any.
    pub fn live(&self) -> Option<Arc<Connection>> {
        lock(&self.live).clone().filter(|conn| !conn.is_closed())
    }

    /// Makes `conn` the live driver unless another live one exists (which it returns).
    pub fn claim(&self, conn: &Arc<Connection>) -> Result<(), Arc<Connection>> {
        let mut live = lock(&self.live);
        if let Some(existing) = live.as_ref()
            && !existing.is_closed()
        {
            return Err(existing.clone());
        }
        *live = Some(conn.clone());
        Ok(())
    }

    /// Clears the live slot if it still holds `conn`.
    pub fn release(&self, conn: &Arc<Connection>) {
        let mut live = lock(&self.live);
        if live.as_ref().is_some_and(|c| c.id == conn.id) {
            *live = None;
            drop(live);
            self.set_health(Health::new(
                HealthState::Unavailable,
                Some("driver disconnected".into()),
            ));
        }
    }

    pub fn health(&self) -> HealthView {
        lock(&self.health).clone()
    }

    /// Records the driver's health; true when it just became Ready (it was not before).
    pub fn set_health(&self, health: Health) -> bool {
        let ready = health.state == HealthState::Ready;
        let mut current = lock(&self.health);
        let was_ready = current.health.state == HealthState::Ready;
        *current = HealthView { health, updated: SystemTime::now() };
        ready && !was_ready
    }

    pub fn record_error(&self, message: impl Into<String>) {
        Counters::bump(&self.counters.errors);
        *lock(&self.last_error) = Some((SystemTime::now(), message.into()));
    }

    pub fn last_error(&self) -> Option<(SystemTime, String)> {
        lock(&self.last_error).clone()
    }

    /// The session generation for a route (bumped by `/new`).
    pub fn generation(&self, route: &str) -> u64 {
        lock(&self.generations).get(route).copied().unwrap_or(0)
    }

    /// Starts a new session for a route; returns the new generation.
    pub fn bump_generation(&self, route: &str) -> u64 {
        let mut generations = lock(&self.generations);
        let entry = generations.entry(route.to_owned()).or_insert(0);
        *entry += 1;
        *entry
    }

    /// Sets a route's generation (as recorded by the ledger).
    pub fn set_generation(&self, route: &str, generation: u64) {
        lock(&self.generations).insert(route.to_owned(), generation);
    }

    /// Loads persisted generations (from the ledger).
    pub fn load_generations(&self, loaded: HashMap<String, u64>) {
        *lock(&self.generations) = loaded;
    }

    /// The supervised driver process, if the hub spawns one.
    pub fn process(&self) -> Option<ProcessView> {
        lock(&self.process).clone()
    }

    pub fn set_process(&self, view: ProcessView) {
        *lock(&self.process) = Some(view);
    }
}

/// Instances by id.
pub type Instances = std::collections::BTreeMap<channeld_protocol::ChannelId, Arc<Instance>>;

/// The instances the hub serves now: a reload adds and removes them. Readers take a snapshot
/// (or one instance) and never hold the lock across an await.
#[derive(Debug, Default)]
pub struct Registry {
    current: Mutex<Arc<Instances>>,
}

impl Registry {
    pub fn new(instances: Instances) -> Self {
        Self { current: Mutex::new(Arc::new(instances)) }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Instance>> {
        lock(&self.current).get(id).cloned()
    }

    /// Every instance served at this moment.
    pub fn snapshot(&self) -> Arc<Instances> {
        lock(&self.current).clone()
    }

    pub fn len(&self) -> usize {
        lock(&self.current).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Serves `inst` from now on (replacing one with the same id).
    pub fn insert(&self, inst: Arc<Instance>) {
        let mut current = lock(&self.current);
        let mut next = Instances::clone(&current);
        next.insert(inst.config.id.clone(), inst);
        *current = Arc::new(next);
    }

    /// Stops serving `id`; returns the instance that was served.
    pub fn remove(&self, id: &str) -> Option<Arc<Instance>> {
        let mut current = lock(&self.current);
        let mut next = Instances::clone(&current);
        let removed = next.remove(id);
        *current = Arc::new(next);
        removed
    }
}

/// Why an `agent_env` frame is refused, naming the entries (never a value): more than
/// [`MAX_AGENT_ENV_ENTRIES`], a value longer than [`MAX_AGENT_ENV_VALUE`] or holding NUL, a
/// name outside the driver family's namespace (`BCN_…` for `bcn`).
pub fn check_agent_env(family: &str, frame: &AgentEnv) -> Result<(), String> {
    if frame.env.len() > MAX_AGENT_ENV_ENTRIES {
        return Err(format!(
            "agent_env has {} entries; at most {MAX_AGENT_ENV_ENTRIES} are taken",
            frame.env.len()
        ));
    }
    let refused: Vec<&str> = frame
        .env
        .iter()
        .filter(|(name, value)| {
            value.len() > MAX_AGENT_ENV_VALUE
                || !channeld_agent_exec::env_entry_allowed(family, name, value)
        })
        .map(|(name, _)| name.as_str())
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    let namespace = channeld_agent_exec::env_namespace(family);
    Err(format!(
        "agent_env refused: {} (names must be {namespace}… in A-Z, 0-9, _; values at most \
         {MAX_AGENT_ENV_VALUE} bytes, without NUL)",
        refused.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(entries: &[(&str, &str)]) -> AgentEnv {
        AgentEnv { env: entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect() }
    }

    #[test]
    fn an_agent_env_is_taken_whole_or_refused_naming_entries_never_values() {
        assert_eq!(check_agent_env("bcn", &env(&[("BCN_BOT_TOKEN", "tok-1")])), Ok(()));
        assert_eq!(check_agent_env("bcn", &env(&[])), Ok(()));
        let refused = check_agent_env(
            "bcn",
            &env(&[("BCN_OK", "x"), ("PATH", "/evil"), ("BCN_NUL", "a\0b"), ("bcn_low", "x")]),
        )
        .unwrap_err();
        assert!(refused.contains("BCN_NUL, PATH, bcn_low"), "{refused}");
        assert!(!refused.contains("BCN_OK") && !refused.contains("/evil"), "{refused}");
        let long = "x".repeat(MAX_AGENT_ENV_VALUE + 1);
        assert!(check_agent_env("bcn", &env(&[("BCN_LONG", &long)])).is_err());
        let just = "x".repeat(MAX_AGENT_ENV_VALUE);
        assert_eq!(check_agent_env("bcn", &env(&[("BCN_LONG", &just)])), Ok(()));
        let many: Vec<(String, String)> =
            (0..=MAX_AGENT_ENV_ENTRIES).map(|n| (format!("BCN_V{n}"), "x".into())).collect();
        let many = AgentEnv { env: many.into_iter().collect() };
        assert!(check_agent_env("bcn", &many).unwrap_err().contains("entries"));
    }
}
