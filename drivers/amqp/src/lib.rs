//! The AMQP 0-9-1 driver (RabbitMQ) as a library, so its tests can reach the pure parts.
//!
//! * [`config`]: settings from the launch environment (`CHANNELD_AMQP_*`).
//! * [`convert`]: pure mapping between AMQP messages and channeld frames.
//! * [`platform`]: the [`AmqpDriver`]: connection, recovery, consuming and publishing.

pub mod config;
pub mod convert;
pub mod platform;

pub use config::AmqpConfig;
pub use platform::AmqpDriver;
