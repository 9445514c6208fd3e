//! The table of inbound frames the hub has not yet taken responsibility for.
//!
//! Pure bookkeeping: the runtime decides when to (re)send; this table remembers what is
//! outstanding, in arrival order, and who waits for each outcome.

use std::collections::{BTreeMap, VecDeque};

// foldhash (seeded per map), not SipHash: looked up several times per inbound. The keys are
// event ids a platform chose, but the table holds at most `MAX_PENDING_INBOUND` (256) of
// them, so colliding keys cannot make a lookup long.
use foldhash::HashMap;
use std::time::{Duration, Instant};

use channeld_protocol::{Frame, Id};
use smallvec::{SmallVec, smallvec};
use tokio::sync::oneshot;

/// How the hub answered an inbound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acceptance {
    /// The hub took responsibility; the driver may acknowledge it to its platform.
    Accepted { duplicate: bool },
    /// The hub refused it for good (e.g. invalid, sender denied, conflicting content). The
    /// driver should acknowledge it away rather than have the platform redeliver it forever.
    Rejected { code: String, message: String },
    /// No answer within the reply timeout, or the driver is shutting down: do not acknowledge,
    /// so the platform redelivers.
    Unresolved,
}

/// What the runtime should do after an `error` frame for a pending inbound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorAction {
    /// Resend after this delay.
    Retry(Duration),
    /// The outcome was delivered to the waiters.
    Resolved,
    /// The error was not about a pending inbound.
    NotPending,
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    frame: Frame,
    /// Who waits for the outcome: the first sender, then one per redelivery while pending
    /// (the first inline: an inbound sent once allocates no list).
    waiters: SmallVec<[oneshot::Sender<Acceptance>; 1]>,
    retries: u32,
    inserted: Instant,
}

/// Outstanding inbound frames keyed by event id.
#[derive(Debug, Default)]
pub struct PendingTable {
    entries: HashMap<Id, Entry>,
    order: BTreeMap<u64, Id>,
    next_seq: u64,
    /// Events the hub answered `busy` (or another retryable error), oldest first: each is
    /// resent when a run ends (a slot frees up) or when its retry timer fires, whichever comes
    /// first.
    waiting: VecDeque<Id>,
}

/// Retryable errors back off from this delay, doubling up to [`MAX_RETRY_DELAY`]; a run
/// ending on the connection usually resends sooner.
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(50);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);

impl PendingTable {
    /// Adds an inbound. Returns true when it is new (and must be sent); a redelivery of an
    /// event that is already pending only adds a waiter.
    pub fn insert(
        &mut self,
        event_id: Id,
        frame: Frame,
        waiter: oneshot::Sender<Acceptance>,
    ) -> bool {
        if let Some(entry) = self.entries.get_mut(&event_id) {
            entry.waiters.push(waiter);
            return false;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, event_id.clone());
        let entry =
            Entry { seq, frame, waiters: smallvec![waiter], retries: 0, inserted: Instant::now() };
        self.entries.insert(event_id, entry);
        true
    }

    /// Resolves an event with `outcome`; false if it was not pending.
    pub fn resolve(&mut self, event_id: &str, outcome: Acceptance) -> bool {
        let Some(entry) = self.entries.remove(event_id) else {
            return false;
        };
        self.waiting.retain(|id| id.as_str() != event_id);
        self.order.remove(&entry.seq);
        for waiter in entry.waiters {
            let _ = waiter.send(outcome.clone());
        }
        true
    }

    /// Applies an `error` frame that names `event_id`.
    pub fn on_error(
        &mut self,
        event_id: &str,
        code: &str,
        message: &str,
        retryable: bool,
    ) -> ErrorAction {
        let Some(entry) = self.entries.get_mut(event_id) else {
            return ErrorAction::NotPending;
        };
        if retryable {
            let delay = FIRST_RETRY_DELAY
                .saturating_mul(1u32 << entry.retries.min(16))
                .min(MAX_RETRY_DELAY);
            entry.retries = entry.retries.saturating_add(1);
            let id = event_id_of(&self.order, entry.seq);
            if !self.waiting.contains(&id) {
                self.waiting.push_back(id);
            }
            return ErrorAction::Retry(delay);
        }
        let outcome = Acceptance::Rejected { code: code.to_owned(), message: message.to_owned() };
        self.resolve(event_id, outcome);
        ErrorAction::Resolved
    }

    /// Takes `event_id` off the waiting list; its frame if it was waiting (and so is to be
    /// resent by the caller).
    pub fn take_waiting(&mut self, event_id: &str) -> Option<Frame> {
        let position = self.waiting.iter().position(|id| id.as_str() == event_id)?;
        let id = self.waiting.remove(position)?;
        self.entries.get(&id).map(|entry| entry.frame.clone())
    }

    /// Takes the oldest waiting event still pending: a slot freed up, resend it now.
    pub fn take_oldest_waiting(&mut self) -> Option<Frame> {
        while let Some(id) = self.waiting.pop_front() {
            if let Some(entry) = self.entries.get(&id) {
                return Some(entry.frame.clone());
            }
        }
        None
    }

    /// Every pending frame in arrival order (resent after a reconnect).
    pub fn frames_in_order(&self) -> Vec<Frame> {
        self.order.values().filter_map(|id| self.entries.get(id)).map(|e| e.frame.clone()).collect()
    }

    /// Resolves entries older than `max_age` as [`Acceptance::Unresolved`]; returns how many.
    pub fn expire(&mut self, now: Instant, max_age: Duration) -> usize {
        let expired: Vec<Id> = self
            .entries
            .iter()
            .filter(|(_, entry)| now.saturating_duration_since(entry.inserted) >= max_age)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            self.resolve(id.as_str(), Acceptance::Unresolved);
        }
        expired.len()
    }

    /// Resolves everything as [`Acceptance::Unresolved`] (shutdown); returns how many.
    pub fn abandon_all(&mut self) -> usize {
        let ids: Vec<Id> = self.order.values().cloned().collect();
        for id in &ids {
            self.resolve(id.as_str(), Acceptance::Unresolved);
        }
        ids.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn event_id_of(order: &BTreeMap<u64, Id>, seq: u64) -> Id {
    order.get(&seq).cloned().expect("every entry is in the order index")
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_protocol::frame::Lifecycle;

    fn frame(id: &str) -> Frame {
        Frame::Start(Lifecycle { request_id: Id::new(id).unwrap() })
    }

    #[test]
    fn redelivery_of_a_pending_event_adds_a_waiter_not_a_send() {
        let mut table = PendingTable::default();
        let (a, mut ra) = oneshot::channel();
        let (b, mut rb) = oneshot::channel();
        assert!(table.insert(Id::new("e1").unwrap(), frame("e1"), a));
        // One waiter is held inline: an inbound sent once allocates no list.
        assert!(!table.entries["e1"].waiters.spilled());
        assert!(!table.insert(Id::new("e1").unwrap(), frame("e1"), b));
        assert!(table.resolve("e1", Acceptance::Accepted { duplicate: false }));
        assert_eq!(ra.try_recv().unwrap(), Acceptance::Accepted { duplicate: false });
        assert_eq!(rb.try_recv().unwrap(), Acceptance::Accepted { duplicate: false });
        assert!(table.is_empty());
    }

    #[test]
    fn retryable_errors_back_off_and_fatal_ones_resolve() {
        let mut table = PendingTable::default();
        let (a, mut ra) = oneshot::channel();
        table.insert(Id::new("e1").unwrap(), frame("e1"), a);
        assert_eq!(table.on_error("e1", "busy", "", true), ErrorAction::Retry(FIRST_RETRY_DELAY));
        assert_eq!(
            table.on_error("e1", "busy", "", true),
            ErrorAction::Retry(FIRST_RETRY_DELAY * 2)
        );
        assert_eq!(table.take_oldest_waiting(), Some(frame("e1")));
        assert_eq!(table.take_waiting("e1"), None, "taken once");
        assert_eq!(table.on_error("e1", "denied", "no", false), ErrorAction::Resolved);
        assert!(
            matches!(ra.try_recv().unwrap(), Acceptance::Rejected { code, .. } if code == "denied")
        );
        assert_eq!(table.on_error("e1", "busy", "", true), ErrorAction::NotPending);
    }

    #[test]
    fn frames_are_resent_in_arrival_order() {
        let mut table = PendingTable::default();
        for id in ["c", "a", "b"] {
            let (tx, _rx) = oneshot::channel();
            std::mem::forget(_rx);
            table.insert(Id::new(id).unwrap(), frame(id), tx);
        }
        table.resolve("a", Acceptance::Unresolved);
        assert_eq!(table.frames_in_order(), vec![frame("c"), frame("b")]);
    }

    #[test]
    fn old_entries_expire_unresolved() {
        let mut table = PendingTable::default();
        let (tx, mut rx) = oneshot::channel();
        table.insert(Id::new("e1").unwrap(), frame("e1"), tx);
        let now = Instant::now();
        assert_eq!(table.expire(now, Duration::from_secs(60)), 0);
        assert_eq!(table.expire(now + Duration::from_secs(61), Duration::from_secs(60)), 1);
        assert_eq!(rx.try_recv().unwrap(), Acceptance::Unresolved);
    }
}
