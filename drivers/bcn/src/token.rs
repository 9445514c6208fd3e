//! The bot token BCN issues on the first `bot.connect`, kept in one file (mode 0600) so every
//! reconnect and restart restores the same bot identity. The token is never logged.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use channeld_driver_sdk::Secret;

/// Why the token file could not be read or written (the text names the file, not the token).
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("reading the bot token {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("writing the bot token {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// The stored token, `None` when there is none yet (first connection).
pub fn load(path: &Path) -> Result<Option<Secret>, TokenError> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let token = text.trim();
            Ok((!token.is_empty()).then(|| Secret::new(token.to_owned())))
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenError::Read { path: path.to_owned(), source }),
    }
}

/// Replaces the stored token atomically (a temporary file with mode 0600, then a rename).
pub fn store(path: &Path, token: &str) -> Result<(), TokenError> {
    let failed = |source| TokenError::Write { path: path.to_owned(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    let temporary = path.with_extension("token.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(failed)?;
    file.write_all(token.as_bytes()).and_then(|()| file.sync_all()).map_err(failed)?;
    std::fs::rename(&temporary, path).map_err(failed)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_stored_token_loads_back_and_only_the_owner_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("bcn.lab.token");
        assert!(load(&path).unwrap().is_none());
        store(&path, "tok-1").unwrap();
        store(&path, "tok-2").unwrap();
        assert_eq!(load(&path).unwrap().unwrap().expose(), "tok-2");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::write(&path, "\n").unwrap();
        assert!(load(&path).unwrap().is_none(), "an empty file is no token");
    }
}
