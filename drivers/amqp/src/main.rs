//! `channeld-amqp`: a channeld driver for AMQP 0-9-1 brokers. Consumes one queue, reports each
//! message to the hub, acknowledges it once the hub has it, and publishes replies and
//! proactive sends with publisher confirms. Settings: `CHANNELD_AMQP_*` (see `config`).

use std::process::ExitCode;

use channeld_amqp::{AmqpConfig, AmqpDriver};
use channeld_driver_sdk::DriverError;

/// The log filter when `CHANNELD_LOG` is not set. lapin logs a returned (unroutable) message
/// with its body at WARN and reports recoveries the driver handles at ERROR; the driver logs
/// those events itself, at the level they deserve (`CHANNELD_LOG=info,lapin=debug` shows
/// lapin's own lines).
const DEFAULT_LOG: &str = "info,lapin=off";

fn main() -> ExitCode {
    init_logging();
    channeld_driver_sdk::main(|launch| async move {
        let config =
            AmqpConfig::from_launch(&launch).map_err(|err| DriverError::Config(err.to_string()))?;
        Ok(AmqpDriver::new(config))
    })
}

/// The SDK's logging (stderr, filter from `CHANNELD_LOG`) with the driver's default filter;
/// the SDK's own initialisation then finds a subscriber in place and leaves it.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CHANNELD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
