//! The driver's state directory: what must survive a restart (or a `kill -9`).
//!
//! * `login.json` — what `channeld-wechat login` stored: bot token, bot and user ids, base URL;
//! * `cursor.json` — the `getupdates` cursor, written only once the hub accepted every message
//!   before it;
//! * `seen.json` — the replay set ([`SeenSet`]): message ids the hub took, with reply progress;
//! * `contexts.json` — the latest context token per user ([`ContextTokens`]).
//!
//! Every file is written atomically — a temporary file created `0600`, written, fsynced,
//! renamed over the old one, and the directory fsynced — so a crash leaves either the old
//! or the new content, never a mix. A file written by root (the `login` command run with
//! `sudo`) is given to the directory's owner, so the driver's own user can read it.
//! These functions block; the driver calls them off its async threads.

mod contexts;
mod seen;

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use contexts::{ContextToken, ContextTokens, Usable};
pub use seen::{ReplyProgress, Seen, SeenSet};

/// The format version every file carries; a newer one is refused rather than misread.
pub const FORMAT_VERSION: u32 = 1;

pub const LOGIN_FILE: &str = "login.json";
pub const CURSOR_FILE: &str = "cursor.json";
pub const SEEN_FILE: &str = "seen.json";
pub const CONTEXTS_FILE: &str = "contexts.json";

/// Why the state directory could not be read or written. Names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("state file {} is unreadable ({reason}); move it aside to start over", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("state directory {} is not a directory", path.display())]
    NotADirectory { path: PathBuf },
}

fn io_error(path: &Path, source: io::Error) -> StateError {
    StateError::Io { path: path.to_owned(), source }
}

/// What a QR login produced.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredLogin {
    pub bot_token: String,
    pub bot_id: String,
    #[serde(default)]
    pub user_id: Option<String>,
    /// The API base URL the login named; it wins over `CHANNELD_WECHAT_BASE_URL`.
    #[serde(default)]
    pub base_url: Option<String>,
    pub saved_at_ms: u64,
    /// Tokens of earlier logins, newest first (the next QR request lists them).
    #[serde(default)]
    pub previous_tokens: Vec<String>,
}

impl fmt::Debug for StoredLogin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredLogin")
            .field("bot_token", &"***")
            .field("bot_id", &self.bot_id)
            .field("user_id", &self.user_id)
            .field("base_url", &self.base_url)
            .field("saved_at_ms", &self.saved_at_ms)
            .field("previous_tokens", &self.previous_tokens.len())
            .finish()
    }
}

/// A file's content with its format version.
#[derive(Serialize, Deserialize)]
struct Versioned<T> {
    version: u32,
    #[serde(flatten)]
    content: T,
}

#[derive(Serialize, Deserialize)]
struct Cursor {
    get_updates_buf: String,
}

/// The state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    /// Opens `dir`, creating it (mode 0700) if missing.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        match fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(StateError::NotADirectory { path: dir.to_owned() }),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|err| io_error(dir, err))?;
            }
            Err(err) => return Err(io_error(dir, err)),
        }
        Ok(Self { dir: dir.to_owned() })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn load_login(&self) -> Result<Option<StoredLogin>, StateError> {
        self.load(LOGIN_FILE)
    }

    pub fn save_login(&self, login: &StoredLogin) -> Result<(), StateError> {
        self.save(LOGIN_FILE, login)
    }

    /// The stored cursor; empty when there is none (the server then resumes where this bot
    /// last acknowledged).
    pub fn load_cursor(&self) -> Result<String, StateError> {
        Ok(self.load::<Cursor>(CURSOR_FILE)?.map(|c| c.get_updates_buf).unwrap_or_default())
    }

    pub fn save_cursor(&self, cursor: &str) -> Result<(), StateError> {
        self.save(CURSOR_FILE, &Cursor { get_updates_buf: cursor.to_owned() })
    }

    pub fn load_seen(&self) -> Result<SeenSet, StateError> {
        Ok(self.load(SEEN_FILE)?.unwrap_or_default())
    }

    pub fn save_seen(&self, seen: &SeenSet) -> Result<(), StateError> {
        self.save(SEEN_FILE, seen)
    }

    pub fn load_contexts(&self) -> Result<ContextTokens, StateError> {
        Ok(self.load(CONTEXTS_FILE)?.unwrap_or_default())
    }

    pub fn save_contexts(&self, contexts: &ContextTokens) -> Result<(), StateError> {
        self.save(CONTEXTS_FILE, contexts)
    }

    fn load<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StateError> {
        let path = self.file(name);
        let raw = match fs::read(&path) {
            Ok(raw) => raw,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(io_error(&path, err)),
        };
        let corrupt = |reason: String| StateError::Corrupt { path: path.clone(), reason };
        let header: VersionOnly =
            serde_json::from_slice(&raw).map_err(|err| corrupt(format!("not JSON: {err}")))?;
        if header.version > FORMAT_VERSION {
            return Err(corrupt(format!(
                "format version {} is newer than this driver's {FORMAT_VERSION}",
                header.version
            )));
        }
        let versioned: Versioned<T> =
            serde_json::from_slice(&raw).map_err(|err| corrupt(err.to_string()))?;
        Ok(Some(versioned.content))
    }

    fn save<T: Serialize>(&self, name: &str, content: &T) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(&Versioned { version: FORMAT_VERSION, content })
            .map_err(|err| io_error(&self.file(name), io::Error::other(err)))?;
        write_atomic(&self.dir, name, &bytes)
    }
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// Above `max` entries, forgets the oldest tenth (by `age`) at once: one sort per many
/// inserts instead of one per insert.
fn evict_oldest<V>(map: &mut HashMap<String, V>, max: usize, age: impl Fn(&V) -> u64) {
    if map.len() <= max {
        return;
    }
    let mut ages: Vec<(u64, String)> =
        map.iter().map(|(key, value)| (age(value), key.clone())).collect();
    ages.sort_unstable();
    let drop = map.len() - max + max / 10;
    for (_, key) in ages.into_iter().take(drop) {
        map.remove(&key);
    }
}

/// Replaces `dir/name` with `bytes`: temp file (0600, exclusive), write, fsync, rename,
/// fsync of the directory.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StateError> {
    let target = dir.join(name);
    let temp = dir.join(format!(".{name}.{}-{:08x}.tmp", std::process::id(), fastrand::u32(..)));
    let written = (|| -> io::Result<()> {
        let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        give_to_directory_owner(dir, &file, &temp);
        fs::rename(&temp, &target)?;
        File::open(dir)?.sync_all()
    })();
    if let Err(err) = written {
        let _ = fs::remove_file(&temp);
        return Err(io_error(&target, err));
    }
    Ok(())
}

/// A file created by another user than the directory's owner (root running `login`) is
/// handed to the owner; when that is not permitted the file stays as it is.
fn give_to_directory_owner(dir: &Path, file: &File, path: &Path) {
    let (Ok(dir_meta), Ok(file_meta)) = (fs::metadata(dir), file.metadata()) else { return };
    if dir_meta.uid() != file_meta.uid() {
        let _ = std::os::unix::fs::chown(path, Some(dir_meta.uid()), Some(dir_meta.gid()));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn each_file_round_trips_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(&dir.path().join("nested/state")).unwrap();
        assert_eq!(state.load_cursor().unwrap(), "");
        assert!(state.load_login().unwrap().is_none());

        state.save_cursor("CgkIARC4").unwrap();
        assert_eq!(state.load_cursor().unwrap(), "CgkIARC4");
        let login = StoredLogin {
            bot_token: "tok".into(),
            bot_id: "b@im.bot".into(),
            user_id: Some("u@im.wechat".into()),
            base_url: Some("https://ilinkai.weixin.qq.com".into()),
            saved_at_ms: 1,
            previous_tokens: vec!["old".into()],
        };
        state.save_login(&login).unwrap();
        assert_eq!(state.load_login().unwrap(), Some(login.clone()));
        assert!(!format!("{login:?}").contains("tok\""), "the token never prints");

        let mut seen = SeenSet::default();
        seen.settle("wx-1", 10);
        state.save_seen(&seen).unwrap();
        assert!(state.load_seen().unwrap().is_settled("wx-1"));

        for name in [CURSOR_FILE, LOGIN_FILE, SEEN_FILE] {
            let mode = fs::metadata(state.file(name)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{name}");
        }
        let dir_mode = fs::metadata(state.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);
        let leftovers: Vec<_> = fs::read_dir(state.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files are renamed away");
    }

    #[test]
    fn a_corrupt_or_newer_file_is_refused_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        fs::write(state.file(CURSOR_FILE), "{\"version\":1,\"get_upd").unwrap();
        let err = state.load_cursor().unwrap_err().to_string();
        assert!(err.contains(CURSOR_FILE) && err.contains("move it aside"), "{err}");
        fs::write(state.file(SEEN_FILE), r#"{"version":99,"entries":{}}"#).unwrap();
        let err = state.load_seen().unwrap_err().to_string();
        assert!(err.contains("newer"), "{err}");
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state");
        fs::write(&file, "").unwrap();
        assert!(matches!(StateDir::open(&file), Err(StateError::NotADirectory { .. })));
    }

    #[test]
    fn a_write_replaces_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "f", b"a much longer first content").unwrap();
        write_atomic(dir.path(), "f", b"short").unwrap();
        assert_eq!(fs::read(dir.path().join("f")).unwrap(), b"short");
    }
}
