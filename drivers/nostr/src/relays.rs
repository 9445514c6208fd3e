//! Where each relay stands (connection, subscription, the last time it was caught up) and
//! the one health that follows: Ready while at least one relay is connected and subscribed,
//! Degraded with every relay's state otherwise. Pure: the platform side feeds it the relay
//! pool's status changes and relay messages and reads the link state back.

use std::collections::BTreeMap;

use channeld_driver_sdk::LinkState;

/// One relay's connection as the pool reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// Not connected yet, or connecting.
    Connecting,
    Connected,
    /// The connection failed or dropped; the pool retries.
    Disconnected,
    /// The pool gave up on it (terminated, banned).
    Stopped,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Relay {
    connection: Connection,
    /// The relay delivered its stored events for the inbox subscription (EOSE) on this
    /// connection.
    subscribed: bool,
    /// The relay closed the subscription, and why (e.g. `auth-required: …`).
    closed: Option<String>,
    /// Failed connection attempts since it was last connected.
    failures: u32,
    /// Unix seconds up to which it is known to have delivered everything.
    caught_up: u64,
}

/// Every configured relay, by URL.
#[derive(Debug, Clone)]
pub struct RelayBoard {
    npub: String,
    relays: BTreeMap<String, Relay>,
}

impl RelayBoard {
    /// `relays` start connecting; each is caught up to `checkpoint` (the persisted state).
    pub fn new(npub: String, relays: impl IntoIterator<Item = String>, checkpoint: u64) -> Self {
        let relays = relays
            .into_iter()
            .map(|url| {
                let relay = Relay {
                    connection: Connection::Connecting,
                    subscribed: false,
                    closed: None,
                    failures: 0,
                    caught_up: checkpoint,
                };
                (url, relay)
            })
            .collect();
        Self { npub, relays }
    }

    /// The pool reported a connection change.
    pub fn connection(&mut self, url: &str, connection: Connection) {
        let Some(relay) = self.relays.get_mut(url) else { return };
        if relay.connection == connection {
            return;
        }
        match connection {
            Connection::Connected => relay.failures = 0,
            Connection::Disconnected | Connection::Stopped => {
                if relay.connection != Connection::Connected {
                    relay.failures = relay.failures.saturating_add(1);
                }
            }
            Connection::Connecting => {}
        }
        if connection != Connection::Connected {
            relay.subscribed = false;
        }
        relay.connection = connection;
    }

    /// The relay sent EOSE for the inbox subscription: it is live and caught up now.
    pub fn end_of_stored(&mut self, url: &str, now: u64) {
        if let Some(relay) = self.relays.get_mut(url) {
            relay.subscribed = true;
            relay.closed = None;
            relay.caught_up = relay.caught_up.max(now);
        }
    }

    /// The relay closed the inbox subscription.
    pub fn closed(&mut self, url: &str, reason: &str) {
        if let Some(relay) = self.relays.get_mut(url) {
            relay.subscribed = false;
            relay.closed = Some(reason.to_owned());
        }
    }

    /// Relays that are live (connected and subscribed) are caught up to `now`.
    pub fn tick(&mut self, now: u64) {
        for relay in self.relays.values_mut() {
            if relay.connection == Connection::Connected && relay.subscribed {
                relay.caught_up = relay.caught_up.max(now);
            }
        }
    }

    /// When each relay was last caught up.
    pub fn caught_up(&self) -> impl Iterator<Item = u64> + '_ {
        self.relays.values().map(|relay| relay.caught_up)
    }

    /// The connected relays, where a post can go.
    pub fn connected(&self) -> Vec<String> {
        self.relays
            .iter()
            .filter(|(_, relay)| relay.connection == Connection::Connected)
            .map(|(url, _)| url.clone())
            .collect()
    }

    /// True while at least one relay is connected and subscribed.
    pub fn is_ready(&self) -> bool {
        self.relays
            .values()
            .any(|relay| relay.connection == Connection::Connected && relay.subscribed)
    }

    /// The health: Ready while one relay is live, naming the others' trouble; Degraded
    /// (connecting at first, retrying once a relay failed) with every relay's state.
    pub fn link_state(&self) -> LinkState {
        let live = self
            .relays
            .values()
            .filter(|relay| relay.connection == Connection::Connected && relay.subscribed)
            .count();
        let states = self.describe();
        if live > 0 {
            return LinkState::up_as(format!(
                "{} listening on {live} of {} relays: {states}",
                self.npub,
                self.relays.len()
            ));
        }
        let attempt = self.relays.values().map(|relay| relay.failures).max().unwrap_or(0);
        if attempt == 0 && self.relays.values().all(|relay| relay.closed.is_none()) {
            return LinkState::Connecting { attempt: 0 };
        }
        LinkState::Retrying { attempt, error: format!("{}: {states}", self.npub) }
    }

    /// `ws://a connected, subscribed; ws://b disconnected (3 failed attempts)`.
    pub fn describe(&self) -> String {
        self.relays
            .iter()
            .map(|(url, relay)| {
                let mut text = match relay.connection {
                    Connection::Connecting => format!("{url} connecting"),
                    Connection::Connected if relay.subscribed => {
                        format!("{url} connected, subscribed")
                    }
                    Connection::Connected => format!("{url} connected, not subscribed yet"),
                    Connection::Disconnected => format!("{url} disconnected"),
                    Connection::Stopped => format!("{url} given up"),
                };
                if relay.failures > 0 {
                    text.push_str(&format!(" ({} failed attempts)", relay.failures));
                }
                if let Some(reason) = &relay.closed {
                    text.push_str(&format!(" (subscription closed: {reason})"));
                }
                text
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::types::HealthState;

    use super::*;

    fn board() -> RelayBoard {
        RelayBoard::new("npub1bot".into(), ["ws://a".to_owned(), "ws://b".to_owned()], 100)
    }

    #[test]
    fn ready_needs_one_relay_connected_and_subscribed() {
        let mut board = board();
        assert_eq!(board.link_state(), LinkState::Connecting { attempt: 0 });
        board.connection("ws://a", Connection::Connected);
        assert!(!board.is_ready(), "connected is not yet subscribed");
        assert_eq!(board.link_state().health().state, HealthState::Degraded);
        board.end_of_stored("ws://a", 200);
        board.connection("ws://b", Connection::Disconnected);
        let health = board.link_state().health();
        assert_eq!(health.state, HealthState::Ready);
        let detail = health.detail.unwrap();
        assert!(detail.starts_with("npub1bot listening on 1 of 2 relays"), "{detail}");
        assert!(detail.contains("ws://b disconnected (1 failed attempts)"), "{detail}");
    }

    #[test]
    fn losing_every_relay_is_degraded_with_each_relays_state() {
        let mut board = board();
        board.connection("ws://a", Connection::Connected);
        board.end_of_stored("ws://a", 200);
        board.connection("ws://a", Connection::Disconnected);
        board.connection("ws://b", Connection::Disconnected);
        board.connection("ws://b", Connection::Connecting);
        board.connection("ws://b", Connection::Disconnected);
        let state = board.link_state();
        let LinkState::Retrying { attempt, error } = &state else { panic!("{state:?}") };
        assert_eq!(*attempt, 2);
        assert!(error.starts_with("npub1bot: ws://a disconnected; ws://b disconnected"), "{error}");
        assert_eq!(state.health().state, HealthState::Degraded);
        board.connection("ws://a", Connection::Connected);
        board.closed("ws://a", "auth-required: we only serve known keys");
        assert!(board.describe().contains("subscription closed: auth-required"));
        assert!(!board.is_ready());
    }

    #[test]
    fn live_relays_are_caught_up_and_a_lost_one_keeps_its_time() {
        let mut board = board();
        board.connection("ws://a", Connection::Connected);
        board.end_of_stored("ws://a", 150);
        board.tick(300);
        let caught_up: Vec<u64> = board.caught_up().collect();
        assert_eq!(caught_up, [300, 100], "b never connected: still at the checkpoint");
        board.connection("ws://a", Connection::Disconnected);
        board.tick(400);
        assert_eq!(board.caught_up().max(), Some(300));
        assert_eq!(board.connected(), Vec::<String>::new());
    }
}
