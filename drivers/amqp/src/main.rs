//! `channeld-amqp`: a channeld driver for AMQP 0-9-1 brokers. Consumes one queue, reports each
//! message to the hub, acknowledges it once the hub has it, and publishes replies and
//! proactive sends with publisher confirms. Settings: `CHANNELD_AMQP_*` (see `config`).

use std::process::ExitCode;

use channeld_amqp::{AmqpConfig, AmqpDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = AmqpConfig::from_launch(&launch)?;
        Ok(AmqpDriver::new(config))
    })
}
