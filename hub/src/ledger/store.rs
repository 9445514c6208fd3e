//! The SQLite side of the ledger: one thread owns the connection and applies queued jobs in
//! batches, one transaction (and so one fsync) per batch — group commit. A caller's answer is
//! released only after its batch committed.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, Transaction};
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::{error, info};

/// Most jobs applied in one transaction.
const MAX_BATCH: usize = 1024;

/// Jobs waiting for the ledger thread; callers wait beyond this (backpressure).
pub const QUEUE_CAPACITY: usize = 8192;

/// Schema migrations, applied in order; `PRAGMA user_version` records how many ran.
const MIGRATIONS: &[&str] = &[
    // 1: inbound ledger, outbox, session generations, metadata.
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE inbound (
         instance TEXT NOT NULL,
         event_id TEXT NOT NULL,
         content_hash BLOB NOT NULL,
         run_id TEXT NOT NULL,
         state TEXT NOT NULL,
         frame BLOB NOT NULL,
         attempts INTEGER NOT NULL,
         reply TEXT,
         error_code TEXT,
         error_message TEXT,
         received_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL,
         PRIMARY KEY (instance, event_id)
     ) WITHOUT ROWID;
     CREATE INDEX inbound_by_state ON inbound (state, instance);
     CREATE INDEX inbound_by_age ON inbound (updated_ms);
     CREATE TABLE outbox (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         idempotency_key TEXT,
         message BLOB NOT NULL,
         state TEXT NOT NULL,
         receipt BLOB,
         error TEXT,
         attempts INTEGER NOT NULL DEFAULT 0,
         created_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL,
         expires_ms INTEGER NOT NULL
     );
     CREATE UNIQUE INDEX outbox_by_key ON outbox (instance, idempotency_key)
         WHERE idempotency_key IS NOT NULL;
     CREATE INDEX outbox_by_state ON outbox (state, instance, id);
     CREATE TABLE sessions (
         instance TEXT NOT NULL,
         route TEXT NOT NULL,
         generation INTEGER NOT NULL,
         PRIMARY KEY (instance, route)
     ) WITHOUT ROWID;",
];

/// How hard each commit pushes to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// `synchronous = FULL`: a commit survives power loss. One fsync per batch.
    Full,
    /// `synchronous = NORMAL` in WAL mode: a commit survives a crash of the hub, but the last
    /// commits can be lost on power loss or kernel crash.
    Normal,
}

/// A unit of work. It runs inside the batch transaction and returns what to do once the
/// batch's commit is known (`true`: committed).
pub type Job = Box<dyn FnOnce(&Transaction<'_>) -> Box<dyn FnOnce(bool) + Send> + Send>;

/// Opens (or creates) the database, migrates it, and returns it ready for the thread.
pub fn open(path: &Path, durability: Durability) -> rusqlite::Result<Connection> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", sync)?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.busy_timeout(Duration::from_secs(5))?;
    migrate(&mut conn)?;
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    let version = usize::try_from(version).unwrap_or(0);
    if version > MIGRATIONS.len() {
        return Err(rusqlite::Error::InvalidParameterName(format!(
            "ledger schema version {version} is newer than this hub understands ({})",
            MIGRATIONS.len()
        )));
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (index + 1) as i64)?;
        tx.commit()?;
        info!(version = index + 1, "ledger schema migrated");
    }
    Ok(())
}

/// Spawns the ledger thread; it runs until every sender is dropped. Callers queue with
/// `send().await`, which waits while the queue is full (backpressure).
pub fn spawn(conn: Connection) -> std::io::Result<Sender<Job>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Job>(QUEUE_CAPACITY);
    std::thread::Builder::new().name("channeld-ledger".into()).spawn(move || run(conn, rx))?;
    Ok(tx)
}

fn run(mut conn: Connection, mut rx: Receiver<Job>) {
    let mut batch: Vec<Job> = Vec::with_capacity(64);
    loop {
        match rx.blocking_recv() {
            Some(job) => batch.push(job),
            None => break,
        }
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        apply(&mut conn, &mut batch);
    }
    let _ = conn.pragma_update(None, "wal_checkpoint", "TRUNCATE");
}

fn apply(conn: &mut Connection, batch: &mut Vec<Job>) {
    let tx = match conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => {
            error!(error = %err, "ledger cannot begin a transaction");
            for job in batch.drain(..) {
                drop(job);
            }
            return;
        }
    };
    let mut finishers = Vec::with_capacity(batch.len());
    for job in batch.drain(..) {
        finishers.push(job(&tx));
    }
    let committed = match tx.commit() {
        Ok(()) => true,
        Err(err) => {
            error!(error = %err, "ledger commit failed");
            false
        }
    };
    for finish in finishers {
        finish(committed);
    }
}
