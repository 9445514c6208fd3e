//! The agent's inbox in the ledger: one item per admitted inbound (its structural ids, no
//! text), whether `respond` sent its reply (the outbox record) and whether it was handled
//! (`respond` or `complete`), and the bounded context `read` shows. The texts are read from
//! the inbound entries, the hub's replies and the outbox, so nothing is stored twice.
//! Synchronous functions over one transaction.

use rusqlite::{OptionalExtension, Row, Transaction, params};

use super::LedgerError;
use super::store::Cached;

/// The ids of a new item, written with its inbound entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewItem {
    pub conversation: String,
    pub thread: Option<String>,
    pub message_id: Option<String>,
    pub sender: Option<String>,
}

/// One item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The ledger entry id.
    pub id: i64,
    pub instance: String,
    pub event_id: String,
    pub conversation: String,
    pub thread: Option<String>,
    pub message_id: Option<String>,
    pub sender: Option<String>,
    pub received_ms: u64,
    /// The outbox record of the reply `respond` sent.
    pub outbox_id: Option<i64>,
    pub handled_ms: Option<u64>,
    /// `respond` or `complete`.
    pub handled_by: Option<String>,
}

/// An item with what `read` shows of it: the inbound frame as recorded, the hub's reply to
/// its run (message JSON and delivery state) and the reply `respond` sent (message JSON and
/// outbox state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemView {
    pub item: Item,
    pub frame: Option<Vec<u8>>,
    pub run_reply: Option<(Vec<u8>, String)>,
    pub respond_reply: Option<(Vec<u8>, String)>,
}

const COLUMNS: &str = "items.id, items.instance, items.event_id, items.conversation, \
    items.thread, items.message_id, items.sender, items.received_ms, items.outbox_id, \
    items.handled_ms, items.handled_by";

const VIEW_JOINS: &str = "LEFT JOIN inbound ON inbound.instance = items.instance \
        AND inbound.event_id = items.event_id \
    LEFT JOIN replies ON replies.instance = items.instance AND replies.event_id = items.event_id \
    LEFT JOIN outbox ON outbox.id = items.outbox_id";

fn item(row: &Row<'_>) -> rusqlite::Result<Item> {
    Ok(Item {
        id: row.get(0)?,
        instance: row.get(1)?,
        event_id: row.get(2)?,
        conversation: row.get(3)?,
        thread: row.get(4)?,
        message_id: row.get(5)?,
        sender: row.get(6)?,
        received_ms: row.get::<_, i64>(7)? as u64,
        outbox_id: row.get(8)?,
        handled_ms: row.get::<_, Option<i64>>(9)?.map(|ms| ms as u64),
        handled_by: row.get(10)?,
    })
}

fn view(row: &Row<'_>) -> rusqlite::Result<ItemView> {
    let pair = |a: usize, b: usize| -> rusqlite::Result<Option<(Vec<u8>, String)>> {
        Ok(match (row.get::<_, Option<Vec<u8>>>(a)?, row.get::<_, Option<String>>(b)?) {
            (Some(message), Some(state)) => Some((message, state)),
            _ => None,
        })
    };
    Ok(ItemView {
        item: item(row)?,
        frame: row.get(11)?,
        run_reply: pair(12, 13)?,
        respond_reply: pair(14, 15)?,
    })
}

/// Adds the item of a newly recorded inbound; returns its entry id.
pub fn add(
    txn: &Transaction<'_>,
    instance: &str,
    event_id: &str,
    new: &NewItem,
    now_ms: u64,
) -> Result<i64, LedgerError> {
    txn.exec_cached(
        "INSERT INTO items (instance, event_id, conversation, thread, message_id, sender,
             received_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
        params![
            instance,
            event_id,
            new.conversation,
            new.thread,
            new.message_id,
            new.sender,
            now_ms as i64
        ],
    )?;
    Ok(txn.last_insert_rowid())
}

/// The item of `event_id` with what `read` shows of it.
pub fn get(
    txn: &Transaction<'_>,
    instance: &str,
    event_id: &str,
) -> Result<Option<ItemView>, LedgerError> {
    Ok(txn
        .query_row_cached(
            &format!(
                "SELECT {COLUMNS}, inbound.frame, replies.message, replies.state,
                     outbox.message, outbox.state
                 FROM items {VIEW_JOINS}
                 WHERE items.instance = ?1 AND items.event_id = ?2"
            ),
            params![instance, event_id],
            view,
        )
        .optional()?)
}

/// Up to `limit` items before entry `before` in the same conversation and thread (`None`:
/// outside any thread), newest first.
pub fn context(
    txn: &Transaction<'_>,
    instance: &str,
    conversation: &str,
    thread: Option<&str>,
    before: i64,
    limit: usize,
) -> Result<Vec<ItemView>, LedgerError> {
    let mut stmt = txn.prepare_cached(&format!(
        "SELECT {COLUMNS}, inbound.frame, replies.message, replies.state,
             outbox.message, outbox.state
         FROM items {VIEW_JOINS}
         WHERE items.instance = ?1 AND items.conversation = ?2 AND items.thread IS ?3
             AND items.id < ?4
         ORDER BY items.id DESC LIMIT ?5"
    ))?;
    let rows =
        stmt.query_map(params![instance, conversation, thread, before, limit as i64], view)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Items newest first: of one instance or all, only unhandled ones or all, below entry
/// `before`, at most `limit`.
pub fn list(
    txn: &Transaction<'_>,
    instance: Option<&str>,
    unhandled: bool,
    before: Option<i64>,
    limit: usize,
) -> Result<Vec<Item>, LedgerError> {
    let mut stmt = txn.prepare_cached(&list_sql())?;
    let rows = stmt.query_map(params![instance, unhandled, before, limit as i64], item)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The listing reads the items newest first by id, filtering as it goes (no index on the
/// handled state: it would be written with every item).
fn list_sql() -> String {
    format!(
        "SELECT {COLUMNS} FROM items
         WHERE (?1 IS NULL OR instance = ?1) AND (?2 = 0 OR handled_ms IS NULL)
             AND (?3 IS NULL OR id < ?3)
         ORDER BY id DESC LIMIT ?4"
    )
}

/// Records the outbox record of the reply `respond` sent (the first one stays).
pub fn set_reply(
    txn: &Transaction<'_>,
    instance: &str,
    event_id: &str,
    outbox_id: i64,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    let changed = txn.exec_cached(
        "UPDATE items SET outbox_id = ?3, updated_ms = ?4
         WHERE instance = ?1 AND event_id = ?2 AND outbox_id IS NULL",
        params![instance, event_id, outbox_id, now_ms as i64],
    )?;
    Ok(changed == 1)
}

/// Marks an item handled `by` (`respond` or `complete`); the first marking stays. False when
/// there is no such item.
pub fn mark_handled(
    txn: &Transaction<'_>,
    instance: &str,
    event_id: &str,
    by: &str,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    txn.exec_cached(
        "UPDATE items SET handled_ms = ?4, handled_by = ?3, updated_ms = ?4
         WHERE instance = ?1 AND event_id = ?2 AND handled_ms IS NULL",
        params![instance, event_id, by, now_ms as i64],
    )?;
    let exists: Option<i64> = txn
        .query_row_cached(
            "SELECT id FROM items WHERE instance = ?1 AND event_id = ?2",
            params![instance, event_id],
            |row| row.get(0),
        )
        .optional()?;
    Ok(exists.is_some())
}

/// Deletes items last touched before `before_ms` (with the inbound entries they describe).
/// It walks the items received before then, oldest first (ids grow with arrival), and stops
/// at the first one received since: no index on the time is written with every item for it.
pub fn prune(txn: &Transaction<'_>, before_ms: u64) -> Result<usize, LedgerError> {
    Ok(txn.exec_cached(PRUNE, params![before_ms as i64])?)
}

const PRUNE: &str = "DELETE FROM items WHERE updated_ms < ?1 AND id < coalesce(
         (SELECT id FROM items WHERE received_ms >= ?1 ORDER BY id LIMIT 1),
         (SELECT max(id) + 1 FROM items), 0)";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::schema;

    fn new(conversation: &str, thread: Option<&str>) -> NewItem {
        NewItem {
            conversation: conversation.into(),
            thread: thread.map(Into::into),
            message_id: Some("m".into()),
            sender: Some("alice".into()),
        }
    }

    #[test]
    fn context_is_bounded_to_its_conversation_and_thread_newest_first() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        let mut ids = Vec::new();
        for n in 0..6 {
            ids.push(add(&txn, "a.b", &format!("e{n}"), &new("c1", None), n).unwrap());
        }
        add(&txn, "a.b", "other", &new("c2", None), 7).unwrap();
        add(&txn, "a.b", "threaded", &new("c1", Some("t")), 8).unwrap();
        let target = ids[5];
        let before = context(&txn, "a.b", "c1", None, target, 3).unwrap();
        let events: Vec<_> = before.iter().map(|v| v.item.event_id.as_str()).collect();
        assert_eq!(events, ["e4", "e3", "e2"]);
        let threaded = context(&txn, "a.b", "c1", Some("t"), i64::MAX, 10).unwrap();
        assert_eq!(threaded.len(), 1);
        assert_eq!(threaded[0].item.event_id, "threaded");
    }

    #[test]
    fn handled_and_reply_keep_their_first_value_and_filter_the_inbox() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        add(&txn, "a.b", "e1", &new("c1", None), 1).unwrap();
        add(&txn, "a.b", "e2", &new("c1", None), 2).unwrap();
        assert!(set_reply(&txn, "a.b", "e1", 7, 3).unwrap());
        assert!(!set_reply(&txn, "a.b", "e1", 8, 4).unwrap());
        assert!(mark_handled(&txn, "a.b", "e1", "respond", 5).unwrap());
        assert!(mark_handled(&txn, "a.b", "e1", "complete", 6).unwrap());
        assert!(!mark_handled(&txn, "a.b", "absent", "complete", 6).unwrap());
        let e1 = get(&txn, "a.b", "e1").unwrap().unwrap().item;
        assert_eq!(
            (e1.outbox_id, e1.handled_ms, e1.handled_by.as_deref()),
            (Some(7), Some(5), Some("respond"))
        );
        let unhandled = list(&txn, Some("a.b"), true, None, 10).unwrap();
        assert_eq!(unhandled.iter().map(|i| i.event_id.as_str()).collect::<Vec<_>>(), ["e2"]);
        assert_eq!(list(&txn, None, false, None, 10).unwrap().len(), 2);
        assert_eq!(list(&txn, None, false, Some(e1.id + 1), 10).unwrap().len(), 1);
    }

    #[test]
    fn the_listing_reads_the_items_by_id_without_sorting() {
        let conn = schema::open_in_memory().unwrap();
        // Planned as the ledger prepares it: before any value is bound.
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {}", list_sql())).unwrap();
        let mut rows = stmt.raw_query();
        let mut steps = Vec::new();
        while let Some(row) = rows.next().unwrap() {
            steps.push(row.get::<_, String>(3).unwrap());
        }
        let plan = steps.join("\n");
        assert!(plan.starts_with("SCAN items"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }

    #[test]
    fn pruning_walks_the_oldest_items_by_id() {
        let conn = schema::open_in_memory().unwrap();
        let plan = crate::ledger::inbound::tests::plan(&conn, &PRUNE.replace("?1", "1000"));
        assert!(plan.starts_with("SEARCH items USING INTEGER PRIMARY KEY (rowid<?)"), "{plan}");
        assert!(!plan.contains("INDEX"), "{plan}");
    }

    #[test]
    fn pruning_drops_the_items_untouched_since_the_cutoff_and_keeps_the_rest() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        assert_eq!(prune(&txn, 100).unwrap(), 0, "no items");
        add(&txn, "a.b", "old", &new("c1", None), 10).unwrap();
        add(&txn, "a.b", "old-touched", &new("c1", None), 11).unwrap();
        add(&txn, "a.b", "old-too", &new("c2", None), 12).unwrap();
        add(&txn, "a.b", "new", &new("c1", None), 30).unwrap();
        assert!(mark_handled(&txn, "a.b", "old-touched", "respond", 40).unwrap());
        assert_eq!(prune(&txn, 5).unwrap(), 0, "nothing that old");
        assert_eq!(prune(&txn, 20).unwrap(), 2);
        let left: Vec<_> =
            list(&txn, None, false, None, 10).unwrap().into_iter().map(|i| i.event_id).collect();
        assert_eq!(left, ["new", "old-touched"], "touched since the cutoff: kept");
        assert_eq!(prune(&txn, 50).unwrap(), 2, "everything older");
        assert!(list(&txn, None, false, None, 10).unwrap().is_empty());
    }
}
