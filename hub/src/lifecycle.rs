//! How a hub starts and stops: restore durable state, serve every socket, supervise spawned
//! drivers, probe health, keep house, tell systemd; on shutdown stop accepting, drain runs,
//! say `stop` and close connections, stop drivers, drain background work, close the ledger
//! and remove the sockets — every task the hub spawned has ended when [`run_hub`] returns.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::config::{DurabilityMode, HubConfig};
use crate::hub::Hub;
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
                DurabilityMode::Full => Durability::Full,
                DurabilityMode::Normal => Durability::Normal,
            };
            Ledger::open(dir, durability)
        }
        None => Ok(Ledger::off()),
    }
}

/// [`run`] for a hub built by the caller (which keeps a handle to it).
pub async fn run_hub(hub: Arc<Hub>, listeners: Listeners) -> io::Result<()> {
    for inst in hub.instances.values() {
        if inst.config.allow.denies_everyone() {
            warn!(
                instance = %inst.config.id,
                "sender allowlist is empty: every inbound message will be denied (set allow = [...] or allow_all = true)"
            );
        }
    }
    match (hub.ledger.is_on(), hub.ledger.path()) {
        (true, Some(path)) => info!(ledger = %path.display(), "ledger on"),
        (true, None) => info!("ledger on, in memory"),
        (false, _) => warn!(
            "no state directory: the ledger is off, so inbound dedupe, the outbox and /new sessions do not survive a restart"
        ),
    }
    crate::recovery::restore(&hub).await;

    let Listeners { control, instances, paths } = listeners;
    let loops = TaskTracker::new();
    let mut probes = Vec::new();
    for (id, listener) in instances {
        let inst = hub.instances[&id].clone();
        let (probe, responder) = liveness::pair(format!("the accept loop of {id}"));
        probes.push(probe);
        loops.spawn(crate::serve::accept_loop(hub.clone(), inst, listener, responder));
    }
    let (probe, responder) = liveness::pair("the control accept loop");
    probes.push(probe);
    loops.spawn(crate::control::accept_loop(hub.clone(), control, responder));
    let supervisors = TaskTracker::new();
    for inst in hub.instances.values() {
        if !inst.config.spawn.is_empty() {
            supervisors.spawn(crate::supervisor::supervise(hub.clone(), inst.clone()));
        }
    }
    loops.spawn(crate::health::probe_loop(hub.clone()));
    loops.spawn(crate::recovery::housekeeping(hub.clone()));
    let finished = CancellationToken::new();
    let systemd = tokio::spawn(crate::systemd::notify(
        hub.clone(),
        Liveness::new(probes, hub.ledger.clone()),
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
    loops.close();
    loops.wait().await;
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
    hub.connections.close();
    if tokio::time::timeout(CLOSE_GRACE, hub.connections.wait()).await.is_err() {
        warn!(connections = hub.connections.len(), "some connections did not close in time");
    }
    hub.tasks.close();
    if tokio::time::timeout(CLOSE_GRACE, hub.tasks.wait()).await.is_err() {
        warn!(tasks = hub.tasks.len(), "some background work did not end in time");
    }
    hub.ledger.close().await;
    remove_sockets(&paths);
    finished.cancel();
    let _ = systemd.await;
    info!("hub stopped");
    Ok(())
}
