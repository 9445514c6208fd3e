//! The channeld hub: one Unix socket per channel instance, capability negotiation, inbound
//! runs routed to a runtime and back, proactive sends with receipts, gated effects and
//! commands, a control socket for `channelctl`, and supervision of spawned drivers.
//!
//! `main` binds ([`bind`]) and runs ([`run`]); tests do the same in a temp dir, or serve a
//! single connection in memory ([`serve::serve`]). ARCHITECTURE.md has the module map; the
//! modules' `use crate::` edges form a DAG (`tests/module_graph.rs` checks it).

pub mod agent;
pub mod cancels;
pub mod clock;
pub mod command;
pub mod config;
pub mod connection;
pub mod control;
pub mod courier;
pub mod demo;
mod health;
pub mod history;
pub mod hub;
pub mod ids;
pub mod inbound;
pub mod instance;
pub mod ledger;
pub mod lifecycle;
pub mod listen;
pub mod liveness;
pub mod locator;
pub mod metrics;
pub mod notice;
pub mod operator;
pub mod outbox;
pub mod peer;
pub mod proactive;
mod recovery;
pub mod reload;
pub mod route;
pub mod runqueue;
pub mod runtime;
mod scrape;
pub mod send;
mod sendq;
pub mod serve;
mod supervisor;
mod systemd;

pub use config::{HubConfig, Overrides};
pub use hub::Hub;
pub use lifecycle::{open_ledger, run, run_hub};
pub use listen::{Listeners, MetricsListener, bind};
pub use send::{SendError, SendOutcome, SendState};
