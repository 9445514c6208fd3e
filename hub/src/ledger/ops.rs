//! Operator tools on a ledger file, behind `channeld ledger check|backup|vacuum`: an integrity
//! check, an online backup through SQLite's backup API (safe while a hub runs), and compaction
//! (only while no hub uses the state directory).

use std::path::{Path, PathBuf};

use std::time::Duration;

use rusqlite::backup::StepResult;
use rusqlite::{Connection, OpenFlags};

use super::lock::StateLock;
use super::{DB_FILE, LedgerError, REMEDY_CORRUPT, schema};

/// A backup step the source answered busy is tried again this often, this far apart.
const BUSY_TRIES: u32 = 500;
const BUSY_PAUSE: Duration = Duration::from_millis(10);

/// Problems `integrity_check` lists at most.
const MAX_PROBLEMS: u32 = 100;

/// What `check` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    pub path: PathBuf,
    /// The schema version recorded in the file.
    pub schema_version: usize,
    /// The schema version this build writes.
    pub known_version: usize,
    /// What `PRAGMA integrity_check` reported; empty when the database is whole.
    pub problems: Vec<String>,
}

impl CheckReport {
    /// Whole, and a schema this build can use.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty() && self.schema_version <= self.known_version
    }
}

/// Sizes before and after a vacuum, in bytes (database plus write-ahead log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    pub before: u64,
    pub after: u64,
}

/// Opens the ledger of `dir` read-only; a missing file is an error, never created.
fn open_read_only(dir: &Path) -> Result<(PathBuf, Connection), LedgerError> {
    let path = dir.join(DB_FILE);
    if !path.is_file() {
        return Err(LedgerError::Unusable {
            path,
            problem: "there is no ledger database".into(),
            remedy: "check the state directory (hub.state_dir, --state-dir)",
        });
    }
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|err| corrupt_or_open(&path, &err))?;
    Ok((path, conn))
}

fn corrupt_or_open(path: &Path, err: &rusqlite::Error) -> LedgerError {
    use rusqlite::ErrorCode;
    match err.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => LedgerError::Unusable {
            path: path.to_owned(),
            problem: format!("the database is corrupted: {err}"),
            remedy: REMEDY_CORRUPT,
        },
        _ => LedgerError::Open { path: path.to_owned(), message: err.to_string() },
    }
}

/// `PRAGMA integrity_check` over the ledger of `dir`, and its schema version. Read-only:
/// safe while a hub runs.
pub fn check(dir: &Path) -> Result<CheckReport, LedgerError> {
    let (path, conn) = open_read_only(dir)?;
    let schema_version = schema::version(&conn).map_err(|err| corrupt_or_open(&path, &err))?;
    let problems = schema::check_with(&conn, "integrity_check", MAX_PROBLEMS)
        .map_err(|err| corrupt_or_open(&path, &err))?;
    Ok(CheckReport { path, schema_version, known_version: schema::SCHEMA_VERSION, problems })
}

/// Copies the ledger of `dir` to `dest` with SQLite's online backup API: one consistent
/// snapshot, taken as a reader, so a running hub goes on committing. `dest` must not exist;
/// the copy is written beside it under a temporary name, checked, then renamed (mode 0600).
pub fn backup(dir: &Path, dest: &Path) -> Result<CheckReport, LedgerError> {
    let (path, src) = open_read_only(dir)?;
    let dest_err = |message: String| LedgerError::Open { path: dest.to_owned(), message };
    if dest.exists() {
        return Err(dest_err("the backup file exists already; name a new one".into()));
    }
    let file_name = dest.file_name().ok_or_else(|| dest_err("not a file name".into()))?;
    let mut partial_name = file_name.to_owned();
    partial_name.push(format!(".partial-{}", std::process::id()));
    let partial = dest.with_file_name(partial_name);
    let result = (|| {
        let mut copy = Connection::open(&partial).map_err(|err| dest_err(err.to_string()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o600))
                .map_err(|err| dest_err(err.to_string()))?;
        }
        {
            let backup = rusqlite::backup::Backup::new(&src, &mut copy)
                .map_err(|err| corrupt_or_open(&path, &err))?;
            // Every page in one step: one read snapshot, never restarted by the hub's commits
            // (in WAL mode a reader does not hold up the writer). Busy only while another
            // connection checkpoints or recovers: tried again, for a bounded while.
            let mut busy = 0;
            loop {
                match backup.step(-1).map_err(|err| corrupt_or_open(&path, &err))? {
                    StepResult::Done => break,
                    StepResult::More => {}
                    StepResult::Busy | StepResult::Locked => {
                        busy += 1;
                        if busy > BUSY_TRIES {
                            return Err(dest_err("the ledger stayed busy; try again".into()));
                        }
                        std::thread::sleep(BUSY_PAUSE);
                    }
                    _ => {}
                }
            }
        }
        let schema_version = schema::version(&copy).map_err(|err| dest_err(err.to_string()))?;
        let problems = schema::check_with(&copy, "integrity_check", MAX_PROBLEMS)
            .map_err(|err| dest_err(err.to_string()))?;
        drop(copy);
        Ok(CheckReport {
            path: dest.to_owned(),
            schema_version,
            known_version: schema::SCHEMA_VERSION,
            problems,
        })
    })();
    match result {
        Ok(report) => {
            std::fs::rename(&partial, dest).map_err(|err| dest_err(err.to_string()))?;
            Ok(report)
        }
        Err(err) => {
            let _ = std::fs::remove_file(&partial);
            Err(err)
        }
    }
}

/// `VACUUM` and a WAL truncation on the ledger of `dir`. Needs the state directory's lock:
/// refused with [`LedgerError::InUse`] while a hub runs (a vacuum would hold its commits).
pub fn vacuum(dir: &Path) -> Result<Compacted, LedgerError> {
    let path = dir.join(DB_FILE);
    if !path.is_file() {
        return Err(LedgerError::Unusable {
            path,
            problem: "there is no ledger database".into(),
            remedy: "check the state directory (hub.state_dir, --state-dir)",
        });
    }
    let _lock = StateLock::acquire(dir)?;
    let before = size_on_disk(&path);
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|err| corrupt_or_open(&path, &err))?;
    conn.execute_batch("VACUUM").map_err(|err| corrupt_or_open(&path, &err))?;
    conn.pragma_update(None, "wal_checkpoint", "TRUNCATE")
        .map_err(|err| corrupt_or_open(&path, &err))?;
    drop(conn);
    Ok(Compacted { before, after: size_on_disk(&path) })
}

/// The database file plus its write-ahead log.
fn size_on_disk(path: &Path) -> u64 {
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    len(path) + len(Path::new(&wal))
}

#[cfg(test)]
mod tests {
    use super::super::{Durability, Ledger, NewInbound, Recorded};
    use super::*;

    fn inbound(event_id: &str) -> NewInbound {
        NewInbound {
            instance: "a.b".into(),
            event_id: event_id.into(),
            content_hash: [1; 32],
            hash_version: 2,
            frame: vec![7; 2000],
            run_id: format!("run-{event_id}"),
            started: true,
            now_ms: 1,
            item: None,
        }
    }

    #[tokio::test]
    async fn a_backup_taken_while_the_ledger_is_open_holds_what_was_committed() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        for n in 0..50 {
            let recorded = ledger.record_inbound_now(inbound(&format!("e{n}")), |_| None, None);
            assert_eq!(recorded.await.unwrap(), Recorded::New { entry: None });
        }
        let dest = dir.path().join("copy.sqlite3");
        let report = backup(dir.path(), &dest).unwrap();
        assert!(report.is_ok(), "{report:?}");
        assert!(backup(dir.path(), &dest).is_err(), "an existing backup is never overwritten");
        ledger.close().await;

        let restored = tempfile::tempdir().unwrap();
        std::fs::copy(&dest, restored.path().join(DB_FILE)).unwrap();
        let ledger = Ledger::open(restored.path(), Durability::Full).unwrap();
        assert_eq!(ledger.recover(5).await.unwrap().len(), 50);
        ledger.close().await;
    }

    #[tokio::test]
    async fn vacuum_is_refused_while_a_hub_holds_the_directory_and_shrinks_it_after() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        for n in 0..200 {
            ledger.record_inbound_now(inbound(&format!("e{n}")), |_| None, None).await.unwrap();
        }
        ledger.prune(u64::MAX).await.unwrap();
        assert!(matches!(vacuum(dir.path()), Err(LedgerError::InUse { .. })));
        ledger.close().await;
        let compacted = vacuum(dir.path()).unwrap();
        assert!(compacted.after <= compacted.before, "{compacted:?}");
        assert!(check(dir.path()).unwrap().is_ok());
    }

    #[test]
    fn check_names_a_file_that_is_not_a_database() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DB_FILE), vec![0x5a; 8192]).unwrap();
        match check(dir.path()) {
            Err(LedgerError::Unusable { path, problem, .. }) => {
                assert_eq!(path, dir.path().join(DB_FILE));
                assert!(problem.contains("corrupted"), "{problem}");
            }
            other => panic!("expected Unusable, got {other:?}"),
        }
    }

    #[test]
    fn check_names_damaged_pages_as_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DB_FILE);
        {
            let mut conn = Connection::open(&path).unwrap();
            let tx = conn.transaction().unwrap();
            tx.execute_batch(
                "CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT);
                 CREATE INDEX t_v ON t (v);",
            )
            .unwrap();
            for n in 0..500 {
                tx.execute("INSERT INTO t (v) VALUES (?1)", [format!("value {n}")]).unwrap();
            }
            tx.commit().unwrap();
        }
        let mut bytes = std::fs::read(&path).unwrap();
        // Scribble over the last pages (the index and table leaves), keep the header.
        let len = bytes.len();
        for byte in &mut bytes[len - 8192..len - 100] {
            *byte = 0x33;
        }
        std::fs::write(&path, bytes).unwrap();
        match check(dir.path()) {
            Err(LedgerError::Unusable { problem, .. }) => {
                assert!(problem.contains("corrupted"), "{problem}");
            }
            other => panic!("expected Unusable, got {other:?}"),
        }
    }
}
