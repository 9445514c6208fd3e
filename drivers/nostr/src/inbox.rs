//! The receiving side: each event the inbox subscription brings is checked against the
//! seen-set and what is already in flight, unwrapped or decrypted, verified, converted and
//! reported to the hub. Once the hub has answered, the settlement records it as seen
//! (persisted), so neither a relay reconnect nor a restart reports it again; an event the hub
//! did not answer stays held, holding the checkpoint back so a restart brings it again.
//!
//! Anything that does not decrypt, is malformed, or carries a forged seal is logged, recorded
//! as seen (so it is not logged again after every restart) and skipped.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use channeld_driver_sdk::{Acceptance, Hub, HubError, PendingAcks, Settle};
use nostr_sdk::nips::nip04;
use nostr_sdk::nips::nip59::{self, UnwrappedGift};
use nostr_sdk::{Event, Kind, PublicKey, RelayUrl};
use tracing::{debug, info, warn};

use crate::config::NostrConfig;
use crate::convert::{self, Incoming, Nip, Participants, Report, Skip};
use crate::publish::relay_name;
use crate::state::{StateStore, unix_now};

/// Recent inbound messages remembered in memory for their replies and reactions.
pub const REMEMBERED_ORIGINS: usize = 4096;
/// Events held (reported and unanswered, or left unresolved) at most; beyond it the oldest
/// unresolved one is let go (a restart may then miss it if its time is past the lookback).
pub const MAX_HELD: usize = 65_536;

/// Who wrote a recent inbound message, in which NIP and conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub nip: Nip,
    pub sender: PublicKey,
    pub participants: Participants,
}

/// Recent inbound messages by id (hex), oldest forgotten first.
#[derive(Debug, Default)]
pub struct Origins {
    by_id: HashMap<String, Origin>,
    order: VecDeque<String>,
}

impl Origins {
    pub fn remember(&mut self, id: String, origin: Origin) {
        if self.by_id.insert(id.clone(), origin).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > REMEMBERED_ORIGINS {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<&Origin> {
        self.by_id.get(id)
    }
}

/// One event between its arrival and the hub's answer.
#[derive(Debug, Clone, Copy)]
struct HeldEvent {
    /// Its `created_at` (what the subscription filters on).
    at: u64,
    /// Reported and waiting for the hub; false once the wait ended without an answer.
    reported: bool,
}

/// Events reported and not yet settled, by event id (wrap or kind 4) and by message id.
#[derive(Debug, Default)]
pub struct Held {
    events: HashMap<String, HeldEvent>,
    messages: HashMap<String, String>,
}

impl Held {
    fn is_reported(&self, id: &str) -> bool {
        self.events.get(id).is_some_and(|held| held.reported)
            || self.messages.get(id).is_some_and(|event| self.is_reported(event))
    }

    fn hold(&mut self, event_id: String, message_id: String, at: u64) {
        if self.events.len() >= MAX_HELD {
            let oldest = self
                .events
                .iter()
                .filter(|(_, held)| !held.reported)
                .min_by_key(|(_, held)| held.at)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                warn!(event_id = %oldest, "too many unanswered events; letting the oldest go");
                self.release(&oldest);
            }
        }
        self.events.insert(event_id.clone(), HeldEvent { at, reported: true });
        self.messages.insert(message_id, event_id);
    }

    fn unresolved(&mut self, event_id: &str) {
        if let Some(held) = self.events.get_mut(event_id) {
            held.reported = false;
        }
    }

    fn release(&mut self, event_id: &str) {
        self.events.remove(event_id);
        self.messages.retain(|_, event| event != event_id);
    }

    /// The `created_at` of every held event: the checkpoint may not pass them.
    pub fn times(&self) -> Vec<u64> {
        self.events.values().map(|held| held.at).collect()
    }
}

/// Settles one reported event: seen once the hub answered, held again otherwise.
struct Settlement {
    state: Arc<StateStore>,
    held: Arc<Mutex<Held>>,
    event_id: String,
    message_id: String,
    at: u64,
    nip: Nip,
    conversation: String,
    members: Vec<String>,
}

impl Settle for Settlement {
    async fn settle(self, outcome: &Acceptance) {
        match outcome {
            Acceptance::Accepted { .. } | Acceptance::Rejected { .. } => {
                let accepted = matches!(outcome, Acceptance::Accepted { .. });
                self.state.update(|state| {
                    state.mark_seen(self.event_id.clone(), self.at, None);
                    state.mark_seen(self.message_id.clone(), self.at, Some(self.nip));
                    if accepted {
                        state.use_conversation(
                            &self.conversation,
                            self.nip,
                            self.members,
                            unix_now(),
                        );
                    }
                });
                lock(&self.held).release(&self.event_id);
            }
            Acceptance::Unresolved => lock(&self.held).unresolved(&self.event_id),
        }
    }
}

/// What the inbox needs from the driver for one run.
#[derive(Debug)]
pub struct Inbox<'a> {
    pub config: &'a NostrConfig,
    pub hub: &'a Hub,
    pub state: &'a Arc<StateStore>,
    pub acks: &'a PendingAcks,
    pub held: &'a Arc<Mutex<Held>>,
    pub origins: &'a Arc<Mutex<Origins>>,
}

impl Inbox<'_> {
    /// Handles one event from the inbox subscription. Returns false once the hub handle
    /// stopped taking input (the run is stopping).
    pub async fn receive(&self, relay: &RelayUrl, event: Event) -> bool {
        let event_id = event.id.to_hex();
        let at = event.created_at.as_secs();
        let window_start =
            self.state.read(|s| s.checkpoint).saturating_sub(self.config.lookback.as_secs());
        if at < window_start {
            // Older than the subscription reaches back: handled before, or beyond the lookback.
            debug!(%event_id, "event older than the lookback window; ignored");
            return true;
        }
        // Held before seen: a settlement marks an event seen and only then releases it, so
        // checking in this order never misses one settled between the two checks.
        if lock(self.held).is_reported(&event_id) || self.state.read(|s| s.is_seen(&event_id)) {
            return true;
        }
        let incoming = match self.open(&event).await {
            Ok(incoming) => incoming,
            Err(reason) => {
                self.skip(&event_id, at, relay, &reason);
                return true;
            }
        };
        let message_id = incoming.id.to_hex();
        if lock(self.held).is_reported(&message_id) {
            return true;
        }
        if self.state.read(|s| s.is_seen(&message_id)) {
            // The same message in another wrap (or relayed again): already handled.
            self.state.update(|s| s.mark_seen(event_id, at, None));
            return true;
        }
        let report = match convert::report(&self.hub.channel().clone(), &incoming, relay) {
            Ok(report) => report,
            Err(reason) => {
                self.skip(&event_id, at, relay, &reason);
                return true;
            }
        };
        self.report(event_id, message_id, at, incoming, report).await
    }

    /// Decrypts and verifies `event` into a message.
    async fn open(&self, event: &Event) -> Result<Incoming, Skip> {
        let keys = self.config.keys.expose();
        let me = self.config.public_key;
        match event.kind {
            Kind::GiftWrap => match UnwrappedGift::from_gift_wrap(keys, event).await {
                Ok(gift) => convert::from_rumor(&me, gift.sender, &gift.rumor),
                Err(nip59::Error::SenderMismatch) => Err(Skip::ForgedSeal),
                Err(err) => Err(Skip::Invalid(format!("cannot unwrap the gift wrap: {err}"))),
            },
            Kind::EncryptedDirectMessage if self.config.accept_nip04 => {
                let plaintext = nip04::decrypt(keys.secret_key(), &event.pubkey, &event.content)
                    .map_err(|err| Skip::Invalid(format!("cannot decrypt: {err}")))?;
                convert::from_nip04(&me, event, &plaintext)
            }
            other => Err(Skip::UnsupportedKind(other.as_u16())),
        }
    }

    /// Logs and remembers an event that will never be a message.
    fn skip(&self, event_id: &str, at: u64, relay: &RelayUrl, reason: &Skip) {
        match reason {
            Skip::FromUs | Skip::NotForUs => debug!(%event_id, reason = %reason, "event skipped"),
            _ => warn!(%event_id, relay = %relay_name(relay), reason = %reason, "event skipped"),
        }
        self.state.update(|s| s.mark_seen(event_id.to_owned(), at, None));
    }

    async fn report(
        &self,
        event_id: String,
        message_id: String,
        at: u64,
        incoming: Incoming,
        report: Report,
    ) -> bool {
        let conversation = convert::conversation_id(&incoming.participants);
        let members = if conversation.starts_with(convert::GROUP_PREFIX) {
            incoming.participants.iter().map(PublicKey::to_hex).collect()
        } else {
            Vec::new()
        };
        lock(self.origins).remember(
            message_id.clone(),
            Origin {
                nip: incoming.nip,
                sender: incoming.sender,
                participants: incoming.participants,
            },
        );
        lock(self.held).hold(event_id.clone(), message_id.clone(), at);
        let settlement = Settlement {
            state: self.state.clone(),
            held: self.held.clone(),
            event_id: event_id.clone(),
            message_id: message_id.clone(),
            at,
            nip: incoming.nip,
            conversation,
            members,
        };
        let ticket = match report {
            Report::Message(inbound) => self.hub.inbound(inbound).await,
            Report::Event { event_id, event } => self.hub.inbound_event(event_id, event).await,
        };
        match ticket {
            Ok(ticket) => {
                debug!(%event_id, %message_id, nip = incoming.nip.as_str(), "reported to the hub");
                self.acks.track(ticket, settlement);
                true
            }
            Err(HubError::ShuttingDown) => {
                lock(self.held).unresolved(&event_id);
                false
            }
            Err(err) => {
                info!(%event_id, error = %err, "the hub handle refused the message; skipped");
                let refused =
                    Acceptance::Rejected { code: "invalid".into(), message: err.to_string() };
                self.acks.settle_now(settlement, refused);
                true
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_events_are_found_by_either_id_and_unresolved_ones_may_come_again() {
        let mut held = Held::default();
        held.hold("wrap".into(), "rumor".into(), 10);
        assert!(held.is_reported("wrap") && held.is_reported("rumor"));
        held.unresolved("wrap");
        assert!(!held.is_reported("rumor"), "unanswered: may be reported again");
        assert_eq!(held.times(), [10], "still holding the checkpoint back");
        held.release("wrap");
        assert!(held.times().is_empty() && !held.is_reported("rumor"));
    }

    #[test]
    fn origins_forget_the_oldest_beyond_their_bound() {
        let mut origins = Origins::default();
        let origin = Origin {
            nip: Nip::Nip17,
            sender: nostr_sdk::Keys::generate().public_key(),
            participants: Participants::new(),
        };
        for n in 0..=REMEMBERED_ORIGINS {
            origins.remember(format!("m{n}"), origin.clone());
        }
        assert!(origins.get("m0").is_none());
        assert!(origins.get(&format!("m{REMEMBERED_ORIGINS}")).is_some());
    }
}
