//! The hub's control socket (`channeld.control/v1`, types in the `channeld-control` crate)
//! for `channelctl` and applications: `server.rs` accepts (peer check, connection limit) and
//! frames requests, `handle.rs` answers them.

mod handle;
mod server;

pub use handle::catalog;
pub(crate) use server::accept_loop;
pub use server::{MAX_CONNECTIONS, serve};
