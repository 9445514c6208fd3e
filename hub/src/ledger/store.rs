//! The ledger thread: one thread owns the SQLite connection and applies queued jobs in
//! batches, one transaction per batch — group commit. A caller's answer is released only
//! after its batch committed. A batch's jobs run without a savepoint each; when one fails the
//! batch is rolled back and redone with a savepoint per job, so the failed one leaves nothing.
//!
//! A job is [`Commit::Durable`] (the caller hears only once the batch is on the disk) or
//! [`Commit::Deferred`] (the caller hears once the batch is in the WAL: it survives a crash of
//! the hub at once, and power loss once the next durable sync, or the flush [`FLUSH_DELAY`]
//! after the ledger went quiet, synced the WAL). Under [`Durability::Full`] no commit waits
//! for the disk: the durable jobs of a batch go to the log syncer (`syncer.rs`), which answers
//! them after an `fdatasync` of the WAL, while this thread commits the next batch
//! ([`batch_plan`]). Under [`Durability::Strict`] every batch is committed with an fsync,
//! under [`Durability::Normal`] none is. While this thread is busy, its checkpoints are the
//! checkpointer's (`checkpointer.rs`), beside the commits.

use std::ffi::c_int;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use rusqlite::Connection;
use tokio::sync::mpsc::{Receiver, Sender};
use tracing::{error, info};

use super::LedgerError;
use super::checkpointer::{self, Checkpointer};
use super::journal::{Entry, Journal, Taken};
use super::schema::Durability;
use super::syncer::Syncer;

/// Jobs gathered into one transaction (a corked task's last message may add up to 63 more).
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

/// Messages waiting for the ledger thread (a job each, or a corked task's jobs, at most 64);
/// callers wait beyond this (backpressure).
pub const QUEUE_CAPACITY: usize = 8192;

/// The ledger's own measurements, kept by the ledger thread (the ledger imports nothing from
/// the hub, so it owns these handles and the registry only reads them).
#[derive(Debug, Clone)]
pub struct LedgerMetrics {
    /// Seconds from beginning a batch's transaction to its commit (with the log syncer, the
    /// fsync is not inside: see `sync_seconds`).
    pub commit_seconds: Histogram,
    /// Jobs (ledger calls) per committed batch.
    pub batch_jobs: Histogram,
    /// Seconds each `fdatasync` of the write-ahead log by the log syncer took, one sample per
    /// sync (`durability = "full"`).
    pub sync_seconds: Histogram,
    /// Seconds each checkpoint pass of the checkpointer took (copying the write-ahead log
    /// back into the database file, with its fsyncs).
    pub checkpoint_seconds: Histogram,
}

impl Default for LedgerMetrics {
    fn default() -> Self {
        Self {
            // 0.1 ms to about 15 s.
            commit_seconds: Histogram::new(exponential_buckets(0.0001, 2.5, 14)),
            // 1 to 1024 jobs (the most one batch takes).
            batch_jobs: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            // 0.05 ms to about 4 s.
            sync_seconds: Histogram::new(exponential_buckets(0.00005, 2.5, 13)),
            // 1 ms to about 60 s.
            checkpoint_seconds: Histogram::new(exponential_buckets(0.001, 2.5, 13)),
        }
    }
}

/// A unit of work: a ledger call, run inside its batch's transaction, then told whether the
/// batch committed.
pub trait Work: Send {
    /// Runs the call in `txn`, in a savepoint of its own when `savepoint`; false when it
    /// failed. Run again (in a new transaction) when the batch is redone, so it must not
    /// act outside the database.
    fn run(&mut self, txn: &Connection, savepoint: bool) -> bool;
    /// A durable job's batch committed and the log syncer will sync it (`durability =
    /// "full"`): a call that answers at its commit answers now, and hears the sync in
    /// [`finish`](Work::finish). Not called when the batch did not commit, nor when the
    /// commit was as durable as asked by itself.
    fn committed(&mut self) {}
    /// Tells the caller, once the batch's commit is known (`Ok`: committed; else why not).
    fn finish(self: Box<Self>, outcome: Result<(), LedgerError>);
}

/// A queued unit of work.
pub type Job = Box<dyn Work>;

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
    /// A corked task's calls (`cork.rs`), in order: they go into one batch.
    Jobs(Vec<(Job, Commit)>),
    /// Apply what is queued before this, checkpoint the WAL and end the thread.
    Stop,
}

/// What the ledger's calls leave to be written behind them (`history.rs`: entries held on
/// this thread and moved into their table in bulk), as the thread drives it: what a call
/// held is kept only if its batch commits, and what a move wrote is forgotten only then.
#[derive(Clone, Copy)]
pub struct Behind {
    /// First thing on the thread: what a crash left unwritten is rebuilt.
    pub start: fn(&Connection) -> Result<(), LedgerError>,
    /// The state to return to when what follows does not commit.
    pub mark: fn() -> BehindMark,
    pub undo: fn(BehindMark),
    /// In a batch's transaction after its calls: writes what is due (all of it with `true`);
    /// whether it wrote anything.
    pub write: fn(&Connection, bool) -> Result<bool, LedgerError>,
    /// The transaction committed: what it wrote is forgotten.
    pub committed: fn(),
    /// Whether anything is held.
    pub holding: fn() -> bool,
}

/// The sends held in the journal (`journal.rs`): the thread writes them first in every
/// batch, so any call queued after a send was held finds its row.
#[derive(Clone)]
pub struct Held {
    /// None for a ledger in memory: every send is recorded before it is handed over.
    pub journal: Option<Arc<Journal>>,
    /// Writes one held send's row.
    pub write: fn(&Connection, &Entry) -> Result<(), LedgerError>,
}

impl Held {
    /// No journal (tests of the thread alone).
    #[cfg(test)]
    pub const NONE: Held = Held { journal: None, write: |_, _| Ok(()) };

    /// Takes the held sends as a batch begins.
    fn take(&self) -> Taken {
        self.journal.as_ref().map(|journal| journal.take()).unwrap_or_default()
    }

    /// Writes `taken`'s rows; when one fails, the transaction holds part of them (the caller
    /// rolls back, or writes them in a savepoint).
    fn write(&self, txn: &Connection, taken: &Taken) -> Result<(), LedgerError> {
        taken.held.iter().try_for_each(|entry| (self.write)(txn, entry))
    }

    /// After the batch: rows written and committed let the journal forget them; otherwise
    /// they are held again for the next batch.
    fn settle(&self, taken: Taken, written: bool) {
        let Some(journal) = &self.journal else { return };
        if written { journal.committed(taken) } else { journal.restore(taken) }
    }

    fn holding(&self) -> bool {
        self.journal.as_ref().is_some_and(|journal| journal.holding())
    }
}

/// Where [`Behind::undo`] returns to (opaque to the thread): each written-behind table's
/// [`HeldMark`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BehindMark {
    pub history: HeldMark,
    pub items: HeldMark,
}

/// What one table's held rows were at a mark: how many were held, how many the open
/// transaction had written, and the table's own counter (history's generation, the next
/// item id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeldMark(usize, usize, i64);

/// One table's rows written behind the calls that logged them (history entries, inbox
/// items), in the order logged, with how many the open transaction has written. Each table
/// keeps its own on the ledger thread and drives it through [`Behind`].
#[derive(Debug)]
pub struct HeldRows<T> {
    rows: Vec<T>,
    written: usize,
}

impl<T> Default for HeldRows<T> {
    fn default() -> Self {
        Self { rows: Vec::new(), written: 0 }
    }
}

impl<T> HeldRows<T> {
    pub fn push(&mut self, row: T) {
        self.rows.push(row);
    }

    /// Where [`undo`](Self::undo) returns to, with the table's `counter` at this point.
    pub fn mark(&self, counter: i64) -> HeldMark {
        HeldMark(self.rows.len(), self.written, counter)
    }

    /// Forgets what was held and written since `mark` (its transaction, or its savepoint,
    /// did not commit); returns the table's counter at the mark.
    pub fn undo(&mut self, mark: HeldMark) -> i64 {
        self.rows.truncate(mark.0);
        self.written = mark.1;
        mark.2
    }

    /// The open transaction committed: what it wrote is no longer held.
    pub fn committed(&mut self) {
        let written = std::mem::take(&mut self.written);
        self.rows.drain(..written);
    }

    /// The rows no transaction wrote yet.
    pub fn waiting(&self) -> &[T] {
        &self.rows[self.written..]
    }

    /// The open transaction wrote every waiting row.
    pub fn all_written(&mut self) {
        self.written = self.rows.len();
    }
}

/// Writes a table's held rows with `write_held` when `at` of them wait, or any that wait
/// with `all`; whether it wrote. No savepoint of its own (it would copy every page the write
/// touches): a failed write leaves the rows held (`undo` to the `mark` before it) and the
/// transaction with part of the write, which the caller rolls back — a job that fails is
/// redone, and a failed write behind the jobs is dropped with its batch's first try
/// ([`apply`]).
pub fn write_held_rows(
    txn: &Connection,
    (waiting, at, all): (usize, usize, bool),
    write_held: fn(&Connection) -> Result<(), LedgerError>,
    mark: fn() -> HeldMark,
    undo: fn(HeldMark),
) -> Result<bool, LedgerError> {
    if waiting == 0 || (!all && waiting < at) {
        return Ok(false);
    }
    let before = mark();
    write_held(txn).inspect_err(|_| undo(before))?;
    Ok(true)
}

impl Behind {
    /// Nothing written behind (tests of the thread alone).
    #[cfg(test)]
    pub const NONE: Behind = Behind {
        start: |_| Ok(()),
        mark: BehindMark::default,
        undo: |_| {},
        write: |_, _| Ok(false),
        committed: || {},
        holding: || false,
    };
}

/// Spawns the ledger thread. It runs until it is sent [`Message::Stop`] or every sender is
/// dropped. Callers queue with `send().await`, which waits while the queue is full
/// (backpressure).
pub fn spawn(
    conn: Connection,
    durability: Durability,
    metrics: LedgerMetrics,
    storage: StorageFlag,
    behind: Behind,
    held: Held,
) -> std::io::Result<(Sender<Message>, JoinHandle<()>)> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Message>(QUEUE_CAPACITY);
    // A runtime of the thread's own, only for its timer: waiting for a job at most until a
    // flush is due.
    let timer = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let thread = std::thread::Builder::new().name("channeld-ledger".into()).spawn(move || {
        let mut conn = conn;
        let wal = wal_path(&conn);
        let checkpointer = start_checkpointer(&mut conn, &metrics);
        let mut thread = LedgerThread {
            conn,
            durability,
            storage,
            synchronous: None,
            unsynced: false,
            behind_failing: false,
            wal,
            syncer: None,
            checkpointer,
            behind,
            held,
        };
        thread.start_behind();
        thread.run(rx, &timer, &metrics);
    })?;
    Ok((tx, thread))
}

/// Starts the checkpointer for a ledger in a file and hooks it to the connection: the WAL
/// hook (which replaces SQLite's automatic checkpoint) reports the log's length after each
/// commit, and checkpoints on this thread when [`checkpointer::writer_checkpoints`] says so.
/// `None` for a ledger in memory, or when the checkpointer cannot start (the automatic
/// checkpoint stays).
fn start_checkpointer(conn: &mut Connection, metrics: &LedgerMetrics) -> Option<Checkpointer> {
    let path = conn.path().filter(|path| !path.is_empty())?.to_owned();
    let checkpointer = Checkpointer::start(Path::new(&path), metrics.checkpoint_seconds.clone())?;
    let mut reporter = checkpointer.reporter();
    let hooked = conn.wal_hook(Some(move |wal: &mut rusqlite::hooks::Wal, frames: c_int| {
        reporter.committed(wal, u32::try_from(frames).unwrap_or(0));
        Ok(())
    }));
    match hooked {
        Ok(()) => Some(checkpointer),
        Err(err) => {
            error!(error = %err, "ledger cannot hand its checkpoints over; the ledger thread checkpoints");
            checkpointer.finish();
            None
        }
    }
}

/// Removes the connection's WAL hook (dropping its reporter) and waits for the checkpointer
/// to end.
fn stop_checkpointer(conn: &mut Connection, checkpointer: Checkpointer) {
    let no_hook: Option<fn(&mut rusqlite::hooks::Wal, c_int) -> rusqlite::Result<()>> = None;
    if let Err(err) = conn.wal_hook(no_hook) {
        error!(error = %err, "ledger cannot remove its WAL hook");
    }
    checkpointer.finish();
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
    /// The last write of what is held behind failed (logged once until one succeeds: every
    /// batch, and the quiet loop every [`FLUSH_DELAY`], tries again).
    behind_failing: bool,
    /// The write-ahead log's file (none in memory), and the thread that syncs it, started
    /// with the first durable batch.
    wal: Option<std::path::PathBuf>,
    syncer: Option<Syncer>,
    /// The thread that checkpoints the write-ahead log (none in memory).
    checkpointer: Option<Checkpointer>,
    behind: Behind,
    held: Held,
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
            let first = if self.unsynced || (self.behind.holding)() {
                match timer.block_on(async { tokio::time::timeout(FLUSH_DELAY, rx.recv()).await }) {
                    Ok(message) => message,
                    Err(_) => {
                        // Quiet: what is held is written, then the log synced.
                        self.write_behind();
                        if self.unsynced {
                            self.flush();
                        }
                        continue;
                    }
                }
            } else {
                rx.blocking_recv()
            };
            match first {
                Some(Message::Job(job, commit)) => batch.push((job, commit)),
                Some(Message::Jobs(jobs)) => batch.extend(jobs),
                Some(Message::Stop) | None => stopping = true,
            }
            while !stopping && batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(Message::Job(job, commit)) => batch.push((job, commit)),
                    Ok(Message::Jobs(jobs)) => batch.extend(jobs),
                    Ok(Message::Stop) => stopping = true,
                    Err(_) => break,
                }
            }
            if !batch.is_empty() {
                if let Some(checkpointer) = &self.checkpointer {
                    checkpointer.set_busy(checkpointer::busy(!rx.is_empty(), batch.len()));
                }
                self.apply(&mut batch, metrics);
            }
        }
        // Jobs queued after the stop get `Unavailable` as their senders see the channel close.
        rx.close();
        if self.held.holding() {
            self.apply(&mut batch, metrics);
        }
        self.write_behind();
        if let Some(syncer) = self.syncer.take() {
            syncer.finish();
        }
        if let Some(checkpointer) = self.checkpointer.take() {
            stop_checkpointer(&mut self.conn, checkpointer);
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

    /// Rebuilds what a crash left unwritten behind (`Behind::start`), in a transaction of its
    /// own before any call.
    fn start_behind(&mut self) {
        let mark = (self.behind.mark)();
        let started = self.conn.transaction().map_err(LedgerError::from).and_then(|tx| {
            (self.behind.start)(&tx)?;
            tx.commit().map_err(LedgerError::from)
        });
        match started {
            Ok(()) => (self.behind.committed)(),
            Err(err) => {
                (self.behind.undo)(mark);
                error!(error = %err, "ledger could not rebuild the history and inbox items a crash left unwritten");
            }
        }
    }

    /// Writes everything held behind, in a deferred commit of its own (the ledger is quiet
    /// or stopping).
    fn write_behind(&mut self) {
        if !(self.behind.holding)() {
            return;
        }
        let plan = batch_plan(self.durability, false, self.syncer.is_some());
        self.set_sync(plan.commit);
        let mark = (self.behind.mark)();
        let written = self.conn.transaction().map_err(LedgerError::from).and_then(|tx| {
            (self.behind.write)(&tx, true)?;
            tx.commit().map_err(LedgerError::from)
        });
        match written {
            Ok(()) => {
                (self.behind.committed)();
                if self.durability == Durability::Full && plan.commit == "NORMAL" {
                    self.unsynced = true;
                }
                if std::mem::take(&mut self.behind_failing) {
                    info!("ledger writes the history it holds again");
                }
            }
            Err(err) => {
                (self.behind.undo)(mark);
                self.storage.note(&err);
                if !std::mem::replace(&mut self.behind_failing, true) {
                    error!(error = %err, "ledger could not write the history it holds; trying again while quiet");
                }
            }
        }
    }

    /// Syncs the WAL the deferred commits are in: a one-row durable commit (its fsync covers
    /// every frame before it).
    fn flush(&mut self) {
        self.set_sync("FULL");
        let flushed = self.conn.prepare_cached(
            "INSERT INTO meta (key, value) VALUES ('flushed', '1')
             ON CONFLICT (key) DO UPDATE SET value = CAST(value AS INTEGER) + 1",
        );
        match flushed.and_then(|mut statement| statement.execute([])) {
            Ok(_) => self.unsynced = false,
            Err(err) => error!(error = %err, "ledger flush failed"),
        }
    }

    /// Applies a batch as [`batch_plan`] says and answers its jobs. When the sync after a
    /// batch fails, its durable jobs hear that error: their writes are committed (a hub crash
    /// keeps them) but not known to be on the disk.
    fn apply(&mut self, batch: &mut Vec<(Job, Commit)>, metrics: &LedgerMetrics) {
        let any_durable = batch.iter().any(|(_, commit)| *commit == Commit::Durable);
        if any_durable && self.durability == Durability::Full && self.syncer.is_none() {
            let (storage, seconds) = (self.storage.clone(), metrics.sync_seconds.clone());
            self.syncer = self.wal.as_deref().and_then(|wal| Syncer::start(wal, storage, seconds));
        }
        let plan = batch_plan(self.durability, any_durable, self.syncer.is_some());
        self.set_sync(plan.commit);
        let behind = (self.behind, &mut self.behind_failing);
        let outcome = apply(&self.conn, batch, metrics, &self.storage, behind, &self.held);
        match (outcome.is_ok(), self.durability, plan.commit) {
            (true, Durability::Full, "NORMAL") => self.unsynced = true,
            (true, _, "FULL") => self.unsynced = false,
            _ => {}
        }
        let syncer = match (&self.syncer, plan.sync_after, &outcome) {
            (Some(syncer), true, Ok(())) => syncer,
            _ => {
                for (job, _) in batch.drain(..) {
                    job.finish(outcome.clone());
                }
                return;
            }
        };
        // The sync begins before anyone hears of the commit: the answers below wake their
        // callers, which (on one CPU) ran first and queued the next batch, and its commit
        // went before the sync (an inbound's `accepted` waited for its run's end's commit).
        syncer.committed();
        let mut durable = Vec::with_capacity(batch.len());
        for (mut job, commit) in batch.drain(..) {
            match commit {
                Commit::Deferred => job.finish(Ok(())),
                Commit::Durable => {
                    job.committed();
                    durable.push(job);
                }
            }
        }
        syncer.after_sync(durable);
        // The sync it asked for covers the deferred commits before it.
        self.unsynced = false;
    }
}

/// Applies `batch` in one transaction; returns whether it committed (the jobs stay in `batch`
/// to be told so).
///
/// The jobs run one after another without savepoints, and what is due behind them is written
/// after them, in the same transaction and without a savepoint either: a savepoint copies
/// every page written under it into its journal first (and SQLite allocates that journal
/// page by page), and nothing here fails often. When a job fails, the transaction is rolled
/// back and the batch redone with a savepoint per job, so the failed job leaves nothing
/// behind and the others their writes (and what a failed job held for `behind` is dropped).
/// When the write behind fails, the batch is redone the same way without it: what it would
/// have written stays held for the next batch, and the jobs' writes stand.
fn apply(
    conn: &Connection,
    batch: &mut Vec<(Job, Commit)>,
    metrics: &LedgerMetrics,
    storage: &StorageFlag,
    (behind, failing): (Behind, &mut bool),
    held: &Held,
) -> Result<(), LedgerError> {
    let began = Instant::now();
    let jobs = batch.len();
    let changes_before = conn.total_changes();
    let mark = (behind.mark)();
    let taken = held.take();
    let mut tx = match begin(conn, batch) {
        Ok(tx) => tx,
        Err(err) => {
            held.settle(taken, false);
            return Err(err);
        }
    };
    // The held sends' rows first: the calls after them may settle them.
    let mut held_written = match held.write(&tx, &taken) {
        Ok(()) => true,
        Err(err) => {
            storage.note(&err);
            false
        }
    };
    let mut clean = held_written && batch.iter_mut().all(|(job, _)| job.run(&tx, false));
    let mut write_behind = true;
    if clean {
        // What is due behind the calls.
        match (behind.write)(&tx, false) {
            Ok(wrote) => behind_wrote(wrote, failing),
            Err(err) => {
                behind_failed(storage, failing, &err);
                (clean, write_behind) = (false, false);
            }
        }
    }
    if !clean {
        drop(tx);
        (behind.undo)(mark);
        tx = match begin(conn, batch) {
            Ok(tx) => tx,
            Err(err) => {
                held.settle(taken, false);
                return Err(err);
            }
        };
        // Held sends that cannot be written are held again; the calls still run.
        held_written = savepoint(&tx, |tx| held.write(tx, &taken)).is_ok();
        for (job, _) in batch.iter_mut() {
            let before = (behind.mark)();
            if !job.run(&tx, true) {
                (behind.undo)(before);
            }
        }
        // A job failed: what is due behind the others is written in a savepoint of its own,
        // so a failure leaves it held and their writes standing.
        if write_behind {
            let before = (behind.mark)();
            match savepoint(&tx, |tx| (behind.write)(tx, false)) {
                Ok(wrote) => behind_wrote(wrote, failing),
                Err(err) => {
                    (behind.undo)(before);
                    behind_failed(storage, failing, &err);
                }
            }
        }
    }
    let outcome = commit(tx, changes_before, began, jobs, metrics, storage);
    held.settle(taken, held_written && outcome.is_ok());
    match outcome {
        Ok(()) => (behind.committed)(),
        Err(_) => (behind.undo)(mark),
    }
    outcome
}

/// Notes a write behind the calls that wrote something: after failures, it says so once.
fn behind_wrote(wrote: bool, failing: &mut bool) {
    if wrote && std::mem::take(failing) {
        info!("ledger writes the history it holds again");
    }
}

/// Notes a failed write behind the calls (logged once until one succeeds again).
fn behind_failed(storage: &StorageFlag, failing: &mut bool, err: &LedgerError) {
    storage.note(err);
    if !std::mem::replace(failing, true) {
        error!(error = %err, "ledger could not write the history it holds; the next batches try again");
    }
}

/// Begins a batch's transaction. When it cannot, the batch's jobs are dropped unrun: their
/// callers hear `Unavailable`.
fn begin<'c>(
    conn: &'c Connection,
    batch: &mut Vec<(Job, Commit)>,
) -> Result<Batch<'c>, LedgerError> {
    Batch::begin(conn).map_err(|err| {
        error!(error = %err, "ledger cannot begin a transaction");
        batch.clear();
        LedgerError::Commit
    })
}

/// A batch's transaction, begun and committed with statements from the connection's cache:
/// rusqlite's `Transaction` runs `BEGIN` and `COMMIT` through `execute_batch`, which parses
/// them again for every transaction (5 % of the ledger thread on a sequential durable send,
/// BENCHMARKS.md thirty-first round). Dropped without a commit, or after a commit that
/// failed and left the transaction open, it rolls back.
struct Batch<'c> {
    conn: &'c Connection,
}

impl<'c> Batch<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        Ok(Self { conn })
    }

    fn commit(self) -> rusqlite::Result<()> {
        self.conn.prepare_cached("COMMIT")?.execute([]).map(drop)
    }
}

impl std::ops::Deref for Batch<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        // After a commit the connection is back in autocommit; a commit that failed may have
        // rolled back already (SQLite does on a full disk) or left the transaction open.
        if !self.conn.is_autocommit()
            && let Err(err) = self.conn.prepare_cached("ROLLBACK").and_then(|mut s| s.execute([]))
        {
            error!(error = %err, "ledger cannot roll a batch back");
        }
    }
}

/// Commits a batch's transaction and observes it.
fn commit(
    tx: Batch<'_>,
    changes_before: u64,
    began: Instant,
    jobs: usize,
    metrics: &LedgerMetrics,
    storage: &StorageFlag,
) -> Result<(), LedgerError> {
    // Only a batch that wrote proves there is room again (an empty one writes nothing).
    let wrote = tx.total_changes() > changes_before;
    match tx.commit() {
        Ok(()) => {
            metrics.commit_seconds.observe(began.elapsed().as_secs_f64());
            metrics.batch_jobs.observe(jobs as f64);
            if wrote {
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
    }
}

/// Runs `f` in a savepoint so a failing job leaves no partial writes in its batch.
pub fn savepoint<T>(
    txn: &Connection,
    f: impl FnOnce(&Connection) -> Result<T, LedgerError>,
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
    use rusqlite::OptionalExtension;

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

    /// A batch's transaction is immediate, commits what it wrote, rolls back when dropped
    /// uncommitted, and reuses its statements instead of preparing them again.
    #[test]
    fn a_batch_commits_or_rolls_back_with_cached_statements() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();
        let count = |conn: &Connection| -> i64 {
            conn.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap()
        };

        let batch = Batch::begin(&conn).unwrap();
        assert!(!conn.is_autocommit());
        batch.execute("INSERT INTO t VALUES (1)", []).unwrap();
        drop(batch);
        assert!(conn.is_autocommit());
        assert_eq!(count(&conn), 0, "an uncommitted batch rolls back");

        for x in 0..3 {
            let batch = Batch::begin(&conn).unwrap();
            batch.execute("INSERT INTO t VALUES (?1)", [x]).unwrap();
            batch.commit().unwrap();
            assert!(conn.is_autocommit());
        }
        assert_eq!(count(&conn), 3);

        // Both statements stay prepared in the cache, to be run again (rusqlite's own
        // transactions finalize theirs).
        let mut prepared = Vec::new();
        // SAFETY: the handle is the live connection's; the statements it lists and their
        // text are only read, while the connection and its cache are not used.
        unsafe {
            let db = conn.handle();
            let mut stmt = rusqlite::ffi::sqlite3_next_stmt(db, std::ptr::null_mut());
            while !stmt.is_null() {
                let sql = std::ffi::CStr::from_ptr(rusqlite::ffi::sqlite3_sql(stmt));
                prepared.push(sql.to_string_lossy().into_owned());
                stmt = rusqlite::ffi::sqlite3_next_stmt(db, stmt);
            }
        }
        for sql in ["BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"] {
            assert_eq!(prepared.iter().filter(|s| *s == sql).count(), 1, "{sql} in {prepared:?}");
        }
    }

    fn thread(conn: Connection) -> LedgerThread {
        LedgerThread {
            wal: wal_path(&conn),
            conn,
            durability: Durability::Full,
            storage: StorageFlag::default(),
            synchronous: None,
            unsynced: false,
            behind_failing: false,
            syncer: None,
            checkpointer: None,
            behind: Behind::NONE,
            held: Held::NONE,
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
        let metrics = LedgerMetrics::default();
        let heard = Heard::watching(&metrics.sync_seconds);
        let job = |name: &'static str| TestJob::boxed(name, false, &heard);
        let flushes = |conn: &Connection| -> i64 {
            conn.query_row(
                "SELECT COALESCE((SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'flushed'), 0)",
                [],
                |r| r.get(0),
            )
            .unwrap()
        };

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
        let syncs = heard.syncs_seen();
        let committed = heard.committed.lock().unwrap().clone();
        let heard = heard.calls.lock().unwrap().clone();
        if on_disk {
            // Each durable job was told of its commit, and heard after the deferred one (at
            // its commit; the sync, begun at the commit, may have ended by then or not).
            assert_eq!(committed, ["durable", "only durable"]);
            assert_eq!(heard[0], ("deferred", true), "{heard:?}");
            assert_eq!(heard[1..].len(), 2);
            assert!(heard[1..].contains(&("durable", true)), "{heard:?}");
            assert!(heard[1..].contains(&("only durable", true)), "{heard:?}");
            // The syncer's fdatasync ran (and was counted) before a durable job heard.
            assert!(syncs[1..].iter().all(|(_, seen)| *seen >= 1), "{syncs:?}");
        } else {
            assert_eq!(heard, [("durable", true), ("deferred", true), ("only durable", true)]);
            assert!(committed.is_empty(), "the commit was the sync: {committed:?}");
            assert!(syncs.iter().all(|(_, seen)| *seen == 0), "the commit synced: {syncs:?}");
        }
        assert_eq!(flushes(&thread.conn), 0, "no extra commit to sync");
    }

    /// What the test jobs' callers heard: (job, whether its call and commit succeeded), and,
    /// when watching, how many syncs the log syncer had made when each heard.
    #[derive(Default, Clone)]
    struct Heard {
        calls: Arc<std::sync::Mutex<Vec<(&'static str, bool)>>>,
        syncs: Option<(Histogram, SyncsSeen)>,
        /// The jobs told their batch committed (before the syncer answers them).
        committed: Arc<std::sync::Mutex<Vec<&'static str>>>,
    }

    /// Per job that heard, the log syncer's syncs by then.
    type SyncsSeen = Arc<std::sync::Mutex<Vec<(&'static str, u64)>>>;

    impl Heard {
        fn watching(syncs: &Histogram) -> Self {
            let syncs = Some((syncs.clone(), Arc::default()));
            Self { calls: Arc::default(), syncs, committed: Arc::default() }
        }

        fn syncs_seen(&self) -> Vec<(&'static str, u64)> {
            self.syncs.as_ref().map(|(_, seen)| seen.lock().unwrap().clone()).unwrap_or_default()
        }
    }

    /// A job that writes a `meta` row named after it, and then fails when `fails`.
    struct TestJob {
        name: &'static str,
        fails: bool,
        runs: Arc<std::sync::atomic::AtomicUsize>,
        ran: Option<bool>,
        heard: Heard,
    }

    impl TestJob {
        fn boxed(name: &'static str, fails: bool, heard: &Heard) -> Job {
            Self::counted(name, fails, heard).0
        }

        fn counted(
            name: &'static str,
            fails: bool,
            heard: &Heard,
        ) -> (Job, Arc<std::sync::atomic::AtomicUsize>) {
            let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let job = Self { name, fails, runs: runs.clone(), ran: None, heard: heard.clone() };
            (Box::new(job), runs)
        }
    }

    impl Work for TestJob {
        fn run(&mut self, txn: &Connection, savepoint: bool) -> bool {
            self.runs.fetch_add(1, Ordering::SeqCst);
            let work = |txn: &Connection| {
                txn.execute("INSERT INTO meta (key, value) VALUES (?1, 'x')", [self.name])?;
                if self.fails { Err(LedgerError::Sql("refused".into())) } else { Ok(()) }
            };
            let result = if savepoint { super::savepoint(txn, work) } else { work(txn) };
            self.ran = Some(result.is_ok());
            result.is_ok()
        }

        fn committed(&mut self) {
            self.heard.committed.lock().unwrap().push(self.name);
        }

        fn finish(self: Box<Self>, outcome: Result<(), LedgerError>) {
            let ok = outcome.is_ok() && self.ran == Some(true);
            self.heard.calls.lock().unwrap().push((self.name, ok));
            if let Some((syncs, seen)) = &self.heard.syncs {
                seen.lock().unwrap().push((self.name, syncs.count()));
            }
        }
    }

    /// Commits `commits` rows of about three WAL frames each (a row with two overflow
    /// pages) through a connection hooked to a checkpointer, the ledger thread `busy` or not;
    /// the checkpointer's passes and the frames the log file grew to.
    fn commit_through_the_checkpointer(busy: bool, commits: u32) -> (u64, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.sqlite3");
        let mut conn = crate::ledger::schema::open(&path, Durability::Normal).unwrap();
        let metrics = LedgerMetrics::default();
        let checkpointer = start_checkpointer(&mut conn, &metrics).expect("a ledger in a file");
        checkpointer.set_busy(busy);
        for n in 0..commits {
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?1, randomblob(8000))",
                [format!("k{n}")],
            )
            .unwrap();
        }
        stop_checkpointer(&mut conn, checkpointer);
        let rows: u32 = conn.query_row("SELECT COUNT(*) FROM meta", [], |r| r.get(0)).unwrap();
        assert!(rows >= commits);
        let wal = std::fs::metadata(dir.path().join("ledger.sqlite3-wal")).unwrap().len();
        (metrics.checkpoint_seconds.count(), wal / (4096 + 24))
    }

    /// A busy ledger thread hands its checkpoints to the checkpointer: its passes copy the
    /// log back while the connection commits, and the log restarts (its file stays within
    /// twice the limit) although nothing pauses between the commits.
    #[test]
    fn the_checkpointer_copies_the_log_back_and_the_log_stays_bounded() {
        use crate::ledger::checkpointer::LOG_LIMIT;
        let (passes, frames) = commit_through_the_checkpointer(true, LOG_LIMIT);
        assert!(passes >= 1, "the checkpointer made a pass");
        assert!(frames <= 2 * u64::from(LOG_LIMIT) + 16, "the log grew to {frames} frames");
    }

    /// A ledger thread that is not busy checkpoints itself, as SQLite would: the thread makes
    /// no pass, and the log restarts after its first thousand frames.
    #[test]
    fn an_idle_ledger_thread_checkpoints_itself() {
        use crate::ledger::checkpointer::CHECKPOINT_FRAMES;
        let (passes, frames) = commit_through_the_checkpointer(false, CHECKPOINT_FRAMES);
        assert_eq!(passes, 0, "the checkpointer made no pass");
        assert!(frames <= u64::from(CHECKPOINT_FRAMES) + 16, "the log grew to {frames} frames");
    }

    #[test]
    fn jobs_run_once_without_savepoints_and_a_failure_redoes_the_batch_with_them() {
        let conn = crate::ledger::schema::open_in_memory().unwrap();
        let mut thread = thread(conn);
        let metrics = LedgerMetrics::default();
        let heard = Heard::default();
        let (first, first_runs) = TestJob::counted("first", false, &heard);
        let (second, second_runs) = TestJob::counted("second", false, &heard);
        let mut batch = vec![(first, Commit::Deferred), (second, Commit::Deferred)];
        thread.apply(&mut batch, &metrics);
        assert_eq!(first_runs.load(Ordering::SeqCst), 1);
        assert_eq!(second_runs.load(Ordering::SeqCst), 1);

        let (before, before_runs) = TestJob::counted("before", false, &heard);
        let (failing, failing_runs) = TestJob::counted("failing", true, &heard);
        let (after, after_runs) = TestJob::counted("after", false, &heard);
        let mut batch = vec![
            (before, Commit::Deferred),
            (failing, Commit::Deferred),
            (after, Commit::Deferred),
        ];
        thread.apply(&mut batch, &metrics);
        // The fast pass stopped at the failure; the redo ran each once more in a savepoint.
        assert_eq!(before_runs.load(Ordering::SeqCst), 2);
        assert_eq!(failing_runs.load(Ordering::SeqCst), 2);
        assert_eq!(after_runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            *heard.calls.lock().unwrap(),
            [
                ("first", true),
                ("second", true),
                ("before", true),
                ("failing", false),
                ("after", true)
            ]
        );
        let names: Vec<String> = {
            let mut statement =
                thread.conn.prepare("SELECT key FROM meta WHERE value = 'x' ORDER BY key").unwrap();
            statement.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
        };
        assert_eq!(names, ["after", "before", "first", "second"], "the failed job left nothing");
    }

    thread_local! {
        /// Whether [`FLAKY_BEHIND`]'s write fails, and how often its rows were undone.
        static BEHIND_FAILS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        static BEHIND_UNDONE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A write behind that adds to a `behind` row in `meta`, then fails while
    /// `BEHIND_FAILS`.
    const FLAKY_BEHIND: Behind = Behind {
        start: |_| Ok(()),
        mark: BehindMark::default,
        undo: |_| BEHIND_UNDONE.with(|n| n.set(n.get() + 1)),
        write: |txn, _| {
            txn.execute(
                "INSERT INTO meta (key, value) VALUES ('behind', 'y')
                 ON CONFLICT (key) DO UPDATE SET value = value || 'y'",
                [],
            )?;
            if BEHIND_FAILS.with(std::cell::Cell::get) {
                Err(LedgerError::StorageFull)
            } else {
                Ok(true)
            }
        },
        committed: || {},
        holding: || false,
    };

    /// What [`FLAKY_BEHIND`] wrote and kept (`None`: nothing committed).
    fn behind_row(conn: &Connection) -> Option<String> {
        conn.query_row("SELECT value FROM meta WHERE key = 'behind'", [], |r| r.get(0))
            .optional()
            .unwrap()
    }

    /// The write behind the jobs runs without a savepoint; when it fails, the batch is
    /// redone without it: the jobs' writes stand, none of its own, and what it held is
    /// undone (held for the next batch). The next batch writes it.
    #[test]
    fn a_failed_write_behind_redoes_the_batch_without_it() {
        let conn = crate::ledger::schema::open_in_memory().unwrap();
        let mut thread = thread(conn);
        thread.behind = FLAKY_BEHIND;
        let metrics = LedgerMetrics::default();
        let heard = Heard::default();

        BEHIND_FAILS.with(|fails| fails.set(true));
        let (first, first_runs) = TestJob::counted("first", false, &heard);
        let (second, second_runs) = TestJob::counted("second", false, &heard);
        let mut batch = vec![(first, Commit::Deferred), (second, Commit::Durable)];
        thread.apply(&mut batch, &metrics);
        assert_eq!(first_runs.load(Ordering::SeqCst), 2, "run, then redone");
        assert_eq!(second_runs.load(Ordering::SeqCst), 2, "run, then redone");
        assert_eq!(*heard.calls.lock().unwrap(), [("first", true), ("second", true)]);
        assert_eq!(behind_row(&thread.conn), None, "the failed write left nothing");
        assert!(BEHIND_UNDONE.with(std::cell::Cell::get) >= 1, "what it held was undone");
        assert!(thread.behind_failing);

        BEHIND_FAILS.with(|fails| fails.set(false));
        let (third, third_runs) = TestJob::counted("third", false, &heard);
        let mut batch = vec![(third, Commit::Deferred)];
        thread.apply(&mut batch, &metrics);
        assert_eq!(third_runs.load(Ordering::SeqCst), 1);
        assert_eq!(behind_row(&thread.conn).as_deref(), Some("y"), "written once, by this batch");
        assert!(!thread.behind_failing);
        let names: Vec<String> = {
            let mut statement =
                thread.conn.prepare("SELECT key FROM meta WHERE value = 'x' ORDER BY key").unwrap();
            statement.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
        };
        assert_eq!(names, ["first", "second", "third"]);
    }

    /// A write behind that succeeds in a batch redone for a failed job ends the failing
    /// state as one in a clean batch does (the next failure is logged again).
    #[test]
    fn a_write_behind_in_a_redone_batch_ends_the_failing_state() {
        let conn = crate::ledger::schema::open_in_memory().unwrap();
        let mut thread = thread(conn);
        thread.behind = FLAKY_BEHIND;
        thread.behind_failing = true;
        BEHIND_FAILS.with(|fails| fails.set(false));
        let metrics = LedgerMetrics::default();
        let heard = Heard::default();
        let (good, _) = TestJob::counted("good", false, &heard);
        let (bad, _) = TestJob::counted("bad", true, &heard);
        let mut batch = vec![(good, Commit::Deferred), (bad, Commit::Deferred)];
        thread.apply(&mut batch, &metrics);
        assert_eq!(*heard.calls.lock().unwrap(), [("good", true), ("bad", false)]);
        assert_eq!(behind_row(&thread.conn).as_deref(), Some("y"), "written in the redone batch");
        assert!(!thread.behind_failing, "the write behind succeeded");
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
                ledger.record_inbound_now(inbound("e1"), same, None).await.unwrap(),
                Recorded::New { entry: None }
            );
            let ended = ledger
                .finish_run("a.b".into(), "e1".into(), RunEnd::Reply("hi".into()), None, false, 2)
                .await
                .unwrap();
            assert!(ended.ended);
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
