//! `channeld-wecom`: a channeld driver for a WeCom (企业微信) AI Bot over the long-connection
//! WebSocket. Settings come from `CHANNELD_WECOM_*` (see the `config` module), the secret
//! from the credential `wecom-secret`.

use std::process::ExitCode;

use channeld_wecom::{WeComConfig, WeComDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = WeComConfig::from_launch(&launch)?;
        tracing::info!(
            channel = %config.channel,
            bot_id = %config.bot_id,
            host = config.ws_url.host_str().unwrap_or_default(),
            "starting the WeCom driver"
        );
        Ok(WeComDriver::new(config))
    })
}
