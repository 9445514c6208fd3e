//! What every channeld process does at start, the hub and the drivers alike: logging to
//! stderr with one filter variable, and SIGTERM/SIGINT turned into a cancellation.

use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The environment variable holding the log filter (`tracing` directives, e.g.
/// `info,lapin=debug`).
pub const LOG_ENV: &str = "CHANNELD_LOG";

/// Logs to stderr. The filter comes from `CHANNELD_LOG`, else `default_filter`. Colour codes
/// only when stderr is a terminal: under systemd stderr is the journal, which would store
/// them verbatim. Calling it again (or after another subscriber was set) changes nothing.
pub fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Cancels `token` on the first SIGTERM or SIGINT. Must be called inside a tokio runtime;
/// the task lives as long as the process (abort the handle to stop listening). If the
/// handlers cannot be installed the error is logged and the token is never cancelled by a
/// signal.
pub fn spawn_signal_handler(token: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) =
            (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::debug!("SIGTERM received"),
            _ = int.recv() => tracing::debug!("SIGINT received"),
        }
        token.cancel();
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_signal_cancels_the_token() {
        let token = CancellationToken::new();
        let _handler = spawn_signal_handler(token.clone());
        // On this single-threaded runtime the yield lets the handler task run up to its
        // first await, by which point both listeners are installed (before that, SIGINT
        // would end the test process).
        tokio::task::yield_now().await;
        // SAFETY: raising a signal at our own process.
        unsafe { libc::raise(libc::SIGINT) };
        tokio::time::timeout(Duration::from_secs(10), token.cancelled())
            .await
            .expect("SIGINT did not cancel the token");
    }
}
