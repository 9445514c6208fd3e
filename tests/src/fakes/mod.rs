//! Protocol-faithful fake platform servers for the platforms that have no local server: each
//! binds 127.0.0.1:0, speaks the platform's real wire format, records everything it sees and
//! is steered through a handle.

pub mod bcn;
pub mod slack;
pub mod wechat;
pub mod wecom;
