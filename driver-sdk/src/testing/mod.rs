//! Test support for drivers (feature `testing`): a fake hub that speaks the real wire protocol
//! and the conformance suite every driver runs.
//!
//! * [`FakeHub`] / [`FakeConnection`]: bind a socket in a temp dir, accept the driver, shake
//!   hands ([`AckMode`]) and assert its frames one at a time.
//! * [`conformance`]: the checks and the [`ConformanceHarness`] a driver's test implements;
//!   [`conformance_suite!`](crate::conformance_suite) turns them into tests.
//! * [`checks`]: the pure rules those checks apply, shared with `channeld-conformance` (the
//!   same checks against a driver process in any language).
//! * [`DriverTask`]: runs a driver in-process (what most harnesses' `start`/`stop` need).
//!
//! A driver crate needs nothing else for this: the feature brings its own tokio runtime and
//! temp dirs, and the suite can be invoked from a `#[cfg(test)]` module of `main.rs` (no
//! library target needed) or from `tests/` (then the driver types must be in a library).

pub mod checks;
pub mod conformance;
mod fake_hub;

pub use conformance::ConformanceHarness;
pub use fake_hub::{AckMode, DRAIN, FAKE_HUB_NAME, FakeConnection, FakeHub, IO_TIMEOUT};
pub use tempfile::TempDir;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::driver::Driver;
use crate::launch::DriverLaunchConfig;
use crate::runtime::{RunError, run_driver};

/// A fresh temporary directory (removed when dropped), for a harness's platform files.
pub fn temp_dir(prefix: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()
        .unwrap_or_else(|err| panic!("cannot create a temp dir: {err}"))
}

/// A driver running in-process under [`run_driver`], as `main` would run it.
#[derive(Debug)]
pub struct DriverTask {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RunError>>,
}

impl DriverTask {
    /// Starts `driver` with `launch` on the current runtime.
    pub fn spawn<D: Driver>(driver: D, launch: DriverLaunchConfig) -> Self {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run_driver(driver, launch, shutdown.clone()));
        Self { shutdown, task }
    }

    /// Stops it as SIGTERM would and waits for it; the error if it did not stop cleanly.
    pub async fn stop(self) -> Result<(), RunError> {
        self.shutdown.cancel();
        self.task.await.unwrap_or(Err(RunError::Panicked))
    }

    /// Waits for it to end by itself (its platform input ended, or it failed).
    pub async fn join(self) -> Result<(), RunError> {
        self.task.await.unwrap_or(Err(RunError::Panicked))
    }
}

#[cfg(test)]
mod handlers_test;
#[cfg(test)]
mod lifecycle_test;
#[cfg(test)]
mod requests_test;
#[cfg(test)]
mod self_test;
#[cfg(test)]
mod session_test;
#[cfg(test)]
mod submit_test;
