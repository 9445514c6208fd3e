//! The agent's inbox in the ledger: one item per admitted inbound (its structural ids, no
//! text), whether `respond` sent its reply (the outbox record) and whether it was handled
//! (`respond` or `complete`), and the bounded context `read` shows. The texts are read from
//! the inbound entries, the hub's replies and the outbox, so nothing is stored twice.
//! Synchronous functions over one transaction.
//!
//! Items are written behind the inbound they describe, as history entries are
//! (`history.rs`): the inbound's record takes the item's id ([`next_id`]) and stores it in
//! its own row (`inbound.item_id`), and the item waits on the ledger thread ([`hold`]); the
//! thread writes what it holds once [`WRITE_AT`] items wait, when the ledger is quiet, before
//! any read, change or prune of items, and when it stops, each conversation's items
//! together (its index leaf written once for many items). A write records in `meta` the
//! highest id written and the next inbound id; after a crash the items that waited are
//! rebuilt from the inbound rows past that id that carry a higher item id, from their
//! stored frames ([`rebuild`]).

use std::cell::RefCell;

use channeld_protocol::Frame;
use channeld_protocol::ids::Id;
use channeld_protocol::types::{MessageTarget, Participant};
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::LedgerError;
use super::store::{self, Cached, HeldMark, HeldRows};

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

/// How many held items make a write.
pub const WRITE_AT: usize = 1024;

/// One item waiting to be written.
#[derive(Debug, Clone)]
struct HeldItem {
    id: i64,
    instance: String,
    event_id: String,
    new: NewItem,
    received_ms: u64,
}

/// The items the ledger thread holds, in id order.
#[derive(Debug, Default)]
struct Held {
    items: HeldRows<HeldItem>,
    /// The id the next item takes; read from the ledger on first use.
    next_id: Option<i64>,
}

thread_local! {
    /// The ledger thread's items (only that thread runs the ledger's calls; a test that
    /// calls the functions directly has its own).
    static HELD: RefCell<Held> = RefCell::new(Held::default());
}

impl NewItem {
    /// The item of an admitted inbound: where it came from, the message it answers (none
    /// for an event) and who sent it.
    pub fn new(
        origin: &MessageTarget,
        message_id: Option<&Id>,
        sender: Option<&Participant>,
    ) -> Self {
        NewItem {
            conversation: origin.conversation.to_string(),
            thread: origin.thread.as_ref().map(ToString::to_string),
            message_id: message_id.map(ToString::to_string),
            sender: sender.map(|p| p.id.to_string()),
        }
    }

    /// The item of a recorded inbound frame (an `inbound` message or an `inbound_event`),
    /// as the hub made it when it admitted the frame; `None` for any other frame.
    pub fn of_frame(frame: &Frame) -> Option<NewItem> {
        match frame {
            Frame::Inbound(inbound) => {
                let message = &inbound.message;
                Some(Self::new(&message.target, Some(&message.id), Some(&message.sender)))
            }
            Frame::InboundEvent(inbound) => {
                let context = inbound.event.context();
                Some(Self::new(&context.target, None, context.participant.as_ref()))
            }
            _ => None,
        }
    }
}

/// The id the next recorded inbound's item takes; [`hold`] takes it.
pub fn next_id(txn: &Connection) -> Result<i64, LedgerError> {
    if let Some(id) = HELD.with(|held| held.borrow().next_id) {
        return Ok(id);
    }
    // Every item id is written before `meta.items_written` names it (the migration named
    // the items written before it).
    let id = last_write(txn)?.0 + 1;
    HELD.with(|held| held.borrow_mut().next_id = Some(id));
    Ok(id)
}

/// Holds the item `id` (from [`next_id`]) of a newly recorded inbound for the next write;
/// the inbound's row records the id in the same transaction.
pub fn hold(id: i64, instance: &str, event_id: &str, new: NewItem, received_ms: u64) {
    let item = HeldItem {
        id,
        instance: instance.to_owned(),
        event_id: event_id.to_owned(),
        new,
        received_ms,
    };
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        held.items.push(item);
        held.next_id = Some(id + 1);
    })
}

/// The state [`undo`] returns to.
pub fn mark() -> HeldMark {
    HELD.with(|held| {
        let held = held.borrow();
        held.items.mark(held.next_id.unwrap_or(0))
    })
}

/// Forgets what was held and written since `mark` (its transaction, or its savepoint, did
/// not commit): the ids it took are free again.
pub fn undo(mark: HeldMark) {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        let next_id = held.items.undo(mark);
        held.next_id = (next_id > 0).then_some(next_id);
    })
}

/// The open transaction committed: what it wrote is no longer held.
pub fn committed() {
    HELD.with(|held| held.borrow_mut().items.committed())
}

/// What a crash does to the items the ledger thread holds (tests).
#[cfg(test)]
pub fn forget_held() {
    HELD.with(|held| *held.borrow_mut() = Held::default());
}

/// Whether items wait that no transaction wrote yet.
pub fn holding() -> bool {
    HELD.with(|held| !held.borrow().items.waiting().is_empty())
}

/// Writes what is held into `items` when [`WRITE_AT`] items wait, or whatever waits with
/// `all`; whether it wrote any. A failed write leaves the items held and part
/// of the write in the transaction, which the caller rolls back (`store::write_held_rows`).
pub fn write(txn: &Connection, all: bool) -> Result<bool, LedgerError> {
    let waiting = HELD.with(|held| held.borrow().items.waiting().len());
    store::write_held_rows(txn, (waiting, WRITE_AT, all), write_held, mark, undo)
}

/// Every item the ledger thread holds written (before a read, a change or a prune).
pub fn write_all(txn: &Connection) -> Result<(), LedgerError> {
    write(txn, true).map(drop)
}

/// Writes the held items not yet written, each conversation's together, and records the
/// highest id written and the next inbound id (`meta.items_written`).
fn write_held(txn: &Connection) -> Result<(), LedgerError> {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        let mut waiting: Vec<&HeldItem> = held.items.waiting().iter().collect();
        let highest = waiting.iter().map(|item| item.id).max().unwrap_or(0);
        waiting.sort_by(|a, b| {
            (a.instance.as_str(), a.new.conversation.as_str(), a.new.thread.as_deref(), a.id).cmp(
                &(b.instance.as_str(), b.new.conversation.as_str(), b.new.thread.as_deref(), b.id),
            )
        });
        for item in waiting {
            insert(txn, item)?;
        }
        let (written, _) = last_write(txn)?;
        let next_inbound: i64 =
            txn.query_row_cached("SELECT coalesce(max(id), 0) + 1 FROM inbound", [], |row| {
                row.get(0)
            })?;
        txn.exec_cached(
            "INSERT INTO meta (key, value) VALUES ('items_written', ?1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [format!("{} {next_inbound}", written.max(highest))],
        )?;
        held.items.all_written();
        Ok(())
    })
}

fn insert(txn: &Connection, item: &HeldItem) -> Result<(), LedgerError> {
    txn.exec_cached(
        "INSERT INTO items (id, instance, event_id, conversation, thread, message_id, sender,
             received_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8)",
        params![
            item.id,
            item.instance,
            item.event_id,
            item.new.conversation,
            item.new.thread,
            item.new.message_id,
            item.new.sender,
            item.received_ms as i64
        ],
    )?;
    Ok(())
}

/// The highest item id the last write wrote and the next inbound id then
/// (`meta.items_written`).
fn last_write(txn: &Connection) -> Result<(i64, i64), LedgerError> {
    let value: Option<String> = txn
        .query_row_cached("SELECT value FROM meta WHERE key = 'items_written'", [], |row| {
            row.get(0)
        })
        .optional()?;
    value
        .as_deref()
        .and_then(|value| value.split_once(' '))
        .and_then(|(w, f)| Some((w.parse::<i64>().ok()?, f.parse::<i64>().ok()?)))
        .ok_or_else(|| LedgerError::Sql(format!("meta items_written is {value:?}")))
}

/// Rebuilds the items a crash left held (the ledger thread's first step): the inbound rows
/// recorded since the last write (their ids at or past its next inbound id) whose item id
/// is past the highest it wrote, from their stored frames, and writes them.
pub fn rebuild(txn: &Connection) -> Result<(), LedgerError> {
    HELD.with(|held| *held.borrow_mut() = Held::default());
    let (written, next_inbound) = last_write(txn)?;
    let mut stmt = txn.prepare(
        "SELECT item_id, instance, event_id, frame, received_ms FROM inbound
         WHERE id >= ?1 AND item_id > ?2 ORDER BY id",
    )?;
    let mut rows = stmt.query(params![next_inbound, written])?;
    let mut highest = 0;
    while let Some(row) = rows.next()? {
        let (id, instance, event_id): (i64, String, String) =
            (row.get(0)?, row.get(1)?, row.get(2)?);
        highest = highest.max(id);
        let frame: Vec<u8> = row.get(3)?;
        let received_ms = row.get::<_, i64>(4)? as u64;
        let decoded = channeld_protocol::decode(&frame).ok();
        if let Some(new) = decoded.as_ref().and_then(NewItem::of_frame) {
            hold(id, &instance, &event_id, new, received_ms);
        }
    }
    // An id a row took is never taken again, even if its frame gave no item.
    if highest > 0 {
        HELD.with(|held| held.borrow_mut().next_id = Some(highest + 1));
    }
    drop(rows);
    write_all(txn)
}

/// The item of `event_id` with what `read` shows of it.
pub fn get(
    txn: &Connection,
    instance: &str,
    event_id: &str,
) -> Result<Option<ItemView>, LedgerError> {
    write_all(txn)?;
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
    txn: &Connection,
    instance: &str,
    conversation: &str,
    thread: Option<&str>,
    before: i64,
    limit: usize,
) -> Result<Vec<ItemView>, LedgerError> {
    write_all(txn)?;
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
    txn: &Connection,
    instance: Option<&str>,
    unhandled: bool,
    before: Option<i64>,
    limit: usize,
) -> Result<Vec<Item>, LedgerError> {
    write_all(txn)?;
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
    txn: &Connection,
    instance: &str,
    event_id: &str,
    outbox_id: i64,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    write_all(txn)?;
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
    txn: &Connection,
    instance: &str,
    event_id: &str,
    by: &str,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    write_all(txn)?;
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
pub fn prune(txn: &Connection, before_ms: u64) -> Result<usize, LedgerError> {
    write_all(txn)?;
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

    /// Holds an item as a recorded inbound does; returns its id.
    fn add(txn: &Connection, instance: &str, event_id: &str, new: &NewItem, now: u64) -> i64 {
        let id = next_id(txn).unwrap();
        hold(id, instance, event_id, new.clone(), now);
        id
    }

    /// Records an inbound message `event_id` in `conversation` (with its item) as the hub
    /// does; returns the item's id.
    fn recorded(txn: &Connection, event_id: &str, conversation: &str, now: u64) -> i64 {
        let (_, bytes) = crate::ledger::inbound::test_message(event_id, conversation, Some("t"));
        let frame = channeld_protocol::decode(&bytes).unwrap();
        let new = crate::ledger::NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame: bytes,
            run_id: format!("run-{event_id}"),
            now_ms: now,
            started: true,
            item: NewItem::of_frame(&frame),
        };
        match crate::ledger::inbound::record(txn, &new, |_| None, None).unwrap() {
            crate::ledger::Recorded::New { entry: Some(id) } => id,
            other => panic!("{other:?}"),
        }
    }

    fn written(txn: &Connection) -> Vec<(i64, String)> {
        let mut stmt = txn.prepare("SELECT id, event_id FROM items ORDER BY id").unwrap();
        let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?))).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    }

    /// The items the ledger thread held when the hub crashed come back from their inbound
    /// rows with the ids the hub already handed out, and no id is taken twice.
    #[test]
    fn held_items_lost_in_a_crash_are_rebuilt_with_their_ids() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        forget_held();
        let first = recorded(&txn, "e1", "c1", 1);
        write_all(&txn).unwrap();
        committed();
        let second = recorded(&txn, "e2", "c2", 2);
        let third = recorded(&txn, "e3", "c1", 3);
        assert_eq!((second, third), (first + 1, first + 2));
        assert_eq!(written(&txn), [(first, "e1".to_owned())], "written behind");
        // A redelivery of a recorded event takes no id.
        let again = crate::ledger::NewInbound {
            instance: "a.b".into(),
            event_id: "e3".into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame: Vec::new(),
            run_id: "run-again".into(),
            now_ms: 4,
            started: true,
            item: Some(new("c1", None)),
        };
        let replay = crate::ledger::inbound::record(&txn, &again, |_| None, None).unwrap();
        assert!(!matches!(replay, crate::ledger::Recorded::New { .. }), "{replay:?}");

        forget_held(); // the crash: the rows committed, the held items lost
        rebuild(&txn).unwrap();
        committed();
        assert!(!holding());
        let ids = [(first, "e1"), (second, "e2"), (third, "e3")];
        assert_eq!(written(&txn), ids.map(|(id, e)| (id, e.to_owned())));
        let item = get(&txn, "a.b", "e3").unwrap().unwrap().item;
        assert_eq!(
            (item.conversation.as_str(), item.thread.as_deref(), item.received_ms),
            ("c1", Some("t"), 3)
        );
        assert_eq!(
            (item.message_id.as_deref(), item.sender.as_deref()),
            (Some("m-e3"), Some("alice"))
        );
        // A second restart finds nothing left to rebuild, and the next id is past them all.
        forget_held();
        rebuild(&txn).unwrap();
        committed();
        assert_eq!(written(&txn).len(), 3);
        assert_eq!(recorded(&txn, "e4", "c3", 5), third + 1);
    }

    #[test]
    fn an_undone_call_frees_its_ids_and_holds_nothing() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        forget_held();
        let first = recorded(&txn, "e1", "c1", 1);
        let before = mark();
        recorded(&txn, "e2", "c1", 2);
        undo(before);
        assert_eq!(recorded(&txn, "e3", "c1", 3), first + 1, "e2's id is free again");
        assert_eq!(list(&txn, None, false, None, 10).unwrap().len(), 2, "read writes what waits");
        committed();
        assert!(!holding());
    }

    #[test]
    fn a_batch_writes_once_enough_items_wait() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        forget_held();
        for n in 0..WRITE_AT - 1 {
            add(&txn, "a.b", &format!("e{n}"), &new(&format!("c{}", n % 7), None), n as u64);
        }
        assert!(!write(&txn, false).unwrap(), "not yet");
        add(&txn, "a.b", "last", &new("c0", None), 0);
        assert!(write(&txn, false).unwrap());
        committed();
        assert!(!holding());
        assert_eq!(written(&txn).len(), WRITE_AT);
    }

    #[test]
    fn context_is_bounded_to_its_conversation_and_thread_newest_first() {
        let mut conn = schema::open_in_memory().unwrap();
        let txn = conn.transaction().unwrap();
        let mut ids = Vec::new();
        for n in 0..6 {
            ids.push(add(&txn, "a.b", &format!("e{n}"), &new("c1", None), n));
        }
        add(&txn, "a.b", "other", &new("c2", None), 7);
        add(&txn, "a.b", "threaded", &new("c1", Some("t")), 8);
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
        add(&txn, "a.b", "e1", &new("c1", None), 1);
        add(&txn, "a.b", "e2", &new("c1", None), 2);
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
        add(&txn, "a.b", "old", &new("c1", None), 10);
        add(&txn, "a.b", "old-touched", &new("c1", None), 11);
        add(&txn, "a.b", "old-too", &new("c2", None), 12);
        add(&txn, "a.b", "new", &new("c1", None), 30);
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
