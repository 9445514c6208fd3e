//! `channeld-slack`: a channeld driver for Slack (Socket Mode in, Web API out). Settings come
//! from `CHANNELD_SLACK_*` (see the `config` module), the two tokens from the credentials
//! directory (`slack-app-token`, `slack-bot-token`).

use std::process::ExitCode;

use channeld_driver_sdk::DriverError;
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_slack::{SlackConfig, SlackDriver};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let config = SlackConfig::from_launch(&launch)?;
        let options =
            HttpOptions { timeout: config.http_timeout, ..HttpOptions::for_driver("slack") };
        let client = http::client(&options).map_err(DriverError::platform)?;
        tracing::info!(
            channel = %config.channel,
            api = %config.api_url,
            respond = ?config.respond,
            "starting the Slack driver"
        );
        Ok(SlackDriver::new(config, client))
    })
}
