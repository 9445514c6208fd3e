//! The MQTT driver as a library, so its tests can run it in-process against a real broker.
//!
//! * [`config`]: `CHANNELD_MQTT_*` settings, validated.
//! * [`convert`]: pure mapping between topics and payloads and channeld frames.
//! * [`outbox`]: pure matching of outbound publishes to their PUBACKs.
//! * [`platform`]: the [`MqttDriver`] (`Driver` impl, dispatch to the hub, PUBACKs after it).
//! * `session`: the broker connections of one run (event loop, publisher, reconnects).

pub mod config;
pub mod convert;
pub mod outbox;
pub mod platform;
mod session;

pub use config::MqttConfig;
pub use platform::MqttDriver;
pub use session::{INBOUND_BACKLOG, MAX_INCOMING_PACKET, PUBLISH_QUEUE, REQUEST_QUEUE};
