//! Replies in the ledger: each reply a run produced, from the moment its outcome is recorded
//! until the driver's receipt says it was posted (or it failed for good, its outcome became
//! unknown, or its TTL passed). Claimed for hand-over in order per conversation, answered,
//! retried with backoff, expired, and retried again on an operator's request. Synchronous
//! functions over one transaction; every state change asks `reply_state.rs` first.

use std::sync::LazyLock;

use rusqlite::{Connection, OptionalExtension, params};

use channeld_protocol::ext::STREAM_SEQ_KEY;
use channeld_protocol::types::OutboundMessage;
use serde::{Deserialize, Serialize};

use super::LedgerError;
use super::history::{self, NewHistory};
use super::reply_state::{self, Answer, REPLY_STATES, ReplyState};
use super::state::sql_list;
use super::store::Cached;

/// A reply's delivery record as stored: its `deliver` message and, for a streamed run, the
/// seq its final `deliver` takes (given to drivers with `stream` as
/// `metadata.stream_seq`). Records written before streams have no `stream_seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReply {
    #[serde(flatten)]
    pub message: OutboundMessage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_seq: Option<u64>,
}

impl StoredReply {
    /// The message to hand to a connection: with `stream` negotiated, a streamed reply
    /// carries its seq.
    pub fn message_for(mut self, stream: bool) -> OutboundMessage {
        if let (true, Some(seq)) = (stream, self.stream_seq) {
            self.message.metadata.insert(STREAM_SEQ_KEY.to_owned(), seq.to_string());
        }
        self.message
    }
}

/// A reply to record, in the same transaction as its run's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewReply {
    pub instance: String,
    pub event_id: String,
    /// The conversation it answers: replies of one conversation are posted in order.
    pub conversation: String,
    /// The `OutboundMessage` of its `deliver` frame, as JSON.
    pub message: Vec<u8>,
    pub expires_ms: u64,
}

/// A reply claimed for hand-over: now `handed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedReply {
    pub id: i64,
    pub event_id: String,
    pub message: Vec<u8>,
    /// Attempts so far, this one included.
    pub attempts: u32,
}

/// A reply as listed or shown. From [`list`], `text` and `error` are previews.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyRecord {
    pub id: i64,
    pub instance: String,
    pub event_id: String,
    pub conversation: String,
    pub state: ReplyState,
    pub text: String,
    /// The whole text's size in bytes.
    pub text_bytes: usize,
    /// The `DeliveryReceipt` as JSON, once posted (with `reply_receipt`).
    pub receipt: Option<Vec<u8>>,
    pub error: Option<String>,
    pub attempts: u32,
    /// When a `pending` or `failed_retryable` reply may be handed over next.
    pub next_ms: u64,
    pub expires_ms: u64,
    pub created_ms: u64,
    pub updated_ms: u64,
}

/// How many replies of one instance are in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyCount {
    pub instance: String,
    pub state: ReplyState,
    pub count: u64,
}

/// A driver's answer (or silence) about one reply, with what it carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyAnswer {
    pub instance: String,
    pub event_id: String,
    pub answer: Answer,
    pub receipt: Option<Vec<u8>>,
    pub error: Option<String>,
    /// The conversation history's cap when the instance keeps history: a reply that becomes
    /// `posted` is appended to it in the same step.
    pub history: Option<usize>,
}

/// The error an expired reply records.
pub const EXPIRED: &str = "its TTL passed before it could be posted";

/// Characters of text and error a listing shows.
pub const PREVIEW_CHARS: usize = 100;

/// Whether a reply (its `state` column, after `prefix`) is in a state that holds its
/// conversation. Spelled as the predicate of the partial index `replies_holding` (schema
/// migration 10), which a query uses only when its `WHERE` repeats it. Comparisons joined by
/// `OR`, not `state IN (…)`: SQLite evaluates an `IN` list of three or more values through
/// an ephemeral table, and it evaluates an index's predicate on every write to the table, so
/// each insert and update of a reply built one or two (BENCHMARKS.md, fix 24).
pub(super) fn holding(prefix: &str) -> String {
    let terms: Vec<String> = REPLY_STATES
        .iter()
        .filter(|state| state.holds_conversation())
        .map(|state| format!("{prefix}state = '{}'", state.as_str()))
        .collect();
    format!("({})", terms.join(" OR "))
}

/// The predicate of the index `replies_by_state` (schema migration 9): replies on their way
/// to a driver are not in it. A query uses it only when its `WHERE` repeats this term.
pub(super) const NOT_HANDED: &str = "state <> 'handed'";

/// Records a reply as `pending`, due now. A second reply for the same event is ignored (a
/// run's outcome is recorded once). Returns its id.
pub fn add(txn: &Connection, reply: &NewReply, now_ms: u64) -> Result<i64, LedgerError> {
    insert(txn, reply, ReplyState::Pending, now_ms)?;
    Ok(txn.query_row_cached(
        "SELECT id FROM replies WHERE instance = ?1 AND event_id = ?2",
        params![reply.instance, reply.event_id],
        |row| row.get(0),
    )?)
}

/// Records a new reply claimed at once for hand-over (`handed`, its first attempt) when
/// nothing holds its conversation, so a run that ends hands its reply over without a claim
/// of its own; else as [`add`] does, `pending`, claimed in its turn. `None` when it was not
/// claimed (also when the event has a reply already: a run's outcome is recorded once).
pub fn add_claimed(
    txn: &Connection,
    reply: &NewReply,
    now_ms: u64,
) -> Result<Option<HandedReply>, LedgerError> {
    let held = txn
        .query_row_cached(&HELD_SQL, params![reply.instance, reply.conversation], |_| Ok(()))
        .optional()?
        .is_some();
    if held {
        add(txn, reply, now_ms)?;
        return Ok(None);
    }
    if insert(txn, reply, ReplyState::Handed, now_ms)? == 0 {
        return Ok(None);
    }
    Ok(Some(HandedReply {
        id: txn.last_insert_rowid(),
        event_id: reply.event_id.clone(),
        message: reply.message.clone(),
        attempts: 1,
    }))
}

/// Inserts a new reply, due now, `pending` (no attempt yet) or `handed` (its first); nothing
/// when the event has one. Returns how many rows it added.
fn insert(
    txn: &Connection,
    reply: &NewReply,
    state: ReplyState,
    now_ms: u64,
) -> Result<usize, LedgerError> {
    let attempts = u32::from(state == ReplyState::Handed);
    Ok(txn.exec_cached(
        "INSERT INTO replies (instance, event_id, conversation, message, state, attempts,
             next_ms, expires_ms, created_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?7, ?7)
         ON CONFLICT (instance, event_id) DO NOTHING",
        params![
            reply.instance,
            reply.event_id,
            reply.conversation,
            reply.message,
            state.as_str(),
            attempts,
            now_ms as i64,
            reply.expires_ms as i64
        ],
    )?)
}

/// Whether anything holds a conversation (read from the small index of such replies):
/// asked for every reply a run ends with, so the text is made once.
static HELD_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT 1 FROM replies WHERE instance = ?1 AND conversation = ?2 AND {} LIMIT 1",
        holding("")
    )
});

/// Whether a reply of a conversation after the one with id `?3` holds it (waits, or is on
/// its way), read from the small index of such replies: asked for every reply that settles,
/// so the text is made once.
static BEHIND_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT EXISTS (SELECT 1 FROM replies
             WHERE instance = ?1 AND conversation = ?2 AND id > ?3 AND {})",
        holding("")
    )
});

/// Claims the replies of `instance` that may be handed over now, oldest first: in each
/// conversation only the oldest reply still on its way, and only once it is due. They become
/// `handed` with one more attempt counted.
pub fn claim_due(
    txn: &Connection,
    instance: &str,
    now_ms: u64,
    limit: usize,
) -> Result<Vec<HandedReply>, LedgerError> {
    let due: Vec<(i64, String, Vec<u8>, u32, String)> = {
        let mut stmt = txn.prepare_cached(&claim_sql())?;
        let rows = stmt.query_map(params![instance, now_ms as i64, limit as i64], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?))
        })?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let mut handed = Vec::with_capacity(due.len());
    for (id, event_id, message, attempts, state) in due {
        if !parse(&state)?.may_become(ReplyState::Handed) {
            continue;
        }
        txn.exec_cached(
            "UPDATE replies SET state = ?2, attempts = attempts + 1, updated_ms = ?3 WHERE id = ?1",
            params![id, ReplyState::Handed.as_str(), now_ms as i64],
        )?;
        handed.push(HandedReply { id, event_id, message, attempts: attempts + 1 });
    }
    Ok(handed)
}

fn claim_sql() -> String {
    let holding = holding("e.");
    format!(
        "SELECT id, event_id, message, attempts, state FROM replies AS r
         WHERE instance = ?1 AND state IN ('{}', '{}') AND {NOT_HANDED} AND next_ms <= ?2
             AND NOT EXISTS (
                 SELECT 1 FROM replies AS e
                 WHERE e.instance = r.instance AND e.conversation = r.conversation
                     AND {holding} AND e.id < r.id)
         ORDER BY id LIMIT ?3",
        ReplyState::Pending.as_str(),
        ReplyState::FailedRetryable.as_str(),
    )
}

/// A reply's state after an answer ([`answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub state: ReplyState,
    /// Whether one of its instance's replies may be due now: this one again (its state is
    /// not final), or a later one of its conversation that waited behind it. Otherwise the
    /// answer let no reply go, and a claim would find nothing it did not find before.
    pub more_due: bool,
}

/// Applies a driver's answer (or its silence) to the reply of `event_id`; see
/// [`reply_state::after_answer`]. Returns the state it moved to, `None` when the answer did
/// not apply (no such reply, or not one waiting for this answer). Only the reply's record is
/// written: its inbound entry settled when the record was made (`RunEnd::state`,
/// `Ledger::reply_add`).
pub fn answer(
    txn: &Connection,
    answer: &ReplyAnswer,
    now_ms: u64,
    jitter: f64,
) -> Result<Option<Settled>, LedgerError> {
    // The message too: a posted reply's history entry is made from it below.
    let current = txn
        .query_row_cached(
            "SELECT id, state, attempts, expires_ms, message, conversation FROM replies
             WHERE instance = ?1 AND event_id = ?2",
            params![answer.instance, answer.event_id],
            |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, u32>(2)?,
                    row.get::<_, i64>(3)?,
                    row.get::<_, Vec<u8>>(4)?,
                    row.get::<_, String>(5)?,
                ))
            },
        )
        .optional()?;
    let Some((id, state, attempts, expires_ms, message, conversation)) = current else {
        return Ok(None);
    };
    let Some(next) = reply_state::after_answer(
        parse(&state)?,
        answer.answer,
        attempts,
        now_ms,
        expires_ms as u64,
        jitter,
    ) else {
        return Ok(None);
    };
    // A posted reply's history entry is held for the next move (`history.rs`); the row
    // records its cap and generation so a crash before the move does not lose it.
    let history = match (next.state, answer.history) {
        (ReplyState::Posted, Some(cap)) => {
            let entry = NewHistory::posted_reply(
                &answer.instance,
                &answer.event_id,
                (id, &message),
                answer.receipt.as_deref(),
                now_ms,
            )?;
            Some((entry, cap))
        }
        _ => None,
    };
    let generation = history.as_ref().map(|_| history::generation());
    txn.exec_cached(
        "UPDATE replies SET state = ?2, next_ms = ?3, receipt = COALESCE(?4, receipt),
             error = ?5, updated_ms = ?6, history_cap = ?7, history_gen = ?8
         WHERE id = ?1",
        params![
            id,
            next.state.as_str(),
            next.next_ms as i64,
            answer.receipt,
            answer.error,
            now_ms as i64,
            history.as_ref().map(|(_, cap)| *cap as i64),
            generation
        ],
    )?;
    if let Some((entry, cap)) = history {
        history::hold(entry, cap);
    }
    let more_due = next.state.holds_conversation()
        || txn.query_row_cached(
            &BEHIND_SQL,
            params![answer.instance, conversation, id],
            |row| row.get(0),
        )?;
    Ok(Some(Settled { state: next.state, more_due }))
}

/// The state of the reply to `event_id`, if the run produced one.
pub fn state_of(
    txn: &Connection,
    instance: &str,
    event_id: &str,
) -> Result<Option<ReplyState>, LedgerError> {
    let state: Option<String> = txn
        .query_row_cached(
            "SELECT state FROM replies WHERE instance = ?1 AND event_id = ?2",
            params![instance, event_id],
            |row| row.get(0),
        )
        .optional()?;
    state.as_deref().map(parse).transpose()
}

/// Expires the replies past their TTL that were waiting to be handed over, for every
/// instance; returns how many.
pub fn expire(txn: &Connection, now_ms: u64) -> Result<usize, LedgerError> {
    let expired: Vec<(String, String)> = {
        let mut stmt = txn.prepare_cached(&expire_sql())?;
        let rows = stmt.query_map(params![now_ms as i64], |row| Ok((row.get(0)?, row.get(1)?)))?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    for (instance, event_id) in &expired {
        txn.exec_cached(
            "UPDATE replies SET state = ?3, error = ?4, updated_ms = ?5
             WHERE instance = ?1 AND event_id = ?2",
            params![instance, event_id, ReplyState::Expired.as_str(), EXPIRED, now_ms as i64],
        )?;
    }
    Ok(expired.len())
}

fn expire_sql() -> String {
    let waiting = sql_list(
        &REPLY_STATES,
        |s| s.after_expiry() != s && s.may_become(s.after_expiry()),
        ReplyState::as_str,
    );
    format!(
        "SELECT instance, event_id FROM replies
         WHERE state IN ({waiting}) AND {NOT_HANDED} AND expires_ms <= ?1"
    )
}

/// After a restart nothing is handed over: every `handed` reply is `pending` again, due now.
pub fn restart(txn: &Connection, now_ms: u64) -> Result<usize, LedgerError> {
    let from = ReplyState::Handed;
    Ok(txn.execute(
        &restart_sql(),
        params![from.as_str(), from.after_restart().as_str(), now_ms as i64],
    )?)
}

/// Handed replies are found in the small index of those still on their way.
fn restart_sql() -> String {
    format!(
        "UPDATE replies SET state = ?2, next_ms = ?3, updated_ms = ?3
         WHERE state = ?1 AND {}",
        holding("")
    )
}

/// Makes the retryable failures of `instance` due now (its driver is Ready again); returns
/// how many.
pub fn due_now(txn: &Connection, instance: &str, now_ms: u64) -> Result<usize, LedgerError> {
    Ok(txn.execute(
        &format!(
            "UPDATE replies SET next_ms = ?3
             WHERE instance = ?1 AND state = ?2 AND {NOT_HANDED} AND next_ms > ?3"
        ),
        params![instance, ReplyState::FailedRetryable.as_str(), now_ms as i64],
    )?)
}

/// The earliest time after `after_ms` that something is due for any instance: a retry, or
/// an expiry. (What is due already is handed over when its driver connects or is kicked.)
pub fn next_wake(txn: &Connection, after_ms: u64) -> Result<Option<u64>, LedgerError> {
    let wake: Option<i64> =
        txn.query_row_cached(&next_wake_sql(), params![after_ms as i64], |row| row.get(0))?;
    Ok(wake.map(|ms| ms.max(0) as u64))
}

/// The states spelled out (a bound state would not tell the planner that `NOT_HANDED` holds).
fn next_wake_sql() -> String {
    let (retrying, pending) = (ReplyState::FailedRetryable.as_str(), ReplyState::Pending.as_str());
    format!(
        "SELECT MIN(t) FROM (
             SELECT MIN(next_ms) AS t FROM replies
             WHERE state = '{retrying}' AND {NOT_HANDED} AND next_ms > ?1
             UNION ALL
             SELECT MIN(expires_ms) AS t FROM replies
             WHERE state IN ('{retrying}', '{pending}') AND {NOT_HANDED} AND expires_ms > ?1)"
    )
}

/// The columns of a [`ReplyRecord`], its text and error cut to `chars` characters if given.
fn columns(chars: Option<usize>) -> String {
    let chars = chars.map_or_else(String::new, |n| format!(", {n}"));
    format!(
        "id, instance, event_id, conversation, state,
         COALESCE(substr(json_extract(json, '$.body.text'), 1{chars}), ''),
         COALESCE(length(CAST(json_extract(json, '$.body.text') AS BLOB)), 0),
         receipt, substr(error, 1{chars}), attempts, next_ms, expires_ms, created_ms, updated_ms
         FROM (SELECT *, CASE WHEN json_valid(message) THEN message END AS json FROM replies)"
    )
}

fn record(row: &rusqlite::Row<'_>) -> rusqlite::Result<ReplyRecord> {
    let state: String = row.get(4)?;
    Ok(ReplyRecord {
        id: row.get(0)?,
        instance: row.get(1)?,
        event_id: row.get(2)?,
        conversation: row.get(3)?,
        state: ReplyState::parse(&state).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                4,
                rusqlite::types::Type::Text,
                format!("unknown reply state {state:?}").into(),
            )
        })?,
        text: row.get(5)?,
        text_bytes: row.get::<_, i64>(6)? as usize,
        receipt: row.get(7)?,
        error: row.get(8)?,
        attempts: row.get(9)?,
        next_ms: row.get::<_, i64>(10)? as u64,
        expires_ms: row.get::<_, i64>(11)? as u64,
        created_ms: row.get::<_, i64>(12)? as u64,
        updated_ms: row.get::<_, i64>(13)? as u64,
    })
}

/// Lists replies, newest first, `text` and `error` cut to [`PREVIEW_CHARS`] characters;
/// only those of `instance`, in `state`, with an id below `before`, when given.
pub fn list(
    txn: &Connection,
    instance: Option<&str>,
    state: Option<ReplyState>,
    before: Option<i64>,
    limit: usize,
) -> Result<Vec<ReplyRecord>, LedgerError> {
    let mut stmt = txn.prepare_cached(&format!(
        "SELECT {}
         WHERE (?1 IS NULL OR instance = ?1) AND (?2 IS NULL OR state = ?2)
             AND (?3 IS NULL OR id < ?3)
         ORDER BY id DESC LIMIT ?4",
        columns(Some(PREVIEW_CHARS))
    ))?;
    let rows = stmt.query_map(
        params![instance, state.map(ReplyState::as_str), before, limit as i64],
        record,
    )?;
    Ok(rows.collect::<Result<Vec<_>, _>>()?)
}

/// One reply with its whole text and error.
pub fn get(txn: &Connection, id: i64) -> Result<Option<ReplyRecord>, LedgerError> {
    Ok(txn
        .query_row_cached(&format!("SELECT {} WHERE id = ?1", columns(None)), params![id], record)
        .optional()?)
}

/// An operator's explicit retry: an `unknown`, `failed` or `expired` reply becomes `pending`,
/// due now, with a new TTL.
pub fn requeue(
    txn: &Connection,
    id: i64,
    now_ms: u64,
    expires_ms: u64,
) -> Result<ReplyRecord, LedgerError> {
    let record = get(txn, id)?.ok_or(LedgerError::NoSuchReply(id))?;
    if !record.state.operator_may_retry() {
        return Err(LedgerError::ReplyNotRetryable { id, state: record.state });
    }
    txn.exec_cached(
        "UPDATE replies SET state = ?2, error = NULL, next_ms = ?3, updated_ms = ?3,
             expires_ms = ?4
         WHERE id = ?1",
        params![id, ReplyState::Pending.as_str(), now_ms as i64, expires_ms as i64],
    )?;
    history::keep_from(txn, &record.instance, &record.event_id)?;
    Ok(ReplyRecord {
        state: ReplyState::Pending,
        error: None,
        next_ms: now_ms,
        updated_ms: now_ms,
        expires_ms,
        ..record
    })
}

/// How many replies each instance has in each state (states with none are left out).
pub fn counts(txn: &Connection) -> Result<Vec<ReplyCount>, LedgerError> {
    let mut counts = Vec::new();
    for sql in counts_sql() {
        let mut stmt = txn.prepare_cached(&sql)?;
        let rows = stmt.query_map([], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?, row.get::<_, i64>(2)?))
        })?;
        for row in rows {
            let (instance, state, count) = row?;
            counts.push(ReplyCount { instance, state: parse(&state)?, count: count as u64 });
        }
    }
    counts.sort_by(|a, b| a.instance.cmp(&b.instance));
    Ok(counts)
}

/// Each count reads an index, not the table: the replies at rest from `replies_by_state`,
/// the handed ones from the small `replies_holding`.
fn counts_sql() -> [String; 2] {
    let handed = ReplyState::Handed.as_str();
    [
        format!(
            "SELECT instance, state, COUNT(*) FROM replies WHERE {NOT_HANDED}
             GROUP BY state, instance"
        ),
        format!(
            "SELECT instance, state, COUNT(*) FROM replies
             WHERE state = '{handed}' AND {} GROUP BY instance",
            holding("")
        ),
    ]
}

/// Deletes final replies last touched before `before_ms`; returns how many went.
pub fn prune(txn: &Connection, before_ms: u64) -> Result<usize, LedgerError> {
    Ok(txn.execute(&prune_sql(), params![before_ms as i64])?)
}

fn prune_sql() -> String {
    let finals = sql_list(&REPLY_STATES, ReplyState::is_final, ReplyState::as_str);
    format!("DELETE FROM replies WHERE state IN ({finals}) AND {NOT_HANDED} AND updated_ms < ?1")
}

fn parse(value: &str) -> Result<ReplyState, LedgerError> {
    ReplyState::parse(value)
        .ok_or_else(|| LedgerError::Sql(format!("unknown reply state {value:?}")))
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::ledger::inbound::{self, NewInbound, RunEnd, record};
    use crate::ledger::schema;
    use crate::ledger::state::InboundState;

    const TTL: u64 = 1_000_000;

    fn db() -> Connection {
        schema::open_in_memory().unwrap()
    }

    #[test]
    fn a_claim_finds_what_holds_a_conversation_in_the_small_index() {
        let conn = db();
        let sql = claim_sql().replace("?1", "'a.b'").replace("?2", "5").replace("?3", "10");
        let plan = crate::ledger::inbound::tests::plan(&conn, &sql);
        assert!(plan.contains("USING INDEX replies_holding"), "{plan}");
        assert!(plan.starts_with("SEARCH r USING INDEX replies_by_state"), "{plan}");
        let sql = HELD_SQL.replace("?1", "'a.b'").replace("?2", "'c1'");
        let plan = crate::ledger::inbound::tests::plan(&conn, &sql);
        assert!(plan.contains("USING INDEX replies_holding"), "{plan}");
        let sql = BEHIND_SQL.replace("?1", "'a.b'").replace("?2", "'c1'").replace("?3", "5");
        let plan = crate::ledger::inbound::tests::plan(&conn, &sql);
        let probe = "USING INDEX replies_holding (instance=? AND conversation=? AND id>?)";
        assert!(plan.contains(probe), "{plan}");
    }

    #[test]
    fn what_looks_for_replies_by_state_reads_an_index_not_the_table() {
        let conn = db();
        let plan = |sql: &str| {
            let sql = sql.replace("?1", "5").replace("?2", "'pending'").replace("?3", "5");
            crate::ledger::inbound::tests::plan(&conn, &sql)
        };
        let by_state = "USING INDEX replies_by_state";
        let [at_rest, handed] = counts_sql();
        assert!(
            plan(&at_rest).contains("USING COVERING INDEX replies_by_state"),
            "{}",
            plan(&at_rest)
        );
        assert!(plan(&handed).contains("USING INDEX replies_holding"), "{}", plan(&handed));
        assert!(
            plan(&restart_sql()).contains("USING INDEX replies_holding"),
            "{}",
            plan(&restart_sql())
        );
        let wake = plan(&next_wake_sql());
        assert_eq!(wake.matches(by_state).count(), 2, "{wake}");
        for sql in [expire_sql(), prune_sql()] {
            assert!(plan(&sql).contains(by_state), "{}", plan(&sql));
        }
    }

    fn message(conversation: &str, text: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "target": {"channel": "a.b", "conversation": conversation},
            "body": {"type": "text", "text": text},
        }))
        .unwrap()
    }

    /// Records an inbound whose run replied `text` in `conversation`: the reply is pending.
    fn replied(txn: &Connection, event_id: &str, conversation: &str, now: u64) -> i64 {
        let new = NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame: vec![1],
            run_id: format!("run-{event_id}"),
            now_ms: now,
            started: true,
            item: None,
        };
        record(txn, &new, |_| None, None).unwrap();
        run_replied(txn, event_id, conversation, now)
    }

    /// `event_id`'s run ends with the reply `re <event>` in `conversation`, recorded with
    /// its delivery record as `Ledger::finish_run` does: pending; its id.
    fn run_replied(txn: &Connection, event_id: &str, conversation: &str, now: u64) -> i64 {
        let reply = NewReply {
            instance: "a.b".into(),
            event_id: event_id.into(),
            conversation: conversation.into(),
            message: message(conversation, &format!("re {event_id}")),
            expires_ms: now + TTL,
        };
        let end = RunEnd::Reply(format!("re {event_id}"));
        assert!(inbound::finish(txn, "a.b", event_id, &end, now).unwrap());
        add(txn, &reply, now).unwrap()
    }

    fn get_by_event(txn: &Connection, event_id: &str) -> ReplyRecord {
        let id: i64 = txn
            .query_row("SELECT id FROM replies WHERE event_id = ?1", [event_id], |r| r.get(0))
            .unwrap();
        get(txn, id).unwrap().unwrap()
    }

    fn say(event_id: &str, answer: Answer) -> ReplyAnswer {
        ReplyAnswer {
            instance: "a.b".into(),
            event_id: event_id.into(),
            answer,
            receipt: matches!(answer, Answer::Posted).then(|| b"{}".to_vec()),
            error: matches!(answer, Answer::Failed { .. }).then(|| "send_failed: down".into()),
            history: None,
        }
    }

    fn claimed(txn: &Connection, now: u64) -> Vec<String> {
        claim_due(txn, "a.b", now, 100).unwrap().into_iter().map(|r| r.event_id).collect()
    }

    fn inbound_state(txn: &Connection, event_id: &str) -> String {
        txn.query_row("SELECT state FROM inbound WHERE event_id = ?1", [event_id], |r| r.get(0))
            .unwrap()
    }

    /// Records a message `q <event>` in `conversation` at `now` as the ledger's call does when
    /// its instance keeps history (cap 10): the row with the cap and generation, the entry held.
    fn admitted(txn: &Connection, event_id: &str, conversation: &str, now: u64) {
        let (message, frame) = crate::ledger::inbound::test_message(event_id, conversation, None);
        let new = NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame,
            run_id: format!("run-{event_id}"),
            now_ms: now,
            started: true,
            item: None,
        };
        record(txn, &new, |_| None, Some((10, history::generation()))).unwrap();
        history::hold(NewHistory::user("a.b", event_id, &message, now), 10);
    }

    /// `event_id`'s run replied `re <event>`, and its driver posted it at `now`.
    fn posted_with_history(txn: &Connection, event_id: &str, conversation: &str, now: u64) {
        run_replied(txn, event_id, conversation, now);
        assert_eq!(claimed(txn, now), [event_id]);
        let answer = ReplyAnswer { history: Some(10), ..say(event_id, Answer::Posted) };
        assert_eq!(
            super::answer(txn, &answer, now, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Posted)
        );
    }

    fn history_texts(txn: &Connection, conversation: &str) -> Vec<String> {
        history::recent(txn, "a.b", conversation, None, 100)
            .unwrap()
            .into_iter()
            .map(|entry| entry.text)
            .collect()
    }

    /// The entries the ledger thread held when the hub crashed come back from the rows that
    /// logged them, in time order, and nothing written before is written again.
    #[test]
    fn held_history_lost_in_a_crash_is_rebuilt_from_the_rows_in_time_order() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        history::forget_held();
        admitted(&txn, "e0", "c1", 5);
        posted_with_history(&txn, "e0", "c1", 6);
        history::write_all(&txn).unwrap();
        history::committed();
        assert_eq!(history_texts(&txn, "c1"), ["q e0", "re e0"]);
        // After that move: e1 is admitted, then e2 while e1's reply waits, then e1's reply
        // is posted; e3 is admitted in another conversation. Then the hub crashes.
        admitted(&txn, "e1", "c1", 10);
        // A move while e1's reply is on its way: e1's message is written, its reply not.
        history::write_all(&txn).unwrap();
        history::committed();
        admitted(&txn, "e2", "c1", 20);
        posted_with_history(&txn, "e1", "c1", 30);
        admitted(&txn, "e3", "c2", 40);
        history::forget_held();
        assert_eq!(history_texts(&txn, "c1"), ["q e0", "re e0", "q e1"], "held, not written");
        history::rebuild(&txn).unwrap();
        history::committed();
        assert_eq!(history_texts(&txn, "c1"), ["q e0", "re e0", "q e1", "q e2", "re e1"]);
        assert_eq!(history_texts(&txn, "c2"), ["q e3"]);
        let rebuilt = history::recent(&txn, "a.b", "c1", None, 100).unwrap();
        assert_eq!(rebuilt[2].message_id.as_deref(), Some("m-e1"));
        assert_eq!((rebuilt[2].at_ms, rebuilt[4].at_ms), (10, 30));
        assert_eq!(rebuilt[4].reply_id, Some(get_by_event(&txn, "e1").id));
        // A second crash right after: nothing is written twice.
        history::forget_held();
        history::rebuild(&txn).unwrap();
        history::committed();
        assert_eq!(history_texts(&txn, "c1"), ["q e0", "re e0", "q e1", "q e2", "re e1"]);
        assert_eq!(history_texts(&txn, "c2"), ["q e3"]);
    }

    /// A failed reply the operator sends again belongs to an inbound that had settled, below
    /// the last move's floor: posted before the next move and lost in a crash, it is rebuilt.
    #[test]
    fn a_requeued_reply_posted_before_the_next_move_is_rebuilt_after_a_crash() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        history::forget_held();
        admitted(&txn, "e5", "c3", 50);
        let id = run_replied(&txn, "e5", "c3", 50);
        assert_eq!(claimed(&txn, 50), ["e5"]);
        let failed = say("e5", Answer::Failed { retryable: false });
        assert_eq!(
            super::answer(&txn, &failed, 51, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Failed)
        );
        history::write_all(&txn).unwrap();
        history::committed();
        requeue(&txn, id, 60, 60 + TTL).unwrap();
        assert_eq!(claimed(&txn, 60), ["e5"]);
        let answer = ReplyAnswer { history: Some(10), ..say("e5", Answer::Posted) };
        assert_eq!(
            super::answer(&txn, &answer, 61, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Posted)
        );
        history::forget_held();
        history::rebuild(&txn).unwrap();
        history::committed();
        assert_eq!(history_texts(&txn, "c3"), ["q e5", "re e5"]);
    }

    #[test]
    fn replies_are_handed_over_in_order_one_at_a_time_per_conversation() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c1", 11);
        replied(&txn, "e3", "c2", 12);
        assert_eq!(claimed(&txn, 20), ["e1", "e3"], "e2 waits behind e1 in c1");
        assert_eq!(claimed(&txn, 21), Vec::<String>::new(), "handed ones are not claimed again");
        assert_eq!(
            answer(&txn, &say("e1", Answer::Posted), 22, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Posted)
        );
        assert_eq!(inbound_state(&txn, "e1"), InboundState::Delivered.as_str());
        assert_eq!(claimed(&txn, 23), ["e2"]);
        let e2 = get_by_event(&txn, "e2");
        assert_eq!((e2.state, e2.attempts), (ReplyState::Handed, 1));
        assert_eq!(e2.text, "re e2");
    }

    /// The run's end settles the inbound entry with its reply's record; the driver's answers
    /// write only the record (the entry's row, frame and reply in it, is not written again).
    #[test]
    fn answers_to_a_reply_leave_its_settled_inbound_entry_as_it_is() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        let row = |txn: &Connection| -> (String, i64) {
            txn.query_row("SELECT state, updated_ms FROM inbound WHERE event_id = 'e1'", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap()
        };
        let settled = (InboundState::Delivered.as_str().to_owned(), 10);
        assert_eq!(row(&txn), settled);
        assert_eq!(claimed(&txn, 20), ["e1"]);
        answer(&txn, &say("e1", Answer::Failed { retryable: true }), 30, 0.0).unwrap();
        assert_eq!(claimed(&txn, 2000), ["e1"]);
        assert_eq!(
            answer(&txn, &say("e1", Answer::Posted), 2010, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Posted)
        );
        assert_eq!(row(&txn), settled);
    }

    fn new_reply(event_id: &str, conversation: &str, now: u64) -> NewReply {
        NewReply {
            instance: "a.b".into(),
            event_id: event_id.into(),
            conversation: conversation.into(),
            message: message(conversation, &format!("re {event_id}")),
            expires_ms: now + TTL,
        }
    }

    #[test]
    fn a_reply_is_claimed_as_it_is_recorded_unless_its_conversation_is_held() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let first = add_claimed(&txn, &new_reply("e1", "c1", 10), 10).unwrap().unwrap();
        assert_eq!((first.event_id.as_str(), first.attempts), ("e1", 1));
        assert_eq!(first.message, message("c1", "re e1"));
        let e1 = get_by_event(&txn, "e1");
        assert_eq!((e1.id, e1.state, e1.attempts), (first.id, ReplyState::Handed, 1));
        // e1 holds c1: e2 waits, pending, and is claimed in its turn once e1 settled.
        assert_eq!(add_claimed(&txn, &new_reply("e2", "c1", 11), 11).unwrap(), None);
        assert_eq!(get_by_event(&txn, "e2").state, ReplyState::Pending);
        assert!(add_claimed(&txn, &new_reply("e3", "c2", 12), 12).unwrap().is_some());
        assert_eq!(claimed(&txn, 20), Vec::<String>::new(), "nothing claimed twice");
        assert_eq!(add_claimed(&txn, &new_reply("e1", "c9", 13), 13).unwrap(), None, "once");
        assert_eq!(get_by_event(&txn, "e1").conversation, "c1");
        answer(&txn, &say("e1", Answer::Posted), 21, 0.0).unwrap();
        assert_eq!(claimed(&txn, 22), ["e2"]);
    }

    /// What an answer let go (the courier claims again only then): a reply waiting behind
    /// the settled one in its conversation, or the reply itself while it is not final; not
    /// a reply of another conversation or another instance.
    #[test]
    fn a_settled_reply_says_whether_it_let_one_go() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let settle = |event_id: &str, said: Answer, now: u64| {
            answer(&txn, &say(event_id, said), now, 0.0).unwrap().expect("it applies")
        };
        let settled = |state, more_due| Settled { state, more_due };
        for (event_id, conversation, now) in [("e1", "c1", 10), ("e2", "c2", 11)] {
            add_claimed(&txn, &new_reply(event_id, conversation, now), now).unwrap().unwrap();
        }
        assert_eq!(add_claimed(&txn, &new_reply("e3", "c1", 12), 12).unwrap(), None);
        let other = NewReply { instance: "x.y".into(), ..new_reply("e4", "c2", 13) };
        add(&txn, &other, 13).unwrap();
        // e2's conversation has nothing after it here (e4 is another instance's).
        assert_eq!(settle("e2", Answer::Posted, 20), settled(ReplyState::Posted, false));
        // e3 waits behind e1; a retryable failure of e1 is due again itself.
        let retry = settle("e1", Answer::Failed { retryable: true }, 21);
        assert_eq!(retry, settled(ReplyState::FailedRetryable, true));
        assert_eq!(claimed(&txn, 5_000), ["e1"]);
        assert_eq!(settle("e1", Answer::Posted, 5_001), settled(ReplyState::Posted, true));
        assert_eq!(claimed(&txn, 5_002), ["e3"]);
        assert_eq!(settle("e3", Answer::NoAnswer, 5_003), settled(ReplyState::Unknown, false));
        // A late receipt of the unknown one: nothing behind it either.
        assert_eq!(settle("e3", Answer::Posted, 5_004), settled(ReplyState::Posted, false));
    }

    #[test]
    fn a_retryable_failure_holds_its_conversation_and_comes_back_after_its_backoff() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c1", 11);
        assert_eq!(claimed(&txn, 20), ["e1"]);
        let failed = answer(&txn, &say("e1", Answer::Failed { retryable: true }), 30, 0.5).unwrap();
        assert_eq!(failed.map(|s| s.state), Some(ReplyState::FailedRetryable));
        // Owed by its record, not its inbound entry: that one settled when the run ended.
        assert_eq!(inbound_state(&txn, "e1"), InboundState::Delivered.as_str());
        assert_eq!(
            claimed(&txn, 1029),
            Vec::<String>::new(),
            "not before its 1 s backoff; e2 waits"
        );
        assert_eq!(next_wake(&txn, 1029).unwrap(), Some(1030));
        assert_eq!(next_wake(&txn, 1030).unwrap(), Some(10 + TTL), "then the expiries");
        assert_eq!(claimed(&txn, 1030), ["e1"]);
        assert_eq!(get_by_event(&txn, "e1").attempts, 2);
        answer(&txn, &say("e1", Answer::Failed { retryable: true }), 1040, 0.5).unwrap();
        assert_eq!(get_by_event(&txn, "e1").next_ms, 1040 + 2000, "the backoff doubled");
        // The instance is Ready again: the retry is due at once.
        assert_eq!(due_now(&txn, "a.b", 1050).unwrap(), 1);
        assert_eq!(claimed(&txn, 1050), ["e1"]);
        answer(&txn, &say("e1", Answer::Posted), 1060, 0.5).unwrap();
        assert_eq!(claimed(&txn, 1070), ["e2"]);
    }

    #[test]
    fn final_refusals_and_unknown_outcomes_are_not_retried_and_do_not_hold_the_conversation() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c1", 11);
        replied(&txn, "e3", "c1", 12);
        claimed(&txn, 20);
        let refused = answer(&txn, &say("e1", Answer::Failed { retryable: false }), 21, 0.0);
        assert_eq!(refused.unwrap().map(|s| s.state), Some(ReplyState::Failed));
        assert_eq!(inbound_state(&txn, "e1"), InboundState::Delivered.as_str());
        assert_eq!(claimed(&txn, 22), ["e2"]);
        assert_eq!(
            answer(&txn, &say("e2", Answer::NoAnswer), 23, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Unknown)
        );
        assert_eq!(claimed(&txn, 10_000_000), ["e3"], "e1 and e2 are never claimed again");
        assert_eq!(next_wake(&txn, 0).unwrap(), None);
        // A late receipt settles the unknown one.
        assert_eq!(
            answer(&txn, &say("e2", Answer::Posted), 24, 0.0).unwrap().map(|s| s.state),
            Some(ReplyState::Posted)
        );
        // An answer to a reply that is not waiting for one changes nothing.
        assert_eq!(answer(&txn, &say("e1", Answer::Posted), 25, 0.0).unwrap(), None);
        assert_eq!(answer(&txn, &say("nope", Answer::Posted), 25, 0.0).unwrap(), None);
    }

    #[test]
    fn replies_past_their_ttl_expire_unless_handed_over() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c2", 10);
        replied(&txn, "e3", "c3", 10);
        claim_due(&txn, "a.b", 20, 2).unwrap();
        answer(&txn, &say("e1", Answer::Failed { retryable: true }), 30, 0.0).unwrap();
        assert_eq!(next_wake(&txn, 30).unwrap(), Some(30 + 750));
        assert_eq!(expire(&txn, 10 + TTL - 1).unwrap(), 0);
        assert_eq!(expire(&txn, 10 + TTL).unwrap(), 2, "e1 (failed_retryable) and e3 (pending)");
        assert_eq!(get_by_event(&txn, "e1").state, ReplyState::Expired);
        assert_eq!(get_by_event(&txn, "e1").error.as_deref(), Some(EXPIRED));
        assert_eq!(get_by_event(&txn, "e2").state, ReplyState::Handed);
        assert_eq!(inbound_state(&txn, "e3"), InboundState::Delivered.as_str());
    }

    #[test]
    fn a_restart_hands_over_again_what_was_handed_and_keeps_retry_state() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c2", 10);
        claimed(&txn, 20);
        answer(&txn, &say("e2", Answer::Failed { retryable: true }), 30, 0.0).unwrap();
        assert_eq!(restart(&txn, 40).unwrap(), 1);
        assert_eq!(get_by_event(&txn, "e1").state, ReplyState::Pending);
        let e2 = get_by_event(&txn, "e2");
        assert_eq!((e2.state, e2.next_ms), (ReplyState::FailedRetryable, 30 + 750));
        assert_eq!(claimed(&txn, 40), ["e1"]);
        assert_eq!(claimed(&txn, 780), ["e2"]);
    }

    #[test]
    fn an_operator_retries_unknown_failed_and_expired_replies_only() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let e1 = replied(&txn, "e1", "c1", 10);
        let e2 = replied(&txn, "e2", "c2", 10);
        assert_eq!(
            requeue(&txn, e1, 11, 99).unwrap_err(),
            LedgerError::ReplyNotRetryable { id: e1, state: ReplyState::Pending }
        );
        claimed(&txn, 20);
        answer(&txn, &say("e1", Answer::Unknown), 21, 0.0).unwrap();
        answer(&txn, &say("e2", Answer::Posted), 21, 0.0).unwrap();
        let again = requeue(&txn, e1, 30, 30 + TTL).unwrap();
        assert_eq!((again.state, again.next_ms), (ReplyState::Pending, 30));
        assert_eq!(claimed(&txn, 30), ["e1"]);
        assert!(matches!(requeue(&txn, e2, 31, 99), Err(LedgerError::ReplyNotRetryable { .. })));
        assert_eq!(requeue(&txn, 999, 31, 99).unwrap_err(), LedgerError::NoSuchReply(999));
    }

    #[test]
    fn listing_counts_and_pruning() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        replied(&txn, "e1", "c1", 10);
        replied(&txn, "e2", "c2", 10);
        replied(&txn, "e3", "c3", 10);
        claimed(&txn, 20);
        answer(&txn, &say("e1", Answer::Posted), 21, 0.0).unwrap();
        answer(&txn, &say("e2", Answer::Failed { retryable: false }), 21, 0.0).unwrap();
        let all = list(&txn, None, None, None, 10).unwrap();
        assert_eq!(all.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["e3", "e2", "e1"]);
        let failed = list(&txn, Some("a.b"), Some(ReplyState::Failed), None, 10).unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].error.as_deref(), Some("send_failed: down"));
        assert_eq!(list(&txn, None, None, Some(all[1].id), 10).unwrap().len(), 1);
        let counts = counts(&txn).unwrap();
        let mut states: Vec<_> = counts.iter().map(|c| c.state.as_str()).collect();
        states.sort_unstable();
        assert_eq!(states, ["failed", "handed", "posted"], "the handed one from its own index");
        assert!(counts.iter().all(|c| c.count == 1 && c.instance == "a.b"));
        assert_eq!(prune(&txn, 22).unwrap(), 2, "posted and failed go; handed stays");
        assert_eq!(list(&txn, None, None, None, 10).unwrap().len(), 1);
    }
}
