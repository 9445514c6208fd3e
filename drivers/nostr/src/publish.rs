//! Publishing signed events to the relays and classifying their answers: each connected
//! relay gets the event and is waited on for its `OK`; the first `OK true` is enough for a
//! receipt, and the answers still outstanding then are collected by a tracked task that logs
//! them. Relays that are not connected are not written to at all (the pool would queue the
//! event and send it whenever the relay comes back, which would make a "failed" send appear
//! later), so their answer is a certain "not sent".

use std::time::Duration;

use nostr_sdk::pool::relay::Error as RelayError;
use nostr_sdk::{Client, Event, Relay, RelayStatus};
use tokio::task::JoinSet;
use tokio_util::task::TaskTracker;
use tracing::{debug, info};

use crate::convert::{Published, RelayAnswer, published};

/// A relay's URL as the driver names it (no trailing slash).
pub fn relay_name(url: &nostr_sdk::RelayUrl) -> String {
    url.as_str_without_trailing_slash().to_owned()
}

/// Sends `event` to every connected relay of `client` and waits up to `within` for the
/// first `OK true`; returns what the relays amount to. The answers still outstanding when
/// one relay stored it are awaited (bounded by `within`) in a task of `stragglers`.
pub async fn publish(
    client: &Client,
    event: &Event,
    within: Duration,
    stragglers: &TaskTracker,
) -> Published {
    let mut answers: Vec<(String, RelayAnswer)> = Vec::new();
    let mut sends: JoinSet<(String, RelayAnswer)> = JoinSet::new();
    for (url, relay) in client.pool().relays().await {
        let name = relay_name(&url);
        let status = relay.status();
        if status != RelayStatus::Connected {
            answers.push((name, RelayAnswer::NotSent(format!("not connected ({status})"))));
            continue;
        }
        let event = event.clone();
        sends.spawn(async move {
            let answer = send_to(&relay, &event, within).await;
            (name, answer)
        });
    }
    while let Some(joined) = sends.join_next().await {
        let Ok((name, answer)) = joined else { continue };
        debug!(event_id = %event.id, relay = %name, ?answer, "relay answered");
        let stored = answer == RelayAnswer::Stored;
        answers.push((name, answer));
        if stored {
            if !sends.is_empty() {
                let event_id = event.id;
                stragglers.spawn(async move {
                    while let Some(Ok((name, answer))) = sends.join_next().await {
                        if answer != RelayAnswer::Stored {
                            info!(%event_id, relay = %name, ?answer, "a relay did not store a published event");
                        }
                    }
                });
            }
            break;
        }
    }
    published(&answers)
}

/// One relay's answer to `event`, waiting at most `within` for its `OK`.
async fn send_to(relay: &Relay, event: &Event, within: Duration) -> RelayAnswer {
    match tokio::time::timeout(within, relay.send_event(event)).await {
        Ok(Ok(_)) => RelayAnswer::Stored,
        Ok(Err(err)) => classify(err),
        Err(_) => RelayAnswer::NoAnswer(format!("no OK within {within:?}")),
    }
}

/// Whether a failed send certainly did not reach the relay. `NotConnected` can come from
/// before the write or from a connection lost while waiting for `OK`, so it counts as
/// possibly sent.
fn classify(err: RelayError) -> RelayAnswer {
    match err {
        RelayError::RelayMessage(reason) => RelayAnswer::Refused(reason),
        RelayError::NotReady
        | RelayError::Sleeping
        | RelayError::Banned
        | RelayError::WriteDisabled
        | RelayError::CantSendChannelMessage { .. }
        | RelayError::EventTooLarge { .. }
        | RelayError::TooManyTags { .. }
        | RelayError::MaximumLatencyExceeded { .. } => RelayAnswer::NotSent(err.to_string()),
        other => RelayAnswer::NoAnswer(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_certain_and_lost_connections_are_not() {
        assert_eq!(
            classify(RelayError::RelayMessage("blocked: not on the list".into())),
            RelayAnswer::Refused("blocked: not on the list".into())
        );
        assert!(matches!(classify(RelayError::NotReady), RelayAnswer::NotSent(_)));
        assert!(matches!(classify(RelayError::WriteDisabled), RelayAnswer::NotSent(_)));
        assert!(matches!(classify(RelayError::NotConnected), RelayAnswer::NoAnswer(_)));
        assert!(matches!(classify(RelayError::Timeout), RelayAnswer::NoAnswer(_)));
        assert!(matches!(classify(RelayError::PrematureExit), RelayAnswer::NoAnswer(_)));
    }
}
