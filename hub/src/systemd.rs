//! systemd's service notifications (`Type=notify`, through the `sd-notify` crate): `READY=1`
//! once every socket is served, `WATCHDOG=1` at half of `WatchdogSec=` — but only while the
//! hub makes progress (see `liveness.rs`) — and `STOPPING=1` when shutdown begins. Outside
//! systemd (`$NOTIFY_SOCKET` unset) it does nothing.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::hub::Hub;
use crate::liveness::Liveness;

/// Tells systemd how the hub is doing until `finished` is cancelled (after the hub stopped).
pub(crate) async fn notify(hub: Arc<Hub>, liveness: Liveness, finished: CancellationToken) {
    if std::env::var_os("NOTIFY_SOCKET").is_none_or(|socket| socket.is_empty()) {
        return;
    }
    tokio::select! {
        () = hub.ready.cancelled() => {
            send(format!("READY=1\nSTATUS=serving {} instance(s)", hub.instances.len())).await;
        }
        () = hub.shutdown.cancelled() => {}
        () = finished.cancelled() => return,
    }
    // Pings go on while the hub drains: it is alive until it exits.
    let interval = watchdog_interval();
    let mut tick = interval.map(tokio::time::interval);
    let mut stopping = false;
    let mut stalled = false;
    loop {
        tokio::select! {
            // Biased: a hub that stopped quickly has both `shutdown` and `finished` ready by
            // the time this task runs, and an unbiased pick could return without STOPPING=1.
            biased;
            () = hub.shutdown.cancelled(), if !stopping => {
                stopping = true;
                send("STOPPING=1\nSTATUS=draining runs".to_owned()).await;
            }
            () = finished.cancelled() => return,
            () = next_tick(&mut tick) => {
                let limit = interval.unwrap_or(Duration::from_secs(1));
                match liveness.check(limit, stopping).await {
                    Ok(()) => {
                        if stalled {
                            info!("the hub makes progress again; watchdog pings resumed");
                            stalled = false;
                        }
                        send("WATCHDOG=1".to_owned()).await;
                    }
                    Err(why) => {
                        if !stalled {
                            error!(reason = %why, "the hub is not making progress; withholding the watchdog ping so systemd restarts it");
                            stalled = true;
                        }
                    }
                }
            }
        }
    }
}

/// Half of `$WATCHDOG_USEC` when the watchdog is on for this process (`$WATCHDOG_PID`
/// unset or ours).
fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|usec| !usec.is_zero())
        .map(|usec| (usec / 2).max(Duration::from_millis(1)))
}

async fn next_tick(tick: &mut Option<tokio::time::Interval>) {
    match tick {
        Some(tick) => {
            tick.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// One notification: newline-separated assignments. The send can block on a full socket
/// buffer, so it runs off the async workers.
async fn send(message: String) {
    let sent = tokio::task::spawn_blocking(move || {
        sd_notify::notify(&[NotifyState::Custom(&message)]).map_err(|err| (err, message))
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err((err, message))) => {
            warn!(error = %err, state = %message, "systemd notification failed")
        }
        Err(err) => warn!(error = %err, "systemd notification task failed"),
    }
}
