//! The Slack driver as a library, so its tests can use the pure layers directly.
