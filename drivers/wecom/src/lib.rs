//! The WeCom AI Bot driver as a library, so its tests can run it in-process against the fake.
//!
//! * [`config`]: `CHANNELD_WECOM_*` settings, validated.
//! * [`wire`]: the platform's JSON frames (commands, callbacks, acknowledgements).
//! * [`convert`]: pure mapping between platform payloads and channeld frames.

pub mod config;
pub mod convert;
pub mod wire;
