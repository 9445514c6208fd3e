//! The WeChat iLink driver as a library, so its tests can run it in-process against the fake
//! iLink server.
//!
//! * [`config`]: `CHANNELD_WECHAT_*` settings, validated.
//! * [`ilink`]: the iLink wire types (requests, responses, messages) and their constants.
//! * [`convert`]: pure mapping between iLink messages and channeld frames.

pub mod config;
pub mod convert;
pub mod ilink;

pub use config::{ConfigError, WechatConfig};
