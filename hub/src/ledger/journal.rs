//! The send journal: a direct send whose caller waits for its outcome is written here, one
//! line in the file system's cache, before its frame goes to the driver, and its ledger row
//! is written later, by the ledger thread, in the transaction that records its outcome. A
//! sequential send then costs one ledger transaction instead of two (BENCHMARKS.md,
//! thirty-first round).
//!
//! Why nothing is lost. A held send's line is in the operating system before the driver can
//! see the frame, so a crash of the hub leaves it in the journal's file; opening the ledger
//! writes it as a `sent` record if its row is missing (the restart then makes it `unknown`)
//! before anything else runs. The ledger thread takes the held send at the start of its next
//! batch, before that batch's calls run, so any call queued after a send was held (its
//! outcome, a caller's or an operator's read) finds its row. The journal is not synced: on
//! power loss it keeps what the add's unsynced commit kept before it (a send handed to a
//! driver is durable with its outcome's sync, as before).
//!
//! One send at a time. The file has one slot, its first line: a send is written there when
//! the slot is free, the line is blanked once its row committed, and only then may the next
//! send be held. So the file never holds a line whose row was written, and a record pruned
//! long after its send cannot come back from it.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

/// The journal's file, in the state directory.
pub const FILE: &str = "sends.jsonl";

/// A held send, as the journal's line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub id: i64,
    pub instance: String,
    /// The `OutboundMessage` as JSON text.
    pub message: String,
    pub now_ms: u64,
    pub expires_ms: u64,
}

/// The journal: its file, and the send in its slot.
#[derive(Debug)]
pub struct Journal {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    file: File,
    slot: Slot,
}

#[derive(Debug)]
enum Slot {
    Free,
    /// Written, waiting for the ledger thread.
    Held(Entry),
    /// Taken by a batch that has not committed yet.
    Taken,
}

/// What the ledger thread took at the start of a batch: the send to write first.
#[derive(Debug, Default)]
pub struct Taken {
    pub held: Option<Entry>,
}

impl Journal {
    /// Opens (creating, mode 0600) the journal's file in `dir`, and returns the send a crash
    /// may have left without a row. The file is emptied by [`recovered`](Self::recovered),
    /// once that row is written.
    pub fn open(dir: &Path) -> io::Result<(Self, Vec<Entry>)> {
        let mut file = super::lock::open_private(&dir.join(FILE))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let found = first_line(&bytes).into_iter().collect();
        let inner = Inner { file, slot: Slot::Free };
        Ok((Self { inner: Mutex::new(inner) }, found))
    }

    /// Empties the file: what it held is in the ledger (committed and synced).
    pub fn recovered(&self) -> io::Result<()> {
        self.lock().file.set_len(0)
    }

    /// Writes `entry` in the slot and holds it for the ledger thread, unless another send
    /// holds the slot (`Ok(false)`: the caller records it the usual way). When the line
    /// cannot be written the send is not held either.
    pub fn hold(&self, entry: &Entry) -> io::Result<bool> {
        let mut inner = self.lock();
        if !matches!(inner.slot, Slot::Free) {
            return Ok(false);
        }
        let mut line = Vec::with_capacity(entry.message.len() + 128);
        serde_json::to_writer(&mut line, entry).map_err(io::Error::other)?;
        line.push(b'\n');
        // Over the first line; what follows a shorter one is never read.
        inner.file.write_all_at(&line, 0)?;
        inner.slot = Slot::Held(entry.clone());
        Ok(true)
    }

    /// Takes the held send (the ledger thread, as a batch starts).
    pub fn take(&self) -> Taken {
        let mut inner = self.lock();
        match std::mem::replace(&mut inner.slot, Slot::Free) {
            Slot::Held(entry) => {
                inner.slot = Slot::Taken;
                Taken { held: Some(entry) }
            }
            other => {
                inner.slot = other;
                Taken::default()
            }
        }
    }

    /// The batch that wrote `taken` committed: its line is blanked and the slot freed. When
    /// the line cannot be blanked the slot stays taken, and no send is held again (each is
    /// recorded the usual way).
    pub fn committed(&self, taken: Taken) {
        if taken.held.is_none() {
            return;
        }
        let mut inner = self.lock();
        match inner.file.write_all_at(b"\n", 0) {
            Ok(()) => inner.slot = Slot::Free,
            Err(err) => {
                tracing::error!(error = %err, "cannot clear the send journal; sends are recorded before they are handed over from now on");
            }
        }
    }

    /// The batch that would have written `taken` did not commit: the send is held again.
    pub fn restore(&self, taken: Taken) {
        if let Some(entry) = taken.held {
            self.lock().slot = Slot::Held(entry);
        }
    }

    /// Whether a send is held (the ledger thread writes it before it stops).
    pub fn holding(&self) -> bool {
        matches!(self.lock().slot, Slot::Held(_))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The send in the file's first line; none when it is blank, or does not parse (a power loss
/// cut it short as it was written).
fn first_line(bytes: &[u8]) -> Option<Entry> {
    let line = bytes.split(|byte| *byte == b'\n').next()?;
    serde_json::from_slice(line).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: i64, text: &str) -> Entry {
        Entry {
            id,
            instance: "slack.primary".into(),
            message: format!(r#"{{"text":"{text}"}}"#),
            now_ms: 1_000,
            expires_ms: 2_000,
        }
    }

    fn reopened(dir: &Path) -> Vec<Entry> {
        Journal::open(dir).unwrap().1
    }

    #[test]
    fn a_held_send_stays_in_the_file_until_its_row_committed() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, found) = Journal::open(dir.path()).unwrap();
        assert!(found.is_empty());
        let long = entry(1, &"x".repeat(500));
        assert!(journal.hold(&long).unwrap());
        assert!(journal.holding());
        assert_eq!(reopened(dir.path()), vec![long.clone()], "a crash now leaves it");

        // Taken by a batch: the line stays until the batch committed.
        let taken = journal.take();
        assert_eq!(taken.held, Some(long.clone()));
        assert!(!journal.holding());
        assert_eq!(reopened(dir.path()), vec![long]);
        journal.committed(taken);
        assert!(reopened(dir.path()).is_empty(), "nothing left once the row committed");

        // A shorter line over the longer one's remains reads whole.
        assert!(journal.hold(&entry(2, "short")).unwrap());
        assert_eq!(reopened(dir.path()), vec![entry(2, "short")]);
        journal.recovered().unwrap();
        assert!(reopened(dir.path()).is_empty());
        assert_eq!(std::fs::metadata(dir.path().join(FILE)).unwrap().len(), 0);
    }

    #[test]
    fn one_send_holds_the_slot_until_its_batch_committed() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path()).unwrap();
        assert!(journal.hold(&entry(1, "a")).unwrap());
        assert!(!journal.hold(&entry(2, "b")).unwrap(), "held");
        let taken = journal.take();
        assert!(journal.take().held.is_none(), "taken once");
        assert!(!journal.hold(&entry(2, "b")).unwrap(), "taken, not committed");
        // The batch failed: held again, for the next one.
        journal.restore(taken);
        assert!(journal.holding());
        let taken = journal.take();
        assert_eq!(taken.held, Some(entry(1, "a")));
        journal.committed(taken);
        assert!(journal.hold(&entry(2, "b")).unwrap());
        assert_eq!(reopened(dir.path()), vec![entry(2, "b")]);
    }

    #[test]
    fn a_line_cut_short_is_not_a_send() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), b"{\"id\":3,\"instance\":\"sl").unwrap();
        assert!(reopened(dir.path()).is_empty());
    }
}
