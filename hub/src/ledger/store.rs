//! The ledger thread: one thread owns the SQLite connection and applies queued jobs in
//! batches, one transaction (and so one fsync) per batch — group commit. A caller's answer is
//! released only after its batch committed.

use std::thread::JoinHandle;

use rusqlite::{Connection, Transaction};
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::error;

use super::LedgerError;

/// Most jobs applied in one transaction.
const MAX_BATCH: usize = 1024;

/// Jobs waiting for the ledger thread; callers wait beyond this (backpressure).
pub const QUEUE_CAPACITY: usize = 8192;

/// A unit of work. It runs inside the batch transaction and returns what to do once the
/// batch's commit is known (`true`: committed).
pub type Job = Box<dyn FnOnce(&Transaction<'_>) -> Box<dyn FnOnce(bool) + Send> + Send>;

/// What the thread is sent.
pub enum Message {
    Job(Job),
    /// Apply what is queued before this, checkpoint the WAL and end the thread.
    Stop,
}

/// Spawns the ledger thread. It runs until it is sent [`Message::Stop`] or every sender is
/// dropped. Callers queue with `send().await`, which waits while the queue is full
/// (backpressure).
pub fn spawn(conn: Connection) -> std::io::Result<(Sender<Message>, JoinHandle<()>)> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Message>(QUEUE_CAPACITY);
    let thread =
        std::thread::Builder::new().name("channeld-ledger".into()).spawn(move || run(conn, rx))?;
    Ok((tx, thread))
}

fn run(mut conn: Connection, mut rx: Receiver<Message>) {
    let mut batch: Vec<Job> = Vec::with_capacity(64);
    let mut stopping = false;
    while !stopping {
        match rx.blocking_recv() {
            Some(Message::Job(job)) => batch.push(job),
            Some(Message::Stop) | None => stopping = true,
        }
        while !stopping && batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Message::Job(job)) => batch.push(job),
                Ok(Message::Stop) => stopping = true,
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            apply(&mut conn, &mut batch);
        }
    }
    // Jobs queued after the stop get `Unavailable` as their senders see the channel close.
    rx.close();
    let _ = conn.pragma_update(None, "wal_checkpoint", "TRUNCATE");
}

fn apply(conn: &mut Connection, batch: &mut Vec<Job>) {
    let tx = match conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => {
            error!(error = %err, "ledger cannot begin a transaction");
            batch.clear();
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

/// Runs `f` in a savepoint so a failing job leaves no partial writes in its batch.
pub fn savepoint<T>(
    txn: &Transaction<'_>,
    f: impl FnOnce(&Transaction<'_>) -> Result<T, LedgerError>,
) -> Result<T, LedgerError> {
    txn.prepare_cached("SAVEPOINT job")?.execute([])?;
    match f(txn) {
        Ok(value) => {
            txn.prepare_cached("RELEASE job")?.execute([])?;
            Ok(value)
        }
        Err(err) => {
            txn.execute_batch("ROLLBACK TO job; RELEASE job")?;
            Err(err)
        }
    }
}

/// Statements through the connection's prepared-statement cache: the ledger runs the same
/// few statements for every message, and preparing one costs more than running it.
pub trait Cached {
    fn exec_cached<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn query_row_cached<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for Connection {
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
