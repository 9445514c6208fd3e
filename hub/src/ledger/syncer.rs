//! The ledger's log syncer: a thread that makes the write-ahead log durable (`fdatasync`) for
//! the durable jobs of committed batches, so the ledger thread goes on with the next batch
//! while the disk works. Each sync covers every batch committed before it began; the
//! waiting batches share one. The ledger thread rings the syncer as soon as a batch is
//! committed and hands it the batch's jobs after it told the others: the sync does not wait
//! for the wake-ups those answers cause.

use std::collections::VecDeque;
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

/// What the ledger thread tells the syncer, per batch and in this order.
enum Note {
    /// A batch is committed: its frames are in the log, so a sync may begin.
    Committed,
    /// The durable jobs of the batch of the last `Committed`.
    Jobs(Vec<Job>),
}

/// The handle the ledger thread keeps. Dropping it lets the thread answer what it holds and
/// end; [`Syncer::finish`] also waits for that.
pub struct Syncer {
    tx: SyncSender<Note>,
    thread: JoinHandle<()>,
}

impl Syncer {
    /// Starts the syncer for the log file at `wal`; `None` when the file cannot be opened
    /// (the ledger then syncs with its commits). Each sync's duration goes to `seconds`.
    pub fn start(wal: &Path, storage: StorageFlag, seconds: Histogram) -> Option<Self> {
        let file = File::open(wal).ok()?;
        // Two notes per batch.
        let (tx, rx) = sync_channel(2 * WAITING_BATCHES);
        let thread = std::thread::Builder::new()
            .name("channeld-ledger-sync".into())
            .spawn(move || {
                run(&rx, || {
                    let began = Instant::now();
                    let synced = sync(&file, &storage);
                    seconds.observe(began.elapsed().as_secs_f64());
                    synced
                })
            })
            .ok()?;
        Some(Self { tx, thread })
    }

    /// A batch is committed: the next sync to begin covers it, and one begins now if none
    /// runs. The batch's durable jobs follow with [`after_sync`](Self::after_sync), which
    /// must be called next, once for each call of this.
    pub fn committed(&self) {
        let _ = self.tx.send(Note::Committed);
    }

    /// Answers `durable` (the jobs of the batch [`committed`](Self::committed) announced)
    /// once a sync that began after their commit ended. With [`WAITING_BATCHES`] waiting,
    /// the ledger thread waits for the disk (backpressure); if the syncer is gone, the jobs
    /// are dropped and their callers hear `Unavailable`.
    pub fn after_sync(&self, durable: Vec<Job>) {
        let _ = self.tx.send(Note::Jobs(durable));
    }

    /// Lets the thread answer what it holds, and waits for it to end.
    pub fn finish(self) {
        let Self { tx, thread } = self;
        drop(tx);
        let _ = thread.join();
    }
}

/// The syncer's loop: waits for a committed batch, syncs once for every batch announced by
/// then, and answers those batches' jobs, receiving the ones not handed over yet (they
/// follow their announcement at once). A batch announced during a sync waits for the next.
/// Ends when the ledger thread hung up and everything it sent was answered.
fn run(rx: &Receiver<Note>, mut sync: impl FnMut() -> Result<(), LedgerError>) {
    // Batches announced and not yet covered by a sync; jobs received and not yet answered
    // (oldest batch first: a batch's jobs never come before its announcement).
    let mut announced = 0usize;
    let mut held: VecDeque<Vec<Job>> = VecDeque::new();
    loop {
        if announced == 0 {
            match rx.recv() {
                Ok(note) => take(note, &mut announced, &mut held),
                Err(_) => return,
            }
        }
        while let Ok(note) = rx.try_recv() {
            take(note, &mut announced, &mut held);
        }
        if announced == 0 {
            continue;
        }
        let covered = std::mem::take(&mut announced);
        let synced = sync();
        for _ in 0..covered {
            let jobs = loop {
                if let Some(jobs) = held.pop_front() {
                    break jobs;
                }
                match rx.recv() {
                    Ok(note) => take(note, &mut announced, &mut held),
                    // The ledger thread is gone between a batch's two notes: its jobs were
                    // dropped, and their callers hear `Unavailable`.
                    Err(_) => return,
                }
            };
            for job in jobs {
                job.finish(synced.clone());
            }
        }
    }
}

fn take(note: Note, announced: &mut usize, held: &mut VecDeque<Vec<Job>>) {
    match note {
        Note::Committed => *announced += 1,
        Note::Jobs(jobs) => held.push_back(jobs),
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use rusqlite::Connection;

    use super::*;
    use crate::ledger::store::Work;

    /// Per job that heard, in order: its name and whether its sync succeeded.
    type Heard = Arc<Mutex<Vec<(&'static str, bool)>>>;

    struct Named {
        name: &'static str,
        heard: Heard,
    }

    impl Work for Named {
        fn run(&mut self, _txn: &Connection, _savepoint: bool) -> bool {
            true
        }

        fn finish(self: Box<Self>, outcome: Result<(), LedgerError>) {
            self.heard.lock().unwrap().push((self.name, outcome.is_ok()));
        }
    }

    /// The loop on a thread of its own, whose syncs the test begins and ends: each sync
    /// reports that it began and waits for the outcome the test gives it.
    struct Harness {
        tx: Option<SyncSender<Note>>,
        began: Receiver<()>,
        outcome: std::sync::mpsc::Sender<Result<(), LedgerError>>,
        heard: Heard,
        thread: JoinHandle<()>,
    }

    impl Harness {
        fn start() -> Self {
            let (tx, rx) = sync_channel(16);
            let (began_tx, began) = channel();
            let (outcome, outcome_rx) = channel();
            let thread = std::thread::spawn(move || {
                run(&rx, || {
                    let _ = began_tx.send(());
                    // A sync the test did not expect ends once the test hung up.
                    outcome_rx.recv().unwrap_or(Ok(()))
                })
            });
            Self { tx: Some(tx), began, outcome, heard: Heard::default(), thread }
        }

        fn committed(&self) {
            self.tx.as_ref().unwrap().send(Note::Committed).unwrap();
        }

        fn jobs(&self, names: &[&'static str]) {
            let job = |name| -> Job { Box::new(Named { name, heard: self.heard.clone() }) };
            let jobs = names.iter().map(|name| job(*name)).collect();
            self.tx.as_ref().unwrap().send(Note::Jobs(jobs)).unwrap();
        }

        /// Waits for the next sync to begin; returns what was heard by then.
        fn sync_began(&self) -> Vec<(&'static str, bool)> {
            self.began.recv_timeout(Duration::from_secs(10)).expect("a sync begins");
            self.heard.lock().unwrap().clone()
        }

        fn end_sync(&self, outcome: Result<(), LedgerError>) {
            self.outcome.send(outcome).unwrap();
        }

        /// Hangs up and waits for the loop to end; returns everything heard, and whether
        /// another sync began.
        fn hang_up(self) -> (Vec<(&'static str, bool)>, bool) {
            let Self { tx, began, outcome, heard, thread } = self;
            drop((tx, outcome));
            thread.join().unwrap();
            let extra = began.try_recv().is_ok();
            let heard = heard.lock().unwrap().clone();
            (heard, extra)
        }

        /// Waits until `n` jobs heard.
        fn heard(&self, n: usize) -> Vec<(&'static str, bool)> {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let heard = self.heard.lock().unwrap().clone();
                if heard.len() >= n || Instant::now() > deadline {
                    return heard;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    #[test]
    fn a_sync_begins_at_the_commit_and_its_jobs_hear_after_it_whenever_they_come() {
        let harness = Harness::start();
        harness.committed();
        // The sync began before the batch's jobs were handed over.
        assert!(harness.sync_began().is_empty());
        // The batch's jobs, and a second batch, arrive while the disk works.
        harness.jobs(&["first"]);
        harness.committed();
        harness.jobs(&["second a", "second b"]);
        harness.end_sync(Ok(()));
        // The second batch was committed during the first sync: it waits for the next.
        assert_eq!(harness.sync_began(), [("first", true)]);
        harness.end_sync(Err(LedgerError::Commit));
        assert_eq!(
            harness.heard(3),
            [("first", true), ("second a", false), ("second b", false)],
            "each batch hears the outcome of a sync that began after its commit"
        );
        let (_, extra) = harness.hang_up();
        assert!(!extra, "no sync without a commit");
    }

    #[test]
    fn batches_committed_during_a_sync_share_the_next_one() {
        let harness = Harness::start();
        harness.committed();
        assert!(harness.sync_began().is_empty());
        for name in ["one", "two", "three"] {
            if name != "one" {
                harness.committed();
            }
            harness.jobs(&[name]);
        }
        harness.end_sync(Ok(()));
        // "two" and "three" came during the first sync: one more covers both.
        assert_eq!(harness.sync_began(), [("one", true)]);
        harness.end_sync(Ok(()));
        let (heard, extra) = harness.hang_up();
        assert_eq!(heard, [("one", true), ("two", true), ("three", true)]);
        assert!(!extra, "two batches, one sync");
    }

    #[test]
    fn a_ledger_that_hangs_up_mid_sync_still_hears_the_sync_it_waited_for() {
        let mut harness = Harness::start();
        harness.committed();
        harness.jobs(&["last"]);
        harness.sync_began();
        drop(harness.tx.take());
        harness.end_sync(Ok(()));
        let (heard, extra) = harness.hang_up();
        assert_eq!(heard, [("last", true)]);
        assert!(!extra);
    }
}
