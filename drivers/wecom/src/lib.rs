//! The WeCom (企业微信) AI Bot driver as a library, so its tests can run it in-process
//! against the fake platform.
//!
//! * [`config`]: `CHANNELD_WECOM_*` settings, validated.
//! * [`wire`]: the platform's JSON frames (commands, callbacks, acknowledgements).
//! * [`convert`]: pure mapping between platform payloads and channeld frames.
//! * [`reply`]: one callback's reply as a state machine (stream, window, proactive fallback).
//! * [`pacing`]: per-conversation message pacing (30 a minute, 1,000 an hour).
//! * [`link`]: the live connection: one command, one acknowledgement, matched by `req_id`.
//! * [`session`]: one connection's life (subscribe, pings, reading, fencing).
//! * [`outbound`]: sending: stream frames, proactive messages, cards, welcome texts, paced
//!   one message at a time per conversation.
//! * [`replies`]: replies to callbacks (placeholder, progress, final text or fallback).
//! * [`cards`]: approval and choice cards waiting for a click.
//! * [`platform`]: the [`WeComDriver`] (reconnects, dispatch, the `Driver` methods).

pub mod cards;
pub mod config;
pub mod convert;
pub mod link;
pub mod outbound;
pub mod pacing;
pub mod platform;
pub mod replies;
pub mod reply;
pub mod session;
pub mod wire;

pub use config::WeComConfig;
pub use platform::WeComDriver;
