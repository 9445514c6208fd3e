//! Ids the hub makes: request ids unique across hub restarts (`<kind>-<boot nonce>-<n>`) and
//! connection numbers for logs.

use std::sync::atomic::{AtomicU64, Ordering};

use channeld_protocol::Id;

/// The id source of one running hub.
#[derive(Debug)]
pub struct Ids {
    boot: String,
    request: AtomicU64,
    connection: AtomicU64,
}

impl Default for Ids {
    fn default() -> Self {
        Self::new()
    }
}

impl Ids {
    pub fn new() -> Self {
        Self { boot: boot_nonce(), request: AtomicU64::new(1), connection: AtomicU64::new(1) }
    }

    /// A request id unique across hub restarts: `<kind>-<boot nonce>-<sequence>`.
    pub fn request(&self, kind: &str) -> Id {
        let seq = self.request.fetch_add(1, Ordering::Relaxed);
        Id::format(format_args!("{kind}-{}-{seq}", self.boot))
            .expect("generated ids are short and valid")
    }

    /// The next connection number (for logs and the live-driver slot).
    pub fn connection(&self) -> u64 {
        self.connection.fetch_add(1, Ordering::Relaxed)
    }
}

/// 12 hex digits from the OS's random source. Should that fail (it does not on Linux), the
/// clock and the PID still make a restart's nonce differ from the last one's.
fn boot_nonce() -> String {
    let mut bytes = [0u8; 6];
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mixed = nanos ^ (u128::from(std::process::id()) << 64);
        bytes.copy_from_slice(&mixed.to_le_bytes()[..6]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_unique_per_hub_and_across_restarts() {
        let (first, second) = (Ids::new(), Ids::new());
        let a = first.request("out");
        let b = first.request("out");
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("out-") && a.as_str().ends_with("-1"), "{a}");
        assert_ne!(first.boot, second.boot, "a restarted hub has a new nonce");
        assert_eq!(first.boot.len(), 12);
    }
}
