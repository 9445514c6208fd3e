//! `channeld-acecode`: hosts one ACECode channel platform plugin (a long-lived child process
//! speaking stdio JSONL, see `channeld_protocol::acecode`) as a channeld channel instance.
//!
//! * `config` — settings and the manifest (an invalid one is a configuration error, exit 78).
//! * `backoff` — pure: the restart delay (1 s doubling to 60 s, reset after 60 s up).
//! * `plugin` — one plugin process: requests with timeouts, events, stderr, shutdown.
//! * `convert` — pure: plugin status → link state, inbound → `Inbound`, sends → requests.
//! * `platform` — the `Driver`: the restart loop, posts, typing, operator actions.

pub mod backoff;
pub mod config;
pub mod convert;
pub mod platform;
pub mod plugin;

pub use config::AcecodeConfig;
pub use platform::AcecodeDriver;
