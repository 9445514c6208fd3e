//! Inbound runs in the ledger: record an event once (dedupe by id and content), record how
//! its run ended and whether the reply reached the driver, find the replies still owed, and
//! recover the runs a crash interrupted. Synchronous functions over one transaction.

use rusqlite::{Connection, OptionalExtension, params};

use super::LedgerError;
use super::items::{self, NewItem};
use super::replies;
use super::state::{self, INBOUND_STATES, InboundState, RecordDecision, Recovery};
use super::store::Cached;

/// The predicate of the partial index `inbound_open` (schema migration 6), spelled as the
/// migration spells it: a query uses that index only when its `WHERE` repeats this term.
pub(super) const OPEN_INBOUND: &str = "state IN ('running', 'replied')";

/// A new inbound to record.
#[derive(Debug, Clone)]
pub struct NewInbound {
    pub instance: String,
    pub event_id: String,
    /// The content fingerprint: what makes two deliveries of this id "the same message".
    pub content_hash: [u8; 32],
    /// Which version of the fingerprint `content_hash` is.
    pub hash_version: u32,
    /// The encoded `inbound`/`inbound_event` line, to run it again after a crash.
    pub frame: Vec<u8>,
    pub run_id: String,
    /// Whether its run starts as soon as it is recorded (counted as its first attempt). An
    /// inbound that waits behind others of its session is recorded with no attempt yet;
    /// [`start`] counts it when its run starts.
    pub started: bool,
    pub now_ms: u64,
    /// Its item in the agent's inbox (`items.rs`), added with it.
    pub item: Option<NewItem>,
}

/// Computes the current fingerprint from a stored frame, for entries written with another
/// fingerprint version; `None` when the frame no longer decodes.
pub type Rehash = fn(&[u8]) -> Option<[u8; 32]>;

/// What the ledger holds for an event id seen before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRun {
    pub run_id: String,
    pub state: InboundState,
    pub reply: Option<String>,
    pub error: Option<(String, String)>,
}

/// The answer to [`record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// Recorded now; `entry` is its item's ledger entry id (when it has an item).
    New {
        entry: Option<i64>,
    },
    Replay(StoredRun),
    Conflict,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    Reply(String),
    NoReply,
    Failed { code: String, message: String },
}

impl RunEnd {
    /// The state an entry takes when its run ends this way. A reply is owed by its delivery
    /// record, made in the same transaction (`Ledger::finish_run`), or went back once on the
    /// legacy peer's connection it came from, or could not be a frame (the driver got an
    /// `error` instead): either way the entry owes nothing more, as without a reply. Pure.
    pub fn state(&self) -> InboundState {
        match self {
            RunEnd::Reply(_) | RunEnd::NoReply => InboundState::Delivered,
            RunEnd::Failed { .. } => InboundState::Failed,
        }
    }
}

/// A finished run whose reply is owed but not tracked (see [`untracked_replies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReply {
    pub instance: String,
    pub event_id: String,
    pub frame: Vec<u8>,
    pub reply: String,
}

/// An accepted inbound whose run had not ended when the hub died: it runs again (if it had
/// started, flagged redelivered) in its place in the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredRun {
    pub instance: String,
    pub event_id: String,
    pub run_id: String,
    pub frame: Vec<u8>,
    /// The attempt its next run is (1: it never started).
    pub attempt: u32,
}

/// Records an inbound unless its event id is known; see [`Recorded`]. An entry written with
/// another fingerprint version is compared (and rewritten) by its `rehash`ed stored frame, so
/// a hub upgrade never turns a redelivery into a conflict.
/// `history`: the cap of the message's history entry, which the caller holds when this
/// records a new entry (`history::hold`), with the generation it is held in.
pub fn record(
    txn: &Connection,
    new: &NewInbound,
    rehash: Rehash,
    history: Option<(usize, i64)>,
) -> Result<Recorded, LedgerError> {
    // Inserted first: nearly every inbound is new, and the insert finds a known event id
    // through the same index a read would (BENCHMARKS.md, fix 23).
    // The item's id is taken only if the row is new ([`items::hold`]).
    let item_id = match &new.item {
        Some(_) => Some(items::next_id(txn)?),
        None => None,
    };
    let inserted = txn.exec_cached(
        "INSERT INTO inbound (instance, event_id, content_hash, hash_version, run_id, state,
             frame, attempts, received_ms, updated_ms, history_cap, history_gen, item_id)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?9, ?10, ?11, ?12)
         ON CONFLICT (instance, event_id) DO NOTHING",
        params![
            new.instance,
            new.event_id,
            new.content_hash.as_slice(),
            new.hash_version,
            new.run_id,
            InboundState::Running.as_str(),
            new.frame,
            u32::from(new.started),
            new.now_ms as i64,
            history.map(|(cap, _)| cap as i64),
            history.map(|(_, generation)| generation),
            item_id
        ],
    )?;
    if inserted == 1 {
        if let (Some(item), Some(id)) = (&new.item, item_id) {
            items::hold(id, &new.instance, &new.event_id, item.clone(), new.now_ms);
        }
        return Ok(Recorded::New { entry: item_id });
    }
    let (mut stored_hash, version, stored) = txn.query_row_cached(
        "SELECT content_hash, hash_version, run_id, state, reply, error_code, error_message
         FROM inbound WHERE instance = ?1 AND event_id = ?2",
        params![new.instance, new.event_id],
        |row| {
            Ok((
                row.get::<_, Vec<u8>>(0)?,
                row.get::<_, u32>(1)?,
                StoredRow {
                    run_id: row.get(2)?,
                    state: row.get(3)?,
                    reply: row.get(4)?,
                    code: row.get(5)?,
                    message: row.get(6)?,
                },
            ))
        },
    )?;
    if version != new.hash_version
        && let Some(current) = stored_frame(txn, new)?.as_deref().and_then(rehash)
    {
        txn.exec_cached(
            "UPDATE inbound SET content_hash = ?3, hash_version = ?4
             WHERE instance = ?1 AND event_id = ?2",
            params![new.instance, new.event_id, current.as_slice(), new.hash_version],
        )?;
        stored_hash = current.to_vec();
    }
    match state::decide(Some(&stored_hash), &new.content_hash) {
        RecordDecision::Replay => Ok(Recorded::Replay(stored.into_run()?)),
        RecordDecision::Conflict | RecordDecision::Insert => Ok(Recorded::Conflict),
    }
}

struct StoredRow {
    run_id: String,
    state: String,
    reply: Option<String>,
    code: Option<String>,
    message: Option<String>,
}

impl StoredRow {
    fn into_run(self) -> Result<StoredRun, LedgerError> {
        Ok(StoredRun {
            run_id: self.run_id,
            state: parse_state(&self.state)?,
            reply: self.reply,
            error: self.code.map(|code| (code, self.message.unwrap_or_default())),
        })
    }
}

fn stored_frame(txn: &Connection, new: &NewInbound) -> Result<Option<Vec<u8>>, LedgerError> {
    Ok(txn
        .query_row_cached(
            "SELECT frame FROM inbound WHERE instance = ?1 AND event_id = ?2",
            params![new.instance, new.event_id],
            |row| row.get(0),
        )
        .optional()?)
}

/// How `event_id`'s run stands, if the ledger holds it, and its error code: `Replied` for
/// any run that ended with a reply (its entry settles as the reply's record is made, so
/// the stored state alone no longer says so), `Delivered` for one that ended without.
pub fn outcome(
    txn: &Connection,
    instance: &str,
    event_id: &str,
) -> Result<Option<(InboundState, Option<String>)>, LedgerError> {
    let row: Option<(String, Option<String>, bool)> = txn
        .query_row_cached(
            "SELECT state, error_code, reply IS NOT NULL FROM inbound
             WHERE instance = ?1 AND event_id = ?2",
            params![instance, event_id],
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
        )
        .optional()?;
    row.map(|(state, code, replied)| {
        let state = match parse_state(&state)? {
            InboundState::Delivered if replied => InboundState::Replied,
            state => state,
        };
        Ok((state, code))
    })
    .transpose()
}

/// Records how a run ended (see [`RunEnd::state`]); its reply's delivery record is the
/// caller's, in the same transaction. False when the entry is not running.
pub fn finish(
    txn: &Connection,
    instance: &str,
    event_id: &str,
    end: &RunEnd,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    let next = end.state();
    let Some([from, or]) = InboundState::sources(next) else { return Ok(false) };
    let (reply_text, code, message) = match end {
        RunEnd::Reply(text) => (Some(text.as_str()), None, None),
        RunEnd::NoReply => (None, None, None),
        RunEnd::Failed { code, message } => (None, Some(code.as_str()), Some(message.as_str())),
    };
    let updated = txn.exec_cached(
        FINISH,
        params![
            instance,
            event_id,
            next.as_str(),
            reply_text,
            code,
            message,
            now_ms as i64,
            from,
            or
        ],
    )?;
    Ok(updated == 1)
}

/// [`finish`]'s guarded update: the entry moves only from a state that may become the next.
const FINISH: &str = "UPDATE inbound SET state = ?3, reply = ?4, error_code = ?5,
         error_message = ?6, updated_ms = ?7
     WHERE instance = ?1 AND event_id = ?2 AND (state = ?8 OR state = ?9)";

/// Settles an entry whose owed reply just got its delivery record (one written before
/// replies were tracked, recorded by a restart): from now on the record owes it. False when
/// the entry owed none: only a `Replied` entry moves (`Running → Delivered` is a run's end,
/// not this transition).
pub fn mark_delivered(
    txn: &Connection,
    instance: &str,
    event_id: &str,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    let (from, next) = (InboundState::Replied, InboundState::Delivered);
    debug_assert!(from.may_become(next));
    let updated = txn.exec_cached(
        "UPDATE inbound SET state = ?3, updated_ms = ?4
         WHERE instance = ?1 AND event_id = ?2 AND state = ?5",
        params![instance, event_id, next.as_str(), now_ms as i64, from.as_str()],
    )?;
    Ok(updated == 1)
}

/// Finished runs whose reply is owed but has no delivery record: written by a hub from before
/// replies were tracked (schema 2), oldest first. The hub records each as a pending reply.
pub fn untracked_replies(txn: &Connection) -> Result<Vec<PendingReply>, LedgerError> {
    let mut stmt = txn.prepare_cached(&untracked_sql())?;
    let rows = stmt.query_map(params![InboundState::Replied.as_str()], |row| {
        Ok(PendingReply {
            instance: row.get(0)?,
            event_id: row.get(1)?,
            frame: row.get(2)?,
            reply: row.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<Vec<_>, _>>()?)
}

fn untracked_sql() -> String {
    format!(
        "SELECT i.instance, i.event_id, i.frame, i.reply FROM inbound AS i
         WHERE {OPEN_INBOUND} AND i.state = ?1 AND i.reply IS NOT NULL AND NOT EXISTS (
             SELECT 1 FROM replies AS r WHERE r.instance = i.instance AND r.event_id = i.event_id)
         ORDER BY i.updated_ms, i.event_id"
    )
}

/// Counts a run's start as an attempt (see [`NewInbound::started`]). False when the entry
/// is not running.
pub fn start(txn: &Connection, instance: &str, event_id: &str) -> Result<bool, LedgerError> {
    let updated = txn.exec_cached(
        "UPDATE inbound SET attempts = attempts + 1 WHERE instance = ?1 AND event_id = ?2
             AND state = ?3",
        params![instance, event_id, InboundState::Running.as_str()],
    )?;
    Ok(updated == 1)
}

/// Accepted inbound whose run had not ended when the hub stopped, in arrival order: each is
/// to run again (its start counted by [`start`]), or recorded as failed if it was already
/// started [`state::MAX_ATTEMPTS`] times.
///
/// Arrival order: by `received_ms`, then by run id. The hub gives run ids
/// (`run-r-<boot nonce>-<n>`) in arrival order, and entries received in the same millisecond
/// come from one boot, so a shorter `<n>` is an earlier one.
pub fn recover(txn: &Connection, now_ms: u64) -> Result<Vec<RecoveredRun>, LedgerError> {
    let running: Vec<(String, String, String, Vec<u8>, u32)> = {
        let mut stmt = txn.prepare(&recover_sql())?;
        let rows = stmt.query_map(params![InboundState::Running.as_str()], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?))
        })?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let mut rerun = Vec::new();
    for (instance, event_id, run_id, frame, attempts) in running {
        match state::recover(attempts) {
            Recovery::Rerun { attempt } => {
                rerun.push(RecoveredRun { instance, event_id, run_id, frame, attempt });
            }
            Recovery::GiveUp => {
                let end = RunEnd::Failed {
                    code: "interrupted".into(),
                    message: "run was interrupted twice by a hub restart".into(),
                };
                finish(txn, &instance, &event_id, &end, now_ms)?;
            }
        }
    }
    Ok(rerun)
}

fn recover_sql() -> String {
    format!(
        "SELECT instance, event_id, run_id, frame, attempts FROM inbound
         WHERE {OPEN_INBOUND} AND state = ?1 ORDER BY received_ms, length(run_id), run_id"
    )
}

/// Deletes settled entries last touched before `before_ms`; returns how many went.
///
/// An entry is touched after it arrived, and ids grow with arrival, so the scan walks the
/// entries from the oldest id and stops at the first that arrived at or after `before_ms`.
/// After a wall-clock jump backwards an entry may look touched before it arrived, or arrived
/// before an older one; it goes once the entries before it went.
///
/// The newest entry always stays, settled or not: SQLite numbers a new row after the
/// highest id in the table, so deleting it would hand its id (and those before it) out
/// again, and what is written behind the inbound (history's floor, the inbox items' rebuild
/// in `items.rs`) finds its rows by ids that only grow.
pub fn prune(txn: &Connection, before_ms: u64) -> Result<usize, LedgerError> {
    Ok(txn.execute(&prune_sql(), params![before_ms as i64])?)
}

/// A settled entry whose reply is still on its way stays (its record owes the reply, and a
/// crash before it is posted rebuilds the reply's history entry from this row).
fn prune_sql() -> String {
    let settled = state::sql_list(&INBOUND_STATES, InboundState::is_settled, InboundState::as_str);
    let holding = replies::holding("r.");
    format!(
        "DELETE FROM inbound WHERE state IN ({settled}) AND updated_ms < ?1 AND id < coalesce(
             (SELECT id FROM inbound WHERE received_ms >= ?1 ORDER BY id LIMIT 1),
             (SELECT max(id) FROM inbound), 0)
             AND NOT EXISTS (SELECT 1 FROM replies AS r
                 WHERE r.instance = inbound.instance AND r.event_id = inbound.event_id
                     AND {holding})"
    )
}

fn parse_state(value: &str) -> Result<InboundState, LedgerError> {
    InboundState::parse(value)
        .ok_or_else(|| LedgerError::Sql(format!("unknown inbound state {value:?}")))
}

/// An inbound message `q <event>` from alice in `conversation` (and `thread`) of instance
/// `a.b`, and its frame as the hub records it (tests of the ledger's modules).
#[cfg(test)]
pub(super) fn test_message(
    event_id: &str,
    conversation: &str,
    thread: Option<&str>,
) -> (channeld_protocol::types::InboundMessage, Vec<u8>) {
    use channeld_protocol::types::{InboundMessage, MessageBody, MessageTarget, Participant};
    use channeld_protocol::{ChannelId, Id};
    let mut target =
        MessageTarget::new(ChannelId::new("a.b").unwrap(), Id::new(conversation).unwrap());
    target.thread = thread.map(|t| Id::new(t).unwrap());
    let message = InboundMessage {
        id: Id::new(format!("m-{event_id}")).unwrap(),
        target,
        sender: Participant::new(Id::new("alice").unwrap()),
        body: MessageBody::text(format!("q {event_id}")).unwrap(),
        timestamp_ms: None,
        metadata: Default::default(),
    };
    let frame = channeld_protocol::encode(&channeld_protocol::Frame::Inbound(
        channeld_protocol::frame::Inbound {
            event_id: Id::new(event_id).unwrap(),
            message: message.clone(),
        },
    ))
    .unwrap();
    (message, frame)
}

#[cfg(test)]
pub(crate) mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::ledger::schema;

    const VERSION: u32 = 2;

    fn db() -> Connection {
        schema::open_in_memory().unwrap()
    }

    fn inbound(event_id: &str, hash: u8) -> NewInbound {
        NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [hash; 32],
            hash_version: VERSION,
            frame: vec![hash],
            run_id: format!("run-{event_id}"),
            started: true,
            now_ms: 1,
            item: None,
        }
    }

    /// The "current fingerprint" of a stored frame in these tests: its one byte, repeated.
    fn rehash(frame: &[u8]) -> Option<[u8; 32]> {
        frame.first().map(|b| [*b; 32])
    }

    /// The plan SQLite picks for `sql`, one line per step.
    pub(crate) fn plan(conn: &Connection, sql: &str) -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = stmt.query_map([], |row| row.get::<_, String>(3)).unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("\n")
    }

    #[test]
    fn a_run_s_end_is_one_guarded_update_through_the_event_index() {
        let conn = db();
        let plan = plan(&conn, &crate::ledger::schema::tests::unbound(FINISH));
        assert!(plan.contains("USING INDEX inbound_by_event"), "{plan}");
        assert_eq!(crate::ledger::schema::tests::ephemeral_tables(&conn, FINISH), 0);
    }

    #[test]
    fn recovery_and_pruning_read_the_small_indexes_not_the_table() {
        let conn = db();
        let recover = plan(&conn, &recover_sql().replace("?1", "'running'"));
        assert!(recover.contains("USING INDEX inbound_open"), "{recover}");
        let untracked = plan(&conn, &untracked_sql().replace("?1", "'replied'"));
        assert!(untracked.contains("USING INDEX inbound_open"), "{untracked}");
        let lookup =
            plan(&conn, "SELECT state FROM inbound WHERE instance = 'a' AND event_id = 'e'");
        assert!(lookup.contains("USING INDEX inbound_by_event"), "{lookup}");
        let prune = plan(&conn, &prune_sql().replace("?1", "1000"));
        assert!(prune.starts_with("SEARCH inbound USING INTEGER PRIMARY KEY (rowid<?)"), "{prune}");
    }

    #[test]
    fn a_completed_run_is_replayed_not_repeated() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        assert_eq!(
            record(&txn, &inbound("e1", 1), rehash, None).unwrap(),
            Recorded::New { entry: None }
        );
        assert!(finish(&txn, "a.b", "e1", &RunEnd::Reply("hi".into()), 2).unwrap());
        match record(&txn, &inbound("e1", 1), rehash, None).unwrap() {
            Recorded::Replay(run) => {
                assert_eq!(run.state, InboundState::Delivered);
                assert_eq!(run.reply.as_deref(), Some("hi"));
                assert_eq!(run.run_id, "run-e1");
            }
            other => panic!("expected a replay, got {other:?}"),
        }
        assert_eq!(record(&txn, &inbound("e1", 2), rehash, None).unwrap(), Recorded::Conflict);
        // The reply is its delivery record's to owe (or went back on a legacy peer's
        // connection): nothing is left untracked. A hub before schema 3 left it owed.
        assert!(untracked_replies(&txn).unwrap().is_empty());
        before_schema_3(&txn, "e1");
        assert_eq!(untracked_replies(&txn).unwrap().len(), 1);
        assert!(mark_delivered(&txn, "a.b", "e1", 3).unwrap());
        assert!(untracked_replies(&txn).unwrap().is_empty());
        assert!(!mark_delivered(&txn, "a.b", "e1", 4).unwrap(), "delivered only once");
    }

    #[test]
    fn a_run_ends_once_and_a_run_without_reply_owes_nothing() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        record(&txn, &inbound("e1", 1), rehash, None).unwrap();
        assert!(finish(&txn, "a.b", "e1", &RunEnd::NoReply, 2).unwrap());
        assert!(!finish(&txn, "a.b", "e1", &RunEnd::Reply("late".into()), 3).unwrap());
        assert!(!mark_delivered(&txn, "a.b", "e1", 3).unwrap());
        assert!(!finish(&txn, "a.b", "absent", &RunEnd::NoReply, 3).unwrap());
        // Only a reply waiting is delivered: a running entry stays running.
        record(&txn, &inbound("e2", 1), rehash, None).unwrap();
        assert!(!mark_delivered(&txn, "a.b", "e2", 3).unwrap());
        assert_eq!(outcome(&txn, "a.b", "e2").unwrap(), Some((InboundState::Running, None)));
        match record(&txn, &inbound("e1", 1), rehash, None).unwrap() {
            Recorded::Replay(run) => {
                assert_eq!(run.state, InboundState::Delivered);
                assert_eq!(run.reply, None);
            }
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    #[test]
    fn a_failed_run_replays_its_error() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        record(&txn, &inbound("e1", 1), rehash, None).unwrap();
        let end = RunEnd::Failed { code: "agent_failed".into(), message: "exit 3".into() };
        assert!(finish(&txn, "a.b", "e1", &end, 2).unwrap());
        match record(&txn, &inbound("e1", 1), rehash, None).unwrap() {
            Recorded::Replay(run) => {
                assert_eq!(run.state, InboundState::Failed);
                assert_eq!(run.error, Some(("agent_failed".into(), "exit 3".into())));
            }
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    #[test]
    fn interrupted_runs_are_recovered_once_then_failed() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        record(&txn, &inbound("e1", 1), rehash, None).unwrap();
        let first = recover(&txn, 5).unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].attempt, 2);
        assert_eq!(first[0].frame, vec![1]);
        // Recovered again before its second run started: still its second attempt.
        assert_eq!(recover(&txn, 6).unwrap()[0].attempt, 2);
        assert!(start(&txn, "a.b", "e1").unwrap());
        let second = recover(&txn, 6).unwrap();
        assert!(second.is_empty());
        match record(&txn, &inbound("e1", 1), rehash, None).unwrap() {
            Recorded::Replay(run) => {
                assert_eq!(run.state, InboundState::Failed);
                assert_eq!(run.error.map(|e| e.0).as_deref(), Some("interrupted"));
            }
            other => panic!("expected failed replay, got {other:?}"),
        }
    }

    #[test]
    fn queued_runs_are_recovered_in_arrival_order_and_counted_only_once_started() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        // Same millisecond; run ids given in arrival order (n = 9, 10, 11), event ids not.
        for (event, n) in [("z", 9), ("b", 10), ("a", 11)] {
            let new = NewInbound {
                run_id: format!("run-r-0123456789ab-{n}"),
                started: n == 9,
                ..inbound(event, 1)
            };
            record(&txn, &new, rehash, None).unwrap();
        }
        let later = NewInbound { now_ms: 2, started: false, ..inbound("0", 1) };
        record(&txn, &later, rehash, None).unwrap();
        let recovered = recover(&txn, 5).unwrap();
        let order: Vec<(&str, u32)> =
            recovered.iter().map(|r| (r.event_id.as_str(), r.attempt)).collect();
        assert_eq!(order, [("z", 2), ("b", 1), ("a", 1), ("0", 1)]);
        // Started and interrupted again: counted.
        assert!(start(&txn, "a.b", "b").unwrap());
        assert!(!start(&txn, "a.b", "absent").unwrap());
        let again = recover(&txn, 6).unwrap();
        assert_eq!(again.iter().find(|r| r.event_id == "b").unwrap().attempt, 2);
    }

    #[test]
    fn pruning_removes_only_settled_entries_past_the_window() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        record(&txn, &inbound("old-done", 1), rehash, None).unwrap();
        finish(&txn, "a.b", "old-done", &RunEnd::NoReply, 10).unwrap();
        record(&txn, &inbound("old-running", 1), rehash, None).unwrap();
        record(&txn, &inbound("old-replied", 1), rehash, None).unwrap();
        finish(&txn, "a.b", "old-replied", &RunEnd::Reply("r".into()), 10).unwrap();
        before_schema_3(&txn, "old-replied");
        record(&txn, &NewInbound { now_ms: 500, ..inbound("new-done", 1) }, rehash, None).unwrap();
        finish(&txn, "a.b", "new-done", &RunEnd::NoReply, 500).unwrap();
        assert_eq!(prune(&txn, 100).unwrap(), 1);
        // The pruned id is forgotten; the others still dedupe.
        assert_eq!(
            record(&txn, &inbound("old-done", 2), rehash, None).unwrap(),
            Recorded::New { entry: None }
        );
        for kept in ["old-running", "old-replied", "new-done"] {
            assert!(
                matches!(
                    record(&txn, &inbound(kept, 1), rehash, None).unwrap(),
                    Recorded::Replay(_)
                ),
                "{kept}"
            );
        }
    }

    /// The entry of a run that replied as a hub before schema 3 left it: `replied`, the
    /// reply owed by the entry (no delivery record).
    fn before_schema_3(txn: &Connection, event_id: &str) {
        let updated = txn
            .execute("UPDATE inbound SET state = 'replied' WHERE event_id = ?1", [event_id])
            .unwrap();
        assert_eq!(updated, 1);
    }

    /// An entry settles when its reply's record is made; while that reply is on its way
    /// (pending, handed, retrying) the entry stays past the window, once it is posted it goes.
    #[test]
    fn pruning_keeps_a_settled_entry_whose_reply_is_on_its_way() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        for (event, state) in [("on-its-way", "handed"), ("posted", "posted")] {
            record(&txn, &inbound(event, 1), rehash, None).unwrap();
            assert!(finish(&txn, "a.b", event, &RunEnd::Reply("r".into()), 10).unwrap());
            txn.execute(
                "INSERT INTO replies (instance, event_id, conversation, message, state, next_ms,
                     expires_ms, created_ms, updated_ms)
                 VALUES ('a.b', ?1, 'c1', x'7b7d', ?2, 10, 10, 10, 10)",
                params![event, state],
            )
            .unwrap();
        }
        let later = NewInbound { now_ms: 500, ..inbound("later", 1) };
        record(&txn, &later, rehash, None).unwrap();
        assert_eq!(prune(&txn, 100).unwrap(), 1);
        assert_eq!(outcome(&txn, "a.b", "posted").unwrap(), None);
        assert_eq!(
            outcome(&txn, "a.b", "on-its-way").unwrap(),
            Some((InboundState::Replied, None)),
            "kept; reported as how its run ended"
        );
    }

    /// What is written behind the inbound finds its rows by ids that only grow: pruning
    /// every settled entry leaves the newest, so SQLite never numbers a new row below it.
    #[test]
    fn pruning_keeps_the_newest_entry_so_ids_only_grow() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        for event_id in ["a", "b"] {
            record(&txn, &inbound(event_id, 1), rehash, None).unwrap();
            finish(&txn, "a.b", event_id, &RunEnd::NoReply, 10).unwrap();
        }
        let id_of = |event_id: &str| -> i64 {
            txn.query_row("SELECT id FROM inbound WHERE event_id = ?1", [event_id], |r| r.get(0))
                .unwrap()
        };
        let newest = id_of("b");
        assert_eq!(prune(&txn, 100).unwrap(), 1, "all but the newest");
        assert_eq!(prune(&txn, 100).unwrap(), 0);
        record(&txn, &NewInbound { now_ms: 200, ..inbound("c", 1) }, rehash, None).unwrap();
        assert_eq!(id_of("c"), newest + 1);
    }

    #[test]
    fn an_entry_with_an_older_fingerprint_version_is_compared_by_its_stored_frame() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        // Written by an older hub: version 1, a hash this build cannot reproduce.
        let old = NewInbound { content_hash: [0xee; 32], hash_version: 1, ..inbound("e1", 7) };
        record(&txn, &old, rehash, None).unwrap();
        finish(&txn, "a.b", "e1", &RunEnd::Reply("hi".into()), 2).unwrap();
        // The same message redelivered after the upgrade replays; it does not conflict.
        assert!(matches!(
            record(&txn, &inbound("e1", 7), rehash, None).unwrap(),
            Recorded::Replay(_)
        ));
        let (hash, version): (Vec<u8>, u32) = txn
            .query_row(
                "SELECT content_hash, hash_version FROM inbound WHERE event_id = 'e1'",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .unwrap();
        assert_eq!((hash, version), (vec![7; 32], VERSION), "the entry is rewritten");
        // Different content still conflicts.
        assert_eq!(record(&txn, &inbound("e1", 8), rehash, None).unwrap(), Recorded::Conflict);
    }

    #[test]
    fn an_older_entry_whose_frame_no_longer_decodes_conflicts_rather_than_runs_again() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let old = NewInbound { hash_version: 1, frame: Vec::new(), ..inbound("e1", 7) };
        record(&txn, &old, rehash, None).unwrap();
        assert_eq!(record(&txn, &inbound("e1", 8), rehash, None).unwrap(), Recorded::Conflict);
    }
}
