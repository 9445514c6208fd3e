//! The state one running hub shares between its tasks: configuration, instances, the
//! ledger, the outbox, the reply courier, ids, metrics, the task trackers and the shutdown
//! signals.
//!
//! It holds state and hands it out; what the hub does lives in the modules that take it
//! (`serve`, `inbound`, `control`, …), and how it starts and stops in `lifecycle.rs`.

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use channeld_protocol::ext::Extensions;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::HubConfig;
use crate::courier::Courier;
use crate::ids::Ids;
use crate::instance::{Instance, Instances, Registry};
use crate::ledger::Ledger;
use crate::liveness::Probes;
use crate::locator::LocatorKey;
use crate::metrics::{AmqpSendsState, Metrics};
use crate::outbox::Outbox;
use crate::runtime::Remote;

/// Extensions this hub implements and offers to peers that declare them (to a driver, as
/// [`Hub::driver_extensions`] says).
pub const HUB_EXTENSIONS: Extensions = Extensions {
    accepted: true,
    control_result: true,
    responder: true,
    health_status: true,
    reply_receipt: true,
    operator_action: true,
    history: true,
    cancel: true,
    stream: true,
    agent_env: true,
};

/// The hub's name and version, sent in `hello_ack`.
pub const HUB_NAME: &str = concat!("channeld/", env!("CARGO_PKG_VERSION"));

/// The running hub, shared by every task.
#[derive(Debug)]
pub struct Hub {
    /// As loaded at start: the hub-wide settings, which only a restart changes. Instances and
    /// runtimes a reload changes live in `instances` (and `applied`): the instance list here
    /// is left empty.
    pub config: HubConfig,
    pub instances: Arc<Registry>,
    /// The configuration in effect (the start's, then each reload's applied part); held by a
    /// reload while it applies the next one, so reloads never overlap.
    pub applied: tokio::sync::Mutex<HubConfig>,
    pub ledger: Ledger,
    pub outbox: Outbox,
    /// Hands recorded replies to drivers and settles them (ledger on).
    pub courier: Arc<Courier>,
    pub ids: Arc<Ids>,
    /// Prometheus metrics; counting nothing unless `hub.metrics_listen` is set.
    pub metrics: Arc<Metrics>,
    /// Cancelled when the hub starts shutting down: listeners stop accepting.
    pub shutdown: CancellationToken,
    /// Cancelled after runs drained: connection handlers say `stop` and close.
    pub close_connections: CancellationToken,
    /// Cancelled once every listener is served ("hub ready"; systemd's `READY=1`).
    pub ready: CancellationToken,
    /// Inbound runs (and the ledger writes that start them): drained first at shutdown, for
    /// up to `drain_timeout`.
    pub runs: TaskTracker,
    /// One task per accepted connection, on every socket: closed after the runs.
    pub connections: TaskTracker,
    /// Short background work — receipt waits, reply sweeps, probes, ledger writes off the
    /// reader — that ends by itself once connections close: drained last.
    pub tasks: TaskTracker,
    /// Accept loops and the hub's own loops (health, housekeeping): they stop first.
    pub loops: TaskTracker,
    /// One task per driver process the hub spawns: stopped after the runs drained.
    pub supervisors: TaskTracker,
    /// What the systemd watchdog asks (each accept loop).
    pub probes: Arc<Probes>,
    pub started: SystemTime,
    /// The broker clients of `amqp` runtimes.
    pub remote: Remote,
    /// The AMQP send queue's consumer state (`[hub.amqp_sends]` set).
    pub amqp_sends: Option<Arc<AmqpSendsState>>,
    /// What this hub's locators are bound to (its ledger's id), made once.
    locator_key: LocatorKey,
    /// `config.control_socket`, which every run's request carries: shared, not copied per
    /// run.
    pub control_socket: Arc<Path>,
}

impl Hub {
    /// What this hub offers a driver: `reply_receipt` only with the ledger on, where a reply
    /// is settled by its receipt. Without the ledger a reply is done once written, and its
    /// receipt would be one more frame for the driver to write and the hub to read and drop.
    pub fn driver_extensions(&self) -> Extensions {
        Extensions { reply_receipt: self.ledger.is_on(), ..HUB_EXTENSIONS }
    }

    pub fn new(config: HubConfig, ledger: Ledger, shutdown: CancellationToken) -> Arc<Self> {
        let metrics = Arc::new(Metrics::new(config.metrics_listen.is_some(), ledger.metrics()));
        metrics.init_connection_kinds();
        let amqp_sends = config.amqp_sends.as_ref().map(|sends| {
            metrics.init_amqp_sends();
            Arc::new(AmqpSendsState::new(&sends.queue))
        });
        let instances: Instances = config
            .instances
            .iter()
            .map(|inst| {
                let policy = config.policy_of(inst);
                let counts = metrics.instance(inst.id.as_str());
                (inst.id.clone(), Arc::new(Instance::new(inst.clone(), policy, counts)))
            })
            .collect();
        let instances = Arc::new(Registry::new(instances));
        let ids = Arc::new(Ids::new());
        let tasks = TaskTracker::new();
        let outbox = Outbox::new(
            ledger.clone(),
            instances.clone(),
            ids.clone(),
            tasks.clone(),
            config.outbox_ttl,
            config.receipt_timeout,
        );
        let courier = Arc::new(Courier::new(
            ledger.clone(),
            instances.clone(),
            tasks.clone(),
            config.reply_ttl,
            config.receipt_timeout,
        ));
        let locator_key = LocatorKey::new(ledger.id());
        // One copy of the instance list, in `applied` (each instance has its own settings): a
        // hub configured with thousands of instances holds each one's settings twice, not
        // three times.
        let applied = config.clone();
        let config = HubConfig { instances: Vec::new(), ..config };
        let control_socket = Arc::from(config.control_socket.as_path());
        Arc::new(Self {
            applied: tokio::sync::Mutex::new(applied),
            config,
            instances,
            ledger,
            outbox,
            courier,
            ids,
            metrics,
            shutdown,
            close_connections: CancellationToken::new(),
            ready: CancellationToken::new(),
            runs: TaskTracker::new(),
            connections: TaskTracker::new(),
            tasks,
            loops: TaskTracker::new(),
            supervisors: TaskTracker::new(),
            probes: Arc::default(),
            started: SystemTime::now(),
            remote: Remote::default(),
            amqp_sends,
            locator_key,
            control_socket,
        })
    }

    /// The instance served as `id` now.
    pub fn instance(&self, id: &str) -> Option<Arc<Instance>> {
        self.instances.get(id)
    }

    /// What this hub's locators are bound to: its ledger's id.
    pub fn locator_key(&self) -> &LocatorKey {
        &self.locator_key
    }
}
