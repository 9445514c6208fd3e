//! Where the AMQP send queue's consumer (`[hub.amqp_sends]`, `sendq.rs`) stands: counted
//! always (for `channelctl status`), exported as metrics when they are on.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use channeld_control::AmqpSendsStatus;

/// How one send-queue message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteSendOutcome {
    /// Sent, queued for an offline driver, or answered from a repeated key.
    Sent,
    /// Refused or failed as the control `send` would have been (an error outcome).
    Failed,
    /// Not a send message (answered with an error outcome when it had `reply_to`, then
    /// dead-lettered).
    Malformed,
}

impl RemoteSendOutcome {
    pub const ALL: [RemoteSendOutcome; 3] =
        [RemoteSendOutcome::Sent, RemoteSendOutcome::Failed, RemoteSendOutcome::Malformed];

    pub fn as_str(self) -> &'static str {
        match self {
            RemoteSendOutcome::Sent => "sent",
            RemoteSendOutcome::Failed => "failed",
            RemoteSendOutcome::Malformed => "malformed",
        }
    }
}

/// The consumer's state and counts.
#[derive(Debug)]
pub struct AmqpSendsState {
    queue: String,
    connected: AtomicBool,
    received: AtomicU64,
    sent: AtomicU64,
    failed: AtomicU64,
    malformed: AtomicU64,
    connections: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl AmqpSendsState {
    pub fn new(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            connected: AtomicBool::new(false),
            received: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Relaxed)
    }

    /// The consumer is consuming now.
    pub fn up(&self) {
        self.connections.fetch_add(1, Relaxed);
        self.connected.store(true, Relaxed);
    }

    /// The connection was lost (`error`, never holding the URL) or closed.
    pub fn down(&self, error: Option<String>) {
        self.connected.store(false, Relaxed);
        if let Some(error) = error {
            *self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(error);
        }
    }

    pub fn received(&self) {
        self.received.fetch_add(1, Relaxed);
    }

    pub fn ended(&self, outcome: RemoteSendOutcome) {
        match outcome {
            RemoteSendOutcome::Sent => &self.sent,
            RemoteSendOutcome::Failed => &self.failed,
            RemoteSendOutcome::Malformed => &self.malformed,
        }
        .fetch_add(1, Relaxed);
    }

    /// As `status` shows it.
    pub fn view(&self) -> AmqpSendsStatus {
        AmqpSendsStatus {
            queue: self.queue.clone(),
            connected: self.connected(),
            received: self.received.load(Relaxed),
            sent: self.sent.load(Relaxed),
            failed: self.failed.load(Relaxed),
            malformed: self.malformed.load(Relaxed),
            reconnects: self.connections.load(Relaxed).saturating_sub(1),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_counts_outcomes_and_reconnects() {
        let state = AmqpSendsState::new("q");
        assert!(!state.view().connected);
        state.up();
        state.received();
        state.ended(RemoteSendOutcome::Sent);
        state.down(Some("connection reset".into()));
        state.up();
        state.received();
        state.ended(RemoteSendOutcome::Malformed);
        let view = state.view();
        assert!(view.connected);
        assert_eq!((view.received, view.sent, view.failed, view.malformed), (2, 1, 0, 1));
        assert_eq!(view.reconnects, 1);
        assert_eq!(view.last_error.as_deref(), Some("connection reset"));
    }
}
