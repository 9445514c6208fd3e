//! The platform connection as posts, effects and commands see it: send one command frame and
//! wait for its acknowledgement, matched by `req_id`. The session task owns the socket; it
//! attaches each new connection here and detaches it when it ends, which fails every wait on
//! it at once.
//!
//! A command's outcome is precise about what reached the platform: [`CommandError::NotSent`]
//! means the frame never left (nothing happened, safe to retry), [`CommandError::Lost`] that
//! it was written but no acknowledgement came (it may have taken effect).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::wire::Ack;

/// Frames queued for the socket writer of one connection. Senders wait when it is full
/// (backpressure on posts and effects); pings use `try_send` and skip a beat instead.
pub const OUTGOING_QUEUE: usize = 256;
/// Acknowledgements awaited at once on one connection. A command beyond it waits for room;
/// with one frame in flight per callback and a bounded number of posts this is never reached
/// in practice, and it keeps a misbehaving platform from growing the table.
pub const MAX_AWAITED_ACKS: usize = 4096;

/// A frame for the socket writer, with who to tell once it is written.
#[derive(Debug)]
pub struct Outgoing {
    pub text: String,
    pub written: Option<oneshot::Sender<()>>,
}

/// Why a command got no acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// No connection came up in time, or it closed before the frame was written: the
    /// platform never saw it.
    #[error("not sent: {0}")]
    NotSent(String),
    /// The frame was written but no acknowledgement came (timeout or connection lost): it
    /// may have taken effect.
    #[error("no acknowledgement: {0}")]
    Lost(String),
}

/// One live, subscribed connection.
#[derive(Debug)]
pub struct Connection {
    pub id: u64,
    outgoing: mpsc::Sender<Outgoing>,
    acks: Mutex<HashMap<String, oneshot::Sender<Ack>>>,
    room: tokio::sync::Semaphore,
    closed: CancellationToken,
}

impl Connection {
    fn acks(&self) -> MutexGuard<'_, HashMap<String, oneshot::Sender<Ack>>> {
        self.acks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Hands an acknowledgement to whoever waits for its `req_id`; false if nobody does
    /// (late, or for a command of an earlier connection).
    pub fn acknowledge(&self, ack: Ack) -> bool {
        let waiter = self.acks().remove(&ack.req_id);
        match waiter {
            Some(waiter) => waiter.send(ack).is_ok(),
            None => false,
        }
    }

    /// Queues a frame without waiting (for pings); false when the queue is full or closed.
    pub fn try_send(&self, text: String) -> bool {
        self.outgoing.try_send(Outgoing { text, written: None }).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Writes `text` (a command with `req_id`) and waits up to `ack_timeout` for its
    /// acknowledgement.
    async fn command(
        &self,
        req_id: &str,
        text: String,
        ack_timeout: Duration,
    ) -> Result<Ack, CommandError> {
        let _room = tokio::select! {
            room = self.room.acquire() => room.map_err(|_| CommandError::NotSent("connection closed".into()))?,
            () = self.closed.cancelled() => return Err(CommandError::NotSent("connection closed".into())),
        };
        let (ack_tx, ack_rx) = oneshot::channel();
        if self.acks().insert(req_id.to_owned(), ack_tx).is_some() {
            // A second frame on a req_id whose first is unacknowledged: callers serialise
            // per req_id, so this is a bug; the first waiter gets no answer (Lost).
            tracing::warn!(%req_id, "two commands awaited one acknowledgement");
        }
        let forget = || {
            self.acks().remove(req_id);
        };
        let (written_tx, written_rx) = oneshot::channel();
        let queued = tokio::select! {
            queued = self.outgoing.send(Outgoing { text, written: Some(written_tx) }) => queued.is_ok(),
            () = self.closed.cancelled() => false,
        };
        // The session writes, then tells, before it can detach: when both are ready the
        // frame was written.
        let written = queued
            && tokio::select! {
                biased;
                written = written_rx => written.is_ok(),
                () = self.closed.cancelled() => false,
            };
        if !written {
            forget();
            return Err(CommandError::NotSent(
                "the connection closed before the frame was written".into(),
            ));
        }
        match tokio::time::timeout(ack_timeout, ack_rx).await {
            Ok(Ok(ack)) => Ok(ack),
            Ok(Err(_)) => {
                Err(CommandError::Lost("the connection closed before the acknowledgement".into()))
            }
            Err(_) => {
                forget();
                Err(CommandError::Lost(format!("no acknowledgement within {ack_timeout:?}")))
            }
        }
    }
}

/// The current connection, if any, shared by the session and everything that sends.
#[derive(Debug, Clone)]
pub struct Link {
    current: Arc<watch::Sender<Option<Arc<Connection>>>>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
}

impl Default for Link {
    fn default() -> Self {
        Self::new()
    }
}

impl Link {
    pub fn new() -> Self {
        let (current, _) = watch::channel(None);
        Self { current: Arc::new(current), next_id: Arc::default() }
    }

    /// Makes a new subscribed connection current; the session writes what the receiver
    /// yields to its socket.
    pub fn attach(&self) -> (Arc<Connection>, mpsc::Receiver<Outgoing>) {
        let (outgoing, receiver) = mpsc::channel(OUTGOING_QUEUE);
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let connection = Arc::new(Connection {
            id,
            outgoing,
            acks: Mutex::new(HashMap::new()),
            room: tokio::sync::Semaphore::new(MAX_AWAITED_ACKS),
            closed: CancellationToken::new(),
        });
        self.current.send_replace(Some(connection.clone()));
        (connection, receiver)
    }

    /// Ends `connection`: every command waiting on it fails at once (written ones as
    /// [`CommandError::Lost`]).
    pub fn detach(&self, connection: &Arc<Connection>) {
        connection.closed.cancel();
        connection.room.close();
        connection.acks().clear();
        self.current.send_if_modified(|current| {
            let is_current = current.as_ref().is_some_and(|c| Arc::ptr_eq(c, connection));
            if is_current {
                *current = None;
            }
            is_current
        });
    }

    /// Whether a subscribed connection is up.
    pub fn is_up(&self) -> bool {
        self.current.borrow().is_some()
    }

    /// The current connection, waiting until `deadline` for one.
    pub async fn connection(&self, deadline: Instant) -> Option<Arc<Connection>> {
        let mut current = self.current.subscribe();
        let found = tokio::time::timeout_at(deadline, current.wait_for(Option::is_some)).await;
        match found {
            Ok(Ok(connection)) => connection.clone(),
            _ => None,
        }
    }

    /// Sends a command on the current connection (waiting until `deadline` for one) and
    /// waits up to `ack_timeout` for its acknowledgement.
    pub async fn command(
        &self,
        req_id: &str,
        text: String,
        deadline: Instant,
        ack_timeout: Duration,
    ) -> Result<Ack, CommandError> {
        let connection = self
            .connection(deadline)
            .await
            .ok_or_else(|| CommandError::NotSent("not connected to WeCom".into()))?;
        connection.command(req_id, text, ack_timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(req_id: &str, errcode: i64) -> Ack {
        Ack { req_id: req_id.into(), errcode: Some(errcode), errmsg: "ok".into() }
    }

    /// A socket writer that writes everything and hands each frame to the test.
    fn writer(mut receiver: mpsc::Receiver<Outgoing>) -> mpsc::UnboundedReceiver<String> {
        let (seen, frames) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(frame) = receiver.recv().await {
                let _ = seen.send(frame.text);
                if let Some(written) = frame.written {
                    let _ = written.send(());
                }
            }
        });
        frames
    }

    #[tokio::test]
    async fn a_command_gets_the_acknowledgement_with_its_req_id() {
        let link = Link::new();
        let (connection, receiver) = link.attach();
        let mut frames = writer(receiver);
        let sent = tokio::spawn({
            let link = link.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(1);
                link.command("r1", "frame-1".into(), deadline, Duration::from_secs(5)).await
            }
        });
        assert_eq!(frames.recv().await.unwrap(), "frame-1");
        assert!(!connection.acknowledge(ack("other", 0)), "nobody waits for another req_id");
        assert!(connection.acknowledge(ack("r1", 0)));
        assert_eq!(sent.await.unwrap(), Ok(ack("r1", 0)));
    }

    #[tokio::test]
    async fn without_a_connection_nothing_is_sent() {
        let link = Link::new();
        let deadline = Instant::now() + Duration::from_millis(20);
        let result = link.command("r1", "x".into(), deadline, Duration::from_secs(1)).await;
        assert!(matches!(result, Err(CommandError::NotSent(_))), "{result:?}");
    }

    #[tokio::test]
    async fn a_written_frame_without_an_acknowledgement_is_lost() {
        let link = Link::new();
        let (_connection, receiver) = link.attach();
        let _frames = writer(receiver);
        let deadline = Instant::now() + Duration::from_secs(1);
        let result = link.command("r1", "x".into(), deadline, Duration::from_millis(20)).await;
        assert!(matches!(result, Err(CommandError::Lost(_))), "{result:?}");
    }

    #[tokio::test]
    async fn detaching_fails_written_commands_as_lost_and_unwritten_ones_as_not_sent() {
        let link = Link::new();
        let (connection, receiver) = link.attach();
        let mut frames = writer(receiver);
        let waiting = tokio::spawn({
            let link = link.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(1);
                link.command("r1", "x".into(), deadline, Duration::from_secs(30)).await
            }
        });
        frames.recv().await.unwrap();
        link.detach(&connection);
        assert!(matches!(waiting.await.unwrap(), Err(CommandError::Lost(_))));
        assert!(!link.is_up());

        // A connection whose writer never writes: the frame is not sent.
        let (connection, _unread) = link.attach();
        let waiting = tokio::spawn({
            let link = link.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(1);
                link.command("r2", "y".into(), deadline, Duration::from_secs(30)).await
            }
        });
        tokio::task::yield_now().await;
        link.detach(&connection);
        assert!(matches!(waiting.await.unwrap(), Err(CommandError::NotSent(_))));
    }
}
