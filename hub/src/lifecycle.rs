//! How a hub starts and stops: restore durable state, serve every socket, supervise spawned
//! drivers, probe health, keep house, tell systemd; on shutdown stop accepting, drain runs,
//! say `stop` and close connections, stop drivers, drain background work, close the ledger
//! and remove the sockets — every task the hub spawned has ended when [`run_hub`] returns.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{DurabilityMode, HubConfig, MetricsListen};
use crate::hub::Hub;
use crate::instance::Instance;
use crate::ledger::{Durability, Ledger, LedgerError};
use crate::listen::{Listeners, remove_sockets};
use crate::liveness::{self, Liveness};

/// How long connections get to close, and background work to end, once runs drained.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Runs the hub on already-bound listeners until `shutdown` is cancelled, then drains and
/// removes its sockets.
pub async fn run(
    config: HubConfig,
    ledger: Ledger,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let hub = Hub::new(config, ledger, shutdown);
    run_hub(hub, listeners).await
}

/// Opens the ledger named by the config: on with a state directory, off without one.
pub fn open_ledger(config: &HubConfig) -> Result<Ledger, LedgerError> {
    match &config.state_dir {
        Some(dir) => {
            let durability = match config.durability {
                DurabilityMode::Strict => Durability::Strict,
                DurabilityMode::Full => Durability::Full,
                DurabilityMode::Normal => Durability::Normal,
            };
            Ledger::open(dir, durability)
        }
        None => Ok(Ledger::off()),
    }
}

/// Serves `inst` on its bound `listener`: its accept loop (asked by the watchdog) and, when
/// the hub spawns its driver, the driver's supervisor. At start and when a reload adds it.
pub(crate) fn start_instance(hub: &Arc<Hub>, inst: Arc<Instance>, listener: UnixListener) {
    let (probe, responder) = liveness::pair(accept_loop_name(&inst));
    hub.probes.add(probe);
    hub.loops.spawn(crate::serve::accept_loop(hub.clone(), inst.clone(), listener, responder));
    if !inst.config.spawn.is_empty() {
        hub.supervisors.spawn(crate::supervisor::supervise(hub.clone(), inst));
    }
}

/// The watchdog's name for the accept loop of `inst`.
pub(crate) fn accept_loop_name(inst: &Instance) -> String {
    format!("the accept loop of {}", inst.config.id)
}

/// [`run`] for a hub built by the caller (which keeps a handle to it).
pub async fn run_hub(hub: Arc<Hub>, listeners: Listeners) -> io::Result<()> {
    for warning in hub.applied.lock().await.warnings() {
        warn!("{warning}");
    }
    match (hub.ledger.is_on(), hub.ledger.path()) {
        (true, Some(path)) => info!(ledger = %path.display(), "ledger on"),
        (true, None) => info!("ledger on, in memory"),
        (false, _) => warn!(
            "no state directory: the ledger is off, so inbound dedupe, the outbox and /new sessions do not survive a restart"
        ),
    }
    crate::recovery::restore(&hub).await;

    let Listeners { control, instances, metrics } = listeners;
    if let Some(metrics) = metrics {
        hub.loops.spawn(crate::scrape::serve(hub.clone(), metrics));
    }
    for (id, listener) in instances {
        if let Some(inst) = hub.instance(id.as_str()) {
            start_instance(&hub, inst, listener);
        }
    }
    let (probe, responder) = liveness::pair("the control accept loop");
    hub.probes.add(probe);
    hub.loops.spawn(crate::control::accept_loop(hub.clone(), control, responder));
    hub.loops.spawn(crate::health::probe_loop(hub.clone()));
    hub.loops.spawn(crate::recovery::housekeeping(hub.clone()));
    hub.loops.spawn(crate::recovery::storage_watch(hub.clone()));
    if let (Some(config), Some(state)) = (hub.config.amqp_sends.clone(), hub.amqp_sends.clone()) {
        hub.loops.spawn(crate::sendq::consume(hub.clone(), config, state));
    }
    // Replies keep moving while runs drain: the courier stops with the connections.
    hub.tasks.spawn(hub.courier.clone().run(hub.close_connections.clone()));
    let finished = CancellationToken::new();
    let systemd = tokio::spawn(crate::systemd::notify(
        hub.clone(),
        Liveness::new(hub.probes.clone(), hub.ledger.clone()),
        finished.clone(),
    ));
    info!(
        instances = hub.instances.len(),
        control = %hub.config.control_socket.display(),
        "hub ready"
    );
    hub.ready.cancel();

    hub.shutdown.cancelled().await;
    info!("shutting down: no new connections, draining runs");
    hub.loops.close();
    hub.loops.wait().await;
    hub.runs.close();
    if tokio::time::timeout(hub.config.drain_timeout, hub.runs.wait()).await.is_err() {
        warn!(
            runs = hub.runs.len(),
            "runs still in flight after the drain deadline; abandoning them"
        );
    }
    hub.close_connections.cancel();
    hub.supervisors.close();
    hub.supervisors.wait().await;
    hub.connections.close();
    if tokio::time::timeout(CLOSE_GRACE, hub.connections.wait()).await.is_err() {
        warn!(connections = hub.connections.len(), "some connections did not close in time");
    }
    hub.tasks.close();
    if tokio::time::timeout(CLOSE_GRACE, hub.tasks.wait()).await.is_err() {
        warn!(tasks = hub.tasks.len(), "some background work did not end in time");
    }
    hub.ledger.close().await;
    // The sockets of the instances served now (a reload may have added some and removed
    // others, whose sockets it removed then), and the control socket.
    let mut sockets: Vec<PathBuf> =
        hub.instances.snapshot().values().map(|inst| inst.config.socket.clone()).collect();
    sockets.push(hub.config.control_socket.clone());
    if let Some(MetricsListen::Unix(path)) = &hub.config.metrics_listen {
        sockets.push(path.clone());
    }
    remove_sockets(&sockets);
    finished.cancel();
    let _ = systemd.await;
    info!("hub stopped");
    Ok(())
}
