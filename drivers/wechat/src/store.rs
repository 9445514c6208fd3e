//! The driver's memory: the in-memory copies of the cursor, the replay set and the context
//! tokens, shared by the poll loop and the posts, and written through to the state directory.
//!
//! Writes run on the blocking pool, one at a time: each takes its snapshot while holding the
//! write turn, so a later snapshot is never overwritten by an earlier one.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::state::{ContextTokens, ReplyProgress, SeenSet, StateDir, StateError, Usable};

/// What the driver remembers between polls and across restarts.
#[derive(Debug)]
struct Memory {
    cursor: String,
    seen: SeenSet,
    contexts: ContextTokens,
}

/// The state shared by the poll loop and the posts.
#[derive(Debug)]
pub struct Store {
    dir: StateDir,
    memory: Mutex<Memory>,
    /// One write at a time, in order.
    turn: tokio::sync::Mutex<()>,
    ttl: Duration,
}

/// A user's context token as a send needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContextFor {
    Token(String),
    Missing,
    Refused(i64),
}

impl Store {
    /// Loads everything from `dir`; a corrupt file is an error naming it.
    pub fn load(dir: StateDir, ttl: Duration) -> Result<Self, StateError> {
        let mut seen = dir.load_seen()?;
        seen.expire(now_ms(), ttl.as_millis() as u64);
        let memory = Memory { cursor: dir.load_cursor()?, seen, contexts: dir.load_contexts()? };
        Ok(Self { dir, memory: Mutex::new(memory), turn: tokio::sync::Mutex::new(()), ttl })
    }

    pub fn dir(&self) -> &StateDir {
        &self.dir
    }

    fn lock(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn cursor(&self) -> String {
        self.lock().cursor.clone()
    }

    pub fn is_settled(&self, event_id: &str) -> bool {
        self.lock().seen.is_settled(event_id)
    }

    /// Remembers that the hub took `event_id` (in memory; [`Store::save_seen`] persists).
    pub fn settle(&self, event_id: &str) {
        self.lock().seen.settle(event_id, now_ms());
    }

    pub fn reply(&self, event_id: &str) -> Option<ReplyProgress> {
        self.lock().seen.reply(event_id).cloned()
    }

    /// Records reply progress and persists it before returning.
    pub async fn record_reply(
        self: &Arc<Self>,
        event_id: &str,
        progress: ReplyProgress,
    ) -> Result<(), StateError> {
        self.lock().seen.record_reply(event_id, progress, now_ms());
        self.save_seen().await
    }

    /// Takes a user's context token if it is newer; returns whether it changed.
    pub fn offer_context(&self, user: &str, token: &str, message_ms: Option<u64>) -> bool {
        self.lock().contexts.offer(user, token, message_ms, now_ms())
    }

    pub fn context_for(&self, user: &str) -> ContextFor {
        match self.lock().contexts.usable(user) {
            Usable::Token(token) => ContextFor::Token(token.to_owned()),
            Usable::Missing => ContextFor::Missing,
            Usable::Refused(code) => ContextFor::Refused(code),
        }
    }

    /// Marks a refused context token (and persists it) so it is not presented again.
    pub async fn refuse_context(
        self: &Arc<Self>,
        user: &str,
        token: &str,
        code: i64,
    ) -> Result<(), StateError> {
        if self.lock().contexts.refuse(user, token, code) {
            self.save_contexts().await?;
        }
        Ok(())
    }

    pub async fn save_seen(self: &Arc<Self>) -> Result<(), StateError> {
        let _turn = self.turn.lock().await;
        let snapshot = {
            let mut memory = self.lock();
            memory.seen.expire(now_ms(), self.ttl.as_millis() as u64);
            memory.seen.clone()
        };
        self.blocking(move |dir| dir.save_seen(&snapshot)).await
    }

    pub async fn save_contexts(self: &Arc<Self>) -> Result<(), StateError> {
        let _turn = self.turn.lock().await;
        let snapshot = self.lock().contexts.clone();
        self.blocking(move |dir| dir.save_contexts(&snapshot)).await
    }

    /// Persists a new cursor, then keeps it in memory.
    pub async fn save_cursor(self: &Arc<Self>, cursor: String) -> Result<(), StateError> {
        let _turn = self.turn.lock().await;
        let written = cursor.clone();
        self.blocking(move |dir| dir.save_cursor(&written)).await?;
        self.lock().cursor = cursor;
        Ok(())
    }

    async fn blocking(
        &self,
        write: impl FnOnce(&StateDir) -> Result<(), StateError> + Send + 'static,
    ) -> Result<(), StateError> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write(&dir)).await.unwrap_or_else(|_| {
            Err(StateError::Io {
                path: self.dir.path().to_owned(),
                source: std::io::Error::other("the state write task failed"),
            })
        })
    }
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn what_is_saved_is_there_after_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let ttl = Duration::from_secs(86400);
        let store = Arc::new(Store::load(StateDir::open(dir.path()).unwrap(), ttl).unwrap());
        assert_eq!(store.cursor(), "");
        store.settle("wx-1");
        assert!(store.offer_context("alice", "ctx-1", Some(5)));
        store.save_contexts().await.unwrap();
        store.save_seen().await.unwrap();
        store.save_cursor("c-2".into()).await.unwrap();
        let progress = ReplyProgress {
            digest: "d".into(),
            posted: 1,
            total: 2,
            last_client_id: "k".into(),
            in_doubt: None,
        };
        store.record_reply("wx-1", progress.clone()).await.unwrap();

        let again = Store::load(StateDir::open(dir.path()).unwrap(), ttl).unwrap();
        assert_eq!(again.cursor(), "c-2");
        assert!(again.is_settled("wx-1"));
        assert_eq!(again.reply("wx-1"), Some(progress));
        assert_eq!(again.context_for("alice"), ContextFor::Token("ctx-1".into()));
        assert_eq!(again.context_for("bob"), ContextFor::Missing);
    }

    #[tokio::test]
    async fn a_refused_context_token_stays_refused_after_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let ttl = Duration::from_secs(86400);
        let store = Arc::new(Store::load(StateDir::open(dir.path()).unwrap(), ttl).unwrap());
        store.offer_context("alice", "ctx-1", None);
        store.refuse_context("alice", "ctx-1", -2).await.unwrap();
        let again = Store::load(StateDir::open(dir.path()).unwrap(), ttl).unwrap();
        assert_eq!(again.context_for("alice"), ContextFor::Refused(-2));
    }
}
