//! The ledger thread: one thread owns the SQLite connection and applies queued jobs in
//! batches, one transaction (and at most one fsync) per batch — group commit. A caller's
//! answer is released only after its batch committed.
//!
//! A job is [`Commit::Durable`] (its batch is fsynced before anyone hears of it) or
//! [`Commit::Deferred`] (its batch is committed to the WAL without an fsync: it survives a
//! crash of the hub at once, and power loss once the next durable commit, or the flush
//! [`FLUSH_DELAY`] after the ledger went quiet, synced the WAL). A batch holding both kinds
//! is committed without the fsync, its deferred jobs are answered, and only then is the WAL
//! synced for the durable ones: a deferred caller never waits for an fsync ([`batch_plan`]).
//! Under [`Durability::Strict`] every batch is fsynced, under [`Durability::Normal`] none is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use rusqlite::{Connection, Transaction};
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::{error, info};

use super::LedgerError;
use super::schema::Durability;
use super::syncer::Syncer;

/// Most jobs applied in one transaction.
const MAX_BATCH: usize = 1024;

/// How long deferred commits wait for a durable one to carry them to disk before the thread
/// syncs the WAL by itself (the longest a deferred record stays exposed to power loss while
/// the ledger is quiet).
pub const FLUSH_DELAY: Duration = Duration::from_millis(50);

/// Whether a job's commit must reach the disk before its caller is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// fsynced before the answer (under `full` and `strict`).
    Durable,
    /// Committed to the WAL before the answer; fsynced with the next durable commit or at
    /// the latest [`FLUSH_DELAY`] after the ledger went quiet (under `full`).
    Deferred,
}

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
    Job(Job, Commit),
    /// Apply what is queued before this, checkpoint the WAL and end the thread.
    Stop,
}

/// Spawns the ledger thread. It runs until it is sent [`Message::Stop`] or every sender is
/// dropped. Callers queue with `send().await`, which waits while the queue is full
/// (backpressure).
pub fn spawn(
    conn: Connection,
    durability: Durability,
    metrics: LedgerMetrics,
    storage: StorageFlag,
) -> std::io::Result<(Sender<Message>, JoinHandle<()>)> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Message>(QUEUE_CAPACITY);
    // A runtime of the thread's own, only for its timer: waiting for a job at most until a
    // flush is due.
    let timer = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let thread = std::thread::Builder::new().name("channeld-ledger".into()).spawn(move || {
        let wal = wal_path(&conn);
        let mut thread = LedgerThread {
            conn,
            durability,
            storage,
            synchronous: None,
            unsynced: false,
            wal,
            syncer: None,
        };
        thread.run(rx, &timer, &metrics);
    })?;
    Ok((tx, thread))
}

/// How one batch reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// The `synchronous` setting of the batch's commit (`FULL`: fsynced).
    pub commit: &'static str,
    /// The durable jobs hear of the commit once the log syncer synced the WAL; the others
    /// at once.
    pub sync_after: bool,
}

/// The pure decision of the group commit: how a batch reaches the disk under `durability`,
/// given whether it holds a durable job and whether a log syncer runs (the ledger is in a
/// file). With a syncer, no commit waits for an fsync: the ledger thread goes on with the
/// next batch while the syncer makes this one durable.
pub fn batch_plan(durability: Durability, any_durable: bool, syncer: bool) -> BatchPlan {
    let (commit, sync_after) = match durability {
        Durability::Strict => ("FULL", false),
        Durability::Full if any_durable && syncer => ("NORMAL", true),
        Durability::Full if any_durable => ("FULL", false),
        Durability::Full | Durability::Normal => ("NORMAL", false),
    };
    BatchPlan { commit, sync_after }
}

struct LedgerThread {
    conn: Connection,
    durability: Durability,
    storage: StorageFlag,
    /// The `synchronous` setting the connection has now.
    synchronous: Option<&'static str>,
    /// A deferred commit is in the WAL without an fsync since.
    unsynced: bool,
    /// The write-ahead log's file (none in memory), and the thread that syncs it, started
    /// with the first durable batch.
    wal: Option<std::path::PathBuf>,
    syncer: Option<Syncer>,
}

/// Where SQLite keeps `conn`'s write-ahead log; `None` for a database in memory.
fn wal_path(conn: &Connection) -> Option<std::path::PathBuf> {
    conn.path().filter(|path| !path.is_empty()).map(|path| format!("{path}-wal").into())
}

impl LedgerThread {
    fn run(
        &mut self,
        mut rx: Receiver<Message>,
        timer: &tokio::runtime::Runtime,
        metrics: &LedgerMetrics,
    ) {
        let mut batch: Vec<(Job, Commit)> = Vec::with_capacity(64);
        let mut stopping = false;
        while !stopping {
            let first = if self.unsynced {
                match timer.block_on(async { tokio::time::timeout(FLUSH_DELAY, rx.recv()).await }) {
                    Ok(message) => message,
                    Err(_) => {
                        if let Err(err) = self.flush() {
                            error!(error = %err, "ledger flush failed");
                        }
                        continue;
                    }
                }
            } else {
                rx.blocking_recv()
            };
            match first {
                Some(Message::Job(job, commit)) => batch.push((job, commit)),
                Some(Message::Stop) | None => stopping = true,
            }
            while !stopping && batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(Message::Job(job, commit)) => batch.push((job, commit)),
                    Ok(Message::Stop) => stopping = true,
                    Err(_) => break,
                }
            }
            if !batch.is_empty() {
                self.apply(&mut batch, metrics);
            }
        }
        // Jobs queued after the stop get `Unavailable` as their senders see the channel close.
        rx.close();
        if let Some(syncer) = self.syncer.take() {
            syncer.finish();
        }
        // The checkpoint syncs the WAL and the database file.
        let _ = self.conn.pragma_update(None, "wal_checkpoint", "TRUNCATE");
    }

    /// Sets `synchronous` for the next commit when it differs.
    fn set_sync(&mut self, level: &'static str) {
        if self.synchronous == Some(level) {
            return;
        }
        match self.conn.pragma_update(None, "synchronous", level) {
            Ok(()) => self.synchronous = Some(level),
            Err(err) => error!(error = %err, level, "ledger cannot set synchronous"),
        }
    }

    /// Syncs the WAL the deferred commits are in: a one-row durable commit (its fsync covers
    /// every frame before it).
    fn flush(&mut self) -> Result<(), LedgerError> {
        self.set_sync("FULL");
        let flushed = self.conn.prepare_cached(
            "INSERT INTO meta (key, value) VALUES ('flushed', '1')
             ON CONFLICT (key) DO UPDATE SET value = CAST(value AS INTEGER) + 1",
        );
        match flushed.and_then(|mut statement| statement.execute([])) {
            Ok(_) => {
                self.unsynced = false;
                Ok(())
            }
            Err(err) if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) => {
                self.storage.note(&LedgerError::StorageFull);
                Err(LedgerError::StorageFull)
            }
            Err(err) => {
                error!(error = %err, "ledger flush failed");
                Err(LedgerError::Commit)
            }
        }
    }

    /// Applies a batch as [`batch_plan`] says and answers its jobs. When the sync after a
    /// batch fails, its durable jobs hear that error: their writes are committed (a hub crash
    /// keeps them) but not known to be on the disk.
    fn apply(&mut self, batch: &mut Vec<(Job, Commit)>, metrics: &LedgerMetrics) {
        let any_durable = batch.iter().any(|(_, commit)| *commit == Commit::Durable);
        if any_durable && self.durability == Durability::Full && self.syncer.is_none() {
            self.syncer =
                self.wal.as_deref().and_then(|wal| Syncer::start(wal, self.storage.clone()));
        }
        let plan = batch_plan(self.durability, any_durable, self.syncer.is_some());
        self.set_sync(plan.commit);
        let (outcome, finishers) = apply(&mut self.conn, batch, metrics, &self.storage);
        match (outcome.is_ok(), self.durability, plan.commit) {
            (true, Durability::Full, "NORMAL") => self.unsynced = true,
            (true, _, "FULL") => self.unsynced = false,
            _ => {}
        }
        if outcome.is_err() || !plan.sync_after {
            for (finish, _) in finishers {
                finish(outcome.clone());
            }
            return;
        }
        let mut durable = Vec::with_capacity(finishers.len());
        for (finish, commit) in finishers {
            match commit {
                Commit::Deferred => finish(Ok(())),
                Commit::Durable => durable.push(finish),
            }
        }
        if let Some(syncer) = &self.syncer {
            syncer.after_sync(durable);
            // The sync it asked for covers the deferred commits before it.
            self.unsynced = false;
        }
    }
}

/// Applies `batch` in one transaction; returns whether it committed, and each job's finisher
/// (with its commit kind) to be told so.
fn apply(
    conn: &mut Connection,
    batch: &mut Vec<(Job, Commit)>,
    metrics: &LedgerMetrics,
    storage: &StorageFlag,
) -> (Result<(), LedgerError>, Vec<(Finish, Commit)>) {
    let began = Instant::now();
    let jobs = batch.len();
    let changes_before = conn.total_changes();
    let tx = match conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => {
            error!(error = %err, "ledger cannot begin a transaction");
            // The jobs are dropped unrun: their callers hear `Unavailable`.
            batch.clear();
            return (Err(LedgerError::Commit), Vec::new());
        }
    };
    let mut finishers = Vec::with_capacity(batch.len());
    for (job, commit) in batch.drain(..) {
        finishers.push((job(&tx), commit));
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
    (outcome, finishers)
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

#[cfg(test)]
mod tests {
    //! The group commit's decision, and that a deferred commit is readable at once and
    //! survives a reopen (the WAL is in the file even without its fsync).
    use super::*;
    use crate::ledger::{Ledger, NewInbound, Recorded, RunEnd};

    #[test]
    fn only_a_batch_with_a_durable_job_is_fsynced_under_full() {
        let plan = |commit, sync_after| BatchPlan { commit, sync_after };
        assert_eq!(batch_plan(Durability::Full, true, false), plan("FULL", false));
        assert_eq!(batch_plan(Durability::Full, false, true), plan("NORMAL", false));
        assert_eq!(batch_plan(Durability::Strict, false, true), plan("FULL", false));
        assert_eq!(batch_plan(Durability::Strict, true, true), plan("FULL", false));
        assert_eq!(batch_plan(Durability::Normal, true, true), plan("NORMAL", false));
        // With a log syncer no commit waits for the disk: durable jobs hear after its sync.
        assert_eq!(batch_plan(Durability::Full, true, true), plan("NORMAL", true));
        assert_eq!(batch_plan(Durability::Full, false, true), plan("NORMAL", false));
    }

    fn thread(conn: Connection) -> LedgerThread {
        LedgerThread {
            wal: wal_path(&conn),
            conn,
            durability: Durability::Full,
            storage: StorageFlag::default(),
            synchronous: None,
            unsynced: false,
            syncer: None,
        }
    }

    #[test]
    fn a_mixed_batch_is_committed_then_its_deferred_jobs_hear_then_the_wal_is_synced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.sqlite3");
        let on_disk = crate::ledger::schema::open(&path, Durability::Full).unwrap();
        assert_eq!(wal_path(&on_disk), Some(dir.path().join("ledger.sqlite3-wal")));
        let in_memory = crate::ledger::schema::open_in_memory().unwrap();
        assert_eq!(wal_path(&in_memory), None);
        mixed_batch(thread(on_disk), true);
        mixed_batch(thread(in_memory), false);
    }

    /// A mixed batch, then a durable-only one. With a log file the syncer answers the durable
    /// jobs after the deferred ones; without one (in memory) the commit itself is synced and
    /// everyone hears together, in batch order.
    fn mixed_batch(mut thread: LedgerThread, on_disk: bool) {
        use std::sync::Mutex;
        let heard = Arc::new(Mutex::new(Vec::new()));
        let job = |name: &'static str| -> Job {
            let heard = heard.clone();
            Box::new(move |txn: &Transaction<'_>| -> Finish {
                txn.execute("INSERT INTO meta (key, value) VALUES (?1, 'x')", [name]).unwrap();
                Box::new(move |outcome| heard.lock().unwrap().push((name, outcome.is_ok())))
            })
        };
        let flushes = |conn: &Connection| -> i64 {
            conn.query_row(
                "SELECT COALESCE((SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'flushed'), 0)",
                [],
                |r| r.get(0),
            )
            .unwrap()
        };
        let metrics = LedgerMetrics::default();

        let mut batch =
            vec![(job("durable"), Commit::Durable), (job("deferred"), Commit::Deferred)];
        thread.apply(&mut batch, &metrics);
        let mut batch = vec![(job("only durable"), Commit::Durable)];
        thread.apply(&mut batch, &metrics);
        assert!(!thread.unsynced, "each durable job is synced");
        assert_eq!(thread.syncer.is_some(), on_disk);
        if let Some(syncer) = thread.syncer.take() {
            syncer.finish();
        }
        let heard = heard.lock().unwrap().clone();
        if on_disk {
            assert_eq!(heard[0], ("deferred", true), "{heard:?}");
            assert_eq!(heard[1..].len(), 2);
            assert!(heard[1..].contains(&("durable", true)), "{heard:?}");
            assert!(heard[1..].contains(&("only durable", true)), "{heard:?}");
        } else {
            assert_eq!(heard, [("durable", true), ("deferred", true), ("only durable", true)]);
        }
        assert_eq!(flushes(&thread.conn), 0, "no extra commit to sync");
    }

    fn inbound(event_id: &str) -> NewInbound {
        NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame: vec![1],
            run_id: format!("run-{event_id}"),
            started: true,
            now_ms: 1,
            item: None,
        }
    }

    #[tokio::test]
    async fn a_deferred_run_end_is_kept_and_the_quiet_ledger_flushes_it() {
        let dir = tempfile::tempdir().unwrap();
        {
            let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
            let same = |frame: &[u8]| frame.first().map(|b| [*b; 32]);
            assert_eq!(
                ledger.record_inbound(inbound("e1"), same, None).await.unwrap(),
                Recorded::New { entry: None }
            );
            let ended = ledger
                .finish_run("a.b".into(), "e1".into(), RunEnd::Reply("hi".into()), None, 2)
                .await
                .unwrap();
            assert!(ended);
            // Quiet for longer than the flush delay: the thread synced the WAL by itself.
            tokio::time::sleep(FLUSH_DELAY * 3).await;
            let conn = Connection::open(dir.path().join(crate::ledger::DB_FILE)).unwrap();
            let flushes: i64 = conn
                .query_row(
                    "SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'flushed'",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            assert!(flushes >= 1, "{flushes}");
            drop(conn);
            ledger.close().await;
        }
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        assert!(ledger.recover(5).await.unwrap().is_empty(), "the ended run is not recovered");
    }
}
