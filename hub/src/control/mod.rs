//! The hub's control socket: `channeld.control/v1` for `channelctl` and applications.

pub mod proto;
mod server;

pub(crate) use server::accept_loop;
pub use server::catalog;
