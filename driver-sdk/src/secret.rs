//! Secrets that never print: `Debug` and `Display` show `***`, whatever the value's type.

use std::fmt;
use std::io;
use std::path::Path;

use url::Url;

use crate::config::ConfigError;

/// A credential: a token, a password, a URL with a password in it. Read it with
/// [`Secret::expose`] at the one place that needs the value; everywhere else (logs, errors,
/// `Debug` of a config struct) it prints `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T = String>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The value, for the one call that needs it.
    pub fn expose(&self) -> &T {
        &self.0
    }

    /// The secret turned into another secret (e.g. a string parsed into a URL).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Secret<U> {
        Secret(f(self.0))
    }
}

impl Secret<String> {
    /// The value as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Reads `<dir>/<name>`, trimming one trailing newline. `Ok(None)` if the file is absent.
    pub fn from_credential_file(dir: &Path, name: &str) -> Result<Option<Self>, ConfigError> {
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
                    return Err(credential_error(name, "is empty"));
                }
                Ok(Some(Self(value)))
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(credential_error(name, format!("could not be read: {err}"))),
        }
    }
}

impl Secret<Url> {
    /// The URL with its password replaced by `***` (and without query or fragment, which may
    /// carry tokens), for logs: `amqp://bot:***@broker:5672/%2f`.
    pub fn redacted(&self) -> String {
        let mut url = self.0.clone();
        if url.password().is_some() {
            let _ = url.set_password(Some("***"));
        }
        url.set_query(None);
        url.set_fragment(None);
        url.to_string()
    }
}

fn credential_error(name: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Credential { name: name.to_owned(), reason: reason.into() }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_its_value() {
        let secret = Secret::new("hunter2".to_owned());
        assert_eq!(format!("{secret} {secret:?}"), "*** ***");
        assert_eq!(secret.as_str(), "hunter2");
        let url = Secret::new(Url::parse("amqp://bot:hunter2@broker/%2f?token=t0k").unwrap());
        assert_eq!(format!("{url} {url:?}"), "*** ***");
    }

    #[test]
    fn a_url_redacts_its_password_and_query() {
        let url = Secret::new(Url::parse("amqp://bot:hunter2@broker:5672/%2f?token=t0k").unwrap());
        assert_eq!(url.redacted(), "amqp://bot:***@broker:5672/%2f");
        let plain = Secret::new(Url::parse("https://api.example/v1").unwrap());
        assert_eq!(plain.redacted(), "https://api.example/v1");
    }

    #[test]
    fn credential_files_lose_their_newline_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "abc\n").unwrap();
        let secret = Secret::from_credential_file(dir.path(), "token").unwrap().unwrap();
        assert_eq!(secret.as_str(), "abc");
        assert!(Secret::from_credential_file(dir.path(), "absent").unwrap().is_none());
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        let err = Secret::from_credential_file(dir.path(), "empty").unwrap_err();
        assert_eq!(err.to_string(), "credential empty is empty");
    }
}
