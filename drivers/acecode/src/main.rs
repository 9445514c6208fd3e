//! `channeld-acecode`: a channeld driver that hosts one ACECode channel platform plugin.
//! Settings come from `CHANNELD_ACECODE_*` (see the `config` module).

use std::process::ExitCode;

use channeld_acecode::{AcecodeConfig, AcecodeDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = AcecodeConfig::from_launch(&launch)?;
        tracing::info!(
            channel = %config.channel,
            plugin = %config.manifest.name,
            command = %config.manifest.command.display(),
            "starting the ACECode plugin host"
        );
        Ok(AcecodeDriver::new(config))
    })
}
