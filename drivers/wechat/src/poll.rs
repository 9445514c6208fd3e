//! The inbound side: `notifystart`, the `getupdates` long poll, each batch handed to the hub,
//! and `notifystop`.
//!
//! At-least-once: each message of a batch is tracked in the SDK's [`PendingAcks`] with a
//! [`BatchAck`] that records the hub's answer; the batch's cursor is persisted only after the
//! hub has answered every message in it (and the replay set recording them is on disk), so a
//! crash or kill at any point makes the server offer the batch again. Messages the hub already
//! took are recognised in the replay set and dropped; nothing is lost and nothing is answered
//! twice.
//!
//! The client timeout follows the server's `longpolling_timeout_ms` (plus a grace); a
//! client-side timeout is an empty poll. Failures wait the retry delay, then the longer
//! backoff once they repeat. `-14` hands over to the token session, which pauses polling.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::{
    Acceptance, CancellationToken, Hub, HubError, PendingAcks, Secret, Settle,
};
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::client::{CallError, IlinkClient};
use crate::config::WechatConfig;
use crate::convert::{self, Converted};
use crate::health::{Link, SILENT_AFTER};
use crate::ilink::{GetUpdatesResponse, WeixinMessage, op};
use crate::session::{Credentials, Session};
use crate::state::StateError;
use crate::store::Store;
use crate::typing::Typing;

/// Added to the server's long-poll timeout, so its own empty answer arrives first.
pub const POLL_GRACE: Duration = Duration::from_secs(2);
/// The server's `longpolling_timeout_ms` is kept within these bounds.
pub const MIN_POLL_TIMEOUT: Duration = Duration::from_secs(1);
pub const MAX_POLL_TIMEOUT: Duration = Duration::from_secs(300);

/// `msg/notifystop` goes out while the SDK drains: it may take at most this long.
pub const NOTIFY_STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// Reports the link state (the platform turns it into health).
pub trait LinkReport: Send + Sync + std::fmt::Debug {
    fn link(&self, link: Link);
}

/// How a batch ended.
#[derive(Debug, PartialEq, Eq)]
enum Batch {
    /// Every message answered; the cursor moved.
    Done,
    /// Some message is still unanswered: the batch comes again.
    Incomplete,
    /// The driver is stopping.
    Stopping,
}

/// The poll loop's parts.
#[derive(Debug)]
pub struct Poller<'a> {
    pub client: &'a IlinkClient,
    pub session: &'a Arc<Session>,
    pub store: &'a Arc<Store>,
    pub config: &'a WechatConfig,
    pub typing: &'a Arc<Typing>,
    pub report: &'a dyn LinkReport,
}

impl Poller<'_> {
    /// Polls until `shutdown`.
    pub async fn run(&self, hub: &Hub, shutdown: &CancellationToken) {
        let mut failures = 0u32;
        let mut silent = 0u32;
        let mut server_timeout: Option<Duration> = None;
        let mut announced: Option<Secret> = None;
        let mut last_answer = Instant::now();
        let acks = PendingAcks::new();
        loop {
            let Some(credentials) = self.session.usable(shutdown).await else { break };
            if announced.as_ref() != Some(&credentials.token) {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = self.notify(&credentials, op::NOTIFY_START, self.config.request_timeout) => {}
                }
                announced = Some(credentials.token.clone());
            }
            let cursor = self.store.cursor();
            let timeout = server_timeout.unwrap_or(self.config.poll_timeout) + POLL_GRACE;
            let polled = tokio::select! {
                () = shutdown.cancelled() => break,
                polled = self.client.get_updates(&credentials.base_url, &credentials.token, &cursor, timeout) => polled,
            };
            let error = match polled {
                Ok(response) => {
                    failures = 0;
                    silent = 0;
                    last_answer = Instant::now();
                    if let Some(ms) = response.longpolling_timeout_ms.filter(|ms| *ms > 0) {
                        server_timeout = Some(
                            Duration::from_millis(ms).clamp(MIN_POLL_TIMEOUT, MAX_POLL_TIMEOUT),
                        );
                    }
                    // Ready once the batch is handed over: by then its context tokens are
                    // on disk, so a send right after the report finds them.
                    match self.batch(hub, &acks, response, shutdown).await {
                        Ok(Batch::Stopping) => break,
                        Ok(Batch::Done | Batch::Incomplete) => {
                            self.report.link(Link::Polling);
                            continue;
                        }
                        Err(err) => format!("cannot save the state: {err}"),
                    }
                }
                Err(CallError::Timeout { .. }) => {
                    failures = 0;
                    silent += 1;
                    debug!(silent, "long poll ended without an answer: an empty poll");
                    if silent >= SILENT_AFTER {
                        self.report.link(Link::Silent { idle: last_answer.elapsed() });
                    }
                    continue;
                }
                Err(err) if err.session_expired() => {
                    if self.session.expired(&credentials.token) {
                        error!(
                            source = credentials.source.describe(),
                            "iLink refused the bot token (-14): polling paused until a new token, `channeld-wechat login` or `channelctl resume`"
                        );
                    }
                    continue;
                }
                Err(err) => err.to_string(),
            };
            failures += 1;
            let delay = self.config.retry.delay(failures);
            self.report.link(Link::Retrying { attempt: failures, error: error.clone() });
            if failures == 1 || failures.is_multiple_of(10) {
                warn!(attempt = failures, retry_in = ?delay, error, "polling failed");
            } else {
                debug!(attempt = failures, retry_in = ?delay, error, "polling failed again");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        // Answers still coming settle what the hub took; the cursor stays where it was, so a
        // message answered only now comes again and is recognised as a replay.
        acks.drain(hub.stop_budget(hub.launch().drain_timeout / 2)).await;
        if let Err(err) = self.store.save_seen().await {
            warn!(error = %err, "replay set not saved at shutdown; the hub will see some replays");
        }
        let Some(credentials) =
            self.session.current().filter(|c| announced.as_ref() == Some(&c.token))
        else {
            return;
        };
        let budget = hub.stop_budget(self.config.request_timeout.min(NOTIFY_STOP_TIMEOUT));
        if budget.is_zero() {
            info!("msg/notifystop not sent: the stop used its drain time");
        } else {
            self.notify(&credentials, op::NOTIFY_STOP, budget).await;
        }
    }

    /// `msg/notifystart` or `msg/notifystop`, best effort (a `-14` pauses like a poll's),
    /// given at most `timeout`.
    async fn notify(&self, credentials: &Credentials, which: &'static str, timeout: Duration) {
        let result =
            self.client.notify(&credentials.base_url, &credentials.token, which, timeout).await;
        match result {
            Ok(()) => debug!(op = which, "notified the server"),
            Err(err) if err.session_expired() => {
                self.session.expired(&credentials.token);
            }
            Err(err) => info!(op = which, error = %err, "notification failed; carrying on"),
        }
    }

    /// Hands a batch to the hub and moves the cursor once the hub answered every message.
    async fn batch(
        &self,
        hub: &Hub,
        acks: &PendingAcks,
        response: GetUpdatesResponse,
        shutdown: &CancellationToken,
    ) -> Result<Batch, StateError> {
        let mut fresh: Vec<Converted> = Vec::new();
        let mut contexts_changed = false;
        for raw in response.msgs {
            let message: WeixinMessage = match serde_json::from_value(raw) {
                Ok(message) => message,
                Err(err) => {
                    warn!(error = %err, "unreadable message in getupdates; skipped");
                    continue;
                }
            };
            let converted = match convert::inbound(
                &self.config.channel,
                &message,
                &self.config.cdn_base_url,
            ) {
                Ok(converted) => converted,
                Err(skip) => {
                    debug!(seq = ?message.seq, message_id = ?message.message_id, %skip, "not passed on");
                    continue;
                }
            };
            if let Some(token) = &converted.context_token {
                contexts_changed |=
                    self.store.offer_context(&converted.user, token, converted.create_time_ms);
            }
            if self.store.is_settled(converted.message.id.as_str()) {
                debug!(event_id = %converted.message.id, "replay of a message the hub already took; dropped");
                continue;
            }
            fresh.push(converted);
        }
        // The reply needs the token: it is on disk before the hub can answer.
        if contexts_changed {
            self.store.save_contexts().await?;
        }

        let answers = Arc::new(Answers::default());
        for converted in fresh {
            let event_id = converted.message.id.as_str().to_owned();
            match hub.inbound(converted.message).await {
                Ok(ticket) => {
                    answers.expect();
                    let ack = BatchAck {
                        answers: answers.clone(),
                        store: self.store.clone(),
                        typing: self.typing.clone(),
                        event_id,
                        user: converted.user,
                    };
                    acks.track(ticket, ack);
                }
                Err(HubError::ShuttingDown) => return Ok(Batch::Stopping),
                Err(err @ (HubError::TooLarge(_) | HubError::Invalid(_))) => {
                    warn!(event_id, error = %err, "message cannot be passed on; dropped");
                    self.store.settle(&event_id);
                }
                // WrongChannel; the request-only errors (Refused, Timeout, …) never come from
                // `inbound`.
                Err(err) => {
                    error!(event_id, error = %err, "the hub handle refused the message");
                    return Ok(Batch::Incomplete);
                }
            }
        }
        let complete = tokio::select! {
            () = shutdown.cancelled() => return Ok(Batch::Stopping),
            complete = answers.all() => complete,
        };
        self.store.save_seen().await?;
        if !complete {
            return Ok(Batch::Incomplete);
        }
        if let Some(next) = response.get_updates_buf.filter(|c| !c.is_empty())
            && next != self.store.cursor()
        {
            self.store.save_cursor(next).await?;
        }
        Ok(Batch::Done)
    }
}

/// The hub's answers to one batch: how many are still to come, and whether every one so far
/// was final (accepted or refused for good).
#[derive(Debug)]
struct Answers {
    state: Mutex<(usize, bool)>,
    changed: Notify,
}

impl Default for Answers {
    fn default() -> Self {
        Self { state: Mutex::new((0, true)), changed: Notify::new() }
    }
}

impl Answers {
    fn lock(&self) -> MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn expect(&self) {
        self.lock().0 += 1;
    }

    fn answered(&self, last_word: bool) {
        let mut state = self.lock();
        state.0 -= 1;
        state.1 &= last_word;
        drop(state);
        self.changed.notify_one();
    }

    /// Waits for every answer; true when all were final.
    async fn all(&self) -> bool {
        loop {
            let notified = self.changed.notified();
            let (left, complete) = *self.lock();
            if left == 0 {
                return complete;
            }
            notified.await;
        }
    }
}

/// One message's platform acknowledgement: the hub's answer is recorded in the replay set
/// (and starts the typing indicator for a fresh run); the batch's cursor moves once every
/// message of it has its answer.
#[derive(Debug)]
struct BatchAck {
    answers: Arc<Answers>,
    store: Arc<Store>,
    typing: Arc<Typing>,
    event_id: String,
    user: String,
}

impl Settle for BatchAck {
    async fn settle(self, outcome: &Acceptance) {
        let last_word = match outcome {
            Acceptance::Accepted { duplicate } => {
                self.store.settle(&self.event_id);
                if !duplicate {
                    self.typing.run_started(&self.user, &self.event_id);
                }
                true
            }
            Acceptance::Rejected { .. } => {
                self.store.settle(&self.event_id);
                true
            }
            Acceptance::Unresolved => false,
        };
        self.answers.answered(last_word);
    }
}
