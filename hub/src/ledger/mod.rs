//! The durable ledger: inbound runs (dedupe, recovery), the delivery of their replies, the
//! outbox of proactive sends, and conversation session generations, in one SQLite database in
//! the hub's state directory.
//!
//! The work is done by synchronous functions over one transaction (`inbound.rs`,
//! `replies.rs`, `outbox.rs`, `sessions.rs`, with the state machines in `state.rs` and
//! `reply_state.rs`); [`Ledger`] queues
//! them to the ledger thread (`store.rs`), which commits them in batches. Every call returns
//! only after the transaction holding it committed. Without a state directory the ledger is
//! off: calls that need it fail with [`LedgerError::Off`] and the hub keeps the in-memory
//! behaviour of a hub without durability.
//!
//! Architecture invariant: the ledger imports nothing from the rest of the hub.

mod checkpointer;
mod cork;
pub mod drivers;
pub mod history;
pub mod inbound;
pub mod items;
mod journal;
mod lock;
pub mod ops;
pub mod outbox;
pub mod replies;
pub mod reply_state;
mod schema;
pub mod sessions;
pub mod state;
mod store;
mod syncer;
mod walbuf;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

use lock::StateLock;

pub use cork::{corked, release};
pub use history::{HistoryEntry, NewHistory};
pub use inbound::{NewInbound, PendingReply, Recorded, RecoveredRun, Rehash, RunEnd, StoredRun};
pub use items::{Item, ItemView, NewItem};
pub use outbox::{Added, Claimed, NewSend, OutboxIds, OutboxRecord, OutboxSummary};
pub use replies::{
    HandedReply, NewReply, ReplyAnswer, ReplyCount, ReplyRecord, Settled, StoredReply,
};
pub use reply_state::{Answer, ReplyState};
pub use schema::Durability;
pub use state::{InboundState, OutboxState};
pub use store::{Commit, FLUSH_DELAY, LedgerMetrics, QUEUE_CAPACITY, StorageFlag};

/// What the ledger writes behind its calls: history entries (`history.rs`) and inbox items
/// (`items.rs`), each held on the ledger thread and written in bulk.
const BEHIND: store::Behind = store::Behind {
    start: |txn| history::rebuild(txn).and_then(|()| items::rebuild(txn)),
    mark: || store::BehindMark { history: history::mark(), items: items::mark() },
    undo: |mark| {
        history::undo(mark.history);
        items::undo(mark.items);
    },
    write: |txn, all| Ok(history::write(txn, all)? | items::write(txn, all)?),
    committed: || {
        history::committed();
        items::committed();
    },
    holding: || history::holding() || items::holding(),
};

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
    /// `SQLITE_FULL`: no space left for the database or its log. Retryable: it clears by
    /// itself once space returns.
    #[error("the ledger's storage is full (no space left on the state directory's file system)")]
    StorageFull,
    #[error("ledger database error: {0}")]
    Sql(String),
    #[error("cannot open the ledger at {}: {message}", .path.display())]
    Open { path: PathBuf, message: String },
    /// The state directory or the database file cannot be used as it is; restarting the hub
    /// cannot help, an operator must act (`remedy` says how).
    #[error("cannot use {}: {problem}; {remedy}", .path.display())]
    Unusable { path: PathBuf, problem: String, remedy: &'static str },
    #[error("the state directory {} is in use by another hub ({})", .dir.display(), holder(*.pid))]
    InUse { dir: PathBuf, pid: Option<u32> },
    #[error("outbox record {0} does not exist")]
    NoSuchRecord(i64),
    #[error("outbox record {id} is {state}; only unknown or failed records can be retried")]
    NotRetryable { id: i64, state: OutboxState },
    #[error("reply {0} does not exist")]
    NoSuchReply(i64),
    #[error("reply {id} is {state}; only unknown, failed or expired replies can be retried")]
    ReplyNotRetryable { id: i64, state: ReplyState },
}

/// What to do about a state directory the hub cannot create or write.
const REMEDY_DIR: &str = "make the state directory writable by the hub's user (or mount its \
     file system read-write), or set hub.state_dir (--state-dir) to one that is";
/// What to do about a corrupted database.
const REMEDY_CORRUPT: &str = "stop the hub, move the file aside (keep it for recovery), then \
     restore a backup made with `channeld ledger backup` or start with an empty ledger";
/// What to do about a database from a newer channeld.
const REMEDY_NEWER: &str = "run the channeld version that wrote it (or a newer one), or \
     restore a backup made by this version";

/// Creates `dir` (mode 0700) if it is missing and checks the hub may write in it.
fn check_state_dir(dir: &Path) -> Result<(), LedgerError> {
    let fail = |problem: String| LedgerError::Unusable {
        path: dir.to_owned(),
        problem,
        remedy: REMEDY_DIR,
    };
    std::fs::create_dir_all(dir)
        .map_err(|err| fail(format!("cannot create the state directory: {err}")))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    rustix::fs::access(dir, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK)
        .map_err(|err| fail(format!("the state directory is not writable: {err}")))
}

/// The database file at `path` cannot be used: which problem, and the remedy.
/// The record a held send is written as: `sent`, one attempt, no key.
fn held_send(entry: &journal::Entry) -> NewSend {
    NewSend {
        instance: entry.instance.clone(),
        idempotency_key: None,
        message: entry.message.clone().into_bytes(),
        state: OutboxState::Sent,
        now_ms: entry.now_ms,
        expires_ms: entry.expires_ms,
    }
}

/// Writes a held send's row (the ledger thread, first in a batch; or the recovery).
fn write_held(txn: &Connection, entry: &journal::Entry) -> Result<(), LedgerError> {
    outbox::insert(txn, entry.id, &held_send(entry))
}

/// Writes the journal's sends whose rows a crash left unwritten, as `sent` records (the
/// restart then makes them `unknown`), in one transaction synced before the journal is
/// emptied.
fn recover_held(conn: &rusqlite::Connection, held: &[journal::Entry]) -> Result<(), LedgerError> {
    if held.is_empty() {
        return Ok(());
    }
    // Synced before the journal is emptied, whatever the durability setting (the ledger
    // thread sets its own before its first batch).
    conn.pragma_update(None, "synchronous", "FULL")?;
    let txn = conn.unchecked_transaction()?;
    let mut written = 0;
    for entry in held {
        let exists = txn
            .query_row("SELECT 1 FROM outbox WHERE id = ?1", params![entry.id], |_| Ok(()))
            .optional()?
            .is_some();
        if !exists {
            write_held(&txn, entry)?;
            written += 1;
        }
    }
    txn.commit()?;
    if written > 0 {
        tracing::warn!(sends = written, "recorded sends a crash left in the send journal");
    }
    Ok(())
}

fn unusable(path: &Path, err: schema::OpenError) -> LedgerError {
    use schema::OpenError;
    let remedy = match &err {
        OpenError::Newer { .. } => REMEDY_NEWER,
        OpenError::Corrupt(_) => REMEDY_CORRUPT,
        OpenError::ReadOnly(_) => REMEDY_DIR,
        OpenError::Sql(_) => {
            return LedgerError::Open { path: path.to_owned(), message: err.to_string() };
        }
    };
    LedgerError::Unusable { path: path.to_owned(), problem: err.to_string(), remedy }
}

fn holder(pid: Option<u32>) -> String {
    pid.map_or_else(|| "pid unknown".to_owned(), |pid| format!("pid {pid}"))
}

impl From<rusqlite::Error> for LedgerError {
    fn from(err: rusqlite::Error) -> Self {
        if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
            return LedgerError::StorageFull;
        }
        LedgerError::Sql(err.to_string())
    }
}

/// A ledger call's function, what its last run returned, and the flag a full disk is noted
/// on: what [`Call`] and [`EarlyCall`] share.
struct Body<T, F> {
    f: F,
    result: Option<Result<T, LedgerError>>,
    storage: StorageFlag,
}

impl<T, F> Body<T, F>
where
    F: Fn(&Connection) -> Result<T, LedgerError>,
{
    fn new(f: F, storage: StorageFlag) -> Self {
        Self { f, result: None, storage }
    }

    /// Runs the function (in a savepoint of its own when `savepoint`); false when it failed.
    fn run(&mut self, txn: &Connection, savepoint: bool) -> bool {
        let result = if savepoint { store::savepoint(txn, &self.f) } else { (self.f)(txn) };
        if let Err(err) = &result {
            self.storage.note(err);
        }
        let ran = result.is_ok();
        self.result = Some(result);
        ran
    }

    /// What the last run returned; a call never run (its batch could not begin) is answered
    /// as its commit was.
    fn take(&mut self) -> Result<T, LedgerError> {
        self.result.take().unwrap_or(Err(LedgerError::Commit))
    }
}

/// A ledger call queued for the ledger thread: its body and where its caller waits.
struct Call<T, F> {
    body: Body<T, F>,
    done: oneshot::Sender<Result<T, LedgerError>>,
}

impl<T, F> store::Work for Call<T, F>
where
    T: Send,
    F: Fn(&Connection) -> Result<T, LedgerError> + Send,
{
    fn run(&mut self, txn: &Connection, savepoint: bool) -> bool {
        self.body.run(txn, savepoint)
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), LedgerError>) {
        let result = self.body.take();
        let _ = self.done.send(outcome.and(result));
    }
}

/// A durable call that answers once its batch is committed, before the log syncer made it
/// durable, with a [`Synced`] to hear that: its caller may start work meanwhile and waits
/// for the disk only before it tells anyone. Under `strict` and `normal` (no log syncer) it
/// answers once the commit is as durable as asked, with the sync already heard.
struct EarlyCall<T, F> {
    body: Body<T, F>,
    /// Taken when it answers at the commit.
    done: Option<oneshot::Sender<Result<(T, Synced), LedgerError>>>,
    /// Where the sync's outcome goes, once it answered at the commit.
    synced: Option<oneshot::Sender<Result<(), LedgerError>>>,
}

impl<T, F> store::Work for EarlyCall<T, F>
where
    T: Send,
    F: Fn(&Connection) -> Result<T, LedgerError> + Send,
{
    fn run(&mut self, txn: &Connection, savepoint: bool) -> bool {
        self.body.run(txn, savepoint)
    }

    fn committed(&mut self) {
        let Some(done) = self.done.take() else { return };
        let answer = self.body.take().map(|value| {
            let (tx, rx) = oneshot::channel();
            self.synced = Some(tx);
            (value, Synced(rx))
        });
        let _ = done.send(answer);
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), LedgerError>) {
        match (self.done.take(), self.synced.take()) {
            (Some(done), _) => {
                let answer = outcome.and(self.body.take());
                let _ = done.send(answer.map(|value| (value, Synced::heard(Ok(())))));
            }
            (None, Some(synced)) => {
                let _ = synced.send(outcome);
            }
            (None, None) => {}
        }
    }
}

/// Whether the sync after an early-answered commit reached the disk (see `EarlyCall`).
#[derive(Debug)]
#[must_use = "work started on an unsynced commit waits for it before telling anyone"]
pub struct Synced(oneshot::Receiver<Result<(), LedgerError>>);

impl Synced {
    fn heard(outcome: Result<(), LedgerError>) -> Self {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(outcome);
        Self(rx)
    }

    /// Waits for the sync: `Ok` once the commit is on the disk.
    pub async fn wait(self) -> Result<(), LedgerError> {
        self.0.await.map_err(|_| LedgerError::Unavailable)?
    }
}

/// What [`Ledger::finish_run`] recorded: whether the run's end was (false: the entry was not
/// running), and its reply when it was claimed for hand-over at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub ended: bool,
    pub handed: Option<HandedReply>,
}

/// A call queued on the ledger thread (or refused: the ledger is off or gone);
/// [`Pending::answer`] waits until its batch committed as the call asked.
#[derive(Debug)]
#[must_use = "a queued call runs anyway; its answer says whether it was committed"]
pub struct Pending<T>(Result<oneshot::Receiver<Result<T, LedgerError>>, LedgerError>);

impl<T> Pending<T> {
    /// In a corked task it first sends the calls the task holds (this one may be among them).
    pub async fn answer(self) -> Result<T, LedgerError> {
        cork::release().await;
        self.0?.await.map_err(|_| LedgerError::Unavailable)?
    }
}

/// A handle to the ledger thread. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    tx: Option<mpsc::Sender<store::Message>>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    /// The state directory's lock, released once the ledger thread has ended.
    lock: Arc<Mutex<Option<StateLock>>>,
    id: String,
    path: Option<PathBuf>,
    metrics: LedgerMetrics,
    storage: StorageFlag,
    /// Where direct sends are held before their rows are written (a ledger in a file).
    sends: Option<Arc<journal::Journal>>,
    outbox_ids: Arc<OutboxIds>,
}

impl Ledger {
    /// A ledger that records nothing.
    pub fn off() -> Self {
        Self {
            tx: None,
            thread: Arc::default(),
            lock: Arc::default(),
            id: String::new(),
            path: None,
            metrics: LedgerMetrics::default(),
            storage: StorageFlag::default(),
            sends: None,
            outbox_ids: Arc::new(OutboxIds::new(1)),
        }
    }

    /// Opens `dir/ledger.sqlite3`, creating the directory (mode 0700) and schema as needed.
    /// Only one ledger (one hub) at a time may use `dir`: another gets
    /// [`LedgerError::InUse`] naming the holder's pid.
    ///
    /// A state directory that cannot be created or written, a corrupted database and one
    /// written by a newer channeld are [`LedgerError::Unusable`], naming the path and what
    /// to do.
    pub fn open(dir: &Path, durability: Durability) -> Result<Self, LedgerError> {
        let path = dir.join(DB_FILE);
        let open_err = |message: String| LedgerError::Open { path: path.clone(), message };
        check_state_dir(dir)?;
        let lock = StateLock::acquire(dir)?;
        let conn = schema::open(&path, durability).map_err(|err| unusable(&path, err))?;
        let journal_err = |err: std::io::Error| LedgerError::Unusable {
            path: dir.to_owned(),
            problem: format!("its send journal ({}): {err}", journal::FILE),
            remedy: REMEDY_DIR,
        };
        let (sends, held) = journal::Journal::open(dir).map_err(journal_err)?;
        recover_held(&conn, &held).map_err(|err| open_err(err.to_string()))?;
        sends.recovered().map_err(journal_err)?;
        Self::start(conn, durability, Some(path.clone()), Some(lock), Some(sends))
            .map_err(|err| open_err(err.to_string()))
    }

    /// A ledger in memory: everything works, nothing survives the process (tests).
    pub fn in_memory() -> Result<Self, LedgerError> {
        let conn = schema::open_in_memory().map_err(|err| LedgerError::Sql(err.to_string()))?;
        Self::start(conn, Durability::Normal, None, None, None)
    }

    fn start(
        conn: rusqlite::Connection,
        durability: Durability,
        path: Option<PathBuf>,
        lock: Option<StateLock>,
        sends: Option<journal::Journal>,
    ) -> Result<Self, LedgerError> {
        let id = schema::ledger_id(&conn)?;
        let outbox_ids = Arc::new(OutboxIds::after_table(&conn)?);
        let sends = sends.map(Arc::new);
        let metrics = LedgerMetrics::default();
        let storage = StorageFlag::default();
        let held = store::Held { journal: sends.clone(), write: write_held };
        let (tx, thread) =
            store::spawn(conn, durability, metrics.clone(), storage.clone(), BEHIND, held)
                .map_err(|err| LedgerError::Sql(err.to_string()))?;
        Ok(Self {
            tx: Some(tx),
            thread: Arc::new(Mutex::new(Some(thread))),
            lock: Arc::new(Mutex::new(lock)),
            id,
            path,
            metrics,
            storage,
            sends,
            outbox_ids,
        })
    }

    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// The ledger thread's commit latency and batch sizes.
    pub fn metrics(&self) -> &LedgerMetrics {
        &self.metrics
    }

    /// Whether the last write failed for lack of space (`storage_full` in `status`).
    pub fn storage_full(&self) -> bool {
        self.storage.is_full()
    }

    /// A small real write (the `meta` row `storage_probe`), so a ledger marked full notices
    /// that space returned even when no message arrives. Clears or confirms the mark.
    pub fn probe_storage(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send + '_ {
        self.call(move |txn| {
            txn.execute(
                "INSERT INTO meta (key, value) VALUES ('storage_probe', ?1)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                params![now_ms.to_string()],
            )?;
            Ok(())
        })
    }

    /// Jobs queued for the ledger thread now (0 when off).
    pub fn queue_depth(&self) -> usize {
        self.tx.as_ref().map_or(0, |tx| tx.max_capacity() - tx.capacity())
    }

    /// Outbox records per instance and state.
    pub fn outbox_counts(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, OutboxState, u64)>, LedgerError>> + Send + '_
    {
        self.call(outbox::counts)
    }

    /// The database path, when on (and not in memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The wire request id of an outbox record: unique across databases.
    pub fn outbox_request_id(&self, id: i64) -> String {
        format!("ob-{}-{id}", self.id)
    }

    /// Runs `f` inside the next batch; resolves once that batch committed durably.
    fn call<T, F>(&self, f: F) -> impl Future<Output = Result<T, LedgerError>> + Send + '_
    where
        T: Send + 'static,
        F: Fn(&Connection) -> Result<T, LedgerError> + Send + 'static,
    {
        self.call_with(Commit::Durable, f)
    }

    /// Runs `f` inside the next batch; resolves once that batch committed as `commit` asks.
    /// `f` may run twice (the batch is redone when another call in it failed), so it only
    /// reads and writes the database (or registers what dropping its value withdraws, as
    /// [`outbox_add_watched`](Self::outbox_add_watched) does).
    ///
    /// This and the two below box the call before they return a future, which holds only
    /// the box: an `async fn` keeps its arguments for its whole life, so each level of a call
    /// held the closure (and all it captured) again, and every caller's future grew by those
    /// copies (BENCHMARKS.md, fix 22).
    fn call_with<T, F>(
        &self,
        commit: Commit,
        f: F,
    ) -> impl Future<Output = Result<T, LedgerError>> + Send + '_
    where
        T: Send + 'static,
        F: Fn(&Connection) -> Result<T, LedgerError> + Send + 'static,
    {
        // Not `queue_with(..).await.answer()`: the future would hold that one's future and
        // then `answer`'s beside it (the settle task grew to 1,568 bytes that way).
        let (done, answer) = oneshot::channel();
        let job = Box::new(Call { body: Body::new(f, self.storage.clone()), done });
        async move {
            self.queue_job(job, commit).await?;
            cork::release().await;
            answer.await.map_err(|_| LedgerError::Unavailable)?
        }
    }

    /// Queues `f` for the ledger thread, waiting only for room in its queue: calls run in
    /// the order they were queued, so a caller that must keep an order (a driver's frames)
    /// queues in that order and waits for the answers elsewhere.
    fn queue_with<T, F>(&self, commit: Commit, f: F) -> impl Future<Output = Pending<T>> + Send + '_
    where
        T: Send + 'static,
        F: Fn(&Connection) -> Result<T, LedgerError> + Send + 'static,
    {
        let (done, answer) = oneshot::channel();
        let job = Box::new(Call { body: Body::new(f, self.storage.clone()), done });
        async move { Pending(self.queue_job(job, commit).await.map(|()| answer)) }
    }

    /// [`queue_with`](Self::queue_with) for a durable call answered at its commit, with a
    /// [`Synced`] for the sync after it (see `EarlyCall`).
    fn queue_early<T, F>(&self, f: F) -> impl Future<Output = Pending<(T, Synced)>> + Send + '_
    where
        T: Send + 'static,
        F: Fn(&Connection) -> Result<T, LedgerError> + Send + 'static,
    {
        let (done, answer) = oneshot::channel();
        let body = Body::new(f, self.storage.clone());
        let job = Box::new(EarlyCall { body, done: Some(done), synced: None });
        async move { Pending(self.queue_job(job, Commit::Durable).await.map(|()| answer)) }
    }

    /// Hands `job` to the ledger thread, or to the corked task's cork. Waiting for room in
    /// the queue is the rare case, and boxed: the common one keeps the future small.
    async fn queue_job(&self, job: store::Job, commit: Commit) -> Result<(), LedgerError> {
        let Some(tx) = self.tx.as_ref() else { return Err(LedgerError::Off) };
        // A corked task holds it (`cork.rs`); else it goes now, after what the task held.
        let Some((job, commit)) = cork::hold(tx, job, commit) else { return Ok(()) };
        cork::release().await;
        match tx.try_send(store::Message::Job(job, commit)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(message)) => {
                Box::pin(tx.send(message)).await.map_err(|_| LedgerError::Unavailable)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(LedgerError::Unavailable),
        }
    }

    /// Answers once the ledger thread committed a batch queued now: the thread is alive and
    /// keeping up (the watchdog's liveness probe). Always `Ok` when the ledger is off.
    pub async fn ping(&self) -> Result<(), LedgerError> {
        if !self.is_on() {
            return Ok(());
        }
        self.call(|_| Ok(())).await
    }

    /// Applies what is queued, checkpoints the database and ends the ledger thread; later
    /// calls fail with [`LedgerError::Unavailable`]. Waits for the thread to finish.
    pub async fn close(&self) {
        let Some(tx) = &self.tx else { return };
        cork::release().await;
        let _ = tx.send(store::Message::Stop).await;
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        // The database is checkpointed and closed: another hub may have the directory now.
        drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// Records an inbound unless its event id is known; see [`Recorded`]. A new one's
    /// `history` entry (with the conversation's cap) is appended in the same step. Queued
    /// only: the caller keeps the order of the driver's frames. Answered once committed;
    /// the [`Synced`] says when the record is on the disk (a run may start meanwhile, but
    /// no one hears of the message before).
    pub fn record_inbound(
        &self,
        new: NewInbound,
        rehash: Rehash,
        history: Option<(NewHistory, usize)>,
    ) -> impl Future<Output = Pending<(Recorded, Synced)>> + Send + '_ {
        self.queue_early(move |txn| {
            let logged = history.as_ref().map(|(_, cap)| (*cap, history::generation()));
            let recorded = inbound::record(txn, &new, rehash, logged)?;
            if let (Recorded::New { .. }, Some((entry, cap))) = (&recorded, &history) {
                history::hold(entry.clone(), *cap);
            }
            Ok(recorded)
        })
    }

    /// [`Ledger::record_inbound`] and its answer, for tests that need no order kept.
    #[cfg(test)]
    pub(crate) async fn record_inbound_now(
        &self,
        new: NewInbound,
        rehash: Rehash,
        history: Option<(NewHistory, usize)>,
    ) -> Result<Recorded, LedgerError> {
        let (recorded, synced) = self.record_inbound(new, rehash, history).await.answer().await?;
        synced.wait().await?;
        Ok(recorded)
    }

    /// The newest `limit` history entries of a conversation (and thread), oldest first (what
    /// the ledger thread holds is written first).
    pub fn history_recent(
        &self,
        instance: String,
        conversation: String,
        thread: Option<String>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<HistoryEntry>, LedgerError>> + Send + '_ {
        self.call(move |txn| {
            history::write_all(txn)?;
            history::recent(txn, &instance, &conversation, thread.as_deref(), limit)
        })
    }

    /// The state of `event_id`'s entry and its error code (`aborted` for a cancelled run).
    pub fn inbound_outcome(
        &self,
        instance: String,
        event_id: String,
    ) -> impl Future<Output = Result<Option<(InboundState, Option<String>)>, LedgerError>> + Send + '_
    {
        self.call(move |txn| inbound::outcome(txn, &instance, &event_id))
    }

    /// Counts the start of a run that waited (or was recovered); see [`inbound::start`].
    /// Deferred: it is in the log before the run starts, so a crash of the hub counts it;
    /// power loss can forget it, which allows the run one more attempt.
    pub fn start_run(
        &self,
        instance: String,
        event_id: String,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send + '_ {
        self.call_with(Commit::Deferred, move |txn| inbound::start(txn, &instance, &event_id))
    }

    /// Records how a run ended (see [`RunEnd::state`]) and, for a reply, its delivery record,
    /// in one step: with `claim`, claimed for hand-over at once when nothing holds its
    /// conversation ([`replies::add_claimed`]), else `pending`. The entry settles in this
    /// step: a reply is its record's to owe from now on (the driver's answer writes only the
    /// record), or a legacy peer's, answered once on its connection. Deferred: it survives a hub
    /// crash at once, power loss with the next fsync (a run whose end was lost that way runs
    /// again, flagged `redelivered`).
    pub fn finish_run(
        &self,
        instance: String,
        event_id: String,
        end: RunEnd,
        reply: Option<NewReply>,
        claim: bool,
        now_ms: u64,
    ) -> impl Future<Output = Result<Finished, LedgerError>> + Send + '_ {
        self.call_with(Commit::Deferred, move |txn| {
            let ended = inbound::finish(txn, &instance, &event_id, &end, now_ms)?;
            let handed = match (&reply, &end) {
                (Some(reply), RunEnd::Reply(_)) if ended && claim => {
                    replies::add_claimed(txn, reply, now_ms)?
                }
                (Some(reply), RunEnd::Reply(_)) if ended => {
                    replies::add(txn, reply, now_ms)?;
                    None
                }
                _ => None,
            };
            Ok(Finished { ended, handed })
        })
    }

    /// Owed replies without a delivery record (written before schema 3).
    pub fn untracked_replies(
        &self,
    ) -> impl Future<Output = Result<Vec<PendingReply>, LedgerError>> + Send + '_ {
        self.call(inbound::untracked_replies)
    }

    /// Records an owed reply's delivery as `pending` (one written before replies were
    /// tracked, see [`untracked_replies`](Self::untracked_replies)) and settles its entry in
    /// the same step: the record owes it from now on. Returns the record's id.
    pub fn reply_add(
        &self,
        reply: NewReply,
        now_ms: u64,
    ) -> impl Future<Output = Result<i64, LedgerError>> + Send + '_ {
        self.call(move |txn| {
            let id = replies::add(txn, &reply, now_ms)?;
            inbound::mark_delivered(txn, &reply.instance, &reply.event_id, now_ms)?;
            Ok(id)
        })
    }

    /// Claims the replies of `instance` due for hand-over; see [`replies::claim_due`].
    /// Deferred: a claim lost to power loss changes nothing, as a restart makes every
    /// `handed` reply `pending` again.
    pub fn replies_claim(
        &self,
        instance: String,
        now_ms: u64,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<HandedReply>, LedgerError>> + Send + '_ {
        self.call_with(Commit::Deferred, move |txn| {
            replies::claim_due(txn, &instance, now_ms, limit)
        })
    }

    /// Applies a driver's answer (or silence); see [`replies::answer`].
    /// Queued only: the caller keeps the order of the driver's frames. Deferred: nobody is
    /// told a reply's state, and the next durable commit (the next inbound's record, at the
    /// latest the flush) carries it to the disk; on power loss before that the reply is
    /// handed over again, as a run's end is.
    pub fn reply_answer(
        &self,
        answer: ReplyAnswer,
        now_ms: u64,
        jitter: f64,
    ) -> impl Future<Output = Pending<Option<Settled>>> + Send + '_ {
        self.queue_with(Commit::Deferred, move |txn| replies::answer(txn, &answer, now_ms, jitter))
    }

    /// The state of the reply to `event_id`, if its run produced one.
    pub fn reply_state(
        &self,
        instance: String,
        event_id: String,
    ) -> impl Future<Output = Result<Option<ReplyState>, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::state_of(txn, &instance, &event_id))
    }

    /// Expires waiting replies past their TTL; returns how many.
    pub fn replies_expire(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<usize, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::expire(txn, now_ms))
    }

    /// After a restart nothing is handed over: `handed` replies are `pending` again.
    pub fn replies_restart(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<usize, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::restart(txn, now_ms))
    }

    /// Makes the retryable failures of `instance` due now.
    pub fn replies_due_now(
        &self,
        instance: String,
        now_ms: u64,
    ) -> impl Future<Output = Result<usize, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::due_now(txn, &instance, now_ms))
    }

    /// When the next retry or expiry after `after_ms` is due, for any instance.
    pub fn replies_next_wake(
        &self,
        after_ms: u64,
    ) -> impl Future<Output = Result<Option<u64>, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::next_wake(txn, after_ms))
    }

    /// Lists replies, newest first, with previews; see [`replies::list`].
    pub fn replies_list(
        &self,
        instance: Option<String>,
        state: Option<ReplyState>,
        before: Option<i64>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<ReplyRecord>, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::list(txn, instance.as_deref(), state, before, limit))
    }

    pub fn reply_get(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<Option<ReplyRecord>, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::get(txn, id))
    }

    /// An operator's retry of an `unknown`, `failed` or `expired` reply.
    pub fn reply_requeue(
        &self,
        id: i64,
        now_ms: u64,
        expires_ms: u64,
    ) -> impl Future<Output = Result<ReplyRecord, LedgerError>> + Send + '_ {
        self.call(move |txn| replies::requeue(txn, id, now_ms, expires_ms))
    }

    /// How many replies each instance has in each state.
    pub fn replies_counts(
        &self,
    ) -> impl Future<Output = Result<Vec<ReplyCount>, LedgerError>> + Send + '_ {
        self.call(replies::counts)
    }

    /// Runs that were in progress when the hub stopped; see [`inbound::recover`].
    pub fn recover(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<Vec<RecoveredRun>, LedgerError>> + Send + '_ {
        self.call(move |txn| inbound::recover(txn, now_ms))
    }

    /// Deletes settled inbound entries, final replies and final outbox records last touched
    /// before `before_ms`; returns how many rows went.
    pub fn prune(
        &self,
        before_ms: u64,
    ) -> impl Future<Output = Result<usize, LedgerError>> + Send + '_ {
        self.call(move |txn| {
            Ok(inbound::prune(txn, before_ms)?
                + items::prune(txn, before_ms)?
                + replies::prune(txn, before_ms)?
                + outbox::prune(txn, before_ms)?
                + history::write_all(txn).and_then(|()| history::prune(txn, before_ms))?)
        })
    }

    /// The item of `event_id` with what `read` shows of it.
    pub fn item_get(
        &self,
        instance: String,
        event_id: String,
    ) -> impl Future<Output = Result<Option<ItemView>, LedgerError>> + Send + '_ {
        self.call(move |txn| items::get(txn, &instance, &event_id))
    }

    /// Up to `limit` items before entry `before` in a conversation (thread), newest first.
    pub fn item_context(
        &self,
        instance: String,
        conversation: String,
        thread: Option<String>,
        before: i64,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<ItemView>, LedgerError>> + Send + '_ {
        self.call(move |txn| {
            items::context(txn, &instance, &conversation, thread.as_deref(), before, limit)
        })
    }

    /// The inbox, newest first; see [`items::list`].
    pub fn items_list(
        &self,
        instance: Option<String>,
        unhandled: bool,
        before: Option<i64>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Item>, LedgerError>> + Send + '_ {
        self.call(move |txn| items::list(txn, instance.as_deref(), unhandled, before, limit))
    }

    /// Records the outbox record of an item's `respond` reply (the first one stays).
    pub fn item_set_reply(
        &self,
        instance: String,
        event_id: String,
        outbox_id: i64,
        now_ms: u64,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send + '_ {
        self.call(move |txn| items::set_reply(txn, &instance, &event_id, outbox_id, now_ms))
    }

    /// Marks an item handled (the first marking stays); false when there is no such item.
    pub fn item_mark_handled(
        &self,
        instance: String,
        event_id: String,
        by: &'static str,
        now_ms: u64,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send + '_ {
        self.call(move |txn| items::mark_handled(txn, &instance, &event_id, by, now_ms))
    }

    /// The ledger's id (empty when off): what locators are bound to.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Starts a new session generation for a route; returns it.
    pub fn bump_generation(
        &self,
        instance: String,
        route: String,
    ) -> impl Future<Output = Result<u64, LedgerError>> + Send + '_ {
        self.call(move |txn| sessions::bump_generation(txn, &instance, &route))
    }

    /// Every session generation of `instance`.
    pub fn generations(
        &self,
        instance: String,
    ) -> impl Future<Output = Result<HashMap<String, u64>, LedgerError>> + Send + '_ {
        self.call(move |txn| sessions::generations(txn, &instance))
    }

    /// Queues the names of `instance`'s agent environment (none forgets it) for the next
    /// batch, after the calls queued before it; a restart reads them back
    /// ([`agent_env_names`](Self::agent_env_names)). Deferred: losing the last names to a
    /// power loss costs only the wait of the runs recovered after it.
    pub fn remember_agent_env(
        &self,
        instance: String,
        names: Vec<String>,
    ) -> impl Future<Output = Pending<()>> + Send + '_ {
        self.queue_with(Commit::Deferred, move |txn| {
            drivers::set_agent_env_names(txn, &instance, &names)
        })
    }

    /// The names of each instance's agent environment as last remembered.
    pub fn agent_env_names(
        &self,
    ) -> impl Future<Output = Result<HashMap<String, Vec<String>>, LedgerError>> + Send + '_ {
        self.call(drivers::agent_env_names)
    }

    /// Adds a send, or returns the record that already holds its idempotency key. `commit`
    /// is [`Commit::Deferred`] only when the caller hears nothing before the send's outcome
    /// is recorded durably.
    pub fn outbox_add(
        &self,
        send: NewSend,
        commit: Commit,
    ) -> impl Future<Output = Result<Added, LedgerError>> + Send + '_ {
        let ids = self.outbox_ids.clone();
        self.call_with(commit, move |txn| outbox::add(txn, &ids, &send))
    }

    /// [`outbox_add`](Self::outbox_add), calling `watch` with a new record's id in the same
    /// ledger call, so that what it registers (its caller's wait) is in place before any later
    /// call — a dispatcher's claim — can see the record. `watch` runs again when the batch is
    /// redone (what an earlier run returned is dropped then), and what it returned is dropped
    /// when the batch does not commit: it may only register what its value's drop withdraws.
    pub fn outbox_add_watched<W, F>(
        &self,
        send: NewSend,
        commit: Commit,
        watch: F,
    ) -> impl Future<Output = Result<Result<(i64, W), OutboxRecord>, LedgerError>> + Send + '_
    where
        W: Send + 'static,
        F: Fn(i64) -> W + Send + 'static,
    {
        let ids = self.outbox_ids.clone();
        self.call_with(commit, move |txn| {
            Ok(match outbox::add(txn, &ids, &send)? {
                Added::New(id) => Ok((id, watch(id))),
                Added::Existing(record) => Err(record),
            })
        })
    }

    /// Holds a keyless send handed straight to its driver, whose caller hears nothing before
    /// its outcome is recorded durably: the send is appended to the journal (`journal.rs`)
    /// and given its id at once, and its row is written in the ledger thread's next batch —
    /// normally the one recording its outcome. Gives the send back when it is not held —
    /// a ledger in memory, a key, a queued send, another send in the journal's slot, or a
    /// line that could not be written — and [`outbox_add`] records it instead. The caller
    /// holds only a sequential caller's sends (`outbox::Flight`).
    ///
    /// [`outbox_add`]: Self::outbox_add
    pub fn outbox_hold(&self, send: NewSend) -> Result<i64, NewSend> {
        let Some(journal) = &self.sends else { return Err(send) };
        if send.idempotency_key.is_some() || send.state != OutboxState::Sent {
            return Err(send);
        }
        let message = match String::from_utf8(send.message) {
            Ok(message) => message,
            Err(err) => return Err(NewSend { message: err.into_bytes(), ..send }),
        };
        let entry = journal::Entry {
            id: self.outbox_ids.next(),
            instance: send.instance,
            message,
            now_ms: send.now_ms,
            expires_ms: send.expires_ms,
        };
        let id = entry.id;
        match journal.hold(&entry) {
            Ok(true) => Ok(id),
            Ok(false) => Err(held_send(&entry)),
            Err(err) => {
                tracing::warn!(error = %err, "cannot append to the send journal; recording the send first");
                Err(held_send(&entry))
            }
        }
    }

    /// Moves a send to `state` (with its receipt or error) when the state machine allows it.
    pub fn outbox_set(
        &self,
        id: i64,
        state: OutboxState,
        receipt: Option<Vec<u8>>,
        error: Option<String>,
        now_ms: u64,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send + '_ {
        self.call(move |txn| {
            outbox::transition(txn, id, state, receipt.as_deref(), error.as_deref(), now_ms)
        })
    }

    /// Claims the queued sends of `instance` for dispatch; see [`outbox::claim_queued`].
    pub fn outbox_claim_queued(
        &self,
        instance: String,
        now_ms: u64,
        limit: usize,
    ) -> impl Future<Output = Result<Claimed, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::claim_queued(txn, &instance, now_ms, limit))
    }

    /// Fails queued sends past their expiry, for every instance; returns their ids.
    pub fn outbox_expire(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<Vec<i64>, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::expire(txn, now_ms))
    }

    /// After a restart nothing is in flight: every `sent` record becomes `unknown`.
    pub fn outbox_restart(
        &self,
        now_ms: u64,
    ) -> impl Future<Output = Result<usize, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::restart(txn, now_ms))
    }

    pub fn outbox_get(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<Option<OutboxRecord>, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::get(txn, id))
    }

    /// Lists records as summaries, newest first; see [`outbox::list`].
    pub fn outbox_list(
        &self,
        instance: Option<String>,
        state: Option<OutboxState>,
        before: Option<i64>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<OutboxSummary>, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::list(txn, instance.as_deref(), state, before, limit))
    }

    /// An operator's explicit retry: an `unknown` or `failed` record goes back to `queued`.
    pub fn outbox_requeue(
        &self,
        id: i64,
        now_ms: u64,
        expires_ms: u64,
    ) -> impl Future<Output = Result<OutboxRecord, LedgerError>> + Send + '_ {
        self.call(move |txn| outbox::requeue(txn, id, now_ms, expires_ms))
    }
}

#[cfg(test)]
mod tests {
    //! The handle: a call answers after its batch committed, the data outlives the process,
    //! and an off or closed ledger refuses calls. The SQL itself is tested synchronously in
    //! each module.
    use super::*;

    fn same(frame: &[u8]) -> Option<[u8; 32]> {
        frame.first().map(|b| [*b; 32])
    }

    /// A `user` entry in conversation `c1` of `a.b` whose text is also its event id.
    fn entry(text: &str) -> NewHistory {
        NewHistory {
            instance: "a.b".into(),
            conversation: "c1".into(),
            thread: None,
            role: channeld_protocol::ext::HistoryRole::User,
            text: text.into(),
            sender: None,
            message_id: None,
            event_id: Some(text.into()),
            reply_id: None,
            at_ms: 1,
        }
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
    async fn a_run_in_progress_survives_a_reopen_and_is_recovered() {
        let dir = tempfile::tempdir().unwrap();
        {
            let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
            assert_eq!(
                ledger.record_inbound_now(inbound("e1"), same, None).await.unwrap(),
                Recorded::New { entry: None }
            );
            ledger.close().await;
        }
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        let recovered = ledger.recover(5).await.unwrap();
        assert_eq!(recovered.len(), 1);
        assert_eq!(recovered[0].attempt, 2);
    }

    /// The ledger thread writes the history it holds once the ledger is quiet, and when it
    /// stops: a clean stop leaves nothing for the next start to rebuild.
    #[tokio::test]
    async fn held_history_is_written_when_the_ledger_is_quiet_and_when_it_stops() {
        let dir = tempfile::tempdir().unwrap();
        let written = || -> i64 {
            let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
            conn.query_row("SELECT count(*) FROM history", [], |r| r.get(0)).unwrap()
        };
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        ledger.record_inbound_now(inbound("e1"), same, Some((entry("e1"), 10))).await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while written() == 0 {
            assert!(std::time::Instant::now() < deadline, "a quiet ledger kept its history");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // Closed right after its commit: the stop writes it.
        ledger.record_inbound_now(inbound("e2"), same, Some((entry("e2"), 10))).await.unwrap();
        ledger.close().await;
        assert_eq!(written(), 2);
    }

    /// What `outbox_add_watched`'s `watch` registers is in place before a call queued right
    /// after the add runs — as a dispatcher's claim of the new record would be.
    #[tokio::test]
    async fn a_watched_send_is_watched_before_the_next_call_sees_its_record() {
        use std::future::Future;
        use std::task::Poll;
        use std::time::Duration;

        /// Polls a ledger call once: that queues it, in this order.
        async fn queue<F: Future + Unpin>(call: &mut F) {
            std::future::poll_fn(|cx| {
                assert!(std::pin::Pin::new(&mut *call).poll(cx).is_pending());
                Poll::Ready(())
            })
            .await;
        }

        let ledger = Ledger::in_memory().unwrap();
        // The ledger thread held in a call of its own until both calls below are queued.
        let (entered, running) = std::sync::mpsc::channel::<()>();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (entered, held) = (Mutex::new(entered), Mutex::new(held));
        let mut hold = Box::pin(ledger.call(move |_| {
            let _ = entered.lock().unwrap().send(());
            let _ = held.lock().unwrap().recv_timeout(Duration::from_secs(10));
            Ok(())
        }));
        queue(&mut hold).await;
        running.recv_timeout(Duration::from_secs(10)).unwrap();

        let watched = Arc::new(Mutex::new(Vec::new()));
        let send = NewSend {
            instance: "a.b".into(),
            idempotency_key: None,
            message: b"{}".to_vec(),
            state: OutboxState::Queued,
            now_ms: 1,
            expires_ms: u64::MAX / 2,
        };
        let log = watched.clone();
        let mut add = Box::pin(ledger.outbox_add_watched(send, Commit::Durable, move |id| {
            log.lock().unwrap().push(id);
        }));
        queue(&mut add).await;
        // What a claim queued after the add finds: the record, and whether it is watched.
        let log = watched.clone();
        let mut next = Box::pin(ledger.call(move |txn| {
            let id: i64 = txn.query_row("SELECT max(id) FROM outbox", [], |r| r.get(0))?;
            Ok((id, log.lock().unwrap().contains(&id)))
        }));
        queue(&mut next).await;
        release.send(()).unwrap();

        hold.await.unwrap();
        let (id, ()) = add.await.unwrap().expect("a new record");
        assert_eq!(next.await.unwrap(), (id, true), "the next call saw it unwatched");
    }

    /// The state column itself, not `inbound_outcome`'s reading of it.
    async fn stored_state(ledger: &Ledger, event_id: &'static str) -> String {
        ledger
            .call(move |txn| {
                Ok(txn.query_row(
                    "SELECT state FROM inbound WHERE event_id = ?1",
                    [event_id],
                    |r| r.get(0),
                )?)
            })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_run_that_replied_settles_its_entry_and_an_old_owed_reply_once_recorded() {
        let ledger = Ledger::in_memory().unwrap();
        let reply = |event_id: &str| NewReply {
            instance: "a.b".into(),
            event_id: event_id.into(),
            conversation: "c1".into(),
            message: b"{}".to_vec(),
            expires_ms: u64::MAX / 2,
        };
        for event_id in ["e1", "e2"] {
            ledger.record_inbound_now(inbound(event_id), same, None).await.unwrap();
        }
        // A driver's reply: recorded with the run's end, which settles the entry.
        let end = RunEnd::Reply("hi".into());
        let finished =
            ledger.finish_run("a.b".into(), "e1".into(), end.clone(), Some(reply("e1")), false, 2);
        assert!(finished.await.unwrap().ended);
        assert_eq!(stored_state(&ledger, "e1").await, "delivered");
        let outcome = ledger.inbound_outcome("a.b".into(), "e1".into()).await.unwrap();
        assert_eq!(outcome, Some((InboundState::Replied, None)), "how the run ended");
        // A legacy peer's reply has no record: it went back once on the peer's connection,
        // and nothing is owed after a restart either.
        let finished = ledger.finish_run("a.b".into(), "e2".into(), end, None, false, 2);
        assert!(finished.await.unwrap().ended);
        assert_eq!(stored_state(&ledger, "e2").await, "delivered");
        assert!(ledger.untracked_replies().await.unwrap().is_empty());
        // A reply a hub before schema 3 left owed is recorded for delivery at a restart,
        // which settles its entry in the same step.
        let old = |txn: &Connection| {
            Ok(txn.execute("UPDATE inbound SET state = 'replied' WHERE event_id = 'e2'", [])?)
        };
        assert_eq!(ledger.call(old).await.unwrap(), 1);
        let untracked = ledger.untracked_replies().await.unwrap();
        assert_eq!(untracked.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["e2"]);
        ledger.reply_add(reply("e2"), 3).await.unwrap();
        assert_eq!(stored_state(&ledger, "e2").await, "delivered");
        assert!(ledger.untracked_replies().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_closed_ledger_answers_unavailable_and_an_off_one_off() {
        let ledger = Ledger::in_memory().unwrap();
        ledger.ping().await.unwrap();
        ledger.close().await;
        assert_eq!(ledger.ping().await, Err(LedgerError::Unavailable));
        assert_eq!(
            ledger.record_inbound(inbound("e"), same, None).await.answer().await.err(),
            Some(LedgerError::Unavailable)
        );
        let off = Ledger::off();
        assert_eq!(
            off.record_inbound(inbound("e"), same, None).await.answer().await.err(),
            Some(LedgerError::Off)
        );
        off.ping().await.unwrap();
    }

    #[tokio::test]
    async fn concurrent_calls_commit_together_and_each_gets_its_answer() {
        let ledger = Ledger::in_memory().unwrap();
        let calls: Vec<_> = (0..100)
            .map(|n| {
                let ledger = ledger.clone();
                tokio::spawn(async move {
                    ledger.record_inbound_now(inbound(&format!("e{n}")), same, None).await
                })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap(), Recorded::New { entry: None });
        }
        assert!(matches!(
            ledger.record_inbound_now(inbound("e7"), same, None).await,
            Ok(Recorded::Replay(_))
        ));
    }

    /// History written behind keeps only what committed: a call that fails drops the entry
    /// it held, and a batch redone because of it holds each entry of the others once.
    #[tokio::test]
    async fn history_held_by_a_failed_call_is_dropped_and_a_redone_batch_holds_once() {
        let ledger = Ledger::in_memory().unwrap();
        let holds = |text: &'static str, fails: bool| {
            move |_: &Connection| {
                history::hold(entry(text), 10);
                if fails { Err(LedgerError::Sql("refused".into())) } else { Ok(()) }
            }
        };
        // Corked: the three calls reach the ledger thread as one batch.
        let answers = corked(async {
            let first = ledger.queue_with(Commit::Deferred, holds("first", false)).await;
            let failed = ledger.queue_with(Commit::Deferred, holds("failed", true)).await;
            let last = ledger.queue_with(Commit::Deferred, holds("last", false)).await;
            (first.answer().await, failed.answer().await, last.answer().await)
        })
        .await;
        assert!(answers.0.is_ok() && answers.1.is_err() && answers.2.is_ok(), "{answers:?}");
        let read = ledger.history_recent("a.b".into(), "c1".into(), None, 10).await.unwrap();
        let texts: Vec<&str> = read.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(texts, ["first", "last"]);
    }

    /// A durable call answered at its commit: its value first, the sync's outcome after; a
    /// commit that was as durable as asked by itself answers both at once.
    #[tokio::test]
    async fn an_early_call_answers_at_its_commit_and_hears_its_sync_after() {
        use futures_util::FutureExt;
        use store::Work;
        let mut conn = schema::open_in_memory().unwrap();
        let early = |done| {
            let f = |txn: &Connection| -> Result<i64, LedgerError> {
                Ok(txn.query_row("SELECT 41 + 1", [], |r| r.get(0))?)
            };
            EarlyCall { body: Body::new(f, StorageFlag::default()), done: Some(done), synced: None }
        };

        let (done, answer) = oneshot::channel();
        let mut call = Box::new(early(done));
        let txn = conn.transaction().unwrap();
        assert!(call.run(&txn, false));
        txn.commit().unwrap();
        call.committed();
        let (value, synced) = answer.await.unwrap().unwrap();
        assert_eq!(value, 42);
        let mut waiting = Box::pin(synced.wait());
        assert!(waiting.as_mut().now_or_never().is_none(), "no sync yet");
        call.finish(Err(LedgerError::Commit));
        assert!(matches!(waiting.await, Err(LedgerError::Commit)), "the sync failed");

        let (done, answer) = oneshot::channel();
        let mut call = Box::new(early(done));
        let txn = conn.transaction().unwrap();
        assert!(call.run(&txn, false));
        txn.commit().unwrap();
        call.finish(Ok(()));
        let (value, synced) = answer.await.unwrap().unwrap();
        assert_eq!(value, 42);
        synced.wait().await.unwrap();
    }

    fn direct_send(text: &str) -> NewSend {
        NewSend {
            instance: "a.b".into(),
            idempotency_key: None,
            message: format!(r#"{{"body":{{"text":"{text}"}}}}"#).into_bytes(),
            state: OutboxState::Sent,
            now_ms: 5,
            expires_ms: 500,
        }
    }

    /// Holds `send`, which the journal's free slot takes.
    fn hold(ledger: &Ledger, send: NewSend) -> i64 {
        ledger.outbox_hold(send).unwrap_or_else(|_| panic!("the journal's slot is free"))
    }

    /// Rows committed in the file, seen from another connection: (id, state).
    fn committed_sends(dir: &Path) -> Vec<(i64, String)> {
        let conn = rusqlite::Connection::open(dir.join(DB_FILE)).unwrap();
        let mut stmt = conn.prepare("SELECT id, state FROM outbox ORDER BY id").unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    }

    #[tokio::test]
    async fn a_held_send_is_written_in_the_batch_that_records_its_outcome() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        let id = hold(&ledger, direct_send("hi"));
        assert!(committed_sends(dir.path()).is_empty(), "holding commits nothing");
        let journal = std::fs::read_to_string(dir.path().join(journal::FILE)).unwrap();
        assert!(journal.contains(r#"{\"body\":{\"text\":\"hi\"}}"#), "{journal}");

        let receipt = br#"{"message_id":"m1"}"#.to_vec();
        let set = ledger.outbox_set(id, OutboxState::Receipted, Some(receipt.clone()), None, 9);
        assert!(set.await.unwrap(), "the row was there for its outcome");
        assert_eq!(committed_sends(dir.path()), vec![(id, "receipted".to_owned())]);
        let record = ledger.outbox_get(id).await.unwrap().unwrap();
        assert_eq!(record.message, direct_send("hi").message);
        assert_eq!((record.attempts, record.created_ms, record.expires_ms), (1, 5, 500));
        assert_eq!(record.receipt, Some(receipt));

        // A send with a key, or queued, is not held: it is recorded first, and its id is
        // never one a held send has.
        let keyed = NewSend { idempotency_key: Some("k".into()), ..direct_send("k") };
        assert!(ledger.outbox_hold(keyed).is_err());
        let queued = NewSend { state: OutboxState::Queued, ..direct_send("q") };
        let queued = ledger.outbox_hold(queued).unwrap_err();
        let held = hold(&ledger, direct_send("again"));
        let Added::New(added) = ledger.outbox_add(queued, Commit::Durable).await.unwrap() else {
            panic!("new")
        };
        assert_ne!(held, added);
        // A read queued after the hold finds the held row.
        assert_eq!(ledger.outbox_get(held).await.unwrap().unwrap().state, OutboxState::Sent);
        ledger.close().await;
    }

    #[tokio::test]
    async fn sends_held_at_a_crash_are_recorded_when_the_ledger_opens() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        let first = hold(&ledger, direct_send("one"));
        ledger.outbox_set(first, OutboxState::Receipted, None, None, 9).await.unwrap();
        ledger.close().await;

        // A committed send's line is blanked: a record pruned later cannot come back.
        let (journal, found) = journal::Journal::open(dir.path()).unwrap();
        assert!(found.is_empty());
        // The hub died holding a send: its line is in the journal, its row is not.
        let message = r#"{"n":2}"#.to_owned();
        let id = first + 1;
        let entry =
            journal::Entry { id, instance: "a.b".into(), message, now_ms: 5, expires_ms: 500 };
        assert!(journal.hold(&entry).unwrap());
        drop(journal);
        assert_eq!(committed_sends(dir.path()).len(), 1);

        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        let sent = |id| (id, "sent".to_owned());
        assert_eq!(committed_sends(dir.path()), vec![(first, "receipted".to_owned()), sent(id)]);
        assert_eq!(std::fs::metadata(dir.path().join(journal::FILE)).unwrap().len(), 0);
        assert_eq!(ledger.outbox_restart(10).await.unwrap(), 1, "it becomes unknown");
        let record = ledger.outbox_get(id).await.unwrap().unwrap();
        assert_eq!((record.state, record.message), (OutboxState::Unknown, br#"{"n":2}"#.to_vec()));
        // Ids go on after the recovered one.
        assert_eq!(hold(&ledger, direct_send("next")), id + 1);

        // Stopping writes what is still held.
        ledger.close().await;
        assert_eq!(committed_sends(dir.path()).last(), Some(&sent(id + 1)));
    }
}
