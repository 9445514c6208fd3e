//! The channeld hub: one Unix socket per channel instance, capability negotiation, inbound
//! runs routed to a runtime and back, proactive sends with receipts, gated effects and
//! commands, a control socket for `channelctl`, and supervision of spawned drivers.
//!
//! `main` binds ([`hub::bind`]) and runs ([`hub::run`]); tests do the same in a temp dir.

pub mod config;
mod conn;
pub mod control;
mod delivery;
pub mod demo;
mod health;
pub mod hub;
mod inflight;
pub mod instance;
pub mod ledger;
pub mod notify;
pub mod outbox;
pub mod peer;
mod recovery;
pub mod route;
pub mod runtime;
mod supervisor;

pub use config::{HubConfig, Overrides};
pub use hub::{Hub, Listeners, SendError, SendOutcome, SendState, bind, open_ledger, run};
