//! One hub per state directory: an exclusive `flock` on `<state dir>/channeld.lock`, taken
//! before the ledger opens and held until it closes (or the process dies: the kernel drops
//! the lock with the file). The holder writes its pid into the file, so a second hub can
//! say whose it is.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rustix::fs::{FlockOperation, flock};
use rustix::io::Errno;

use super::LedgerError;

/// The lock file inside the state directory.
pub const LOCK_FILE: &str = "channeld.lock";

/// The state directory's lock, held while this value lives.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

/// Opens `path` to read and write, creating it readable by the hub's user only (mode 0600)
/// and keeping what it holds: the state lock's file and the send journal's.
pub fn open_private(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(path)
}

impl StateLock {
    /// Takes the lock of `dir` (which must exist), or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<Self, LedgerError> {
        let path = dir.join(LOCK_FILE);
        let fail = |message: String| LedgerError::Open { path: path.clone(), message };
        // Opened close-on-exec (Rust's default): agents and drivers the hub starts never
        // inherit the lock.
        let mut file = open_private(&path).map_err(|err| fail(err.to_string()))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(LedgerError::InUse {
                    dir: dir.to_owned(),
                    pid: holder.trim().parse().ok(),
                });
            }
            Err(err) => return Err(fail(format!("cannot lock it: {err}"))),
        }
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()))
            .and_then(|()| file.flush());
        written.map_err(|err| fail(err.to_string()))?;
        Ok(Self { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_state_directory_is_refused_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = StateLock::acquire(dir.path()).unwrap();
        // Another open file description, as another process would have.
        match StateLock::acquire(dir.path()) {
            Err(LedgerError::InUse { dir: named, pid }) => {
                assert_eq!(named, dir.path());
                assert_eq!(pid, Some(std::process::id()));
            }
            other => panic!("expected InUse, got {other:?}"),
        }
        drop(held);
        StateLock::acquire(dir.path()).expect("free once the holder let go");
    }
}
