//! The channeld driver SDK: everything a platform driver needs except the platform.
//!
//! A driver implements [`Driver`] (declare capabilities, receive platform input, post
//! messages, apply effects, answer commands) and calls [`main`] from its `main`. The SDK reads
//! the launch settings ([`DriverLaunchConfig`]), connects to the hub with backoff, performs
//! the handshake and extension negotiation, resends inbound messages the hub has not taken
//! yet, answers redelivered requests without posting twice, and drains on SIGTERM.
//!
//! With the `testing` feature, [`testing`] provides a fake hub and the conformance suite.

mod driver;
mod hub;
pub mod launch;
mod pending;
mod runtime;
pub mod secret;
#[cfg(feature = "testing")]
pub mod testing;

use std::future::Future;
use std::process::ExitCode;

pub use driver::{
    CommandAnswer, CommandRequest, Declaration, Driver, DriverError, EffectError, EffectRequest,
    Post, PostError, PostKind,
};
pub use hub::{Hub, HubError, InboundTicket, MAX_PENDING_INBOUND};
pub use launch::{DriverLaunchConfig, LaunchError};
pub use pending::Acceptance;
pub use runtime::{HEARTBEAT_INTERVAL, RunError, run_driver};
pub use secret::{Secret, SecretError};

pub use channeld_protocol as protocol;
pub use tokio_util::sync::CancellationToken;

/// Installs the process-wide rustls crypto provider. Call first thing in every driver that
/// may speak TLS: with two providers compiled in, rustls cannot pick one by itself.
#[cfg(feature = "tls")]
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Logs to stderr; the filter comes from `CHANNELD_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CHANNELD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: under systemd stderr is the journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// A driver binary's whole `main`: logging, launch settings from the environment, a
/// single-threaded runtime, SIGTERM/SIGINT handling, and an exit status systemd understands
/// (0 after a clean drain, 78 for configuration errors, 1 otherwise).
pub fn main<D, F, Fut>(build: F) -> ExitCode
where
    D: Driver,
    F: FnOnce(DriverLaunchConfig) -> Fut,
    Fut: Future<Output = Result<D, DriverError>>,
{
    #[cfg(feature = "tls")]
    install_crypto_provider();
    init_logging();
    let launch = match DriverLaunchConfig::from_env() {
        Ok(launch) => launch,
        Err(err) => {
            tracing::error!(error = %err, "invalid launch settings");
            return ExitCode::from(78);
        }
    };
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
        spawn_signal_handler(shutdown.clone());
        match run_driver(driver, launch.clone(), shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!(channel = %launch.channel, error = %err, "driver stopped");
                ExitCode::from(err.exit_code())
            }
        }
    })
}

/// Cancels `token` on SIGTERM or SIGINT.
pub fn spawn_signal_handler(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) =
            (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        token.cancel();
    });
}
