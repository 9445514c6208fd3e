//! The MQTT driver as a library, so its tests can run it in-process against a real broker.
//!
//! * [`config`]: `CHANNELD_MQTT_*` settings, validated.
//! * [`convert`]: pure mapping between topics and payloads and channeld frames.
//! * [`outbox`]: pure matching of outbound publishes to their PUBACKs.
//! * [`platform`]: the [`MqttDriver`] (rumqttc client, event loop task, acks after the hub).

pub mod config;
pub mod convert;
pub mod outbox;
pub mod platform;

pub use config::{ConfigError, MqttConfig};
pub use platform::MqttDriver;
