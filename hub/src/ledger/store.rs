//! The ledger thread: one thread owns the SQLite connection and applies queued jobs in
//! batches, one transaction (and so one fsync) per batch — group commit. A caller's answer is
//! released only after its batch committed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use rusqlite::{Connection, Transaction};
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::{error, info};

use super::LedgerError;

/// Most jobs applied in one transaction.
const MAX_BATCH: usize = 1024;

/// Jobs waiting for the ledger thread; callers wait beyond this (backpressure).
pub const QUEUE_CAPACITY: usize = 8192;

/// The ledger's own measurements, kept by the ledger thread (the ledger imports nothing from
/// the hub, so it owns these handles and the registry only reads them).
#[derive(Debug, Clone)]
pub struct LedgerMetrics {
    /// Seconds from beginning a batch's transaction to its commit (one fsync with
    /// `durability = "full"`).
    pub commit_seconds: Histogram,
    /// Jobs (ledger calls) per committed batch.
    pub batch_jobs: Histogram,
}

impl Default for LedgerMetrics {
    fn default() -> Self {
        Self {
            // 0.1 ms to about 15 s.
            commit_seconds: Histogram::new(exponential_buckets(0.0001, 2.5, 14)),
            // 1 to 1024 jobs (the most one batch takes).
            batch_jobs: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
        }
    }
}

/// A unit of work. It runs inside the batch transaction and returns what to do once the
/// batch's commit is known (`Ok`: committed; else why not).
pub type Job = Box<dyn FnOnce(&Transaction<'_>) -> Finish + Send>;

/// What a job does once its batch's commit is known.
pub type Finish = Box<dyn FnOnce(Result<(), LedgerError>) + Send>;

/// Whether the ledger's last write failed for lack of space. Set by the thread (or a job)
/// that met `SQLITE_FULL`, cleared by the next batch that committed a change.
#[derive(Debug, Clone, Default)]
pub struct StorageFlag(Arc<AtomicBool>);

impl StorageFlag {
    pub fn is_full(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Records a failure; logs the change to full once.
    pub fn note(&self, err: &LedgerError) {
        if matches!(err, LedgerError::StorageFull) && !self.0.swap(true, Ordering::Relaxed) {
            error!(
                "ledger storage is full: new inbound is refused (retryable) and sends fail until space returns"
            );
        }
    }

    fn clear(&self) {
        if self.0.swap(false, Ordering::Relaxed) {
            info!("ledger storage writable again");
        }
    }
}

/// What the thread is sent.
pub enum Message {
    Job(Job),
    /// Apply what is queued before this, checkpoint the WAL and end the thread.
    Stop,
}

/// Spawns the ledger thread. It runs until it is sent [`Message::Stop`] or every sender is
/// dropped. Callers queue with `send().await`, which waits while the queue is full
/// (backpressure).
pub fn spawn(
    conn: Connection,
    metrics: LedgerMetrics,
    storage: StorageFlag,
) -> std::io::Result<(Sender<Message>, JoinHandle<()>)> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Message>(QUEUE_CAPACITY);
    let thread = std::thread::Builder::new()
        .name("channeld-ledger".into())
        .spawn(move || run(conn, rx, &metrics, &storage))?;
    Ok((tx, thread))
}

fn run(
    mut conn: Connection,
    mut rx: Receiver<Message>,
    metrics: &LedgerMetrics,
    storage: &StorageFlag,
) {
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
            apply(&mut conn, &mut batch, metrics, storage);
        }
    }
    // Jobs queued after the stop get `Unavailable` as their senders see the channel close.
    rx.close();
    let _ = conn.pragma_update(None, "wal_checkpoint", "TRUNCATE");
}

fn apply(
    conn: &mut Connection,
    batch: &mut Vec<Job>,
    metrics: &LedgerMetrics,
    storage: &StorageFlag,
) {
    let began = Instant::now();
    let jobs = batch.len();
    let changes_before = conn.total_changes();
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
    let outcome = match tx.commit() {
        Ok(()) => {
            metrics.commit_seconds.observe(began.elapsed().as_secs_f64());
            metrics.batch_jobs.observe(jobs as f64);
            // Only a batch that wrote proves there is room again (an empty one writes nothing).
            if conn.total_changes() > changes_before {
                storage.clear();
            }
            Ok(())
        }
        Err(err) => {
            if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
                storage.note(&LedgerError::StorageFull);
                Err(LedgerError::StorageFull)
            } else {
                error!(error = %err, "ledger commit failed");
                Err(LedgerError::Commit)
            }
        }
    };
    for finish in finishers {
        finish(outcome.clone());
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
