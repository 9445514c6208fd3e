//! `channeld-amqp`: a channeld driver for AMQP 0-9-1 brokers. Consumes one queue, reports each
//! message to the hub, acknowledges it once the hub has it, and publishes replies and
//! proactive sends with publisher confirms. Settings: `CHANNELD_AMQP_*` (see `config`).

use std::process::ExitCode;

use channeld_amqp::{AmqpConfig, AmqpDriver};

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = AmqpConfig::from_launch(&launch)?;
        Ok(AmqpDriver::new(config))
    })
}
