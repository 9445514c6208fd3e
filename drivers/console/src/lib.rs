//! The console driver as a library, so its tests can run it in-process over in-memory pipes.
//!
//! * [`config`]: settings from the launch environment.
//! * [`convert`]: pure mapping from typed lines to inbound messages and from outbound
//!   messages to printed text.
//! * [`platform`]: the [`ConsoleDriver`] itself, generic over its input and output.

pub mod config;
pub mod convert;
pub mod platform;

pub use config::ConsoleConfig;
pub use platform::ConsoleDriver;
