//! The Avernet Bot Coordination Network (BCN) driver as a library, so its tests can run it
//! in-process.
//!
//! * [`config`]: `CHANNELD_BCN_*` settings, validated.
//! * [`wire`]: the platform's JSON frames (`req`, `res`, `event`).
//! * [`convert`]: pure mapping between BCN payloads and channeld messages.
//! * [`token`]: the bot token, kept in a 0600 file across reconnects and restarts.
//! * [`runs`]: the runs started for `chat.send` (session key, `seq`, ended or not).
//! * [`session`]: one connection's life (`bot.connect`, `bot.status`, reading).
//! * [`platform`]: the [`BcnDriver`] (reconnects, dispatch, the `Driver` methods).

pub mod config;
pub mod convert;
pub mod platform;
pub mod runs;
pub mod session;
pub mod token;
pub mod wire;

pub use config::BcnConfig;
pub use platform::BcnDriver;
