//! `channeld demo`: a hub with the echo runtime and one console driver it supervises, in a
//! private runtime directory, with no config file and no credentials.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_protocol::ChannelId;
use tokio_util::sync::CancellationToken;

use crate::config::{Allowlist, DEFAULT_RUNTIME, HubConfig, InstanceConfig, RuntimeConfig};

/// The demo's one channel instance.
pub const DEMO_INSTANCE: &str = "console.demo";

/// The demo configuration with sockets under `runtime_dir`.
pub fn config(runtime_dir: &Path, console: PathBuf) -> HubConfig {
    let id = ChannelId::new(DEMO_INSTANCE).expect("static id is valid");
    let mut runtimes = BTreeMap::new();
    runtimes.insert(DEFAULT_RUNTIME.to_owned(), RuntimeConfig::echo());
    HubConfig {
        runtime_dir: runtime_dir.to_owned(),
        state_dir: None,
        durability: crate::config::DurabilityMode::Full,
        retention: Duration::from_secs(7 * 86_400),
        outbox_ttl: Duration::from_secs(86_400),
        control_socket: runtime_dir.join("control.sock"),
        receipt_timeout: Duration::from_secs(30),
        command_timeout: Duration::from_secs(300),
        health_probe_interval: Duration::from_secs(30),
        health_probe_timeout: Duration::from_secs(5),
        liveness: Duration::from_secs(60),
        drain_timeout: Duration::from_secs(10),
        runtimes,
        instances: vec![InstanceConfig {
            socket: runtime_dir.join(format!("{id}.sock")),
            id,
            spawn: vec![console.display().to_string()],
            spawn_env: BTreeMap::new(),
            runtime: DEFAULT_RUNTIME.to_owned(),
            allow: Allowlist::All,
            identity_isolation: false,
            max_inflight: 4,
            deny_notice: None,
            peers: crate::config::PeerRule::SocketMode,
            interactive_child: true,
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

/// Runs the demo until the console exits; returns its exit status.
pub async fn run(console: PathBuf, shutdown: CancellationToken) -> anyhow::Result<i32> {
    let dir = runtime_dir()?;
    let config = config(&dir, console);
    let listeners = crate::hub::bind(&config)?;
    let hub = crate::hub::Hub::new(config, crate::ledger::Ledger::off(), shutdown);
    let result = crate::hub::run_hub(hub.clone(), listeners).await;
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    Ok(crate::instance::lock(&hub.child_exit).unwrap_or(0))
}
