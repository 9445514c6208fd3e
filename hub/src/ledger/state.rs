//! The ledger's state machines, free of I/O: inbound entries and outbox records.
//!
//! These are the transitions the SQL performs: every function in `inbound.rs` and
//! `outbox.rs` that changes a state either reads the current one and asks this module
//! whether (and to what) it may move, or writes only where the entry stands in one of the
//! states this module says may move to the next ([`sources`]). A transition this module
//! refuses never happens.

use std::fmt;

/// Where an inbound run stands.
///
/// An entry is written as `Running` when the hub accepts the inbound (its run starts then,
/// or when its turn in its session's queue comes), then moves to `Delivered` (the run ended
/// and nothing more is owed from this row: no reply, or a reply that its delivery record in
/// `replies` carries from then on, or one a legacy peer got back once on its connection) or
/// `Failed`. `Replied` (a reply the entry itself still owes) is what hubs before schema 3
/// wrote, without a delivery record: a restart records each for delivery and settles it
/// (`Replied → Delivered`). A reply's progress is its record's (`reply_state.rs`): the entry
/// is not written again when the driver answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InboundState {
    Running,
    Replied,
    Delivered,
    Failed,
}

impl InboundState {
    /// The states an entry may become `next` from, for a guarded update ([`sources`]).
    pub fn sources(next: InboundState) -> Option<[&'static str; 2]> {
        sources(&INBOUND_STATES, next, Self::may_become, Self::as_str)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            InboundState::Running => "running",
            InboundState::Replied => "replied",
            InboundState::Delivered => "delivered",
            InboundState::Failed => "failed",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "running" => InboundState::Running,
            "replied" => InboundState::Replied,
            "delivered" => InboundState::Delivered,
            "failed" => InboundState::Failed,
            _ => return None,
        })
    }

    /// A run that finished (its outcome is recorded and will never be run again).
    pub fn is_final(self) -> bool {
        !matches!(self, InboundState::Running)
    }

    /// Nothing is left to do for the entry: it only serves dedupe, and may be pruned once it
    /// is older than the retention window. (`Replied` still owes the driver its reply; a
    /// settled entry whose reply is still on its way is kept by the prune, see
    /// `inbound::prune`.)
    pub fn is_settled(self) -> bool {
        matches!(self, InboundState::Delivered | InboundState::Failed)
    }

    /// Whether an entry may move from `self` to `next`. Nothing becomes `Replied` any more:
    /// a run's end settles its entry (`RunEnd::state`); only entries hubs before schema 3
    /// left `Replied` move on, to `Delivered`.
    pub fn may_become(self, next: InboundState) -> bool {
        use InboundState::*;
        matches!((self, next), (Running, Delivered) | (Running, Failed) | (Replied, Delivered))
    }
}

impl fmt::Display for InboundState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The states in `all` from which an entry may become `next`, as the `N` values of an SQL
/// guard (`state = ? OR state = ?…`; not `IN`, which SQLite evaluates through an ephemeral
/// table from three values on): a guarded update writes in one statement what a read of the state
/// and a decision would (BENCHMARKS.md, fix 23). Padded by repeating the first; `None` when
/// no state may become `next`. Pure.
pub fn sources<S: Copy, const N: usize>(
    all: &[S],
    next: S,
    may_become: impl Fn(S, S) -> bool,
    name: impl Fn(S) -> &'static str,
) -> Option<[&'static str; N]> {
    let mut from = all.iter().copied().filter(|state| may_become(*state, next)).map(name);
    let first = from.next()?;
    let mut names = [first; N];
    for (slot, state) in names.iter_mut().skip(1).zip(from.by_ref()) {
        *slot = state;
    }
    assert!(from.next().is_none(), "more than {N} states lead to the next one");
    Some(names)
}

/// What to do with an inbound whose event id may already be in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordDecision {
    /// First time: record it and run it.
    Insert,
    /// Seen before with the same content: never run again; replay what exists.
    Replay,
    /// Seen before with different content: refuse.
    Conflict,
}

pub fn decide(existing_hash: Option<&[u8]>, new_hash: &[u8]) -> RecordDecision {
    match existing_hash {
        None => RecordDecision::Insert,
        Some(hash) if hash == new_hash => RecordDecision::Replay,
        Some(_) => RecordDecision::Conflict,
    }
}

/// A run is tried at most this many times: the first run and one retry after a crash.
pub const MAX_ATTEMPTS: u32 = 2;

/// What recovery does with a run that was in progress when the hub died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Start it again (flagged `redelivered`) as attempt `attempt`.
    Rerun { attempt: u32 },
    /// It was already retried once: record it as failed rather than loop on a poison message.
    GiveUp,
}

pub fn recover(attempts: u32) -> Recovery {
    if attempts >= MAX_ATTEMPTS {
        Recovery::GiveUp
    } else {
        Recovery::Rerun { attempt: attempts + 1 }
    }
}

/// Every inbound state, for queries that select by a property of the state.
pub const INBOUND_STATES: [InboundState; 4] =
    [InboundState::Running, InboundState::Replied, InboundState::Delivered, InboundState::Failed];

/// Where a proactive send stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutboxState {
    /// Waiting for the driver (offline).
    Queued,
    /// Handed to the driver; no receipt yet.
    Sent,
    Receipted,
    /// The driver reported failure, or the record expired while queued.
    Failed,
    /// Handed to the driver but no receipt came (timeout, disconnect, hub restart): it may or
    /// may not have been posted, so it is never resent automatically.
    Unknown,
}

impl OutboxState {
    /// The states a record may become `next` from, for a guarded update ([`sources`]).
    pub fn sources(next: OutboxState) -> Option<[&'static str; 3]> {
        sources(&OUTBOX_STATES, next, Self::may_become, Self::as_str)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OutboxState::Queued => "queued",
            OutboxState::Sent => "sent",
            OutboxState::Receipted => "receipted",
            OutboxState::Failed => "failed",
            OutboxState::Unknown => "unknown",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "queued" => OutboxState::Queued,
            "sent" => OutboxState::Sent,
            "receipted" => OutboxState::Receipted,
            "failed" => OutboxState::Failed,
            "unknown" => OutboxState::Unknown,
            _ => return None,
        })
    }

    pub fn is_final(self) -> bool {
        matches!(self, OutboxState::Receipted | OutboxState::Failed | OutboxState::Unknown)
    }

    /// Whether a record may move from `self` to `next`. `Sent` → `Queued` only when the frame
    /// never left the hub; `Unknown`/`Failed` → `Queued` is an operator's explicit retry.
    pub fn may_become(self, next: OutboxState) -> bool {
        use OutboxState::*;
        matches!(
            (self, next),
            (Queued, Sent)
                | (Queued, Failed)
                | (Sent, Receipted)
                | (Sent, Failed)
                | (Sent, Unknown)
                | (Sent, Queued)
                | (Unknown, Queued)
                | (Failed, Queued)
        )
    }

    /// What a record in this state becomes when the hub restarts.
    pub fn after_restart(self) -> OutboxState {
        match self {
            OutboxState::Sent => OutboxState::Unknown,
            other => other,
        }
    }

    /// What a record in this state becomes once its expiry passed: only a queued send
    /// expires (it fails); one handed to a driver waits for its receipt.
    pub fn after_expiry(self) -> OutboxState {
        match self {
            OutboxState::Queued => OutboxState::Failed,
            other => other,
        }
    }
}

/// Every outbox state, for queries that select by a property of the state.
pub const OUTBOX_STATES: [OutboxState; 5] = [
    OutboxState::Queued,
    OutboxState::Sent,
    OutboxState::Receipted,
    OutboxState::Failed,
    OutboxState::Unknown,
];

/// `'a', 'b'` for an SQL `IN (...)` list of the states that satisfy `keep`.
pub fn sql_list<S: Copy>(
    states: &[S],
    keep: impl Fn(S) -> bool,
    name: impl Fn(S) -> &'static str,
) -> String {
    states
        .iter()
        .copied()
        .filter(|s| keep(*s))
        .map(|s| format!("'{}'", name(s)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for OutboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redelivery_with_same_content_replays_and_different_content_conflicts() {
        assert_eq!(decide(None, b"a"), RecordDecision::Insert);
        assert_eq!(decide(Some(b"a"), b"a"), RecordDecision::Replay);
        assert_eq!(decide(Some(b"a"), b"b"), RecordDecision::Conflict);
    }

    #[test]
    fn completed_runs_never_go_back_to_running() {
        for state in [InboundState::Replied, InboundState::Delivered, InboundState::Failed] {
            assert!(!state.may_become(InboundState::Running));
            assert!(state.is_final());
        }
        assert!(!InboundState::Running.may_become(InboundState::Replied));
        assert!(InboundState::Replied.may_become(InboundState::Delivered));
        assert!(!InboundState::Delivered.may_become(InboundState::Replied));
    }

    #[test]
    fn a_guarded_update_names_exactly_the_states_that_may_become_the_next() {
        use InboundState as I;
        assert_eq!(I::sources(I::Replied), None, "only hubs before schema 3 wrote it");
        assert_eq!(I::sources(I::Delivered), Some(["running", "replied"]));
        assert_eq!(I::sources(I::Failed), Some(["running", "running"]));
        assert_eq!(I::sources(I::Running), None);
        use OutboxState as O;
        assert_eq!(O::sources(O::Receipted), Some(["sent", "sent", "sent"]));
        assert_eq!(O::sources(O::Failed), Some(["queued", "sent", "queued"]));
        assert_eq!(O::sources(O::Queued), Some(["sent", "failed", "unknown"]));
        for next in OUTBOX_STATES {
            let from = O::sources(next).unwrap_or_default();
            for state in OUTBOX_STATES {
                assert_eq!(
                    from.contains(&state.as_str()),
                    state.may_become(next),
                    "{state} → {next}"
                );
            }
        }
    }

    #[test]
    fn an_interrupted_run_is_retried_once() {
        assert_eq!(recover(1), Recovery::Rerun { attempt: 2 });
        assert_eq!(recover(2), Recovery::GiveUp);
    }

    #[test]
    fn only_settled_entries_and_final_records_are_prunable() {
        let settled = sql_list(&INBOUND_STATES, InboundState::is_settled, InboundState::as_str);
        assert_eq!(settled, "'delivered', 'failed'");
        let finals = sql_list(&OUTBOX_STATES, OutboxState::is_final, OutboxState::as_str);
        assert_eq!(finals, "'receipted', 'failed', 'unknown'");
    }

    #[test]
    fn only_a_queued_send_expires() {
        assert_eq!(OutboxState::Queued.after_expiry(), OutboxState::Failed);
        assert!(OutboxState::Queued.may_become(OutboxState::Queued.after_expiry()));
        for state in [OutboxState::Sent, OutboxState::Receipted, OutboxState::Unknown] {
            assert_eq!(state.after_expiry(), state);
        }
    }

    #[test]
    fn a_handed_send_is_never_resent_by_itself() {
        assert_eq!(OutboxState::Sent.after_restart(), OutboxState::Unknown);
        assert_eq!(OutboxState::Queued.after_restart(), OutboxState::Queued);
        assert!(!OutboxState::Unknown.may_become(OutboxState::Sent));
        assert!(OutboxState::Unknown.may_become(OutboxState::Queued));
        assert!(!OutboxState::Receipted.may_become(OutboxState::Queued));
        for state in ["queued", "sent", "receipted", "failed", "unknown"] {
            assert_eq!(OutboxState::parse(state).unwrap().as_str(), state);
        }
    }
}
