//! `channeld-bcn`: a channeld driver that makes the hub's agent a bot of Avernet's Bot
//! Coordination Network (BCN). Settings come from `CHANNELD_BCN_*` (see the `config`
//! module); the bot token is kept in `CHANNELD_BCN_STATE_DIR` or systemd's `$STATE_DIRECTORY`.

use std::path::PathBuf;
use std::process::ExitCode;

use channeld_bcn::config::ENV_STATE_DIRECTORY;
use channeld_bcn::{BcnConfig, BcnDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        // systemd lists one directory per `StateDirectory=` entry, separated by colons.
        let state_directory = std::env::var_os(ENV_STATE_DIRECTORY)
            .and_then(|dirs| dirs.to_str().and_then(|d| d.split(':').next()).map(PathBuf::from))
            .filter(|dir| !dir.as_os_str().is_empty());
        let config = BcnConfig::from_launch(&launch, state_directory)?;
        tracing::info!(
            channel = %config.channel,
            host = config.url.host_str().unwrap_or_default(),
            protocol_version = config.protocol_version,
            token = %config.token_file.display(),
            "starting the BCN driver"
        );
        Ok(BcnDriver::new(config))
    })
}
