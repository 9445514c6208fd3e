//! The WeCom AI Bot driver as a library, so its tests can run it in-process against the fake.
//!
//! * [`cards`]: approval and choice cards waiting for a click.
//! * [`config`]: `CHANNELD_WECOM_*` settings, validated.
//! * [`wire`]: the platform's JSON frames (commands, callbacks, acknowledgements).
//! * [`convert`]: pure mapping between platform payloads and channeld frames.
//! * [`link`]: the live connection: one command, one acknowledgement, matched by `req_id`.
//! * [`outbound`]: replies, progress, proactive messages, cards, welcome texts, paced.
//! * [`reply`]: one callback's reply as a state machine (stream, window, proactive fallback).
//! * [`pacing`]: per-conversation message pacing (30 a minute, 1,000 an hour).

pub mod cards;
pub mod config;
pub mod convert;
pub mod link;
pub mod outbound;
pub mod pacing;
pub mod reply;
pub mod wire;
