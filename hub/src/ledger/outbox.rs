//! The outbox in the ledger: proactive sends recorded before they are acknowledged,
//! idempotent by key, claimed for dispatch in order, settled, expired and retried on request.
//! Synchronous functions over one transaction.

use std::sync::atomic::{AtomicI64, Ordering};

use rusqlite::{Connection, OptionalExtension, params};

use super::LedgerError;
use super::state::{self, OUTBOX_STATES, OutboxState};
use super::store::Cached;

/// A proactive send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    pub id: i64,
    pub instance: String,
    pub idempotency_key: Option<String>,
    /// The `OutboundMessage` as JSON.
    pub message: Vec<u8>,
    pub state: OutboxState,
    /// The `DeliveryReceipt` as JSON, once receipted.
    pub receipt: Option<Vec<u8>>,
    pub error: Option<String>,
    pub attempts: u32,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub expires_ms: u64,
}

/// A send to add to the outbox.
#[derive(Debug, Clone)]
pub struct NewSend {
    pub instance: String,
    pub idempotency_key: Option<String>,
    pub message: Vec<u8>,
    /// `Sent` when the driver is live and the frame goes out at once, else `Queued`.
    pub state: OutboxState,
    pub now_ms: u64,
    pub expires_ms: u64,
}

/// Outbox record ids, given out by the hub rather than by SQLite: a held send
/// (`journal.rs`) has its id before its row is written, so every row takes one from here.
#[derive(Debug)]
pub struct OutboxIds(AtomicI64);

impl OutboxIds {
    pub const fn new(next: i64) -> Self {
        Self(AtomicI64::new(next))
    }

    /// The largest id in `txn`'s outbox plus one, or 1.
    pub fn after_table(txn: &Connection) -> Result<Self, LedgerError> {
        let next: i64 =
            txn.query_row("SELECT COALESCE(MAX(id), 0) + 1 FROM outbox", [], |row| row.get(0))?;
        Ok(Self::new(next))
    }

    pub fn next(&self) -> i64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// The answer to [`add`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Added {
    New(i64),
    /// The idempotency key was used before: this is that record, nothing new was added.
    Existing(OutboxRecord),
}

/// Queued sends claimed for dispatch, and those that expired instead.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Now `sent`, oldest first.
    pub records: Vec<OutboxRecord>,
    /// Ids of records that were past their expiry: now `failed`.
    pub expired: Vec<i64>,
}

/// The error a queued send records when it expires.
pub const EXPIRED: &str = "expired while queued";

const COLUMNS: &str = "id, instance, idempotency_key, message, state, receipt, error, attempts, created_ms, updated_ms, expires_ms";

/// Adds a send, or returns the record that already holds its idempotency key.
pub fn add(txn: &Connection, ids: &OutboxIds, send: &NewSend) -> Result<Added, LedgerError> {
    if let Some(key) = &send.idempotency_key {
        let existing = txn
            .query_row_cached(
                &format!(
                    "SELECT {COLUMNS} FROM outbox WHERE instance = ?1 AND idempotency_key = ?2"
                ),
                params![send.instance, key],
                row,
            )
            .optional()?;
        if let Some(record) = existing {
            return Ok(Added::Existing(record));
        }
    }
    let id = ids.next();
    insert(txn, id, send)?;
    Ok(Added::New(id))
}

/// Writes record `id` (a new send, or a held one: `journal.rs`).
pub fn insert(txn: &Connection, id: i64, send: &NewSend) -> Result<(), LedgerError> {
    let attempts = u32::from(send.state == OutboxState::Sent);
    txn.exec_cached(
        "INSERT INTO outbox (id, instance, idempotency_key, message, state, attempts,
             created_ms, updated_ms, expires_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8)",
        params![
            id,
            send.instance,
            send.idempotency_key,
            send.message,
            send.state.as_str(),
            attempts,
            send.now_ms as i64,
            send.expires_ms as i64
        ],
    )?;
    Ok(())
}

/// Moves record `id` to `next` (with a receipt or an error) if the state machine allows it
/// from where it stands; false when it does not (or the record is gone).
pub fn transition(
    txn: &Connection,
    id: i64,
    next: OutboxState,
    receipt: Option<&[u8]>,
    error: Option<&str>,
    now_ms: u64,
) -> Result<bool, LedgerError> {
    let Some([a, b, c]) = OutboxState::sources(next) else { return Ok(false) };
    let updated = txn.exec_cached(
        TRANSITION,
        params![id, next.as_str(), receipt, error, now_ms as i64, a, b, c],
    )?;
    Ok(updated == 1)
}

/// [`transition`]'s guarded update: the record moves only from a state that may become the
/// next.
const TRANSITION: &str = "UPDATE outbox SET state = ?2, receipt = COALESCE(?3, receipt),
         error = ?4, updated_ms = ?5
     WHERE id = ?1 AND (state = ?6 OR state = ?7 OR state = ?8)";

/// Claims the queued sends of `instance` for dispatch, oldest first: each becomes `sent`.
/// Those past their expiry fail instead and are not returned.
pub fn claim_queued(
    txn: &Connection,
    instance: &str,
    now_ms: u64,
    limit: usize,
) -> Result<Claimed, LedgerError> {
    let expired = expire_where(txn, Some(instance), now_ms)?;
    let records: Vec<OutboxRecord> = {
        let mut stmt = txn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM outbox WHERE instance = ?1 AND state = ?2 ORDER BY id LIMIT ?3"
        ))?;
        let rows =
            stmt.query_map(params![instance, OutboxState::Queued.as_str(), limit as i64], row)?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let mut claimed = Vec::with_capacity(records.len());
    for record in records {
        let next = OutboxState::Sent;
        if !record.state.may_become(next) {
            continue;
        }
        txn.exec_cached(
            "UPDATE outbox SET state = ?2, attempts = attempts + 1, updated_ms = ?3 WHERE id = ?1",
            params![record.id, next.as_str(), now_ms as i64],
        )?;
        claimed.push(OutboxRecord {
            state: next,
            attempts: record.attempts + 1,
            updated_ms: now_ms,
            ..record
        });
    }
    Ok(Claimed { records: claimed, expired })
}

/// Fails queued sends past their expiry, for every instance; returns their ids.
pub fn expire(txn: &Connection, now_ms: u64) -> Result<Vec<i64>, LedgerError> {
    expire_where(txn, None, now_ms)
}

fn expire_where(
    txn: &Connection,
    instance: Option<&str>,
    now_ms: u64,
) -> Result<Vec<i64>, LedgerError> {
    let due: Vec<(i64, String)> = {
        let mut stmt = txn.prepare_cached(
            "SELECT id, state FROM outbox
             WHERE state = ?1 AND expires_ms <= ?2 AND (?3 IS NULL OR instance = ?3)",
        )?;
        let rows = stmt
            .query_map(params![OutboxState::Queued.as_str(), now_ms as i64, instance], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let mut expired = Vec::with_capacity(due.len());
    for (id, current) in due {
        let current = parse_state(&current)?;
        let next = current.after_expiry();
        if next != current && transition(txn, id, next, None, Some(EXPIRED), now_ms)? {
            expired.push(id);
        }
    }
    Ok(expired)
}

/// After a restart nothing is in flight: what was handed to a driver becomes `unknown`.
/// Returns how many records changed.
pub fn restart(txn: &Connection, now_ms: u64) -> Result<usize, LedgerError> {
    let in_flight: Vec<i64> = {
        let mut stmt = txn.prepare("SELECT id FROM outbox WHERE state = ?1")?;
        let rows = stmt.query_map(params![OutboxState::Sent.as_str()], |row| row.get(0))?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let next = OutboxState::Sent.after_restart();
    let mut changed = 0;
    for id in in_flight {
        if transition(txn, id, next, None, Some("hub restarted before the receipt"), now_ms)? {
            changed += 1;
        }
    }
    Ok(changed)
}

pub fn get(txn: &Connection, id: i64) -> Result<Option<OutboxRecord>, LedgerError> {
    Ok(txn
        .query_row_cached(&format!("SELECT {COLUMNS} FROM outbox WHERE id = ?1"), params![id], row)
        .optional()?)
}

/// One record as a listing shows it: the message's text and the error cut to previews, so
/// a page of records stays small however large the messages are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxSummary {
    pub id: i64,
    pub instance: String,
    pub idempotency_key: Option<String>,
    pub state: OutboxState,
    pub conversation: String,
    /// The first [`PREVIEW_CHARS`] characters of the text.
    pub text_preview: String,
    /// The whole text's length in bytes.
    pub text_bytes: usize,
    pub receipt: Option<Vec<u8>>,
    /// The first [`PREVIEW_CHARS`] characters of the error.
    pub error_preview: Option<String>,
    pub attempts: u32,
    pub created_ms: u64,
    pub updated_ms: u64,
}

/// How many characters of a record's text and error a listing shows.
pub const PREVIEW_CHARS: usize = 100;

/// How many records each instance has in each state (the metrics' outbox depth).
pub fn counts(txn: &Connection) -> Result<Vec<(String, OutboxState, u64)>, LedgerError> {
    let mut stmt = txn.prepare_cached(
        "SELECT instance, state, count(*) FROM outbox GROUP BY state, instance ORDER BY instance",
    )?;
    let rows = stmt.query_map([], |row| {
        Ok((row.get::<_, String>(0)?, state_column(row, 1)?, row.get::<_, i64>(2)? as u64))
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Lists records newest first: at most `limit`, only ids below `before` when given. The
/// previews are cut in SQL (the stored message is an `OutboundMessage` as JSON), so no whole
/// message is read into memory.
pub fn list(
    txn: &Connection,
    instance: Option<&str>,
    state: Option<OutboxState>,
    before: Option<i64>,
    limit: usize,
) -> Result<Vec<OutboxSummary>, LedgerError> {
    let mut stmt = txn.prepare_cached(
        "SELECT id, instance, idempotency_key, state,
             COALESCE(json_extract(json, '$.target.conversation'), ''),
             COALESCE(substr(json_extract(json, '$.body.text'), 1, ?5), ''),
             COALESCE(length(CAST(json_extract(json, '$.body.text') AS BLOB)), 0),
             receipt, substr(error, 1, ?5), attempts, created_ms, updated_ms
         FROM (SELECT *, CASE WHEN json_valid(message) THEN message END AS json FROM outbox)
         WHERE (?1 IS NULL OR instance = ?1) AND (?2 IS NULL OR state = ?2)
             AND (?3 IS NULL OR id < ?3)
         ORDER BY id DESC LIMIT ?4",
    )?;
    let rows = stmt.query_map(
        params![
            instance,
            state.map(OutboxState::as_str),
            before,
            limit as i64,
            PREVIEW_CHARS as i64
        ],
        |row| {
            Ok(OutboxSummary {
                id: row.get(0)?,
                instance: row.get(1)?,
                idempotency_key: row.get(2)?,
                state: state_column(row, 3)?,
                conversation: row.get(4)?,
                text_preview: row.get(5)?,
                text_bytes: row.get::<_, i64>(6)? as usize,
                receipt: row.get(7)?,
                error_preview: row.get(8)?,
                attempts: row.get(9)?,
                created_ms: row.get::<_, i64>(10)? as u64,
                updated_ms: row.get::<_, i64>(11)? as u64,
            })
        },
    )?;
    Ok(rows.collect::<Result<Vec<_>, _>>()?)
}

/// An operator's explicit retry: an `unknown` or `failed` record goes back to `queued`.
pub fn requeue(
    txn: &Connection,
    id: i64,
    now_ms: u64,
    expires_ms: u64,
) -> Result<OutboxRecord, LedgerError> {
    let record = get(txn, id)?.ok_or(LedgerError::NoSuchRecord(id))?;
    let next = OutboxState::Queued;
    if !record.state.may_become(next) {
        return Err(LedgerError::NotRetryable { id, state: record.state });
    }
    txn.exec_cached(
        "UPDATE outbox SET state = ?2, error = NULL, updated_ms = ?3, expires_ms = ?4 WHERE id = ?1",
        params![id, next.as_str(), now_ms as i64, expires_ms as i64],
    )?;
    Ok(OutboxRecord { state: next, error: None, updated_ms: now_ms, expires_ms, ..record })
}

/// Deletes final records last touched before `before_ms`; returns how many went.
pub fn prune(txn: &Connection, before_ms: u64) -> Result<usize, LedgerError> {
    let finals = state::sql_list(&OUTBOX_STATES, OutboxState::is_final, OutboxState::as_str);
    Ok(txn.execute(
        &format!("DELETE FROM outbox WHERE state IN ({finals}) AND updated_ms < ?1"),
        params![before_ms as i64],
    )?)
}

fn parse_state(value: &str) -> Result<OutboxState, LedgerError> {
    OutboxState::parse(value)
        .ok_or_else(|| LedgerError::Sql(format!("unknown outbox state {value:?}")))
}

fn state_column(row: &rusqlite::Row<'_>, index: usize) -> rusqlite::Result<OutboxState> {
    let state: String = row.get(index)?;
    OutboxState::parse(&state).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            index,
            rusqlite::types::Type::Text,
            format!("unknown outbox state {state:?}").into(),
        )
    })
}

fn row(row: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxRecord> {
    let state = state_column(row, 4)?;
    Ok(OutboxRecord {
        id: row.get(0)?,
        instance: row.get(1)?,
        idempotency_key: row.get(2)?,
        message: row.get(3)?,
        state,
        receipt: row.get(5)?,
        error: row.get(6)?,
        attempts: row.get(7)?,
        created_ms: row.get::<_, i64>(8)? as u64,
        updated_ms: row.get::<_, i64>(9)? as u64,
        expires_ms: row.get::<_, i64>(10)? as u64,
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::ledger::schema;

    static IDS: OutboxIds = OutboxIds::new(1);

    fn db() -> Connection {
        schema::open_in_memory().unwrap()
    }

    #[test]
    fn a_transition_is_one_guarded_update_by_id() {
        let conn = db();
        let plan = crate::ledger::inbound::tests::plan(&conn, &schema::tests::unbound(TRANSITION));
        assert!(plan.contains("USING INTEGER PRIMARY KEY"), "{plan}");
        assert_eq!(schema::tests::ephemeral_tables(&conn, TRANSITION), 0);
    }

    fn send(key: Option<&str>, state: OutboxState, message: &str, expires_ms: u64) -> NewSend {
        NewSend {
            instance: "a.b".into(),
            idempotency_key: key.map(str::to_owned),
            message: message.as_bytes().to_vec(),
            state,
            now_ms: 1,
            expires_ms,
        }
    }

    #[test]
    fn idempotency_keys_return_the_existing_record() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let Added::New(id) =
            add(&txn, &IDS, &send(Some("k1"), OutboxState::Sent, "{}", 100)).unwrap()
        else {
            panic!("new")
        };
        assert!(transition(&txn, id, OutboxState::Receipted, Some(b"{\"r\":1}"), None, 2).unwrap());
        match add(&txn, &IDS, &send(Some("k1"), OutboxState::Sent, "{}", 100)).unwrap() {
            Added::Existing(record) => {
                assert_eq!(record.id, id);
                assert_eq!(record.state, OutboxState::Receipted);
                assert_eq!(record.receipt.as_deref(), Some(b"{\"r\":1}".as_slice()));
            }
            other => panic!("expected the existing record, got {other:?}"),
        }
        assert!(matches!(
            add(&txn, &IDS, &send(Some("k2"), OutboxState::Sent, "{}", 100)).unwrap(),
            Added::New(_)
        ));
        assert!(matches!(requeue(&txn, id, 3, 100), Err(LedgerError::NotRetryable { .. })));
        assert!(matches!(requeue(&txn, 999, 3, 100), Err(LedgerError::NoSuchRecord(999))));
    }

    #[test]
    fn counts_group_records_by_instance_and_state() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        add(&txn, &IDS, &send(None, OutboxState::Queued, "{}", 100)).unwrap();
        add(&txn, &IDS, &send(None, OutboxState::Queued, "{}", 100)).unwrap();
        let Added::New(id) = add(&txn, &IDS, &send(None, OutboxState::Sent, "{}", 100)).unwrap()
        else {
            panic!("new")
        };
        assert!(transition(&txn, id, OutboxState::Unknown, None, Some("no receipt"), 2).unwrap());
        let mut counts = counts(&txn).unwrap();
        counts.sort_by_key(|(_, state, _)| state.as_str());
        assert_eq!(
            counts,
            [
                ("a.b".to_owned(), OutboxState::Queued, 2),
                ("a.b".to_owned(), OutboxState::Unknown, 1)
            ]
        );
    }

    #[test]
    fn a_settled_send_never_moves_again() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let Added::New(id) = add(&txn, &IDS, &send(None, OutboxState::Sent, "{}", 100)).unwrap()
        else {
            panic!("new")
        };
        assert!(transition(&txn, id, OutboxState::Unknown, None, Some("no receipt"), 2).unwrap());
        // A receipt that arrives after the record went unknown does not rewrite history.
        assert!(!transition(&txn, id, OutboxState::Receipted, Some(b"{}"), None, 3).unwrap());
        assert_eq!(get(&txn, id).unwrap().unwrap().state, OutboxState::Unknown);
        // Only an operator's retry moves it on.
        assert_eq!(requeue(&txn, id, 4, 100).unwrap().state, OutboxState::Queued);
    }

    #[test]
    fn queued_sends_are_claimed_in_order_and_expire() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let mut ids = Vec::new();
        for (n, expires) in [(1, 100), (2, 5), (3, 100)] {
            match add(&txn, &IDS, &send(None, OutboxState::Queued, &n.to_string(), expires))
                .unwrap()
            {
                Added::New(id) => ids.push(id),
                other => panic!("{other:?}"),
            }
        }
        let claimed = claim_queued(&txn, "a.b", 10, 100).unwrap();
        let messages: Vec<&[u8]> = claimed.records.iter().map(|r| r.message.as_slice()).collect();
        assert_eq!(messages, vec![b"1".as_slice(), b"3".as_slice()]);
        assert!(claimed.records.iter().all(|r| r.state == OutboxState::Sent && r.attempts == 1));
        assert_eq!(claimed.expired, vec![ids[1]]);
        let failed = list(&txn, None, Some(OutboxState::Failed), None, 10).unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].error_preview.as_deref(), Some(EXPIRED));
        assert_eq!(restart(&txn, 11).unwrap(), 2);
        assert_eq!(list(&txn, None, Some(OutboxState::Unknown), None, 10).unwrap().len(), 2);
    }

    #[test]
    fn expiry_fails_only_queued_sends_past_their_time_and_names_them() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let Added::New(due) = add(&txn, &IDS, &send(None, OutboxState::Queued, "a", 5)).unwrap()
        else {
            panic!()
        };
        add(&txn, &IDS, &send(None, OutboxState::Queued, "b", 50)).unwrap();
        add(&txn, &IDS, &send(None, OutboxState::Sent, "c", 5)).unwrap();
        assert_eq!(expire(&txn, 10).unwrap(), vec![due]);
        assert!(expire(&txn, 10).unwrap().is_empty(), "expired once");
        assert_eq!(list(&txn, None, Some(OutboxState::Queued), None, 10).unwrap().len(), 1);
        assert_eq!(list(&txn, None, Some(OutboxState::Sent), None, 10).unwrap().len(), 1);
    }

    #[test]
    fn pruning_removes_only_final_records_past_the_window() {
        let mut db = db();
        let txn = db.transaction().unwrap();
        let Added::New(done) = add(&txn, &IDS, &send(None, OutboxState::Sent, "a", 500)).unwrap()
        else {
            panic!()
        };
        transition(&txn, done, OutboxState::Receipted, Some(b"{}"), None, 10).unwrap();
        add(&txn, &IDS, &send(None, OutboxState::Queued, "b", 500)).unwrap();
        assert_eq!(prune(&txn, 100).unwrap(), 1);
        assert!(get(&txn, done).unwrap().is_none());
        assert_eq!(list(&txn, None, None, None, 10).unwrap().len(), 1);
    }
}

#[cfg(test)]
mod listing_tests {
    use super::*;
    use crate::ledger::schema;

    fn message(conversation: &str, text: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "target": {"channel": "a.b", "conversation": conversation},
            "body": {"text": text},
        }))
        .unwrap()
    }

    #[test]
    fn a_listing_pages_newest_first_with_previews_of_text_and_error() {
        let mut db = schema::open_in_memory().unwrap();
        let txn = db.transaction().unwrap();
        let mut ids = Vec::new();
        for n in 0..5 {
            let text = format!("{n}{}", "é".repeat(300));
            let send = NewSend {
                instance: "a.b".into(),
                idempotency_key: None,
                message: message("room", &text),
                state: OutboxState::Sent,
                now_ms: 1,
                expires_ms: 100,
            };
            let Added::New(id) = add(&txn, &OutboxIds::new(n + 1), &send).unwrap() else {
                panic!()
            };
            ids.push(id);
        }
        let long_error = "x".repeat(10_000);
        transition(&txn, ids[4], OutboxState::Failed, None, Some(&long_error), 2).unwrap();

        let page = list(&txn, None, None, None, 2).unwrap();
        assert_eq!(page.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[4], ids[3]]);
        assert_eq!(page[0].conversation, "room");
        assert_eq!(page[0].text_preview.chars().count(), PREVIEW_CHARS);
        assert!(page[0].text_preview.starts_with('4'));
        assert_eq!(page[0].text_bytes, 1 + 600);
        assert_eq!(page[0].error_preview.as_deref().map(str::len), Some(PREVIEW_CHARS));
        let next = list(&txn, None, None, Some(ids[3]), 2).unwrap();
        assert_eq!(next.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[2], ids[1]]);
        let only_failed = list(&txn, Some("a.b"), Some(OutboxState::Failed), None, 10).unwrap();
        assert_eq!(only_failed.len(), 1);
        assert!(list(&txn, Some("x.y"), None, None, 10).unwrap().is_empty());
    }
}
