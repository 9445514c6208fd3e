//! Conversation history in the ledger: each conversation's admitted inbound texts and posted
//! replies, per instance, conversation and thread, with a wall-clock timestamp. Bounded by
//! a per-conversation cap (the oldest entries go first) and by `retention_days` pruning.
//! Synchronous functions over one connection or transaction.
//!
//! A thread is stored as `''` when there is none, so one index serves every lookup.

use channeld_protocol::ext::HistoryRole;
use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};

use super::LedgerError;
use super::store::Cached;

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

/// Appends `new` and keeps its conversation (and thread) near its `cap` (at least 1): an
/// entry is numbered after the conversation's newest (`seq`), and every `slack + 1`-th
/// number past the cap drops the entries more than `cap` numbers older, so a conversation
/// holds at most `cap +` [`slack`] entries and always its newest `cap`. The numbers live in
/// the rows: a rolled-back append, a prune or a restart needs no count kept aside (the TEMP
/// table of counts this replaced cost two statements per append; BENCHMARKS.md, fix 26).
/// Returns the new entry's id.
pub fn append(txn: &Transaction<'_>, new: &NewHistory, cap: usize) -> Result<i64, LedgerError> {
    let thread = new.thread.as_deref().unwrap_or("");
    let newest: Option<i64> = txn
        .query_row_cached(NEWEST, params![new.instance, new.conversation, thread], |row| row.get(0))
        .optional()?;
    let seq = newest.unwrap_or(0) + 1;
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
    let id = txn.last_insert_rowid();
    if let Some(oldest_kept) = trim_from(seq, cap) {
        txn.exec_cached(TRIM, params![new.instance, new.conversation, thread, oldest_kept])?;
    }
    Ok(id)
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

/// Records the reply of `event_id` as posted, from its delivery record (its id and stored
/// message, which the caller has just read): an assistant entry in the reply's conversation
/// and thread, with the platform's message id from `receipt`.
pub fn append_posted_reply(
    txn: &Transaction<'_>,
    instance: &str,
    event_id: &str,
    (reply_id, message): (i64, &[u8]),
    message_id: Option<String>,
    cap: usize,
    now_ms: u64,
) -> Result<i64, LedgerError> {
    let message: channeld_protocol::types::OutboundMessage = serde_json::from_slice(message)
        .map_err(|err| LedgerError::Sql(format!("stored reply does not decode: {err}")))?;
    let new = NewHistory {
        instance: instance.to_owned(),
        conversation: message.target.conversation.to_string(),
        thread: message.target.thread.as_ref().map(ToString::to_string),
        role: HistoryRole::Assistant,
        text: message.body.text_str().to_owned(),
        sender: None,
        message_id,
        event_id: Some(event_id.to_owned()),
        reply_id: Some(reply_id),
        at_ms: now_ms,
    };
    append(txn, &new, cap)
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
pub fn prune(txn: &Transaction<'_>, before_ms: u64) -> Result<usize, LedgerError> {
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
        let count = |txn: &Transaction<'_>| -> i64 {
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
        append_posted_reply(&txn, "a.b", "e-q", stored, Some("p-1".into()), 10, 5).unwrap();
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
