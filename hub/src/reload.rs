//! Re-reading the configuration while the hub runs (SIGHUP, `systemctl reload`): the new
//! file is validated first — an invalid one is logged and the hub runs on as it was —, then
//! what can change live is applied: instances added (bound and served) and removed (their
//! drivers told `stop`, their supervised processes stopped, their sockets removed), and the
//! live settings of the others (allowlist, deny notice, runtime). Keys that only a restart
//! applies are named in the log. The decision is `config::reload::plan`; this is the I/O.

use std::path::Path;
use std::sync::Arc;

use tracing::{error, info, warn};

use crate::config::{HubConfig, InstanceConfig, Overrides, reload};
use crate::hub::Hub;
use crate::instance::Instance;
use crate::lifecycle::{accept_loop_name, start_instance};
use crate::listen::bind_instance;

/// Reads `path` (with the same command-line overrides as at start) and applies it. Never
/// fails the hub: whatever goes wrong is logged.
pub async fn reload_from(hub: &Arc<Hub>, path: &Path, overrides: &Overrides) {
    match HubConfig::load(path, overrides) {
        Ok(config) => apply(hub, config).await,
        Err(err) => error!(
            config = %path.display(),
            error = %err,
            "configuration not reloaded: the hub keeps running on the previous one"
        ),
    }
}

/// Applies a validated configuration to the running hub.
pub async fn apply(hub: &Arc<Hub>, new: HubConfig) {
    if hub.shutdown.is_cancelled() {
        return;
    }
    // Held throughout: reloads never overlap.
    let mut applied = hub.applied.lock().await;
    let mut plan = reload::plan(&applied, &new);
    for warning in new.warnings() {
        warn!("{warning}");
    }
    if !plan.restart_only.is_empty() {
        warn!(
            keys = %plan.restart_only.join(", "),
            "changed settings that apply only when the hub restarts; running on the previous values"
        );
    }
    for id in &plan.removed {
        if let Some(inst) = hub.instances.remove(id.as_str()) {
            stop_instance(hub, &inst);
        }
    }
    for (id, policy) in &plan.changed {
        if let Some(inst) = hub.instance(id.as_str()) {
            inst.set_policy(policy.clone());
        }
    }
    let mut added = 0;
    for config in &plan.added {
        match add_instance(hub, &plan.applied, config.clone()).await {
            Ok(()) => added += 1,
            Err(err) => {
                error!(instance = %config.id, socket = %config.socket.display(), error = %err, "instance not added");
                plan.applied.instances.retain(|i| i.id != config.id);
            }
        }
    }
    info!(
        added,
        removed = plan.removed.len(),
        changed = plan.changed.len(),
        instances = hub.instances.len(),
        "configuration reloaded"
    );
    *applied = plan.applied;
}

/// Stops serving a removed instance: its accept loop, connections and supervised driver
/// end (drivers hear `stop`), the watchdog stops asking for it, and its socket goes.
fn stop_instance(hub: &Hub, inst: &Instance) {
    inst.removed.cancel();
    // Its runs go on as the others do; none waits any longer for a driver that will not come.
    inst.settle_agent_env();
    hub.metrics.forget(inst.config.id.as_str());
    hub.probes.retire(&accept_loop_name(inst));
    if let Err(err) = std::fs::remove_file(&inst.config.socket) {
        warn!(instance = %inst.config.id, error = %err, "socket of a removed instance not removed");
    }
    info!(instance = %inst.config.id, "instance removed");
}

/// Binds and serves an instance the reload added, with the session generations the ledger
/// keeps for it.
async fn add_instance(
    hub: &Arc<Hub>,
    applied: &HubConfig,
    config: InstanceConfig,
) -> Result<(), crate::listen::HubError> {
    let listener = bind_instance(&config.socket)?;
    let counts = hub.metrics.instance(config.id.as_str());
    let inst = Arc::new(Instance::new(config.clone(), applied.policy_of(&config), counts));
    if hub.ledger.is_on() {
        match hub.ledger.generations(config.id.to_string()).await {
            Ok(generations) => inst.load_generations(generations),
            Err(err) => {
                warn!(instance = %config.id, error = %err, "session generations not loaded")
            }
        }
    }
    hub.instances.insert(inst.clone());
    start_instance(hub, inst, listener);
    info!(instance = %config.id, socket = %config.socket.display(), "instance added");
    Ok(())
}
