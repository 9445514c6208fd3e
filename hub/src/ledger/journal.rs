//! The send journal: a direct send whose caller waits for its outcome is appended here, one
//! line in the file system's cache, before its frame goes to the driver, and its ledger row
//! is written later, by the ledger thread, in the transaction that records its outcome. A
//! sequential send then costs one ledger transaction instead of two (BENCHMARKS.md,
//! thirty-first round).
//!
//! Why nothing is lost. A held send's line is in the operating system before the driver can
//! see the frame, so a crash of the hub leaves it in a journal file; opening the ledger
//! writes every line whose row is missing as a `sent` record (which the restart then makes
//! `unknown`) before anything else runs. The ledger thread takes every held send at the start
//! of each batch, before that batch's calls run, so any call queued after a send was held
//! (its outcome, a caller's or an operator's read) finds its row. The journal is not synced:
//! on power loss it keeps what the add's unsynced commit kept before it (a send handed to a
//! driver is durable with its outcome's sync, as before).
//!
//! Two files take turns: once the one written grows past [`ROTATE_AT`], the ledger thread
//! turns to the other (empty) one as it takes the held sends, and empties the first once
//! their rows committed. The files stay bounded whatever the rate.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

/// The journal's two files, in the state directory.
pub const FILES: [&str; 2] = ["sends.0.jsonl", "sends.1.jsonl"];

/// The size past which the ledger thread turns to the other file.
pub const ROTATE_AT: u64 = 4 * 1024 * 1024;

/// A held send, as one journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub id: i64,
    pub instance: String,
    /// The `OutboundMessage` as JSON text.
    pub message: String,
    pub now_ms: u64,
    pub expires_ms: u64,
}

/// The journal: the file being written, and the sends held since the ledger thread last took
/// them.
#[derive(Debug)]
pub struct Journal {
    inner: Mutex<Inner>,
    /// The ledger thread waits for work (set by the thread).
    idle: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    files: [File; 2],
    sizes: [u64; 2],
    active: usize,
    held: Vec<Entry>,
    /// A file whose lines are all held again after a batch that did not commit: emptied
    /// after the next commit.
    to_empty: Option<usize>,
}

/// What the ledger thread took at the start of a batch: the sends to write, and the file to
/// empty once they committed.
#[derive(Debug, Default)]
pub struct Taken {
    pub held: Vec<Entry>,
    empty: Option<usize>,
}

impl Journal {
    /// Opens (creating, mode 0600) the journal's files in `dir`, and returns what they hold:
    /// the sends a crash may have left without a row. The files are emptied by
    /// [`recovered`](Self::recovered), once those rows are written.
    pub fn open(dir: &Path) -> io::Result<(Self, Vec<Entry>)> {
        let mut found = Vec::new();
        let mut open = |name: &str| -> io::Result<(File, u64)> {
            let path = dir.join(name);
            let file =
                OpenOptions::new().read(true).append(true).create(true).mode(0o600).open(&path)?;
            let size = file.metadata()?.len();
            found.extend(read(&file)?);
            Ok((file, size))
        };
        let (first, first_size) = open(FILES[0])?;
        let (second, second_size) = open(FILES[1])?;
        let inner = Inner {
            files: [first, second],
            sizes: [first_size, second_size],
            active: 0,
            held: Vec::new(),
            to_empty: None,
        };
        Ok((Self { inner: Mutex::new(inner), idle: AtomicBool::new(false) }, found))
    }

    /// Empties both files: what they held is in the ledger (committed and synced).
    pub fn recovered(&self) -> io::Result<()> {
        let mut inner = self.lock();
        for index in 0..2 {
            inner.files[index].set_len(0)?;
            inner.sizes[index] = 0;
        }
        Ok(())
    }

    /// Appends `entry` and holds it for the ledger thread, unless another send is held
    /// already (`Ok(false)`: sends come faster than the ledger thread's batches, and the
    /// caller records it the usual way, in a batch with others). When the line cannot be
    /// written the send is not held either.
    pub fn hold(&self, entry: &Entry) -> io::Result<bool> {
        // Each line starts on a new one: a line a failed write left cut short (a full disk)
        // ends there, and only it is lost.
        let mut line = Vec::with_capacity(entry.message.len() + 128);
        line.push(b'\n');
        let mut inner = self.lock();
        if !inner.held.is_empty() {
            return Ok(false);
        }
        serde_json::to_writer(&mut line, entry).map_err(io::Error::other)?;
        let active = inner.active;
        inner.files[active].write_all(&line)?;
        inner.sizes[active] += line.len() as u64;
        inner.held.push(entry.clone());
        Ok(true)
    }

    /// Takes the held sends (the ledger thread, as a batch starts), turning to the other file
    /// when the one written is past [`ROTATE_AT`] and the other is empty.
    pub fn take(&self) -> Taken {
        let mut inner = self.lock();
        let held = std::mem::take(&mut inner.held);
        let mut empty = inner.to_empty.take();
        let (active, other) = (inner.active, 1 - inner.active);
        if empty.is_none() && inner.sizes[active] >= ROTATE_AT && inner.sizes[other] == 0 {
            inner.active = other;
            empty = Some(active);
        }
        Taken { held, empty }
    }

    /// The batch that wrote `taken` committed: the file it emptied is emptied.
    pub fn committed(&self, taken: Taken) {
        let Some(index) = taken.empty else { return };
        let mut inner = self.lock();
        match inner.files[index].set_len(0) {
            Ok(()) => inner.sizes[index] = 0,
            // Tried again after the next commit; meanwhile the files do not turn.
            Err(_) => inner.to_empty = Some(index),
        }
    }

    /// The batch that would have written `taken` did not commit: its sends are held again,
    /// ahead of those held since.
    pub fn restore(&self, taken: Taken) {
        let mut inner = self.lock();
        let since = std::mem::replace(&mut inner.held, taken.held);
        inner.held.extend(since);
        if taken.empty.is_some() {
            inner.to_empty = taken.empty;
        }
    }

    /// The ledger thread starts (`true`) or stops waiting for work.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }

    /// Whether the ledger thread waits for work: a send is worth holding then (see
    /// `Ledger::outbox_hold`).
    pub fn idle(&self) -> bool {
        self.idle.load(Ordering::Relaxed)
    }

    /// Whether sends are held (the ledger thread writes them before it stops).
    pub fn holding(&self) -> bool {
        !self.lock().held.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The entries in `file`, in order; a line that does not parse (cut short by a power loss as
/// it was written) is skipped.
fn read(file: &File) -> io::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for line in BufReader::new(file).split(b'\n') {
        if let Ok(entry) = serde_json::from_slice::<Entry>(&line?) {
            entries.push(entry);
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: i64) -> Entry {
        Entry {
            id,
            instance: "slack.primary".into(),
            message: format!(r#"{{"text":"m{id}"}}"#),
            now_ms: 1_000,
            expires_ms: 2_000,
        }
    }

    #[test]
    fn held_sends_survive_in_the_files_until_recovered_and_a_cut_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, found) = Journal::open(dir.path()).unwrap();
        assert!(found.is_empty());
        assert!(journal.hold(&entry(1)).unwrap());
        assert!(!journal.hold(&entry(9)).unwrap(), "one send held at a time");
        assert!(journal.holding());
        // Taken by a batch that never committed (the hub died): the line stays.
        let _taken = journal.take();
        assert!(journal.hold(&entry(2)).unwrap());
        drop(journal);
        // A write cut a line short (a full disk, a power loss); the next line still reads.
        let mut file = OpenOptions::new().append(true).open(dir.path().join(FILES[0])).unwrap();
        file.write_all(b"\n{\"id\":3,\"instance\":\"sl").unwrap();
        let (journal, _) = Journal::open(dir.path()).unwrap();
        assert!(journal.hold(&entry(4)).unwrap());
        drop(journal);

        let (journal, found) = Journal::open(dir.path()).unwrap();
        assert_eq!(found, vec![entry(1), entry(2), entry(4)]);
        journal.recovered().unwrap();
        drop(journal);
        let (_, found) = Journal::open(dir.path()).unwrap();
        assert!(found.is_empty());
    }

    #[test]
    fn the_files_take_turns_and_one_is_emptied_only_after_its_sends_committed() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path()).unwrap();
        let size = |index: usize| std::fs::metadata(dir.path().join(FILES[index])).unwrap().len();
        let big = Entry { message: "x".repeat(ROTATE_AT as usize), ..entry(1) };
        assert!(journal.hold(&big).unwrap());

        // Past the limit: the next send goes to the other file, the first is emptied once
        // the batch that took its sends committed.
        let taken = journal.take();
        assert_eq!(taken.held, vec![big.clone()]);
        assert!(journal.hold(&entry(2)).unwrap());
        assert!(size(0) > ROTATE_AT && size(1) > 0);
        // That batch failed: its send is held again, first, and the file keeps it.
        journal.restore(taken);
        let taken = journal.take();
        assert_eq!(taken.held, vec![big, entry(2)]);
        assert!(size(0) > ROTATE_AT, "not emptied before a commit");
        journal.committed(taken);
        assert_eq!(size(0), 0);
        assert!(size(1) > 0, "the file written now is kept");

        // Below the limit nothing turns and nothing is emptied.
        let taken = journal.take();
        journal.committed(taken);
        assert!(size(1) > 0);
        let (_, found) = Journal::open(dir.path()).unwrap();
        assert_eq!(found, vec![entry(2)]);
    }
}
