//! The WeChat iLink driver as a library, so its tests can run it in-process against the fake
//! iLink server.
//!
//! * [`config`]: `CHANNELD_WECHAT_*` settings, validated.
//! * [`ilink`]: the iLink wire types (requests, responses, messages) and their constants.
//! * [`convert`]: pure mapping between iLink messages and channeld frames.
//! * [`client`]: the iLink HTTP client (headers, timeouts, errors that say whether the
//!   server may have acted).
//! * [`login`]: `channeld-wechat login`, the QR login.
//! * [`platform`]: the [`WechatDriver`]; [`poll`] (the inbound loop), [`outbound`] (posts),
//!   [`typing`] (indicators) and [`health`] are its parts.
//! * [`session`]: the bot token and base URL in use; the wait for a new token after `-14`.
//! * [`store`]: the in-memory cursor, replay set and context tokens, written through.
//! * [`state`]: the state directory (cursor, replay set, context tokens, login), written
//!   atomically.

pub mod client;
pub mod config;
pub mod convert;
pub mod health;
pub mod ilink;
pub mod login;
pub mod outbound;
pub mod platform;
pub mod poll;
pub mod session;
pub mod state;
pub mod store;
pub mod typing;

pub use config::WechatConfig;
pub use platform::WechatDriver;
