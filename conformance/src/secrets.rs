//! Secret watching: the canary values the driver is launched with, looked for in every byte it
//! writes (to the socket, stdout and stderr), across chunk boundaries. Only variable names are
//! ever reported, never values.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// The canary variable every driver under test gets.
pub const CANARY_VAR: &str = "CHANNELD_CONFORMANCE_SECRET";

/// A secret to watch for: the variable that holds it and its value.
#[derive(Clone)]
pub struct Watched {
    pub var: String,
    value: Vec<u8>,
}

impl Watched {
    pub fn new(var: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self { var: var.into(), value: value.into() }
    }
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Watched({}=***)", self.var)
    }
}

/// A fresh canary value: `canary-` and 32 random hex digits.
pub fn canary() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Unique enough for a canary: it only has to be a string nobody writes by accident.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes = (nanos ^ u128::from(std::process::id())).to_le_bytes();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("canary-{hex}")
}

/// Where the driver wrote a secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    Wire,
    Stdout,
    Stderr,
}

impl Place {
    pub fn as_str(self) -> &'static str {
        match self {
            Place::Wire => "the socket",
            Place::Stdout => "stdout",
            Place::Stderr => "stderr",
        }
    }
}

/// The leaks found so far, shared by every stream being scanned.
#[derive(Debug, Clone, Default)]
pub struct Leaks(Arc<Mutex<BTreeSet<(String, Place)>>>);

impl Leaks {
    fn record(&self, var: &str, place: Place) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert((var.to_owned(), place));
    }

    /// Every (variable, place) found, sorted.
    pub fn found(&self) -> Vec<(String, Place)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }
}

/// Scans one stream: keeps the tail of the last chunk so a value split across two reads is
/// still found.
#[derive(Debug)]
pub struct Scanner {
    watched: Arc<[Watched]>,
    place: Place,
    leaks: Leaks,
    carry: Vec<u8>,
}

impl Scanner {
    pub fn new(watched: Arc<[Watched]>, place: Place, leaks: Leaks) -> Self {
        Self { watched, place, leaks, carry: Vec::new() }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let longest = self.watched.iter().map(|w| w.value.len()).max().unwrap_or(0);
        if longest == 0 || chunk.is_empty() {
            return;
        }
        self.carry.extend_from_slice(chunk);
        for watched in self.watched.iter().filter(|w| !w.value.is_empty()) {
            if contains(&self.carry, &watched.value) {
                self.leaks.record(&watched.var, self.place);
            }
        }
        let keep = longest - 1;
        if self.carry.len() > keep {
            self.carry.drain(..self.carry.len() - keep);
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// `text` with every watched value replaced by `***`, for reasons that quote driver output.
pub fn redact(text: &str, watched: &[Watched]) -> String {
    let mut text = text.to_owned();
    for w in watched {
        if let Ok(value) = std::str::from_utf8(&w.value)
            && !value.is_empty()
        {
            text = text.replace(value, "***");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_split_across_chunks_is_found_and_named_by_its_variable() {
        let watched: Arc<[Watched]> = vec![Watched::new("TOKEN", "s3cret-value")].into();
        let leaks = Leaks::default();
        let mut scanner = Scanner::new(watched.clone(), Place::Stderr, leaks.clone());
        scanner.feed(b"connecting with s3cr");
        assert!(leaks.found().is_empty());
        scanner.feed(b"et-value\n");
        assert_eq!(leaks.found(), vec![("TOKEN".to_owned(), Place::Stderr)]);
        let mut wire = Scanner::new(watched.clone(), Place::Wire, leaks.clone());
        wire.feed(b"nothing to see");
        assert_eq!(leaks.found().len(), 1);
        assert_eq!(redact("token=s3cret-value", &watched), "token=***");
        assert_eq!(format!("{:?}", watched[0]), "Watched(TOKEN=***)");
    }

    #[test]
    fn canaries_differ() {
        let (a, b) = (canary(), canary());
        assert_ne!(a, b);
        assert!(a.starts_with("canary-") && a.len() == 39, "{a}");
    }
}
