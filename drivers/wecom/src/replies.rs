//! Replies to callbacks: each message callback gets a [`Slot`] holding its [`Reply`] (the
//! stream on the callback's `req_id`). The placeholder opens the stream when the hub accepts
//! the message, `typing` and `preview` effects update it, and the final reply finishes it or
//! falls back to proactive messages.
//!
//! Frames for one callback go one at a time (each waits for its acknowledgement): the slot
//! holds its reply behind an async lock for the whole exchange. Progress is live: while a
//! frame is in flight only the newest progress waits, older ones are dropped, and progress
//! never waits for the conversation's turn or its pace.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::PostError;
use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{DeliveryReceipt, MessageTarget, OutboundMessage};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug, info};

use crate::config::WeComConfig;
use crate::convert::{self, Chat};
use crate::outbound::{self, Outbound};
use crate::reply::{self, Outcome, Reply};
use crate::wire;

/// Callbacks whose reply is remembered at once. Beyond it the oldest is forgotten; a reply
/// to a forgotten callback still arrives, as a proactive message.
pub const MAX_REPLY_SLOTS: usize = 1024;
/// How long a reply slot is kept without a final reply (the platform takes replies to a
/// callback for 24 hours).
const SLOT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// One callback awaiting its reply.
#[derive(Debug)]
struct Slot {
    event_id: String,
    req_id: String,
    chat: Chat,
    created: Instant,
    /// Held while a frame on `req_id` waits for its acknowledgement.
    reply: tokio::sync::Mutex<Reply>,
    /// The newest progress not sent yet.
    progress: Mutex<Option<Progress>>,
    /// A progress sender task is running for this slot.
    sending: AtomicBool,
    /// The final reply began: progress is ignored from now on.
    finishing: AtomicBool,
}

/// Live progress to show on a reply's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// The placeholder: shown only while nothing else is (it would blank a preview).
    Placeholder,
    /// A preview of the reply, replacing what is shown.
    Preview(String),
}

impl Slot {
    fn progress(&self) -> MutexGuard<'_, Option<Progress>> {
        self.progress.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Callbacks by event id, and per conversation in arrival order.
#[derive(Debug, Default)]
struct Slots {
    by_event: HashMap<String, Arc<Slot>>,
    order: VecDeque<String>,
}

impl Slots {
    fn remove(&mut self, event_id: &str) {
        self.by_event.remove(event_id);
        self.order.retain(|id| id != event_id);
    }

    /// The oldest callback of `conversation` whose final reply has not begun: live effects
    /// carry only the conversation, and runs in one conversation answer in order.
    fn current(&self, conversation: &str) -> Option<Arc<Slot>> {
        self.order
            .iter()
            .filter_map(|id| self.by_event.get(id))
            .find(|slot| {
                slot.chat.conversation == conversation && !slot.finishing.load(Ordering::Acquire)
            })
            .cloned()
    }
}

/// The replies in progress.
#[derive(Debug)]
pub struct Replies {
    config: Arc<WeComConfig>,
    outbound: Arc<Outbound>,
    slots: Mutex<Slots>,
    /// Progress senders; drained when the platform side stops.
    tasks: TaskTracker,
}

impl Replies {
    pub fn new(config: Arc<WeComConfig>, outbound: Arc<Outbound>) -> Self {
        Self { config, outbound, slots: Mutex::default(), tasks: TaskTracker::new() }
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Progress senders still running (drained on shutdown).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// A message callback arrived: its reply goes on `req_id`. A repeated callback (same
    /// event id) keeps the first `req_id`, whose stream may already be open.
    pub fn register(&self, event_id: &str, req_id: &str, chat: Chat) {
        self.outbound.remember_chat(&chat);
        let now = Instant::now();
        let mut slots = self.slots();
        if slots.by_event.contains_key(event_id) {
            return;
        }
        while let Some(oldest) = slots.order.front().cloned() {
            let expired = slots
                .by_event
                .get(&oldest)
                .is_none_or(|slot| now.duration_since(slot.created) > SLOT_LIFETIME);
            if slots.order.len() < MAX_REPLY_SLOTS && !expired {
                break;
            }
            debug!(event_id = %oldest, "forgetting a callback that got no reply");
            slots.remove(&oldest);
        }
        let slot = Slot {
            event_id: event_id.to_owned(),
            req_id: req_id.to_owned(),
            chat,
            created: now,
            reply: tokio::sync::Mutex::new(Reply::new(
                self.config.stream_window,
                self.config.ack_timeout,
            )),
            progress: Mutex::new(None),
            sending: AtomicBool::new(false),
            finishing: AtomicBool::new(false),
        };
        slots.order.push_back(event_id.to_owned());
        slots.by_event.insert(event_id.to_owned(), Arc::new(slot));
    }

    /// The hub accepted a message (not a duplicate): show the placeholder at once.
    pub fn accepted(self: &Arc<Self>, event_id: &str) {
        let slot = self.slots().by_event.get(event_id).cloned();
        if let Some(slot) = slot {
            self.show(&slot, Progress::Placeholder);
        }
    }

    /// A typing (`Placeholder`) or preview effect for `conversation`; false when no reply
    /// there is in progress.
    pub fn progress(self: &Arc<Self>, conversation: &str, progress: Progress) -> bool {
        let Some(slot) = self.slots().current(conversation) else { return false };
        self.show(&slot, progress);
        true
    }

    fn show(self: &Arc<Self>, slot: &Arc<Slot>, progress: Progress) {
        if slot.finishing.load(Ordering::Acquire)
            || (progress == Progress::Placeholder && self.config.placeholder.is_none())
        {
            return;
        }
        {
            let mut pending = slot.progress();
            // A placeholder never replaces a waiting preview.
            if progress != Progress::Placeholder || pending.is_none() {
                *pending = Some(progress);
            }
        }
        if slot.sending.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        let slot = slot.clone();
        self.tasks.spawn(async move {
            loop {
                let next = slot.progress().take();
                match next {
                    Some(progress) => this.send_progress(&slot, progress).await,
                    None => {
                        slot.sending.store(false, Ordering::Release);
                        // Progress set between the take and the store would wait forever.
                        if slot.progress().is_none() || slot.sending.swap(true, Ordering::AcqRel) {
                            return;
                        }
                    }
                }
            }
        });
    }

    async fn send_progress(&self, slot: &Slot, progress: Progress) {
        let mut reply = slot.reply.lock().await;
        let content = match progress {
            Progress::Placeholder if reply.is_idle() => self.config.placeholder.clone(),
            Progress::Placeholder => None,
            Progress::Preview(text) => Some(text),
        };
        let Some(content) = content else { return };
        if slot.finishing.load(Ordering::Acquire) {
            return;
        }
        // Opening a stream is a message; progress never waits for its turn or the pace.
        let mut turn = None;
        if reply.is_idle() {
            turn = self.outbound.turn_now(&slot.chat.conversation);
            if turn.is_none() {
                debug!(event_id = %slot.event_id, "conversation busy or at its message limit: no progress shown");
                return;
            }
        }
        let now = Instant::now();
        let Some(frame) = reply.progress(&content, now, || wire::req_id("stream")) else {
            return;
        };
        if let Some(turn) = &mut turn {
            turn.attempted();
        }
        let outcome =
            self.outbound.stream_frame(&slot.req_id, &frame, now + self.config.ack_timeout).await;
        debug!(event_id = %slot.event_id, ?outcome, "progress frame");
        reply.record(&frame, outcome);
    }

    /// The final reply to `event_id`: on its stream when the stream can take it, else (or
    /// when the platform refuses the stream as expired or unknown) as proactive messages.
    pub async fn reply(
        &self,
        event_id: &Id,
        message: &OutboundMessage,
    ) -> Result<DeliveryReceipt, PostError> {
        let text = convert::reply_text(&message.body);
        let slot = self.slots().by_event.get(event_id.as_str()).cloned();
        let Some(slot) = slot else {
            info!(%event_id, "reply to a callback this process does not know; sending it as a proactive message");
            return self.outbound.proactive(&message.target, &text).await;
        };
        slot.finishing.store(true, Ordering::Release);
        slot.progress().take();
        let deadline = Instant::now() + self.config.send_queue;
        let mut reply = slot.reply.lock().await;
        let result = self.finish(&slot, &mut reply, &text, &message.target, deadline).await;
        drop(reply);
        // A reply that certainly did not go may come again (the hub retries it): its stream
        // is kept for that.
        if !matches!(result, Err(PostError::Failed { .. })) {
            self.slots().remove(&slot.event_id);
        }
        result
    }

    async fn finish(
        &self,
        slot: &Slot,
        reply: &mut Reply,
        text: &str,
        target: &MessageTarget,
        deadline: Instant,
    ) -> Result<DeliveryReceipt, PostError> {
        // Opening the stream is a message: it waits for the conversation's turn.
        let mut turn = None;
        if reply.is_idle() {
            turn = Some(self.outbound.turn(&slot.chat.conversation, deadline).await?);
        }
        let plan = reply.plan_final(text, Instant::now(), || wire::req_id("stream"));
        let Some(frame) = plan.stream else {
            drop(turn);
            debug!(event_id = %slot.event_id, "stream window over; replying with proactive messages");
            return self.outbound.send_parts(target, &plan.proactive, deadline, None).await;
        };
        if let Some(turn) = &mut turn {
            turn.attempted();
        }
        let outcome = self.outbound.stream_frame(&slot.req_id, &frame, deadline).await;
        drop(turn);
        reply.record(&frame, outcome);
        match outcome {
            Outcome::Acked => {
                let message_id = frame.id.clone();
                if plan.proactive.is_empty() {
                    return Ok(outbound::receipt(target, &message_id));
                }
                self.outbound.send_parts(target, &plan.proactive, deadline, Some(&message_id)).await
            }
            Outcome::Refused { errcode } if reply::closes(errcode) => {
                info!(event_id = %slot.event_id, errcode, "the platform refused the stream; replying with proactive messages");
                let parts = convert::split_content(text, wire::MAX_CONTENT_BYTES);
                self.outbound.send_parts(target, &parts, deadline, None).await
            }
            Outcome::NotSent => {
                Err(PostError::failed("not connected to WeCom within the send queue time", true))
            }
            Outcome::Refused { errcode } => {
                Err(PostError::failed(format!("WeCom refused the reply: errcode {errcode}"), false))
            }
            Outcome::Lost => Err(PostError::unknown(
                "the final stream frame got no acknowledgement; it may be shown",
            )),
        }
    }
}
