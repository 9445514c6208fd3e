//! The driver's persisted state: the checkpoint the subscription starts from (minus the
//! lookback), the seen-set of handled events, the replies already posted, and what each
//! conversation speaks. One JSON file per instance, written atomically (a temp file, fsync,
//! rename, fsync of the directory) with mode 0600.
//!
//! Why each part exists:
//! * gift wraps are backdated up to two days, so the subscription reaches back
//!   `lookback` before the checkpoint, and everything it brings again is recognised by the
//!   seen-set (wrap ids and rumor ids) instead of being answered twice;
//! * the hub answers a message it already has by delivering its stored reply again, so a
//!   reply already posted is remembered with its receipt and not posted twice after a crash;
//! * a conversation remembers the NIP it last spoke (proactive sends use it) and, for a
//!   `group-…` id, its members.
//!
//! Memory and disk are bounded: seen entries older than the checkpoint minus `seen_ttl` (which
//! is longer than the lookback, so nothing the subscription can bring again is forgotten)
//! are pruned, and each map has a cap (oldest first out).

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::convert::Nip;

/// The state file's format version; a file of another version is refused, not guessed at.
pub const STATE_VERSION: u32 = 1;
/// Conversations remembered (least recently used forgotten first).
pub const MAX_CONVERSATIONS: usize = 10_000;

/// Why the state cannot be read or written. Names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path} is not a state file of this driver ({reason}); move it away to start afresh")]
    Corrupt { path: String, reason: String },
    #[error("cannot write {path}: {source}")]
    Write { path: String, source: std::io::Error },
}

/// One handled event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    /// The `created_at` relays filter it by (a wrap's randomised time): it is forgotten once
    /// that lies `seen_ttl` before the checkpoint.
    pub at: u64,
    /// For a message id (rumor or kind 4): the NIP it came in, so its reply goes out in it.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "nip_name")]
    pub nip: Option<Nip>,
}

/// A reply already posted: its receipt's message id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replied {
    pub message_id: String,
    /// Wall-clock time of the post.
    pub at: u64,
}

/// What the driver knows about a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    #[serde(with = "nip_required")]
    pub nip: Nip,
    /// Hex public keys, kept only for `group-…` ids (other ids list their members).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    pub used: u64,
}

/// The whole state. Pure: every method takes the clock as an argument.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// Unix seconds: every message published before it has been received and settled.
    pub checkpoint: u64,
    pub seen: HashMap<String, Seen>,
    pub replies: HashMap<String, Replied>,
    pub conversations: HashMap<String, Conversation>,
}

impl State {
    /// A first start: the subscription reaches back `lookback` from now.
    pub fn fresh(now: u64) -> Self {
        Self {
            version: STATE_VERSION,
            checkpoint: now,
            seen: HashMap::new(),
            replies: HashMap::new(),
            conversations: HashMap::new(),
        }
    }

    pub fn from_json(raw: &[u8]) -> Result<Self, String> {
        let state: State = serde_json::from_slice(raw).map_err(|err| err.to_string())?;
        if state.version != STATE_VERSION {
            return Err(format!("version {} (this driver writes {STATE_VERSION})", state.version));
        }
        Ok(state)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn is_seen(&self, id: &str) -> bool {
        self.seen.contains_key(id)
    }

    /// Remembers `id` as handled; a later sighting keeps the latest `at`.
    pub fn mark_seen(&mut self, id: String, at: u64, nip: Option<Nip>) {
        let entry = self.seen.entry(id).or_insert(Seen { at, nip });
        entry.at = entry.at.max(at);
        entry.nip = entry.nip.or(nip);
    }

    /// The NIP a handled message came in.
    pub fn nip_of(&self, id: &str) -> Option<Nip> {
        self.seen.get(id).and_then(|seen| seen.nip)
    }

    pub fn reply(&self, event_id: &str) -> Option<&Replied> {
        self.replies.get(event_id)
    }

    pub fn record_reply(&mut self, event_id: String, message_id: String, now: u64) {
        self.replies.insert(event_id, Replied { message_id, at: now });
    }

    /// Remembers that `id` last spoke `nip` (and its members, for a group id).
    pub fn use_conversation(&mut self, id: &str, nip: Nip, members: Vec<String>, now: u64) {
        let entry = self.conversations.entry(id.to_owned()).or_insert(Conversation {
            nip,
            members: Vec::new(),
            used: now,
        });
        entry.nip = nip;
        entry.used = now;
        if !members.is_empty() {
            entry.members = members;
        }
    }

    /// Moves the checkpoint forward (never back).
    pub fn advance(&mut self, checkpoint: u64) {
        self.checkpoint = self.checkpoint.max(checkpoint);
    }

    /// Forgets seen entries older than the checkpoint minus `ttl` and replies older than `now`
    /// minus `ttl`, then the oldest of each beyond `max` (conversations beyond
    /// [`MAX_CONVERSATIONS`]). Returns how many entries went.
    pub fn prune(&mut self, now: u64, ttl: u64, max: usize) -> usize {
        let before = self.seen.len() + self.replies.len() + self.conversations.len();
        let horizon = self.checkpoint.saturating_sub(ttl);
        self.seen.retain(|_, seen| seen.at >= horizon);
        let reply_horizon = now.saturating_sub(ttl);
        self.replies.retain(|_, replied| replied.at >= reply_horizon);
        keep_newest(&mut self.seen, max, |seen| seen.at);
        keep_newest(&mut self.replies, max, |replied| replied.at);
        keep_newest(&mut self.conversations, MAX_CONVERSATIONS, |c| c.used);
        before - (self.seen.len() + self.replies.len() + self.conversations.len())
    }
}

/// Drops the entries with the smallest `age` key until at most `max` remain.
fn keep_newest<V>(map: &mut HashMap<String, V>, max: usize, age: impl Fn(&V) -> u64) {
    if map.len() <= max {
        return;
    }
    let mut ages: Vec<u64> = map.values().map(&age).collect();
    ages.sort_unstable();
    let cutoff = ages[map.len() - max];
    map.retain(|_, value| age(value) >= cutoff);
    // Ties at the cutoff may leave a few extra; drop arbitrary ones of those.
    if map.len() > max {
        let excess = map.len() - max;
        let tied: Vec<String> = map
            .iter()
            .filter(|(_, v)| age(v) == cutoff)
            .map(|(k, _)| k.clone())
            .take(excess)
            .collect();
        for key in tied {
            map.remove(&key);
        }
    }
}

/// The checkpoint the driver may persist now: no later than the time every relay was last
/// caught up (connected with its stored events delivered), nor than the `created_at` plus
/// `lookback` of any message still waiting for the hub (so a crash brings it back), and
/// never earlier than `previous`.
pub fn next_checkpoint(
    previous: u64,
    relays_caught_up: impl IntoIterator<Item = u64>,
    unsettled: impl IntoIterator<Item = u64>,
    lookback: u64,
) -> u64 {
    let relays = relays_caught_up.into_iter().min().unwrap_or(previous);
    let waiting = unsettled.into_iter().map(|at| at.saturating_add(lookback)).min();
    let limit = waiting.map_or(relays, |waiting| waiting.min(relays));
    limit.max(previous)
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The state and its file: the one place the state lives while the driver runs.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    state: Mutex<State>,
    /// Bumped on every change; a write records the generation it wrote.
    generation: Mutex<u64>,
    /// Serialises writes, holding the generation on disk, so an older snapshot never
    /// replaces a newer one.
    written: tokio::sync::Mutex<u64>,
    dirty: Notify,
}

impl StateStore {
    /// Reads the state file; a missing file is a first start.
    pub fn open(path: PathBuf, now: u64) -> Result<Self, StateError> {
        let state = match std::fs::read(&path) {
            Ok(raw) => State::from_json(&raw).map_err(|reason| StateError::Corrupt {
                path: path.display().to_string(),
                reason,
            })?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => State::fresh(now),
            Err(source) => {
                return Err(StateError::Read { path: path.display().to_string(), source });
            }
        };
        Ok(Self {
            path,
            state: Mutex::new(state),
            generation: Mutex::new(0),
            written: tokio::sync::Mutex::new(0),
            dirty: Notify::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the state.
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&lock(&self.state))
    }

    /// Changes the state and asks the writer to save it soon.
    pub fn update<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let result = f(&mut lock(&self.state));
        *lock(&self.generation) += 1;
        self.dirty.notify_one();
        result
    }

    /// Waits until something changed since the last save was asked for.
    pub async fn changed(&self) {
        self.dirty.notified().await;
    }

    /// Writes the current state if it changed since the last write; returns once it is on
    /// disk (or the write failed).
    pub async fn flush(&self) -> Result<(), StateError> {
        let mut written = self.written.lock().await;
        let (generation, bytes) = {
            let state = lock(&self.state);
            (*lock(&self.generation), state.to_json())
        };
        if generation == *written && generation != 0 {
            return Ok(());
        }
        let path = self.path.clone();
        let result = tokio::task::spawn_blocking(move || write_atomically(&path, &bytes))
            .await
            .unwrap_or_else(|err| Err(std::io::Error::other(err.to_string())));
        result.map_err(|source| StateError::Write {
            path: self.path.display().to_string(),
            source,
        })?;
        *written = generation;
        Ok(())
    }
}

/// `path` replaced by `bytes` all at once: a temp file beside it (0600), fsync, rename, fsync
/// of the directory, so a crash leaves either the old or the new file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

mod nip_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::convert::Nip;

    pub fn serialize<S: Serializer>(nip: &Option<Nip>, s: S) -> Result<S::Ok, S::Error> {
        match nip {
            Some(nip) => s.serialize_str(nip.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Nip>, D::Error> {
        let raw: Option<String> = Option::deserialize(d)?;
        raw.map(|raw| {
            Nip::parse(&raw).ok_or_else(|| serde::de::Error::custom(format!("unknown NIP {raw:?}")))
        })
        .transpose()
    }
}

mod nip_required {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::convert::Nip;

    pub fn serialize<S: Serializer>(nip: &Nip, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(nip.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Nip, D::Error> {
        let raw = String::deserialize(d)?;
        Nip::parse(&raw).ok_or_else(|| serde::de::Error::custom(format!("unknown NIP {raw:?}")))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const DAY: u64 = 86_400;

    #[test]
    fn the_checkpoint_waits_for_the_slowest_relay_and_unsettled_messages() {
        let lookback = 2 * DAY;
        assert_eq!(next_checkpoint(100, [500, 300], [], lookback), 300);
        // A message still waiting for the hub holds it back to its time plus the lookback.
        let waiting = 1_000_000;
        assert_eq!(
            next_checkpoint(100, [waiting + 3 * DAY], [waiting], lookback),
            waiting + lookback
        );
        // Never backwards; no relay known: where it was.
        assert_eq!(next_checkpoint(900, [500], [], lookback), 900);
        assert_eq!(next_checkpoint(900, [], [], lookback), 900);
    }

    #[test]
    fn seen_entries_live_past_the_lookback_and_the_cap_drops_the_oldest() {
        let mut state = State::fresh(10 * DAY);
        let ttl = 3 * DAY;
        state.mark_seen("inside".into(), 8 * DAY, Some(Nip::Nip17));
        state.mark_seen("outside".into(), 6 * DAY, None);
        state.record_reply("old-reply".into(), "m1".into(), 6 * DAY);
        state.record_reply("new-reply".into(), "m2".into(), 10 * DAY);
        assert_eq!(state.prune(10 * DAY, ttl, 100), 2);
        assert!(state.is_seen("inside") && !state.is_seen("outside"));
        assert_eq!(state.nip_of("inside"), Some(Nip::Nip17));
        assert!(state.reply("new-reply").is_some() && state.reply("old-reply").is_none());
        for n in 0..10 {
            state.mark_seen(format!("e{n}"), 9 * DAY + n, None);
        }
        state.prune(10 * DAY, ttl, 4);
        assert_eq!(state.seen.len(), 4);
        assert!(state.is_seen("e9") && state.is_seen("e6") && !state.is_seen("e5"));
    }

    #[test]
    fn a_second_sighting_keeps_the_latest_time_and_the_first_nip() {
        let mut state = State::fresh(0);
        state.mark_seen("r".into(), 50, Some(Nip::Nip04));
        state.mark_seen("r".into(), 70, None);
        state.mark_seen("r".into(), 60, Some(Nip::Nip17));
        assert_eq!(state.seen["r"], Seen { at: 70, nip: Some(Nip::Nip04) });
    }

    #[test]
    fn the_state_round_trips_and_foreign_files_are_refused() {
        let mut state = State::fresh(42);
        state.mark_seen("a".into(), 1, Some(Nip::Nip04));
        state.record_reply("e".into(), "m".into(), 2);
        state.use_conversation("group-x", Nip::Nip17, vec!["k1".into(), "k2".into()], 3);
        assert_eq!(State::from_json(&state.to_json()).unwrap(), state);
        assert!(State::from_json(b"{}").is_err());
        let mut future = state.clone();
        future.version = 99;
        assert!(State::from_json(&future.to_json()).unwrap_err().contains("version 99"));
    }

    #[tokio::test]
    async fn the_file_is_written_atomically_with_mode_0600_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("nostr.bot.nostr-state.json");
        let store = StateStore::open(path.clone(), 1_000).unwrap();
        store.update(|state| state.mark_seen("wrap".into(), 990, None));
        store.flush().await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        let again = StateStore::open(path.clone(), 5_000).unwrap();
        assert!(again.read(|state| state.is_seen("wrap") && state.checkpoint == 1_000));
        std::fs::write(&path, b"not json").unwrap();
        let err = StateStore::open(path, 0).unwrap_err();
        assert!(err.to_string().contains("move it away"), "{err}");
    }
}
