//! `channeld-nostr`: a channeld driver for Nostr encrypted direct messages (NIP-17 gift wraps
//! and NIP-04). Settings come from `CHANNELD_NOSTR_*` (see the `config` module), the secret
//! key from the credentials directory, the state directory from `CHANNELD_NOSTR_STATE_DIR` or
//! systemd's `$STATE_DIRECTORY`.

use std::path::PathBuf;
use std::process::ExitCode;

use channeld_nostr::{NostrConfig, NostrDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        // systemd lists one directory per `StateDirectory=` entry, separated by colons.
        let state_directory = std::env::var_os("STATE_DIRECTORY")
            .and_then(|dirs| dirs.to_str().and_then(|d| d.split(':').next()).map(PathBuf::from))
            .filter(|dir| !dir.as_os_str().is_empty());
        let config = NostrConfig::from_launch(&launch, state_directory)?;
        tracing::info!(
            channel = %config.channel,
            npub = %config.npub(),
            relays = config.relays.len(),
            state = %config.state_file.display(),
            "starting the Nostr driver"
        );
        NostrDriver::new(config)
    })
}
