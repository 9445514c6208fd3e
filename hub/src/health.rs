//! Scheduled health: probes each live driver and marks silent ones Unavailable.

use std::sync::Arc;

use channeld_protocol::types::{Health, HealthState};
use tracing::warn;

use crate::hub::Hub;

pub(crate) async fn probe_loop(hub: Arc<Hub>) {
    let mut tick = tokio::time::interval(hub.config.health_probe_interval);
    tick.tick().await;
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for inst in hub.instances.values() {
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
            let hub = hub.clone();
            let inst = inst.clone();
            tokio::spawn(async move {
                hub.probe(&inst).await;
            });
        }
    }
}
