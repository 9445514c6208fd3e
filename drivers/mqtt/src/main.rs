//! `channeld-mqtt`: a channeld driver for an MQTT 3.1.1 broker. Settings come from
//! `CHANNELD_MQTT_*` (see the `config` module), the password from the credentials directory.

use std::process::ExitCode;

use channeld_mqtt::{MqttConfig, MqttDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = MqttConfig::from_launch(&launch)?;
        tracing::info!(
            channel = %config.channel,
            broker = %config.broker,
            client_id = %config.client_id,
            subscriptions = ?config.subscriptions,
            "starting the MQTT driver"
        );
        MqttDriver::new(config)
    })
}
