//! The WeCom AI Bot driver as a library, so its tests can run it in-process against the fake.
//!
//! * [`config`]: `CHANNELD_WECOM_*` settings, validated.
//! * [`wire`]: the platform's JSON frames (commands, callbacks, acknowledgements).
//! * [`convert`]: pure mapping between platform payloads and channeld frames.
//! * [`reply`]: one callback's reply as a state machine (stream, window, proactive fallback).
//! * [`pacing`]: per-conversation message pacing (30 a minute, 1,000 an hour).

pub mod config;
pub mod convert;
pub mod pacing;
pub mod reply;
pub mod wire;
