//! `channeld-conformance`: checks a channeld driver written in any language. It binds a hub
//! socket of its own, starts the driver under test with the launch environment pointing at it,
//! plays the hub side of `cortexfs.channel.socket/v1` and reports one result per check.
//!
//! Modules: [`cli`] (flags → [`Options`]), [`report`] (results, text/JSON, exit status),
//! [`secrets`] (canary values and the scanners that look for them), [`driver`] (the child
//! process), [`conn`] (one connection as the hub sees it), [`inject`] (the author's stimulus
//! command), `suite` (the order of checks, sessions and restarts) with the checks themselves
//! in `probes` (one connection) and `lifecycle` (reconnects, SIGTERM, secrets).

pub mod cli;
pub mod conn;
pub mod driver;
pub mod inject;
mod lifecycle;
mod probes;
pub mod report;
pub mod secrets;
mod suite;

pub use cli::{Options, UsageError};
pub use report::{CheckResult, Status};
pub use suite::{CHECKS, KitError, run};
