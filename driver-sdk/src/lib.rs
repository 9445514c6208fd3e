//! The channeld driver SDK: everything a platform driver needs except the platform.
//!
//! A driver implements [`Driver`] (declare capabilities, run the platform side, post
//! messages, apply effects, answer commands and operator actions) and calls [`main`] from its
//! `main`. The SDK reads the launch settings ([`DriverLaunchConfig`]), connects to the hub
//! with backoff, performs the handshake and extension negotiation, starts the platform side
//! only once the hub has accepted the driver (and stops it while the hub refuses it), resends
//! inbound messages the hub has not taken yet, answers redelivered requests without posting
//! twice, and drains on SIGTERM.
//!
//! The driver kit, for the platform side:
//! * [`Inbound`]: build the message to report; [`Hub::inbound`] reports it and returns an
//!   [`InboundTicket`] resolved by the hub's answer ([`Acceptance`]).
//! * [`PendingAcks`] + [`Settle`]: acknowledge each platform message only after the hub's
//!   answer, drained on shutdown.
//! * [`LinkState`] + [`Hub::link_state`]: one rule from link state to health.
//! * [`Reconnect`]: capped, jittered backoff with a slow lane for operator-only failures.
//! * [`DriverLaunchConfig::parse`] and friends, [`ConfigError`], [`Secret`]: typed settings.
//! * `transport` (features `http`, `websocket`): an HTTP client and a WebSocket connection
//!   with keepalive, for platforms that speak them.
//!
//! With the `testing` feature, [`testing`] provides a fake hub and the conformance suite.

pub mod acecode;
pub mod config;
mod driver;
mod health;
mod hub;
mod inbound;
pub mod launch;
mod pending;
mod reconnect;
mod runtime;
pub mod secret;
mod session;
mod settle;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
#[cfg(any(feature = "http", feature = "websocket"))]
pub mod transport;

use std::future::Future;
use std::process::ExitCode;

pub use config::{ConfigError, Setting};
pub use driver::{
    CommandAnswer, CommandRequest, Declaration, DeclarationError, Driver, DriverError, EffectError,
    EffectRequest, OperatorAction, OperatorActionError, Post, PostError, PostKind,
};
pub use health::LinkState;
pub use hub::{Hub, HubError, InboundTicket, IntoInbound, MAX_PENDING_INBOUND, STOP_MARGIN};
pub use inbound::{Inbound, InboundError};
pub use launch::DriverLaunchConfig;
pub use pending::Acceptance;
pub use reconnect::{Failure, Nudge, Reconnect, ReconnectPolicy};
pub use runtime::{HEARTBEAT_INTERVAL, RunError, run_driver, run_driver_acecode};
pub use secret::Secret;
pub use settle::{PendingAcks, SETTLE_WITHIN, Settle};
pub use tls::install_crypto_provider;

pub use channeld_protocol as protocol;
/// The tokio and tracing the SDK is built with, so a driver needs no dependency of its own
/// for its timers, tasks and logs (`channeld_driver_sdk::tokio::select!`, `tracing::info!`).
pub use tokio;
pub use tokio_util::sync::CancellationToken;
pub use tracing;
pub use url::Url;

/// Logs with the filter from `CHANNELD_LOG` (default `default_filter`) in the format
/// `CHANNELD_LOG_FORMAT` or systemd chooses (journal, JSON or human lines on stderr); the
/// same setup as the hub's.
pub fn init_logging(default_filter: &str) {
    channeld_link::process::init_logging(default_filter);
}

/// A driver binary's whole `main`: the TLS provider, logging, launch settings from the
/// environment, a single-threaded runtime, SIGTERM/SIGINT handling, and an exit status
/// systemd understands: 0 after a clean drain; 78 for configuration errors (settings, an
/// unusable `CHANNELD_SOCKET`, conflicting launch variables, a refused channel), which are
/// not restarted; 1 otherwise (including a `run` that had to be aborted).
///
/// With `--acecode` among the arguments the driver is an ACECode channel platform plugin:
/// it speaks the plugin protocol on stdin/stdout instead of connecting to a hub
/// ([`acecode`]), with the channel id `<family>.acecode` unless `CHANNELD_CHANNEL_ID` says
/// otherwise, and no socket.
///
/// `build` turns the launch settings into the driver; it should only read and check
/// settings (`?` works on [`ConfigError`]), never connect to the platform: [`Driver::run`]
/// does that once the hub accepted the driver.
pub fn main<D, F, Fut>(build: F) -> ExitCode
where
    D: Driver,
    F: FnOnce(DriverLaunchConfig) -> Fut,
    Fut: Future<Output = Result<D, DriverError>>,
{
    install_crypto_provider();
    init_logging(D::LOG_FILTER);
    let acecode = std::env::args_os().skip(1).any(|arg| arg == "--acecode");
    let launch = if acecode {
        DriverLaunchConfig::for_acecode(std::env::vars(), &family_of_binary())
    } else {
        DriverLaunchConfig::from_env()
    };
    let launch = match launch {
        Ok(launch) => launch,
        Err(err) => {
            tracing::error!(error = %err, "invalid launch settings");
            return ExitCode::from(78);
        }
    };
    // Every line this driver logs carries its instance (`INSTANCE=` in the journal, `spans`
    // in JSON): the runtime is single-threaded, so every task is polled inside this span.
    let process_span = tracing::info_span!("driver", instance = %launch.channel);
    let _in_process_span = process_span.enter();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(error = %err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let driver = match build(launch.clone()).await {
            Ok(driver) => driver,
            Err(err) => {
                tracing::error!(channel = %launch.channel, error = %err, "driver failed to start");
                return ExitCode::from(RunError::Driver(err).exit_code());
            }
        };
        let shutdown = CancellationToken::new();
        let _signals = channeld_link::process::spawn_signal_handler(shutdown.clone());
        let ran = if acecode {
            let (input, output) = (tokio::io::stdin(), tokio::io::stdout());
            run_driver_acecode(driver, launch.clone(), shutdown, input, output).await
        } else {
            run_driver(driver, launch.clone(), shutdown).await
        };
        match ran {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!(channel = %launch.channel, error = %err, "driver stopped");
                ExitCode::from(err.exit_code())
            }
        }
    })
}

/// The family in this binary's name (`channeld-slack` → `slack`), for `--acecode`'s default
/// channel id.
fn family_of_binary() -> String {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|path| path.file_name().map(|n| n.to_string_lossy().into_owned()))
        .map(|name| name.strip_prefix("channeld-").unwrap_or(&name).to_owned())
        .filter(|family| channeld_protocol::ChannelId::new(format!("{family}.acecode")).is_ok())
        .unwrap_or_else(|| "driver".to_owned())
}
