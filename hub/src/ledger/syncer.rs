//! The ledger's log syncer: a thread that makes the write-ahead log durable (`fdatasync`) for
//! the durable jobs of committed batches, so the ledger thread goes on with the next batch
//! while the disk works. Each sync covers every batch committed before it began; the
//! waiting batches share one.

use std::fs::File;
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;
use tracing::error;

use super::LedgerError;
use super::store::{Job, StorageFlag};

/// Committed batches whose durable jobs wait for a sync; the ledger thread waits beyond this.
const WAITING_BATCHES: usize = 1024;

/// The handle the ledger thread keeps. Dropping it lets the thread answer what it holds and
/// end; [`Syncer::finish`] also waits for that.
pub struct Syncer {
    tx: SyncSender<Vec<Job>>,
    thread: JoinHandle<()>,
}

impl Syncer {
    /// Starts the syncer for the log file at `wal`; `None` when the file cannot be opened
    /// (the ledger then syncs with its commits). Each sync's duration goes to `seconds`.
    pub fn start(wal: &Path, storage: StorageFlag, seconds: Histogram) -> Option<Self> {
        let file = File::open(wal).ok()?;
        let (tx, rx) = sync_channel(WAITING_BATCHES);
        let thread = std::thread::Builder::new()
            .name("channeld-ledger-sync".into())
            .spawn(move || run(&file, &rx, &storage, &seconds))
            .ok()?;
        Some(Self { tx, thread })
    }

    /// Answers `durable` once the log holding their committed batch is on the disk. Their
    /// frames were written before this call, so the next sync to begin covers them.
    /// With [`WAITING_BATCHES`] waiting, the ledger thread waits for the disk (backpressure);
    /// if the syncer is gone, the jobs are dropped and their callers hear `Unavailable`.
    pub fn after_sync(&self, durable: Vec<Job>) {
        let _ = self.tx.send(durable);
    }

    /// Lets the thread answer what it holds, and waits for it to end.
    pub fn finish(self) {
        let Self { tx, thread } = self;
        drop(tx);
        let _ = thread.join();
    }
}

fn run(file: &File, rx: &Receiver<Vec<Job>>, storage: &StorageFlag, seconds: &Histogram) {
    while let Ok(first) = rx.recv() {
        let mut waiting = vec![first];
        while let Ok(more) = rx.try_recv() {
            waiting.push(more);
        }
        let began = Instant::now();
        let synced = sync(file, storage);
        seconds.observe(began.elapsed().as_secs_f64());
        for job in waiting.into_iter().flatten() {
            job.finish(synced.clone());
        }
    }
}

/// One `fdatasync` of the log: what a `synchronous = FULL` commit does after writing its
/// frames (the sync covers the file, whichever descriptor asks).
pub fn sync(file: &File, storage: &StorageFlag) -> Result<(), LedgerError> {
    match file.sync_data() {
        Ok(()) => Ok(()),
        Err(err) if err.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) => {
            storage.note(&LedgerError::StorageFull);
            Err(LedgerError::StorageFull)
        }
        Err(err) => {
            error!(error = %err, "ledger cannot sync its write-ahead log");
            Err(LedgerError::Commit)
        }
    }
}
