//! Test support for drivers (feature `testing`): a fake hub that speaks the real wire protocol
//! and the conformance suite every driver runs.
//!
//! * [`FakeHub`] / [`FakeConnection`]: bind a socket in a temp dir, accept the driver, shake
//!   hands ([`AckMode`]) and assert its frames one at a time.
//! * [`conformance`]: the checks and the [`ConformanceHarness`] a driver's test implements;
//!   [`conformance_suite!`](crate::conformance_suite) turns them into tests.

pub mod conformance;
mod fake_hub;

pub use conformance::ConformanceHarness;
pub use fake_hub::{AckMode, FAKE_HUB_NAME, FakeConnection, FakeHub, IO_TIMEOUT};

#[cfg(test)]
mod self_test;
