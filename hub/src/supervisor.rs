//! Supervises a driver the hub spawns itself (`spawn = [...]`): restarts it with backoff
//! (1 s doubling to 60 s, reset after 60 s up), stops it with SIGTERM on shutdown, and leaves
//! it stopped when it exits with 78 (`EX_CONFIG`: its configuration is invalid, so a restart
//! cannot help — as the systemd units' `RestartPreventExitStatus=78`).

use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use channeld_link::Backoff;
use tokio::process::{Child, Command};
use tracing::{error, info, warn};

use crate::config::InstanceConfig;
use crate::hub::Hub;
use crate::instance::{Instance, ProcessState, ProcessView};

/// The exit status that means "invalid configuration" (`EX_CONFIG` from sysexits.h).
pub const EXIT_CONFIG: i32 = 78;

pub(crate) async fn supervise(hub: Arc<Hub>, inst: Arc<Instance>) {
    let mut backoff = Backoff::supervisor();
    let id = inst.config.id.clone();
    let mut view =
        ProcessView { state: ProcessState::Running, pid: None, starts: 0, last_exit: None };
    loop {
        if hub.shutdown.is_cancelled() || inst.removed.is_cancelled() {
            break;
        }
        match spawn(&inst.config, Stdio::null()) {
            Ok(mut child) => {
                let started = Instant::now();
                view = ProcessView {
                    state: ProcessState::Running,
                    pid: child.id(),
                    starts: view.starts + 1,
                    ..view
                };
                inst.set_process(view.clone());
                info!(instance = %id, pid = ?child.id(), "driver process started");
                let status = tokio::select! {
                    status = child.wait() => status,
                    () = hub.close_connections.cancelled() => {
                        terminate(&mut child, hub.config.drain_timeout + Duration::from_secs(2)).await;
                        break;
                    }
                    () = inst.removed.cancelled() => {
                        info!(instance = %id, "instance removed by a reload; stopping its driver process");
                        terminate(&mut child, hub.config.drain_timeout + Duration::from_secs(2)).await;
                        break;
                    }
                };
                backoff.record_uptime(started.elapsed());
                let described = describe(&status);
                view = ProcessView { pid: None, last_exit: Some(described.clone()), ..view };
                if status.as_ref().ok().and_then(ExitStatus::code) == Some(EXIT_CONFIG) {
                    inst.record_error(format!(
                        "driver process exited with {EXIT_CONFIG} (invalid configuration); not restarted"
                    ));
                    error!(instance = %id, status = %described, "driver rejected its configuration; not restarting it: fix its settings, then restart the hub");
                    inst.set_process(ProcessView { state: ProcessState::Stopped, ..view });
                    return;
                }
                inst.record_error(format!("driver process exited: {described}"));
                warn!(instance = %id, status = %described, "driver process exited");
            }
            Err(err) => {
                view = ProcessView {
                    pid: None,
                    last_exit: Some(format!("not started: {err}")),
                    ..view
                };
                inst.record_error(format!("cannot start driver: {err}"));
                error!(instance = %id, command = ?inst.config.spawn.first(), error = %err, "cannot start driver process");
            }
        }
        inst.set_process(ProcessView { state: ProcessState::Restarting, ..view.clone() });
        let delay = backoff.next_delay();
        info!(instance = %id, delay_ms = delay.as_millis() as u64, attempt = backoff.attempt(), "restarting driver after backoff");
        tokio::select! {
            () = tokio::time::sleep(delay) => inst.metrics.driver_restart(),
            () = hub.shutdown.cancelled() => break,
            () = inst.removed.cancelled() => break,
        }
    }
    inst.set_process(ProcessView { state: ProcessState::Stopped, pid: None, ..view });
}

fn describe(status: &std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(status) => status.to_string(),
        Err(err) => format!("wait failed: {err}"),
    }
}

/// Starts the driver of `instance` with its launch environment (`CHANNELD_CHANNEL_ID`,
/// `CHANNELD_SOCKET`); it gets SIGTERM if the hub dies.
pub fn spawn(instance: &InstanceConfig, stdin: Stdio) -> std::io::Result<Child> {
    let (program, args) = instance.spawn.split_first().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty spawn command")
    })?;
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(&instance.spawn_env)
        .env("CHANNELD_CHANNEL_ID", instance.id.as_str())
        .env("CHANNELD_SOCKET", &instance.socket)
        .stdin(stdin)
        .kill_on_drop(true);
    // SAFETY: prctl and restore_in_child are async-signal-safe and touch no memory of the
    // parent.
    unsafe {
        command.pre_exec(|| {
            // A driver whose hub died drains and exits instead of lingering.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The driver runs under the policy the hub was started with.
            channeld_link::sched::restore_in_child()
        });
    }
    command.spawn()
}

/// SIGTERM, then SIGKILL if the driver has not drained within `grace`.
pub async fn terminate(child: &mut Child, grace: Duration) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        if tokio::time::timeout(grace, child.wait()).await.is_ok() {
            return;
        }
        warn!(pid, "driver did not exit after SIGTERM; killing it");
    }
    let _ = child.kill().await;
}
