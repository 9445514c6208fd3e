//! Conversation history in the ledger: each conversation's admitted inbound texts and posted
//! replies, per instance, conversation and thread, with a wall-clock timestamp. Bounded by
//! a per-conversation cap (the oldest entries go first) and by `retention_days` pruning.
//! Synchronous functions over one connection or transaction.
//!
//! A thread is stored as `''` when there is none, so one index serves every lookup.
//!
//! Entries are written behind the message they come from. A message's commit records the
//! inbound (or the posted reply) with the entry's cap and the current move generation in
//! its own row, and the entry waits on the ledger thread ([`hold`]); the thread moves what
//! it holds into `history` once [`MOVE_AT`] entries wait, when the ledger is quiet, before
//! any read or prune, and when it stops, each conversation's entries together (one leaf
//! written for many entries, where one at a time each commit wrote the conversation's
//! leaf). A move records the next generation in `meta` in the transaction that writes it.
//! After a crash the entries that waited are rebuilt from the rows that carry a generation
//! not yet moved ([`rebuild`]), in time order to the millisecond. What the thread holds is
//! bounded by [`MOVE_AT`] and one batch's entries while moves succeed; a move that fails
//! (logged) is tried again by every batch.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;

use channeld_protocol::ext::HistoryRole;
use channeld_protocol::types::InboundMessage;
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde::Deserialize;

use super::LedgerError;
use super::store::{self, Cached, HeldMark, HeldRows};

/// An entry to append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHistory {
    pub instance: String,
    pub conversation: String,
    pub thread: Option<String>,
    pub role: HistoryRole,
    pub text: String,
    pub sender: Option<String>,
    pub message_id: Option<String>,
    pub event_id: Option<String>,
    /// The reply's delivery record (`replies.id`), for an assistant entry.
    pub reply_id: Option<i64>,
    pub at_ms: u64,
}

/// One stored entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryEntry {
    pub id: i64,
    pub instance: String,
    pub conversation: String,
    pub thread: Option<String>,
    pub role: HistoryRole,
    pub text: String,
    pub sender: Option<String>,
    pub message_id: Option<String>,
    pub event_id: Option<String>,
    pub reply_id: Option<i64>,
    pub at_ms: u64,
}

impl NewHistory {
    /// The entry of an admitted inbound message (`user`), received at `at_ms`.
    pub fn user(instance: &str, event_id: &str, message: &InboundMessage, at_ms: u64) -> Self {
        NewHistory {
            instance: instance.to_owned(),
            conversation: message.target.conversation.to_string(),
            thread: message.target.thread.as_ref().map(ToString::to_string),
            role: HistoryRole::User,
            text: message.body.text_str().to_owned(),
            sender: Some(message.sender.id.to_string()),
            message_id: Some(message.id.to_string()),
            event_id: Some(event_id.to_owned()),
            reply_id: None,
            at_ms,
        }
    }

    /// The entry of a posted reply (`assistant`) from its delivery record: its id, stored
    /// message and receipt, posted at `at_ms`.
    pub fn posted_reply(
        instance: &str,
        event_id: &str,
        (reply_id, message): (i64, &[u8]),
        receipt: Option<&[u8]>,
        at_ms: u64,
    ) -> Result<Self, LedgerError> {
        let message: StoredReply<'_> = serde_json::from_slice(message)
            .map_err(|err| LedgerError::Sql(format!("stored reply does not decode: {err}")))?;
        let message_id = receipt
            .and_then(|r| serde_json::from_slice::<StoredReceipt<'_>>(r).ok())
            .map(|r| r.message_id.into_owned());
        Ok(NewHistory {
            instance: instance.to_owned(),
            conversation: message.target.conversation.into_owned(),
            thread: message.target.thread.map(Cow::into_owned),
            role: HistoryRole::Assistant,
            text: message.body.text.into_owned(),
            sender: None,
            message_id,
            event_id: Some(event_id.to_owned()),
            reply_id: Some(reply_id),
            at_ms,
        })
    }
}

/// What a posted reply's entry keeps of its stored message (an `OutboundMessage` the hub
/// checked before storing it): decoding only these fields, borrowed where the JSON has no
/// escapes, skips the allocations of the whole message (its full decode was 3.9 % of the
/// ledger thread at 256 replies in flight).
#[derive(Deserialize)]
struct StoredReply<'a> {
    #[serde(borrow)]
    target: StoredTarget<'a>,
    #[serde(borrow)]
    body: StoredBody<'a>,
}

#[derive(Deserialize)]
struct StoredTarget<'a> {
    #[serde(borrow)]
    conversation: Cow<'a, str>,
    #[serde(default, borrow)]
    thread: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct StoredBody<'a> {
    #[serde(default, borrow)]
    text: Cow<'a, str>,
}

/// The part of a stored delivery receipt an entry keeps.
#[derive(Deserialize)]
struct StoredReceipt<'a> {
    #[serde(borrow)]
    message_id: Cow<'a, str>,
}

impl HistoryEntry {
    /// The wire form (`history_result`, control `history`).
    pub fn to_wire(&self) -> channeld_protocol::ext::HistoryEntry {
        channeld_protocol::ext::HistoryEntry {
            id: self.id,
            role: self.role,
            text: self.text.clone(),
            at_ms: self.at_ms,
            sender: self.sender.clone(),
            message_id: self.message_id.clone(),
            event_id: self.event_id.clone(),
        }
    }
}

const COLUMNS: &str = "id, instance, conversation, thread, role, text, sender, message_id, \
                       event_id, reply_id, at_ms";

fn entry(row: &Row<'_>) -> rusqlite::Result<HistoryEntry> {
    let thread: String = row.get(3)?;
    let role: String = row.get(4)?;
    Ok(HistoryEntry {
        id: row.get(0)?,
        instance: row.get(1)?,
        conversation: row.get(2)?,
        thread: (!thread.is_empty()).then_some(thread),
        role: HistoryRole::parse(&role).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                4,
                rusqlite::types::Type::Text,
                format!("unknown history role {role:?}").into(),
            )
        })?,
        text: row.get(5)?,
        sender: row.get(6)?,
        message_id: row.get(7)?,
        event_id: row.get(8)?,
        reply_id: row.get(9)?,
        at_ms: row.get::<_, i64>(10)? as u64,
    })
}

/// How many entries beyond its cap a conversation may hold before the surplus goes: a
/// quarter of the cap, at most 64 (none for a cap under 4). Trimming on every append wrote
/// the pages of the oldest entry and its index entry with every message once a conversation
/// was full; trimming in steps writes them once per step. Readers never see the surplus:
/// the hub reads at most `cap` entries ([`recent`]'s callers pass `limit ≤ cap`). Pure.
pub fn slack(cap: i64) -> i64 {
    (cap / 4).min(64)
}

/// Appends `new` at once: [`hold`], then [`write_all`] (tests).
#[cfg(test)]
pub fn append(txn: &Connection, new: &NewHistory, cap: usize) -> Result<(), LedgerError> {
    hold(new.clone(), cap);
    write_all(txn)?;
    committed();
    Ok(())
}

/// Entries a move writes at once once this many wait: at 256 conversations in flight ~8
/// entries per conversation share its index leaf, and a move takes a few milliseconds of
/// the batch that reaches the mark (BENCHMARKS.md, seventeenth round).
pub const MOVE_AT: usize = 2048;

/// The entries the ledger thread holds, in the order they were logged.
#[derive(Debug, Default)]
struct Held {
    entries: HeldRows<(NewHistory, usize)>,
    /// The generation a row logged now carries: the last move's, plus one per move in the
    /// open transaction.
    generation: i64,
}

thread_local! {
    /// The ledger thread's entries (only that thread runs the ledger's calls; a test that
    /// calls the functions directly has its own).
    static HELD: RefCell<Held> = RefCell::new(Held::default());
}

/// The generation a row whose entry is logged now records (`history_gen`).
pub fn generation() -> i64 {
    HELD.with(|held| held.borrow().generation)
}

/// Holds `new` (with its conversation's `cap`) for the next move. The caller's row records
/// [`generation`] and `cap` in the same transaction.
pub fn hold(new: NewHistory, cap: usize) {
    HELD.with(|held| held.borrow_mut().entries.push((new, cap)));
}

/// The state [`undo`] returns to.
pub fn mark() -> HeldMark {
    HELD.with(|held| {
        let held = held.borrow();
        held.entries.mark(held.generation)
    })
}

/// Forgets what was held and written since `mark` (its transaction, or its savepoint, did
/// not commit).
pub fn undo(mark: HeldMark) {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        held.generation = held.entries.undo(mark);
    })
}

/// The open transaction committed: what it wrote is no longer held.
pub fn committed() {
    HELD.with(|held| held.borrow_mut().entries.committed())
}

/// What a crash does to the entries the ledger thread holds (tests).
#[cfg(test)]
pub fn forget_held() {
    HELD.with(|held| *held.borrow_mut() = Held::default());
}

/// Whether entries wait that no transaction wrote yet.
pub fn holding() -> bool {
    HELD.with(|held| !held.borrow().entries.waiting().is_empty())
}

/// Moves what is held into `history` when [`MOVE_AT`] entries wait, or whatever waits with
/// `all`; whether it moved any. A failed move leaves the entries held and part
/// of the move in the transaction, which the caller rolls back (`store::write_held_rows`).
pub fn write(txn: &Connection, all: bool) -> Result<bool, LedgerError> {
    let waiting = HELD.with(|held| held.borrow().entries.waiting().len());
    store::write_held_rows(txn, (waiting, MOVE_AT, all), write_held, mark, undo)
}

/// Every entry the ledger thread holds written into `history` (before a read or a prune).
pub fn write_all(txn: &Connection) -> Result<(), LedgerError> {
    write(txn, true).map(drop)
}

/// Writes the held entries not yet written, each conversation's together in the order
/// logged, and records the next generation. Each conversation (and thread) stays near its
/// `cap` (at least 1): an entry is numbered after the conversation's newest (`seq`), and
/// every `slack + 1`-th number past the cap drops the entries more than `cap` numbers older,
/// so a conversation holds at most `cap +` [`slack`] entries and always its newest `cap`.
/// The numbers live in the rows: a rolled-back move, a prune or a restart needs no count
/// kept aside (BENCHMARKS.md, fix 26). A conversation's newest number is read once per
/// move, and it is trimmed once, to the highest number its entries' trims keep.
fn write_held(txn: &Connection) -> Result<(), LedgerError> {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        let waiting = held.entries.waiting();
        let mut order: Vec<(&str, &str, &str)> = Vec::new();
        let mut groups: HashMap<(&str, &str, &str), Vec<usize>> = HashMap::new();
        for (n, (new, _)) in waiting.iter().enumerate() {
            let key = (
                new.instance.as_str(),
                new.conversation.as_str(),
                new.thread.as_deref().unwrap_or(""),
            );
            let group = groups.entry(key).or_default();
            if group.is_empty() {
                order.push(key);
            }
            group.push(n);
        }
        for key in order {
            let newest: Option<i64> = txn
                .query_row_cached(NEWEST, params![key.0, key.1, key.2], |row| row.get(0))
                .optional()?;
            let mut seq = newest.unwrap_or(0);
            let mut oldest_kept: Option<i64> = None;
            for n in &groups[&key] {
                let (new, cap) = &waiting[*n];
                seq += 1;
                insert(txn, new, key.2, seq)?;
                if let Some(kept) = trim_from(seq, *cap) {
                    oldest_kept = Some(oldest_kept.map_or(kept, |k| k.max(kept)));
                }
            }
            if let Some(kept) = oldest_kept {
                txn.exec_cached(TRIM, params![key.0, key.1, key.2, kept])?;
            }
        }
        let generation = held.generation + 1;
        let floor: i64 = txn.query_row_cached(FLOOR, [], |row| row.get(0))?;
        txn.exec_cached(
            "INSERT INTO meta (key, value) VALUES ('history_moved', ?1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [format!("{generation} {floor}")],
        )?;
        held.entries.all_written();
        held.generation = generation;
        Ok(())
    })
}

/// The lowest inbound id whose history entry (its own or its reply's) may still be logged
/// after now: an entry still running or owing an untracked reply, or a reply on its way
/// (`replies_holding`: pending, handed or retrying); the next id when there is none. A reply
/// can be posted only while on its way, so a reply posted later belongs to one of these.
///
/// Each part reads a small index: without `INDEXED BY` the planner takes `min(id)` from the
/// table's rowid order and walks every settled row before the first open one (a move then
/// cost more than the history it wrote).
const FLOOR: &str = "SELECT min(id) FROM (
         SELECT min(id) AS id FROM inbound INDEXED BY inbound_open
         WHERE state IN ('running', 'replied')
         UNION ALL
         SELECT min(i.id) FROM replies AS r INDEXED BY replies_holding JOIN inbound AS i
             ON i.instance = r.instance AND i.event_id = r.event_id
         WHERE (r.state = 'pending' OR r.state = 'handed' OR r.state = 'failed_retryable')
         UNION ALL
         SELECT coalesce(max(id), 0) + 1 FROM inbound)";

/// Rebuilds the entries a crash left held (the ledger thread's first step): the rows that
/// logged one after the last move carry its generation or a later one, and all of them are
/// at or past the move's floor. Held again in time order (to the millisecond; a message
/// before its reply) and written at once.
pub fn rebuild(txn: &Connection) -> Result<(), LedgerError> {
    let (generation, floor) = last_move(txn)?;
    HELD.with(|held| *held.borrow_mut() = Held { generation, ..Held::default() });
    let mut stmt = txn.prepare(
        "SELECT i.id, i.instance, i.event_id, i.frame, i.received_ms,
             CASE WHEN i.history_gen >= ?2 THEN i.history_cap END,
             r.id, r.message, r.receipt, r.updated_ms, r.history_cap
         FROM inbound AS i LEFT JOIN replies AS r
             ON r.instance = i.instance AND r.event_id = i.event_id AND r.history_gen >= ?2
         WHERE i.id >= ?1 AND (i.history_gen >= ?2 OR r.id IS NOT NULL)
         ORDER BY i.id",
    )?;
    let mut rows = stmt.query(params![floor, generation])?;
    // (time, inbound id, 0 for the message and 1 for its reply): the order entries are held.
    let mut found: Vec<((u64, i64, u8), NewHistory, usize)> = Vec::new();
    while let Some(row) = rows.next()? {
        let (id, instance, event_id): (i64, String, String) =
            (row.get(0)?, row.get(1)?, row.get(2)?);
        let cap = |n| -> rusqlite::Result<Option<usize>> {
            Ok(row.get::<_, Option<i64>>(n)?.map(|cap| usize::try_from(cap).unwrap_or(1)))
        };
        // The message's entry only if it was logged after the move (its reply may have been
        // logged after it, and the message's entry moved before).
        if let Some(cap) = cap(5)? {
            let frame: Vec<u8> = row.get(3)?;
            let received_ms = row.get::<_, i64>(4)? as u64;
            if let Ok(channeld_protocol::Frame::Inbound(inbound)) =
                channeld_protocol::decode(&frame)
            {
                let entry = NewHistory::user(&instance, &event_id, &inbound.message, received_ms);
                found.push(((received_ms, id, 0), entry, cap));
            }
        }
        if let (Some(reply_id), Some(cap)) = (row.get::<_, Option<i64>>(6)?, cap(10)?) {
            let message: Vec<u8> = row.get(7)?;
            let receipt: Option<Vec<u8>> = row.get(8)?;
            let posted_ms = row.get::<_, i64>(9)? as u64;
            let entry = NewHistory::posted_reply(
                &instance,
                &event_id,
                (reply_id, &message),
                receipt.as_deref(),
                posted_ms,
            )?;
            found.push(((posted_ms, id, 1), entry, cap));
        }
    }
    found.sort_by_key(|(order, _, _)| *order);
    for (_, entry, cap) in found {
        hold(entry, cap);
    }
    write_all(txn)
}

/// The last move's generation and floor (`meta.history_moved`).
fn last_move(txn: &Connection) -> Result<(i64, i64), LedgerError> {
    let moved: Option<String> = txn
        .query_row("SELECT value FROM meta WHERE key = 'history_moved'", [], |row| row.get(0))
        .optional()?;
    moved
        .as_deref()
        .and_then(|value| value.split_once(' '))
        .and_then(|(g, f)| Some((g.parse::<i64>().ok()?, f.parse::<i64>().ok()?)))
        .ok_or_else(|| LedgerError::Sql(format!("meta history_moved is {moved:?}")))
}

/// Lowers the floor of the last move to `instance`'s inbound `event_id`: a reply the
/// operator sends again belongs to an inbound that had settled, below the floor, and its
/// entry may be logged before a move sees the reply on its way.
pub fn keep_from(txn: &Connection, instance: &str, event_id: &str) -> Result<(), LedgerError> {
    let id: Option<i64> = txn
        .query_row_cached(
            "SELECT id FROM inbound WHERE instance = ?1 AND event_id = ?2",
            params![instance, event_id],
            |row| row.get(0),
        )
        .optional()?;
    let (generation, floor) = last_move(txn)?;
    if let Some(id) = id.filter(|id| *id < floor) {
        txn.execute(
            "UPDATE meta SET value = ?1 WHERE key = 'history_moved'",
            [format!("{generation} {id}")],
        )?;
    }
    Ok(())
}

/// Inserts one entry numbered `seq` in its conversation's `thread` (`''` for none).
fn insert(txn: &Connection, new: &NewHistory, thread: &str, seq: i64) -> Result<(), LedgerError> {
    txn.exec_cached(
        "INSERT INTO history (instance, conversation, thread, role, text, sender, message_id,
             event_id, reply_id, at_ms, seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![
            new.instance,
            new.conversation,
            thread,
            new.role.as_str(),
            new.text,
            new.sender,
            new.message_id,
            new.event_id,
            new.reply_id,
            new.at_ms as i64,
            seq
        ],
    )?;
    Ok(())
}

/// The newest number of a conversation and thread.
const NEWEST: &str = "SELECT seq FROM history
     WHERE instance = ?1 AND conversation = ?2 AND thread = ?3 ORDER BY seq DESC LIMIT 1";

/// A conversation's entries numbered below the oldest it keeps.
pub(super) const TRIM: &str = "DELETE FROM history
     WHERE instance = ?1 AND conversation = ?2 AND thread = ?3 AND seq < ?4";

/// Whether appending entry number `seq` trims its conversation, and if so the oldest number
/// it keeps (the newest `cap` stay). Pure: a trim every `slack + 1` numbers past the cap.
pub fn trim_from(seq: i64, cap: usize) -> Option<i64> {
    let cap = cap.max(1) as i64;
    let step = slack(cap) + 1;
    (seq > cap && (seq - cap) % step == 0).then_some(seq - cap + 1)
}

/// The newest `limit` entries of a conversation (and thread: `None` is the conversation
/// outside threads), oldest first. The hub passes `limit ≤` the instance's cap: a full
/// conversation may hold up to [`slack`] older entries that are on their way out.
pub fn recent(
    conn: &Connection,
    instance: &str,
    conversation: &str,
    thread: Option<&str>,
    limit: usize,
) -> Result<Vec<HistoryEntry>, LedgerError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM history WHERE instance = ?1 AND conversation = ?2 AND thread = ?3
         ORDER BY seq DESC LIMIT ?4"
    ))?;
    let rows =
        stmt.query_map(params![instance, conversation, thread.unwrap_or(""), limit as i64], entry)?;
    let mut entries = rows.collect::<Result<Vec<_>, _>>()?;
    entries.reverse();
    Ok(entries)
}

const PRUNE: &str = "DELETE FROM history WHERE id < coalesce(
         (SELECT id FROM history WHERE at_ms >= ?1 ORDER BY id LIMIT 1),
         (SELECT max(id) + 1 FROM history), 0)";

/// Deletes entries older than `before_ms`, oldest first up to the first one that is not
/// (ids grow with time, so that is all of them but for a clock set back); returns how many
/// went. It reads only the rows it deletes and one more: no index on the time is written
/// with every entry for it.
pub fn prune(txn: &Connection, before_ms: u64) -> Result<usize, LedgerError> {
    Ok(txn.execute(PRUNE, params![before_ms as i64])?)
}

#[cfg(test)]
mod tests {
    use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
    use channeld_protocol::{ChannelId, Id};

    use super::*;
    use crate::ledger::replies::{self, NewReply};
    use crate::ledger::schema::open_in_memory;

    fn user(conversation: &str, thread: Option<&str>, text: &str, at_ms: u64) -> NewHistory {
        NewHistory {
            instance: "a.b".into(),
            conversation: conversation.into(),
            thread: thread.map(Into::into),
            role: HistoryRole::User,
            text: text.into(),
            sender: Some("alice".into()),
            message_id: Some(format!("m-{text}")),
            event_id: Some(format!("e-{text}")),
            reply_id: None,
            at_ms,
        }
    }

    fn texts(entries: &[HistoryEntry]) -> Vec<&str> {
        entries.iter().map(|e| e.text.as_str()).collect()
    }

    #[test]
    fn recent_is_the_newest_entries_oldest_first_per_conversation_and_thread() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        for (n, text) in ["one", "two", "three", "four"].into_iter().enumerate() {
            append(&txn, &user("c1", None, text, n as u64), 200).unwrap();
        }
        append(&txn, &user("c1", Some("t1"), "in-thread", 9), 200).unwrap();
        append(&txn, &user("c2", None, "other", 9), 200).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 3).unwrap()), ["two", "three", "four"]);
        assert_eq!(texts(&recent(&txn, "a.b", "c1", Some("t1"), 10).unwrap()), ["in-thread"]);
        assert!(recent(&txn, "a.b", "nope", None, 10).unwrap().is_empty());
        assert!(recent(&txn, "x.y", "c1", None, 10).unwrap().is_empty());
        let entry = &recent(&txn, "a.b", "c1", None, 4).unwrap()[1];
        assert_eq!(entry.text, "two");
        assert_eq!(entry.event_id.as_deref(), Some("e-two"));
        assert_eq!(entry.sender.as_deref(), Some("alice"));
        assert_eq!(entry.thread, None);
    }

    #[test]
    fn the_cap_keeps_only_the_newest_entries_of_that_conversation() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        append(&txn, &user("c2", None, "kept", 0), 2).unwrap();
        for n in 0..5 {
            append(&txn, &user("c1", None, &n.to_string(), n), 2).unwrap();
        }
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["3", "4"]);
        assert_eq!(texts(&recent(&txn, "a.b", "c2", None, 10).unwrap()), ["kept"]);
        // A lower cap (a changed setting) trims to it on the next append.
        append(&txn, &user("c1", None, "5", 5), 1).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["5"]);
        // A raised cap keeps more from then on.
        append(&txn, &user("c1", None, "6", 6), 3).unwrap();
        append(&txn, &user("c1", None, "7", 7), 3).unwrap();
        append(&txn, &user("c1", None, "8", 8), 3).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["6", "7", "8"]);
    }

    #[test]
    fn a_full_conversation_is_trimmed_in_steps_and_the_newest_cap_entries_stay() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        let count = |txn: &Connection| -> i64 {
            txn.query_row("SELECT count(*) FROM history", [], |row| row.get(0)).unwrap()
        };
        assert_eq!((slack(2), slack(8), slack(200), slack(1000)), (0, 2, 50, 64));
        for n in 0..250 {
            append(&txn, &user("c1", None, &n.to_string(), n), 200).unwrap();
        }
        assert_eq!(count(&txn), 250, "within the slack nothing goes");
        append(&txn, &user("c1", None, "250", 250), 200).unwrap();
        assert_eq!(count(&txn), 200, "past it the conversation is back at its cap");
        let newest = recent(&txn, "a.b", "c1", None, 200).unwrap();
        assert_eq!(newest.first().unwrap().text, "51");
        assert_eq!(newest.last().unwrap().text, "250");
    }

    #[test]
    fn numbering_keeps_every_cap_within_its_slack_and_its_newest_entries() {
        // The pure rule alone, against a model of one conversation's numbers.
        for cap in [1, 2, 3, 4, 7, 8, 20, 200, 1000] {
            let mut held = std::collections::VecDeque::new();
            let mut most = 0;
            for seq in 1..=(3 * cap as i64 + 300) {
                held.push_back(seq);
                if let Some(oldest_kept) = trim_from(seq, cap) {
                    held.retain(|n| *n >= oldest_kept);
                }
                most = most.max(held.len());
                let newest = (seq - cap as i64 + 1).max(1)..=seq;
                assert!(newest.clone().all(|n| held.contains(&n)), "cap {cap} seq {seq}");
            }
            let cap_i = cap as i64;
            assert_eq!(most as i64, cap_i + slack(cap_i), "cap {cap}: the most it held");
        }
    }

    #[test]
    fn a_rolled_back_append_is_not_counted() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        append(&txn, &user("c1", None, "a", 0), 2).unwrap();
        txn.execute_batch("SAVEPOINT job").unwrap();
        append(&txn, &user("c1", None, "lost", 1), 2).unwrap();
        txn.execute_batch("ROLLBACK TO job; RELEASE job").unwrap();
        append(&txn, &user("c1", None, "b", 2), 2).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["a", "b"]);
        append(&txn, &user("c1", None, "c", 3), 2).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["b", "c"]);
    }

    #[test]
    fn a_posted_reply_keeps_escaped_text_and_skips_what_its_entry_does_not_keep() {
        let stored = br#"{"target":{"channel":"a.b","conversation":"c\u00e91","thread":null,"reply_to":"m"},"body":{"text":"line \"one\"\nzwei \u00fc","attachments":[{"url":"https://x/y","name":"n"}]},"metadata":{"k":{"deep":[1,2]}}}"#;
        let receipt = br#"{"channel":"a.b","message_id":"p\/2","target":{"channel":"a.b","conversation":"c"}}"#;
        let entry = NewHistory::posted_reply("a.b", "e", (7, stored), Some(receipt), 9).unwrap();
        assert_eq!(entry.conversation, "c\u{e9}1");
        assert_eq!(entry.thread, None);
        assert_eq!(entry.text, "line \"one\"\nzwei \u{fc}");
        assert_eq!(entry.message_id.as_deref(), Some("p/2"));
        assert_eq!((entry.reply_id, entry.at_ms), (Some(7), 9));
        let broken = NewHistory::posted_reply("a.b", "e", (7, b"{\"body\":{}}"), None, 9);
        assert!(broken.is_err(), "a stored reply without its target does not decode");
    }

    #[test]
    fn a_posted_reply_becomes_an_assistant_entry_in_its_conversation() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        let mut target = MessageTarget::new(ChannelId::new("a.b").unwrap(), Id::new("c1").unwrap());
        target.thread = Some(Id::new("t1").unwrap());
        let message = OutboundMessage {
            target,
            body: MessageBody::text("the answer".to_owned()).unwrap(),
            metadata: Default::default(),
        };
        let reply = NewReply {
            instance: "a.b".into(),
            event_id: "e-q".into(),
            conversation: "c1".into(),
            message: serde_json::to_vec(&message).unwrap(),
            expires_ms: 100,
        };
        let reply_id = replies::add(&txn, &reply, 1).unwrap();
        let stored = (reply_id, reply.message.as_slice());
        let receipt = serde_json::to_vec(&channeld_protocol::types::DeliveryReceipt {
            channel: ChannelId::new("a.b").unwrap(),
            message_id: Id::new("p-1").unwrap(),
            target: message.target.clone(),
            timestamp_ms: None,
        })
        .unwrap();
        let entry = NewHistory::posted_reply("a.b", "e-q", stored, Some(&receipt), 5).unwrap();
        append(&txn, &entry, 10).unwrap();
        let entries = recent(&txn, "a.b", "c1", Some("t1"), 10).unwrap();
        assert_eq!(entries.len(), 1);
        let entry = &entries[0];
        assert_eq!(entry.role, HistoryRole::Assistant);
        assert_eq!(entry.text, "the answer");
        assert_eq!(entry.message_id.as_deref(), Some("p-1"));
        assert_eq!(entry.event_id.as_deref(), Some("e-q"));
        assert_eq!(entry.reply_id, Some(reply_id));
        assert_eq!(entry.at_ms, 5);
    }

    #[test]
    fn a_batch_moves_what_is_held_once_the_mark_is_reached() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        forget_held();
        let count = |txn: &Connection| -> usize {
            let n: i64 =
                txn.query_row("SELECT count(*) FROM history", [], |row| row.get(0)).unwrap();
            n as usize
        };
        for n in 0..MOVE_AT - 1 {
            hold(user("c1", None, &n.to_string(), n as u64), 10_000);
        }
        assert!(!write(&txn, false).unwrap(), "below the mark nothing moves");
        assert_eq!(count(&txn), 0);
        hold(user("c1", None, "last", 0), 10_000);
        assert!(write(&txn, false).unwrap());
        committed();
        assert_eq!(count(&txn), MOVE_AT);
        assert!(!holding());
        assert!(!write(&txn, true).unwrap(), "nothing held, nothing to move");
    }

    #[test]
    fn the_floor_of_a_move_reads_only_small_indexes() {
        let conn = open_in_memory().unwrap();
        let plan = crate::ledger::inbound::tests::plan(&conn, FLOOR);
        for line in plan.lines() {
            let line = line.trim();
            assert!(!line.starts_with("SCAN") || line.contains("INDEX"), "{plan}");
        }
        assert!(plan.contains("inbound_open") && plan.contains("replies_holding"), "{plan}");
    }

    #[test]
    fn pruning_walks_the_oldest_rows_by_id() {
        let conn = open_in_memory().unwrap();
        let plan = crate::ledger::inbound::tests::plan(&conn, &PRUNE.replace("?1", "1000"));
        assert!(plan.starts_with("SEARCH history USING INTEGER PRIMARY KEY (rowid<?)"), "{plan}");
        assert!(!plan.contains("INDEX"), "{plan}");
    }

    #[test]
    fn an_append_reads_and_trims_through_the_conversation_index() {
        let conn = open_in_memory().unwrap();
        let plan = |sql: &str| {
            crate::ledger::inbound::tests::plan(&conn, &crate::ledger::schema::tests::unbound(sql))
        };
        let newest = plan(NEWEST);
        assert!(
            newest.starts_with("SEARCH history USING COVERING INDEX history_by_conversation"),
            "{newest}"
        );
        assert!(!newest.contains("TEMP B-TREE"), "{newest}");
        let trim = plan(TRIM);
        assert!(
            trim.starts_with("SEARCH history USING INDEX history_by_conversation")
                && trim.contains("seq<?"),
            "{trim}"
        );
        let recent = plan(&format!(
            "SELECT {COLUMNS} FROM history WHERE instance = ?1 AND conversation = ?2
                 AND thread = ?3 ORDER BY seq DESC LIMIT ?4"
        ));
        assert!(!recent.contains("TEMP B-TREE"), "{recent}");
    }

    #[test]
    fn pruning_drops_entries_older_than_the_cutoff() {
        let mut conn = open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        assert_eq!(prune(&txn, 20).unwrap(), 0, "an empty history");
        append(&txn, &user("c1", None, "old", 10), 200).unwrap();
        append(&txn, &user("c2", None, "old too", 11), 200).unwrap();
        assert_eq!(prune(&txn, 5).unwrap(), 0, "nothing older");
        assert_eq!(prune(&txn, 20).unwrap(), 2, "everything older");
        assert!(recent(&txn, "a.b", "c2", None, 10).unwrap().is_empty());
        append(&txn, &user("c1", None, "old", 10), 200).unwrap();
        append(&txn, &user("c1", None, "new", 30), 200).unwrap();
        assert_eq!(prune(&txn, 20).unwrap(), 1);
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["new"]);
        // Numbering goes on after the pruned rows: the cap still holds exactly.
        append(&txn, &user("c1", None, "newer", 40), 2).unwrap();
        append(&txn, &user("c1", None, "newest", 50), 2).unwrap();
        assert_eq!(texts(&recent(&txn, "a.b", "c1", None, 10).unwrap()), ["newer", "newest"]);
    }
}
