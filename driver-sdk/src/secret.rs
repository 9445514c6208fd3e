//! Secrets that never print: `Debug` and `Display` show `***`.

use std::fmt;
use std::io;
use std::path::Path;

/// A credential. Read it with [`Secret::expose`] at the one place that needs the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

/// Why a credential could not be read. Never contains the credential's value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("credential {name} could not be read: {source}")]
    Read { name: String, source: io::Error },
    #[error("credential {name} is empty")]
    Empty { name: String },
}

impl Secret {
    pub fn new(value: String) -> Self {
        Self(value)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Reads `<dir>/<name>`, trimming one trailing newline. `Ok(None)` if the file is absent.
    pub fn from_credential_file(dir: &Path, name: &str) -> Result<Option<Self>, SecretError> {
        let path = dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(mut value) => {
                if value.ends_with('\n') {
                    value.pop();
                    if value.ends_with('\r') {
                        value.pop();
                    }
                }
                if value.is_empty() {
                    return Err(SecretError::Empty { name: name.to_owned() });
                }
                Ok(Some(Self(value)))
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(SecretError::Read { name: name.to_owned(), source }),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_its_value() {
        let secret = Secret::new("hunter2".into());
        assert_eq!(format!("{secret} {secret:?}"), "*** ***");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn credential_files_win_and_lose_their_newline() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "abc\n").unwrap();
        let secret = Secret::from_credential_file(dir.path(), "token").unwrap().unwrap();
        assert_eq!(secret.expose(), "abc");
        assert!(Secret::from_credential_file(dir.path(), "absent").unwrap().is_none());
    }
}
