//! The Nostr driver as a library, so its tests can run it in-process against a real relay.
//!
//! * [`config`]: `CHANNELD_NOSTR_*` settings and the secret key, validated.
//! * [`convert`]: pure mapping between Nostr events and channeld frames.
//! * [`state`]: the persisted checkpoint, seen-set, posted replies and conversations.
//! * [`relays`]: each relay's state and the health that follows.
//! * [`inbox`]: receiving: dedupe, unwrap or decrypt, verify, report, settle.
//! * [`outgoing`]: building signed, wrapped messages and reactions.
//! * [`publish`]: publishing to the relays and classifying their answers.
//! * [`platform`]: the [`NostrDriver`] (`Driver` impl: declaration, posts, effects).
//! * `session`: one run (relay pool, subscription, run loop, checkpoint, announcements).

pub mod config;
pub mod convert;
pub mod inbox;
pub mod outgoing;
pub mod platform;
pub mod publish;
pub mod relays;
mod session;
pub mod state;

pub use config::NostrConfig;
pub use platform::NostrDriver;
