//! The durable ledger: inbound runs (dedupe, recovery), the outbox of proactive sends, and
//! session generations, in one SQLite database in the hub's state directory.
//!
//! Every call returns only after the transaction holding it committed. Without a state
//! directory the ledger is off: calls that need it fail with [`LedgerError::Off`] and the hub
//! keeps the in-memory behaviour of a hub without durability.

pub mod state;
mod store;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rusqlite::{OptionalExtension, Transaction, params};
use tokio::sync::{mpsc, oneshot};

pub use state::{InboundState, OutboxState};
pub use store::Durability;

use state::{RecordDecision, Recovery};

/// The database file inside the state directory.
pub const DB_FILE: &str = "ledger.sqlite3";

/// Why a ledger call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("the ledger is off (no state directory)")]
    Off,
    #[error("the ledger thread is gone")]
    Unavailable,
    #[error("the ledger commit failed")]
    Commit,
    #[error("ledger database error: {0}")]
    Sql(String),
    #[error("cannot open the ledger at {path}: {message}")]
    Open { path: PathBuf, message: String },
    #[error("outbox record {0} does not exist")]
    NoSuchRecord(i64),
    #[error("outbox record {id} is {state}; only unknown or failed records can be retried")]
    NotRetryable { id: i64, state: OutboxState },
}

impl From<rusqlite::Error> for LedgerError {
    fn from(err: rusqlite::Error) -> Self {
        LedgerError::Sql(err.to_string())
    }
}

/// A new inbound to record.
#[derive(Debug, Clone)]
pub struct NewInbound {
    pub instance: String,
    pub event_id: String,
    pub content_hash: [u8; 32],
    /// The encoded `inbound`/`inbound_event` line, to run it again after a crash.
    pub frame: Vec<u8>,
    pub run_id: String,
    pub now_ms: u64,
}

/// What the ledger holds for an event id seen before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRun {
    pub run_id: String,
    pub state: InboundState,
    pub reply: Option<String>,
    pub error: Option<(String, String)>,
}

/// The answer to [`Ledger::record_inbound`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    New,
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

/// A finished run whose reply has not been confirmed as handed to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReply {
    pub event_id: String,
    pub frame: Vec<u8>,
    pub reply: String,
}

/// A run that was in progress when the hub died and is started again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredRun {
    pub instance: String,
    pub event_id: String,
    pub run_id: String,
    pub frame: Vec<u8>,
    pub attempt: u32,
}

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

/// The answer to [`Ledger::outbox_add`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Added {
    New(i64),
    /// The idempotency key was used before: this is that record, nothing new was added.
    Existing(OutboxRecord),
}

/// A handle to the ledger thread. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    tx: Option<mpsc::Sender<store::Job>>,
    id: String,
    path: Option<PathBuf>,
}

impl Ledger {
    /// A ledger that records nothing.
    pub fn off() -> Self {
        Self { tx: None, id: String::new(), path: None }
    }

    /// Opens `dir/ledger.sqlite3`, creating the directory (mode 0700) and schema as needed.
    pub fn open(dir: &Path, durability: Durability) -> Result<Self, LedgerError> {
        let path = dir.join(DB_FILE);
        let open_err = |message: String| LedgerError::Open { path: path.clone(), message };
        std::fs::create_dir_all(dir).map_err(|err| open_err(err.to_string()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
        let conn = store::open(&path, durability).map_err(|err| open_err(err.to_string()))?;
        let id = ledger_id(&conn).map_err(|err| open_err(err.to_string()))?;
        let tx = store::spawn(conn).map_err(|err| open_err(err.to_string()))?;
        Ok(Self { tx: Some(tx), id, path: Some(path) })
    }

    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// The database path, when on.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The wire request id of an outbox record: unique across databases.
    pub fn outbox_request_id(&self, id: i64) -> String {
        format!("ob-{}-{id}", self.id)
    }

    /// Runs `f` inside the next batch; resolves once that batch committed.
    async fn call<T, F>(&self, f: F) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        F: FnOnce(&Transaction<'_>) -> Result<T, LedgerError> + Send + 'static,
    {
        let tx = self.tx.as_ref().ok_or(LedgerError::Off)?;
        let (done, answer) = oneshot::channel();
        let job: store::Job = Box::new(move |txn| {
            let result = savepoint(txn, f);
            Box::new(move |committed| {
                let _ = done.send(if committed { result } else { Err(LedgerError::Commit) });
            })
        });
        tx.send(job).await.map_err(|_| LedgerError::Unavailable)?;
        answer.await.map_err(|_| LedgerError::Unavailable)?
    }

    /// Records an inbound unless its event id is known; see [`Recorded`].
    pub async fn record_inbound(&self, new: NewInbound) -> Result<Recorded, LedgerError> {
        self.call(move |txn| {
            let existing = txn
                .query_row_cached(
                    "SELECT content_hash, run_id, state, reply, error_code, error_message
                     FROM inbound WHERE instance = ?1 AND event_id = ?2",
                    params![new.instance, new.event_id],
                    |row| {
                        Ok((
                            row.get::<_, Vec<u8>>(0)?,
                            row.get::<_, String>(1)?,
                            row.get::<_, String>(2)?,
                            row.get::<_, Option<String>>(3)?,
                            row.get::<_, Option<String>>(4)?,
                            row.get::<_, Option<String>>(5)?,
                        ))
                    },
                )
                .optional()?;
            let decision = state::decide(existing.as_ref().map(|e| e.0.as_slice()), &new.content_hash);
            match (decision, existing) {
                (RecordDecision::Insert, _) => {
                    txn.exec_cached(
                        "INSERT INTO inbound (instance, event_id, content_hash, run_id, state, frame,
                             attempts, received_ms, updated_ms)
                         VALUES (?1, ?2, ?3, ?4, 'running', ?5, 1, ?6, ?6)",
                        params![
                            new.instance,
                            new.event_id,
                            new.content_hash.as_slice(),
                            new.run_id,
                            new.frame,
                            new.now_ms as i64
                        ],
                    )?;
                    Ok(Recorded::New)
                }
                (RecordDecision::Replay, Some((_, run_id, state, reply, code, message))) => {
                    Ok(Recorded::Replay(StoredRun {
                        run_id,
                        state: parse_inbound_state(&state)?,
                        reply,
                        error: code.map(|c| (c, message.unwrap_or_default())),
                    }))
                }
                _ => Ok(Recorded::Conflict),
            }
        })
        .await
    }

    /// Records how a run ended: `replied` with its reply, `delivered` when there is none,
    /// or `failed`.
    pub async fn finish_run(
        &self,
        instance: String,
        event_id: String,
        end: RunEnd,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        self.call(move |txn| {
            let (state, reply, code, message) = match end {
                RunEnd::Reply(text) => (InboundState::Replied, Some(text), None, None),
                RunEnd::NoReply => (InboundState::Delivered, None, None, None),
                RunEnd::Failed { code, message } => (InboundState::Failed, None, Some(code), Some(message)),
            };
            txn.exec_cached(
                "UPDATE inbound SET state = ?3, reply = ?4, error_code = ?5, error_message = ?6, updated_ms = ?7
                 WHERE instance = ?1 AND event_id = ?2 AND state = 'running'",
                params![instance, event_id, state.as_str(), reply, code, message, now_ms as i64],
            )?;
            Ok(())
        })
        .await
    }

    /// Marks a reply as handed to the driver.
    pub async fn mark_delivered(
        &self,
        instance: String,
        event_id: String,
        now_ms: u64,
    ) -> Result<bool, LedgerError> {
        self.call(move |txn| {
            let changed = txn.exec_cached(
                "UPDATE inbound SET state = 'delivered', updated_ms = ?3
                 WHERE instance = ?1 AND event_id = ?2 AND state = 'replied'",
                params![instance, event_id, now_ms as i64],
            )?;
            Ok(changed > 0)
        })
        .await
    }

    /// Finished runs of `instance` whose reply is not confirmed as handed over, oldest first.
    pub async fn pending_replies(
        &self,
        instance: String,
    ) -> Result<Vec<PendingReply>, LedgerError> {
        self.call(move |txn| {
            let mut stmt = txn.prepare_cached(
                "SELECT event_id, frame, reply FROM inbound
                 WHERE state = 'replied' AND instance = ?1 ORDER BY updated_ms, event_id",
            )?;
            let rows = stmt.query_map(params![instance], |row| {
                Ok(PendingReply { event_id: row.get(0)?, frame: row.get(1)?, reply: row.get(2)? })
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }

    /// Runs that were in progress when the hub stopped: each is started again once (attempt
    /// counted), or recorded as failed if it already was.
    pub async fn recover(&self, now_ms: u64) -> Result<Vec<RecoveredRun>, LedgerError> {
        self.call(move |txn| {
            let running: Vec<(String, String, String, Vec<u8>, u32)> = {
                let mut stmt = txn.prepare(
                    "SELECT instance, event_id, run_id, frame, attempts FROM inbound
                     WHERE state = 'running' ORDER BY received_ms, event_id",
                )?;
                let rows = stmt.query_map([], |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?))
                })?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            let mut rerun = Vec::new();
            for (instance, event_id, run_id, frame, attempts) in running {
                match state::recover(attempts) {
                    Recovery::Rerun { attempt } => {
                        txn.exec_cached(
                            "UPDATE inbound SET attempts = ?3, updated_ms = ?4 WHERE instance = ?1 AND event_id = ?2",
                            params![instance, event_id, attempt, now_ms as i64],
                        )?;
                        rerun.push(RecoveredRun { instance, event_id, run_id, frame, attempt });
                    }
                    Recovery::GiveUp => {
                        txn.exec_cached(
                            "UPDATE inbound SET state = 'failed', error_code = 'interrupted',
                                 error_message = 'run was interrupted twice by a hub restart', updated_ms = ?3
                             WHERE instance = ?1 AND event_id = ?2",
                            params![instance, event_id, now_ms as i64],
                        )?;
                    }
                }
            }
            Ok(rerun)
        })
        .await
    }

    /// Deletes finished inbound entries and final outbox records last touched before
    /// `before_ms`; returns how many rows went.
    pub async fn prune(&self, before_ms: u64) -> Result<usize, LedgerError> {
        self.call(move |txn| {
            let inbound = txn.exec_cached(
                "DELETE FROM inbound WHERE state IN ('delivered', 'failed') AND updated_ms < ?1",
                params![before_ms as i64],
            )?;
            let outbox = txn.exec_cached(
                "DELETE FROM outbox WHERE state IN ('receipted', 'failed', 'unknown') AND updated_ms < ?1",
                params![before_ms as i64],
            )?;
            Ok(inbound + outbox)
        })
        .await
    }

    /// Starts a new session generation for a route; returns it.
    pub async fn bump_generation(
        &self,
        instance: String,
        route: String,
    ) -> Result<u64, LedgerError> {
        self.call(move |txn| {
            txn.exec_cached(
                "INSERT INTO sessions (instance, route, generation) VALUES (?1, ?2, 1)
                 ON CONFLICT (instance, route) DO UPDATE SET generation = generation + 1",
                params![instance, route],
            )?;
            let generation: i64 = txn.query_row_cached(
                "SELECT generation FROM sessions WHERE instance = ?1 AND route = ?2",
                params![instance, route],
                |row| row.get(0),
            )?;
            Ok(generation as u64)
        })
        .await
    }

    /// Every session generation of `instance`.
    pub async fn generations(&self, instance: String) -> Result<HashMap<String, u64>, LedgerError> {
        self.call(move |txn| {
            let mut stmt =
                txn.prepare("SELECT route, generation FROM sessions WHERE instance = ?1")?;
            let rows = stmt.query_map(params![instance], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)? as u64))
            })?;
            Ok(rows.collect::<Result<HashMap<_, _>, _>>()?)
        })
        .await
    }

    /// Adds a send, or returns the record that already holds its idempotency key.
    pub async fn outbox_add(&self, send: NewSend) -> Result<Added, LedgerError> {
        self.call(move |txn| {
            if let Some(key) = &send.idempotency_key {
                let existing = txn
                    .query_row_cached(
                        &format!("SELECT {OUTBOX_COLUMNS} FROM outbox WHERE instance = ?1 AND idempotency_key = ?2"),
                        params![send.instance, key],
                        outbox_row,
                    )
                    .optional()?;
                if let Some(record) = existing {
                    return Ok(Added::Existing(record));
                }
            }
            let attempts = u32::from(send.state == OutboxState::Sent);
            txn.exec_cached(
                "INSERT INTO outbox (instance, idempotency_key, message, state, attempts, created_ms, updated_ms, expires_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7)",
                params![
                    send.instance,
                    send.idempotency_key,
                    send.message,
                    send.state.as_str(),
                    attempts,
                    send.now_ms as i64,
                    send.expires_ms as i64
                ],
            )?;
            Ok(Added::New(txn.last_insert_rowid()))
        })
        .await
    }

    /// Records a send's outcome (`receipted` with its receipt, `failed`, `unknown`).
    pub async fn outbox_set(
        &self,
        id: i64,
        state: OutboxState,
        receipt: Option<Vec<u8>>,
        error: Option<String>,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        self.call(move |txn| {
            txn.exec_cached(
                "UPDATE outbox SET state = ?2, receipt = COALESCE(?3, receipt), error = ?4, updated_ms = ?5
                 WHERE id = ?1 AND state = 'sent'",
                params![id, state.as_str(), receipt, error, now_ms as i64],
            )?;
            Ok(())
        })
        .await
    }

    /// Claims the queued sends of `instance` for dispatch, oldest first: each becomes `sent`.
    /// Those past their expiry become `failed` instead and are not returned.
    pub async fn outbox_claim_queued(
        &self,
        instance: String,
        now_ms: u64,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, LedgerError> {
        self.call(move |txn| {
            txn.exec_cached(
                "UPDATE outbox SET state = 'failed', error = 'expired while queued', updated_ms = ?2
                 WHERE instance = ?1 AND state = 'queued' AND expires_ms <= ?2",
                params![instance, now_ms as i64],
            )?;
            let records: Vec<OutboxRecord> = {
                let mut stmt = txn.prepare_cached(&format!(
                    "SELECT {OUTBOX_COLUMNS} FROM outbox WHERE instance = ?1 AND state = 'queued' ORDER BY id LIMIT ?2"
                ))?;
                let rows = stmt.query_map(params![instance, limit as i64], outbox_row)?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            for record in &records {
                txn.exec_cached(
                    "UPDATE outbox SET state = 'sent', attempts = attempts + 1, updated_ms = ?2 WHERE id = ?1",
                    params![record.id, now_ms as i64],
                )?;
            }
            Ok(records
                .into_iter()
                .map(|r| OutboxRecord { state: OutboxState::Sent, attempts: r.attempts + 1, updated_ms: now_ms, ..r })
                .collect())
        })
        .await
    }

    /// Fails queued sends past their expiry, for every instance; returns how many.
    pub async fn outbox_expire(&self, now_ms: u64) -> Result<usize, LedgerError> {
        self.call(move |txn| {
            Ok(txn.exec_cached(
                "UPDATE outbox SET state = 'failed', error = 'expired while queued', updated_ms = ?1
                 WHERE state = 'queued' AND expires_ms <= ?1",
                params![now_ms as i64],
            )?)
        })
        .await
    }

    /// After a restart nothing is in flight: every `sent` record becomes `unknown`.
    pub async fn outbox_restart(&self, now_ms: u64) -> Result<usize, LedgerError> {
        self.call(move |txn| {
            Ok(txn.exec_cached(
                "UPDATE outbox SET state = 'unknown', error = 'hub restarted before the receipt', updated_ms = ?1
                 WHERE state = 'sent'",
                params![now_ms as i64],
            )?)
        })
        .await
    }

    pub async fn outbox_get(&self, id: i64) -> Result<Option<OutboxRecord>, LedgerError> {
        self.call(move |txn| {
            Ok(txn
                .query_row(
                    &format!("SELECT {OUTBOX_COLUMNS} FROM outbox WHERE id = ?1"),
                    params![id],
                    outbox_row,
                )
                .optional()?)
        })
        .await
    }

    /// Lists records, newest first.
    pub async fn outbox_list(
        &self,
        instance: Option<String>,
        state: Option<OutboxState>,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, LedgerError> {
        self.call(move |txn| {
            let mut stmt = txn.prepare(&format!(
                "SELECT {OUTBOX_COLUMNS} FROM outbox
                 WHERE (?1 IS NULL OR instance = ?1) AND (?2 IS NULL OR state = ?2)
                 ORDER BY id DESC LIMIT ?3"
            ))?;
            let rows = stmt.query_map(
                params![instance, state.map(OutboxState::as_str), limit as i64],
                outbox_row,
            )?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }

    /// An operator's explicit retry: an `unknown` or `failed` record goes back to `queued`.
    pub async fn outbox_requeue(
        &self,
        id: i64,
        now_ms: u64,
        expires_ms: u64,
    ) -> Result<OutboxRecord, LedgerError> {
        self.call(move |txn| {
            let record = txn
                .query_row(&format!("SELECT {OUTBOX_COLUMNS} FROM outbox WHERE id = ?1"), params![id], outbox_row)
                .optional()?
                .ok_or(LedgerError::NoSuchRecord(id))?;
            if !record.state.may_become(OutboxState::Queued) {
                return Err(LedgerError::NotRetryable { id, state: record.state });
            }
            txn.exec_cached(
                "UPDATE outbox SET state = 'queued', error = NULL, updated_ms = ?2, expires_ms = ?3 WHERE id = ?1",
                params![id, now_ms as i64, expires_ms as i64],
            )?;
            Ok(OutboxRecord { state: OutboxState::Queued, error: None, updated_ms: now_ms, expires_ms, ..record })
        })
        .await
    }

    /// Entry counts by state, for status.
    pub async fn counts(&self) -> Result<LedgerCounts, LedgerError> {
        self.call(move |txn| {
            let mut counts = LedgerCounts::default();
            let mut stmt = txn.prepare("SELECT state, COUNT(*) FROM inbound GROUP BY state")?;
            for row in
                stmt.query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)))?
            {
                let (state, count) = row?;
                counts.inbound.push((state, count as u64));
            }
            let mut stmt = txn.prepare("SELECT state, COUNT(*) FROM outbox GROUP BY state")?;
            for row in
                stmt.query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)))?
            {
                let (state, count) = row?;
                counts.outbox.push((state, count as u64));
            }
            Ok(counts)
        })
        .await
    }
}

/// Rows per state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    pub inbound: Vec<(String, u64)>,
    pub outbox: Vec<(String, u64)>,
}

const OUTBOX_COLUMNS: &str = "id, instance, idempotency_key, message, state, receipt, error, attempts, created_ms, updated_ms, expires_ms";

fn outbox_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxRecord> {
    let state: String = row.get(4)?;
    let state = OutboxState::parse(&state).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            4,
            rusqlite::types::Type::Text,
            format!("unknown outbox state {state:?}").into(),
        )
    })?;
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

fn parse_inbound_state(value: &str) -> Result<InboundState, LedgerError> {
    InboundState::parse(value)
        .ok_or_else(|| LedgerError::Sql(format!("unknown inbound state {value:?}")))
}

/// Runs `f` in a savepoint so a failing job leaves no partial writes in its batch.
fn savepoint<T>(
    txn: &Transaction<'_>,
    f: impl FnOnce(&Transaction<'_>) -> Result<T, LedgerError>,
) -> Result<T, LedgerError> {
    txn.exec_cached("SAVEPOINT job", [])?;
    match f(txn) {
        Ok(value) => {
            txn.exec_cached("RELEASE job", [])?;
            Ok(value)
        }
        Err(err) => {
            txn.execute_batch("ROLLBACK TO job; RELEASE job")?;
            Err(err)
        }
    }
}

fn ledger_id(conn: &rusqlite::Connection) -> rusqlite::Result<String> {
    if let Some(id) = conn
        .query_row("SELECT value FROM meta WHERE key = 'ledger_id'", [], |row| {
            row.get::<_, String>(0)
        })
        .optional()?
    {
        return Ok(id);
    }
    let id = crate::hub::boot_nonce();
    conn.execute("INSERT INTO meta (key, value) VALUES ('ledger_id', ?1)", params![id])?;
    Ok(id)
}

/// Statements through the connection's prepared-statement cache: the ledger runs the same
/// few statements for every message, and preparing one costs more than running it.
trait Cached {
    fn exec_cached<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn query_row_cached<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for rusqlite::Connection {
    fn exec_cached<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn query_row_cached<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Normal).unwrap();
        (dir, ledger)
    }

    fn inbound(event_id: &str, hash: u8) -> NewInbound {
        NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [hash; 32],
            frame: b"{}".to_vec(),
            run_id: format!("run-{event_id}"),
            now_ms: 1,
        }
    }

    #[tokio::test]
    async fn a_completed_run_is_replayed_not_repeated() {
        let (_dir, ledger) = ledger();
        assert_eq!(ledger.record_inbound(inbound("e1", 1)).await.unwrap(), Recorded::New);
        ledger.finish_run("a.b".into(), "e1".into(), RunEnd::Reply("hi".into()), 2).await.unwrap();
        match ledger.record_inbound(inbound("e1", 1)).await.unwrap() {
            Recorded::Replay(run) => {
                assert_eq!(run.state, InboundState::Replied);
                assert_eq!(run.reply.as_deref(), Some("hi"));
                assert_eq!(run.run_id, "run-e1");
            }
            other => panic!("expected a replay, got {other:?}"),
        }
        assert_eq!(ledger.record_inbound(inbound("e1", 2)).await.unwrap(), Recorded::Conflict);
        assert_eq!(ledger.pending_replies("a.b".into()).await.unwrap().len(), 1);
        assert!(ledger.mark_delivered("a.b".into(), "e1".into(), 3).await.unwrap());
        assert!(ledger.pending_replies("a.b".into()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn interrupted_runs_are_recovered_once_then_failed() {
        let dir = tempfile::tempdir().unwrap();
        {
            let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
            ledger.record_inbound(inbound("e1", 1)).await.unwrap();
        }
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        let first = ledger.recover(5).await.unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].attempt, 2);
        let second = ledger.recover(6).await.unwrap();
        assert!(second.is_empty());
        match ledger.record_inbound(inbound("e1", 1)).await.unwrap() {
            Recorded::Replay(run) => assert_eq!(run.state, InboundState::Failed),
            other => panic!("expected failed replay, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn idempotency_keys_return_the_existing_record() {
        let (_dir, ledger) = ledger();
        let send = |key: &str| NewSend {
            instance: "a.b".into(),
            idempotency_key: Some(key.into()),
            message: b"{}".to_vec(),
            state: OutboxState::Sent,
            now_ms: 1,
            expires_ms: 100,
        };
        let Added::New(id) = ledger.outbox_add(send("k1")).await.unwrap() else { panic!("new") };
        ledger
            .outbox_set(id, OutboxState::Receipted, Some(b"{\"r\":1}".to_vec()), None, 2)
            .await
            .unwrap();
        match ledger.outbox_add(send("k1")).await.unwrap() {
            Added::Existing(record) => {
                assert_eq!(record.id, id);
                assert_eq!(record.state, OutboxState::Receipted);
            }
            other => panic!("expected the existing record, got {other:?}"),
        }
        assert!(matches!(ledger.outbox_add(send("k2")).await.unwrap(), Added::New(_)));
        assert!(matches!(
            ledger.outbox_requeue(id, 3, 100).await,
            Err(LedgerError::NotRetryable { .. })
        ));
    }

    #[tokio::test]
    async fn queued_sends_are_claimed_in_order_and_expire() {
        let (_dir, ledger) = ledger();
        for (n, expires) in [(1, 100), (2, 5), (3, 100)] {
            ledger
                .outbox_add(NewSend {
                    instance: "a.b".into(),
                    idempotency_key: None,
                    message: format!("{n}").into_bytes(),
                    state: OutboxState::Queued,
                    now_ms: 1,
                    expires_ms: expires,
                })
                .await
                .unwrap();
        }
        let claimed = ledger.outbox_claim_queued("a.b".into(), 10, 100).await.unwrap();
        let messages: Vec<&[u8]> = claimed.iter().map(|r| r.message.as_slice()).collect();
        assert_eq!(messages, vec![b"1".as_slice(), b"3".as_slice()]);
        assert_eq!(ledger.outbox_list(None, Some(OutboxState::Failed), 10).await.unwrap().len(), 1);
        assert_eq!(ledger.outbox_restart(11).await.unwrap(), 2);
        assert_eq!(
            ledger.outbox_list(None, Some(OutboxState::Unknown), 10).await.unwrap().len(),
            2
        );
    }

    #[tokio::test]
    async fn pruning_removes_only_finished_entries_past_the_window() {
        let (_dir, ledger) = ledger();
        ledger.record_inbound(inbound("old-done", 1)).await.unwrap();
        ledger.finish_run("a.b".into(), "old-done".into(), RunEnd::NoReply, 10).await.unwrap();
        ledger.record_inbound(inbound("old-running", 1)).await.unwrap();
        ledger.record_inbound(NewInbound { now_ms: 500, ..inbound("new-done", 1) }).await.unwrap();
        ledger.finish_run("a.b".into(), "new-done".into(), RunEnd::NoReply, 500).await.unwrap();
        assert_eq!(ledger.prune(100).await.unwrap(), 1);
        // The pruned id is forgotten; the others still dedupe.
        assert_eq!(ledger.record_inbound(inbound("old-done", 2)).await.unwrap(), Recorded::New);
        assert!(matches!(
            ledger.record_inbound(inbound("old-running", 1)).await.unwrap(),
            Recorded::Replay(_)
        ));
        assert!(matches!(
            ledger.record_inbound(inbound("new-done", 1)).await.unwrap(),
            Recorded::Replay(_)
        ));
    }

    #[tokio::test]
    async fn the_off_ledger_refuses_every_call() {
        let ledger = Ledger::off();
        assert_eq!(ledger.record_inbound(inbound("e", 1)).await, Err(LedgerError::Off));
    }
}
