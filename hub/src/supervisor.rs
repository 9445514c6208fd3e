//! Supervises a driver the hub spawns itself (`spawn = [...]`): restarts it with backoff
//! (1 s doubling to 60 s, reset after 60 s up) and stops it with SIGTERM on shutdown.

use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use channeld_link::Backoff;
use tokio::process::{Child, Command};
use tracing::{error, info, warn};

use crate::hub::Hub;
use crate::instance::Instance;

pub(crate) async fn supervise(hub: Arc<Hub>, inst: Arc<Instance>) {
    let mut backoff = Backoff::supervisor();
    let id = inst.config.id.clone();
    loop {
        if hub.shutdown.is_cancelled() {
            return;
        }
        match spawn(&inst) {
            Ok(mut child) => {
                let started = Instant::now();
                info!(instance = %id, pid = ?child.id(), "driver process started");
                let status = tokio::select! {
                    status = child.wait() => status,
                    () = hub.close_connections.cancelled() => {
                        terminate(&mut child, hub.config.drain_timeout + Duration::from_secs(2)).await;
                        return;
                    }
                };
                backoff.record_uptime(started.elapsed());
                let code = describe(&status);
                if inst.config.interactive_child {
                    let exit = status.as_ref().ok().and_then(ExitStatus::code).unwrap_or(1);
                    *crate::instance::lock(&hub.child_exit) = Some(exit);
                    hub.shutdown.cancel();
                    return;
                }
                inst.record_error(format!("driver process exited: {code}"));
                warn!(instance = %id, status = %code, "driver process exited");
            }
            Err(err) => {
                inst.record_error(format!("cannot start driver: {err}"));
                error!(instance = %id, command = ?inst.config.spawn.first(), error = %err, "cannot start driver process");
            }
        }
        let delay = backoff.next_delay();
        info!(instance = %id, delay_ms = delay.as_millis() as u64, attempt = backoff.attempt(), "restarting driver after backoff");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = hub.shutdown.cancelled() => return,
        }
    }
}

fn describe(status: &std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(status) => status.to_string(),
        Err(err) => format!("wait failed: {err}"),
    }
}

fn spawn(inst: &Instance) -> std::io::Result<Child> {
    let (program, args) = inst.config.spawn.split_first().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty spawn command")
    })?;
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(&inst.config.spawn_env)
        .env("CHANNELD_CHANNEL_ID", inst.config.id.as_str())
        .env("CHANNELD_SOCKET", &inst.config.socket)
        .stdin(if inst.config.interactive_child { Stdio::inherit() } else { Stdio::null() })
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            // A driver whose hub died drains and exits instead of lingering.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn()
}

/// SIGTERM, then SIGKILL if the driver has not drained within `grace`.
async fn terminate(child: &mut Child, grace: Duration) {
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
