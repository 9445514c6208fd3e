//! The ledger's checkpointer: a thread with a connection of its own that copies the
//! write-ahead log back into the database file (a WAL checkpoint), so the ledger thread does
//! not stop committing for the checkpoint's page copies and its two fsyncs. The ledger
//! connection's WAL hook reports the log's length after each commit ([`Reporter`]); the
//! thread checkpoints once enough frames wait while the ledger thread is busy ([`busy`]);
//! otherwise the ledger thread checkpoints itself, as SQLite would (a pass beside lone
//! commits costs them more than the stall it saves). The log restarts from its beginning only
//! after a checkpoint that copied all of it, which a checkpoint running beside a busy writer
//! may never manage. Once the log outgrows [`LOG_LIMIT`] the thread chases its end, and the
//! ledger thread checkpoints itself after a commit that left only a few frames uncopied
//! (a short stall that restarts the log), and at twice the limit waits for the thread's pass
//! to end and checkpoints in any case: the log never grows past that.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use rusqlite::hooks::Wal;
use rusqlite::wal::CheckpointMode;
use rusqlite::{Connection, OpenFlags};
use tracing::{error, info, warn};

/// Frames not yet copied back that start a checkpoint: SQLite's own automatic checkpoint
/// threshold (about 4 MiB of 4 KiB pages).
pub const CHECKPOINT_FRAMES: u32 = 1000;

/// The log's length (≈ 32 MiB) from which the ledger thread restarts it with a checkpoint of
/// its own.
pub const LOG_LIMIT: u32 = 8 * CHECKPOINT_FRAMES;

/// Past [`LOG_LIMIT`], the uncopied frames the ledger thread copies itself.
pub const CATCH_UP: u32 = CHECKPOINT_FRAMES / 4;

/// How long the thread's connection waits for a lock the ledger connection holds.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The frames of a log `frames` long that no checkpoint copied yet, given how many the last
/// one had (`copied`; more than `frames` when the log restarted since).
fn uncopied(frames: u32, copied: u32) -> u32 {
    if copied > frames { frames } else { frames - copied }
}

/// Whether the thread checkpoints: once [`CHECKPOINT_FRAMES`] wait, and past [`LOG_LIMIT`]
/// while more than the ledger thread's share waits.
pub fn due(frames: u32, copied: u32) -> bool {
    let waiting = uncopied(frames, copied);
    waiting >= CHECKPOINT_FRAMES || (frames >= LOG_LIMIT && waiting > CATCH_UP)
}

/// Whether the ledger thread checkpoints itself after a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriterCheckpoint {
    No,
    /// Unless the thread's pass runs (the next commit tries again).
    IfFree,
    /// After the thread's pass, if one runs.
    Now,
}

/// Jobs in a batch from which the ledger thread counts as busy.
pub const BUSY_BATCH: usize = 4;

/// Whether the ledger thread is busy as it commits a batch of `jobs`, `queued` when more
/// jobs wait behind it. Messages in flight together reach it in batches of several jobs
/// (or queue), one at a time in batches of one to three (a receipt's settle and the next
/// record); the batch's own size is the steadier sign, since the queue empties between the
/// stages of a burst.
pub fn busy(queued: bool, jobs: usize) -> bool {
    queued || jobs >= BUSY_BATCH
}

/// What the ledger thread does after a commit that left the log `frames` long, `busy` as
/// [`busy`] says. Unless busy it checkpoints itself as SQLite would (once
/// [`CHECKPOINT_FRAMES`] wait): a pass beside the commits pays while they come back to back,
/// and costs lone commits more (its fsyncs share the disk with the log syncer's) than the
/// stall it saves. Past the limit it checkpoints once few frames are left to copy, and past
/// twice the limit in any case.
pub fn writer_checkpoints(frames: u32, copied: u32, busy: bool) -> WriterCheckpoint {
    let waiting = uncopied(frames, copied);
    if frames >= 2 * LOG_LIMIT {
        WriterCheckpoint::Now
    } else if (!busy && waiting >= CHECKPOINT_FRAMES)
        || (frames >= LOG_LIMIT && waiting <= CATCH_UP)
    {
        WriterCheckpoint::IfFree
    } else {
        WriterCheckpoint::No
    }
}

/// The handle the ledger thread keeps.
pub struct Checkpointer {
    tx: SyncSender<u32>,
    /// How many frames of the log the last checkpoint (the thread's or the ledger thread's)
    /// had copied.
    copied: Arc<AtomicU32>,
    /// Held for each checkpoint, the thread's or the ledger thread's (SQLite refuses a second
    /// checkpoint at once instead of waiting).
    pass: Arc<Mutex<()>>,
    /// Whether the ledger thread is [`busy`] (set by it before each batch).
    busy: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Checkpointer {
    /// Starts the checkpointer for the database at `path`; `None` when its connection cannot
    /// be opened (the ledger thread then keeps SQLite's automatic checkpoint). Each pass's
    /// duration goes to `seconds`.
    pub fn start(path: &Path, seconds: Histogram) -> Option<Self> {
        let conn = match open(path) {
            Ok(conn) => conn,
            Err(err) => {
                warn!(error = %err, "ledger checkpointer not started; the ledger thread checkpoints");
                return None;
            }
        };
        // One report waiting is enough: a newer one says at least as much.
        let (tx, rx) = sync_channel(1);
        let copied = Arc::new(AtomicU32::new(0));
        let pass = Arc::new(Mutex::new(()));
        let (copies, passes) = (copied.clone(), pass.clone());
        let thread = std::thread::Builder::new()
            .name("channeld-ckpt".into())
            .spawn(move || run(&conn, &rx, &copies, &passes, &seconds))
            .ok()?;
        Some(Self { tx, copied, pass, busy: Arc::default(), thread })
    }

    /// What the ledger connection's WAL hook reports to (after each commit).
    pub fn reporter(&self) -> Reporter {
        Reporter {
            tx: self.tx.clone(),
            copied: self.copied.clone(),
            pass: self.pass.clone(),
            busy: self.busy.clone(),
            last: 0,
            failing: false,
        }
    }

    /// Tells whether the ledger thread is [`busy`] with the batch it commits next.
    pub fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
    }

    /// Waits for a running pass to end and stops the thread. Every [`Reporter`] must be
    /// dropped first (the ledger connection's hook removed).
    pub fn finish(self) {
        let Self { tx, thread, .. } = self;
        drop(tx);
        let _ = thread.join();
    }
}

/// Called from the ledger connection's WAL hook after each commit: reports the log's length
/// to the thread, and checkpoints on the ledger thread when [`writer_checkpoints`] says so
/// (waiting only in its `Now` case, at twice the limit).
pub struct Reporter {
    tx: SyncSender<u32>,
    copied: Arc<AtomicU32>,
    pass: Arc<Mutex<()>>,
    busy: Arc<AtomicBool>,
    /// The log's length after the last commit: a shorter one means the log restarted.
    last: u32,
    /// Its last checkpoint failed.
    failing: bool,
}

impl Reporter {
    /// Reports a commit that left the log `frames` long, and checkpoints `wal` (the ledger
    /// connection's) when [`writer_checkpoints`] says so.
    pub fn committed(&mut self, wal: &mut Wal, frames: u32) {
        if frames < std::mem::replace(&mut self.last, frames) {
            // The log restarted: none of its frames is copied yet.
            self.copied.store(0, Ordering::Relaxed);
        }
        let busy = self.busy.load(Ordering::Relaxed);
        if busy && frames >= CHECKPOINT_FRAMES {
            // Full: a report waits already, and the pass it starts covers this commit too.
            let _ = self.tx.try_send(frames);
        }
        let _pass = match writer_checkpoints(frames, self.copied.load(Ordering::Relaxed), busy) {
            WriterCheckpoint::No => return,
            WriterCheckpoint::IfFree => match self.pass.try_lock() {
                Ok(pass) => pass,
                Err(_) => return,
            },
            WriterCheckpoint::Now => self.pass.lock().unwrap_or_else(PoisonError::into_inner),
        };
        match wal.checkpoint_v2(CheckpointMode::PASSIVE) {
            Ok((_, done)) => {
                self.copied.store(u32::try_from(done).unwrap_or(0), Ordering::Relaxed);
                self.failing = false;
            }
            // Logged once per streak: it fails again with each commit until space returns.
            Err(err) if !std::mem::replace(&mut self.failing, true) => {
                warn!(error = %err, frames, "ledger checkpoint after a commit failed");
            }
            Err(_) => {}
        }
    }
}

fn open(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // A checkpoint syncs the log before it copies and the database file after, under NORMAL
    // as under FULL.
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    Ok(conn)
}

fn run(
    conn: &Connection,
    rx: &Receiver<u32>,
    copied: &AtomicU32,
    pass: &Mutex<()>,
    seconds: &Histogram,
) {
    let mut failing = false;
    while let Ok(frames) = rx.recv() {
        if !due(frames, copied.load(Ordering::Relaxed)) {
            continue;
        }
        let _pass = pass.lock().unwrap_or_else(PoisonError::into_inner);
        let began = Instant::now();
        match conn.wal_checkpoint_v2(None::<&str>, CheckpointMode::PASSIVE) {
            Ok((_, done)) => {
                seconds.observe(began.elapsed().as_secs_f64());
                copied.store(u32::try_from(done).unwrap_or(0), Ordering::Relaxed);
                if std::mem::take(&mut failing) {
                    info!("ledger checkpoints work again");
                }
            }
            // Another connection (`channeld ledger backup`) checkpoints: the next report
            // tries again.
            Err(err) if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {}
            Err(err) => {
                if !std::mem::replace(&mut failing, true) {
                    error!(error = %err, "ledger checkpoint failed; the write-ahead log grows until one succeeds");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_checkpoints_once_enough_frames_wait_and_chases_the_end_past_the_limit() {
        assert!(!due(CHECKPOINT_FRAMES - 1, 0));
        assert!(due(CHECKPOINT_FRAMES, 0));
        // Copied most of it last time, and the writer went on: not yet again.
        assert!(!due(CHECKPOINT_FRAMES + 300, CHECKPOINT_FRAMES));
        assert!(due(2 * CHECKPOINT_FRAMES, CHECKPOINT_FRAMES));
        // The log restarted since the last pass: its frames are all new.
        assert!(due(CHECKPOINT_FRAMES, 5 * CHECKPOINT_FRAMES));
        // Past the limit, a pass runs until the ledger thread's share is left.
        assert!(due(LOG_LIMIT + 300, LOG_LIMIT));
        assert!(!due(LOG_LIMIT + CATCH_UP, LOG_LIMIT));
    }

    #[test]
    fn the_ledger_thread_restarts_a_long_log_once_little_is_left_to_copy() {
        use WriterCheckpoint::*;
        assert_eq!(writer_checkpoints(LOG_LIMIT - 1, 0, true), No);
        assert_eq!(writer_checkpoints(LOG_LIMIT, LOG_LIMIT - CATCH_UP - 1, true), No);
        assert_eq!(writer_checkpoints(LOG_LIMIT, LOG_LIMIT - CATCH_UP, true), IfFree);
        // However much is left, at twice the limit.
        assert_eq!(writer_checkpoints(2 * LOG_LIMIT, 0, true), Now);
    }

    #[test]
    fn unless_busy_the_ledger_thread_checkpoints_as_sqlite_would() {
        use WriterCheckpoint::*;
        assert!(!busy(false, BUSY_BATCH - 1));
        assert!(busy(false, BUSY_BATCH));
        assert!(busy(true, 1));
        assert_eq!(writer_checkpoints(CHECKPOINT_FRAMES - 1, 0, false), No);
        assert_eq!(writer_checkpoints(CHECKPOINT_FRAMES, 0, false), IfFree);
        assert_eq!(writer_checkpoints(CHECKPOINT_FRAMES, 0, true), No);
        assert_eq!(writer_checkpoints(CHECKPOINT_FRAMES + 10, CHECKPOINT_FRAMES, false), No);
    }
}
