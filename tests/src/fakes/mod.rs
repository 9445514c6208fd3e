//! Protocol-faithful fake platform servers for the platforms that have no local server.

pub mod wechat;
