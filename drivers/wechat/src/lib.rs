//! The WeChat iLink driver as a library, so its tests can run it in-process against the fake
//! iLink server.
//!
//! * [`ilink`]: the iLink wire types (requests, responses, messages) and their constants.

pub mod ilink;
