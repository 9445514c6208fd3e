//! Driver health: a probe (`health_request` to the live driver, answered or timed out) and
//! the scheduled loop that probes every live driver and marks silent ones Unavailable.

use std::sync::Arc;

use channeld_protocol::Frame;
use channeld_protocol::frame::Lifecycle;
use channeld_protocol::types::{Health, HealthState};
use tracing::warn;

use crate::hub::Hub;
use crate::instance::Instance;

/// Asks the live driver for its health; a missing driver or a timeout is `Unavailable`.
pub async fn probe(hub: &Hub, inst: &Instance) -> Health {
    let Some(conn) = inst.live() else {
        return Health::new(HealthState::Unavailable, Some("no driver connected".into()));
    };
    let request_id = hub.ids.request("health");
    let Some(waiter) = conn.expect_health(request_id.clone()) else {
        return Health::new(HealthState::Unavailable, Some("driver disconnected".into()));
    };
    let frame = Frame::HealthRequest(Lifecycle { request_id: request_id.clone() });
    if conn.sink.send(&frame).await.is_err() {
        conn.forget_health(&request_id);
        return Health::new(HealthState::Unavailable, Some("driver disconnected".into()));
    }
    let timeout = hub.config.health_probe_timeout;
    let health = match tokio::time::timeout(timeout, waiter).await {
        Ok(Ok(health)) => health,
        Ok(Err(_)) => Health::new(HealthState::Unavailable, Some("driver disconnected".into())),
        Err(_) => {
            conn.forget_health(&request_id);
            Health::new(
                HealthState::Unavailable,
                Some(format!("no health_response within {} s", timeout.as_secs())),
            )
        }
    };
    if inst.set_health(health.clone()) {
        hub.courier.ready(inst.config.id.as_str());
    }
    health
}

/// Every `health_probe_interval`: a driver silent for longer than `liveness` is marked
/// Unavailable, every other live driver is probed (each probe a tracked task, so a slow
/// driver does not delay the others).
pub(crate) async fn probe_loop(hub: Arc<Hub>) {
    let mut tick = tokio::time::interval(hub.config.health_probe_interval);
    tick.tick().await;
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for inst in hub.instances.snapshot().values() {
            let Some(conn) = inst.live() else { continue };
            let idle = conn.idle_for();
            if idle > hub.config.liveness {
                let detail = format!("no frame from the driver for {} s", idle.as_secs());
                if inst.health().health.state != HealthState::Unavailable {
                    warn!(instance = %inst.config.id, idle_s = idle.as_secs(), "driver is silent; marking it Unavailable");
                }
                inst.set_health(Health::new(HealthState::Unavailable, Some(detail)));
                continue;
            }
            let (hub, inst) = (hub.clone(), inst.clone());
            hub.clone().tasks.spawn(async move {
                probe(&hub, &inst).await;
            });
        }
    }
}
