//! `channeld demo`: a hub with the echo runtime and one console driver on the hub's terminal,
//! in a private runtime directory, with no config file and no credentials. The demo starts
//! the console itself, once the hub is ready; the console's exit ends the demo.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::ChannelId;
use tokio_util::sync::CancellationToken;

use crate::config::{
    Allowlist, DEFAULT_RUNTIME, HubConfig, InstanceConfig, PeerRule, RuntimeConfig,
};
use crate::hub::Hub;
use crate::ledger::Ledger;

/// The demo's one channel instance.
pub const DEMO_INSTANCE: &str = "console.demo";

/// The demo configuration with sockets under `runtime_dir`.
pub fn config(runtime_dir: &Path) -> HubConfig {
    let id = ChannelId::new(DEMO_INSTANCE).expect("static id is valid");
    let mut runtimes = BTreeMap::new();
    runtimes.insert(DEFAULT_RUNTIME.to_owned(), Arc::new(RuntimeConfig::echo()));
    HubConfig {
        runtime_dir: runtime_dir.to_owned(),
        state_dir: None,
        durability: crate::config::DurabilityMode::Full,
        // The demo shares a terminal with its console driver: its threads keep the policy.
        cpu_scheduling: crate::config::CpuScheduling::Inherit,
        retention: Duration::from_secs(7 * 86_400),
        outbox_ttl: Duration::from_secs(86_400),
        reply_ttl: Duration::from_secs(86_400),
        control_socket: runtime_dir.join("control.sock"),
        control_peers: PeerRule::SocketMode,
        receipt_timeout: Duration::from_secs(30),
        command_timeout: Duration::from_secs(300),
        health_probe_interval: Duration::from_secs(30),
        health_probe_timeout: Duration::from_secs(5),
        liveness: Duration::from_secs(60),
        stall_timeout: Duration::from_secs(60),
        drain_timeout: Duration::from_secs(10),
        agent_env_wait: Duration::from_secs(30),
        metrics_listen: None,
        amqp_sends: None,
        runtimes,
        instances: vec![InstanceConfig {
            allow: Allowlist::All,
            ..InstanceConfig::new(id.clone(), runtime_dir.join(format!("{id}.sock")))
        }],
    }
}

/// Finds `channeld-console`: next to this executable first, then on `PATH`.
pub fn find_console() -> Option<PathBuf> {
    let name = "channeld-console";
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join(name)));
    if let Some(path) = beside.filter(|p| p.is_file()) {
        return Some(path);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.is_file()))
}

/// A private runtime directory for one demo run.
pub fn runtime_dir() -> std::io::Result<PathBuf> {
    let base =
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("channeld-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// Runs the demo until the console exits; returns its exit status (0 when the demo was
/// interrupted).
pub async fn run(console: PathBuf, shutdown: CancellationToken) -> anyhow::Result<i32> {
    let dir = runtime_dir()?;
    let result = serve(&dir, console, shutdown).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn serve(dir: &Path, console: PathBuf, shutdown: CancellationToken) -> anyhow::Result<i32> {
    let config = config(dir);
    let instance = InstanceConfig {
        spawn: vec![console.display().to_string()],
        ..config.instances[0].clone()
    };
    let grace = config.drain_timeout + Duration::from_secs(2);
    let listeners = crate::listen::bind(&config)?;
    let hub = Hub::new(config, Ledger::off(), shutdown.clone());
    let serving = tokio::spawn(crate::lifecycle::run_hub(hub.clone(), listeners));
    tokio::select! {
        () = hub.ready.cancelled() => {}
        () = shutdown.cancelled() => {}
    }
    let code = match crate::supervisor::spawn(&instance, Stdio::inherit()) {
        Ok(mut console) => tokio::select! {
            status = console.wait() => status.ok().and_then(|s| s.code()).unwrap_or(1),
            // Interrupted: the console hears `stop` with the other connections, then goes.
            () = hub.close_connections.cancelled() => {
                crate::supervisor::terminate(&mut console, grace).await;
                0
            }
        },
        Err(err) => {
            shutdown.cancel();
            serving.await??;
            return Err(anyhow::anyhow!("cannot start {}: {err}", instance.spawn[0]));
        }
    };
    shutdown.cancel();
    serving.await??;
    Ok(code)
}
