//! Everything the driver shows on WeCom: replies as streams on their callback's `req_id`
//! (placeholder when the hub accepts, previews, final text, proactive fallback), proactive
//! messages, command cards, welcome texts and card updates, each paced per conversation.
//!
//! Frames for one callback go one at a time (each waits for its acknowledgement): a
//! callback's [`Slot`] holds its [`Reply`] behind an async lock for the whole exchange.
//! Progress (placeholder, typing, previews) is live: while a frame is in flight only the
//! newest progress text waits, older ones are dropped, and progress never waits for pacing.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::PostError;
use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{DeliveryReceipt, MessageTarget, OutboundMessage};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::config::WeComConfig;
use crate::convert::{self, Chat, ChatKind};
use crate::link::{CommandError, Link};
use crate::pacing::Pacer;
use crate::reply::{self, Outcome, Reply};
use crate::wire::{self, Ack, ReplyBody, SendContent, SendMsg, StreamFrame, TemplateCard};

/// Callbacks whose reply is remembered at once. Beyond it the oldest is forgotten; a reply
/// to a forgotten callback still arrives, as a proactive message.
pub const MAX_REPLY_SLOTS: usize = 1024;
/// Conversations whose chat type (single or group) is remembered for proactive sends;
/// beyond it the type is left out of `aibot_send_msg` (it is optional).
pub const MAX_KNOWN_CHATS: usize = 16_384;
/// Conversations with a send gate; beyond it the gates nobody holds are dropped.
const MAX_GATES: usize = 16_384;
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

/// The sending side of the driver.
#[derive(Debug)]
pub struct Outbound {
    config: Arc<WeComConfig>,
    link: Link,
    pacer: Mutex<Pacer>,
    /// One message in flight per conversation, first come first served.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    slots: Mutex<Slots>,
    chats: Mutex<HashMap<String, ChatKind>>,
    tasks: TaskTracker,
}

/// How a paced message ended.
enum Sent {
    Acked,
    Refused(Ack),
}

impl Outbound {
    pub fn new(config: Arc<WeComConfig>, link: Link) -> Self {
        let pacer = Pacer::new(config.pace);
        Self {
            config,
            link,
            pacer: Mutex::new(pacer),
            gates: Mutex::default(),
            slots: Mutex::default(),
            chats: Mutex::default(),
            tasks: TaskTracker::new(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn chats(&self) -> MutexGuard<'_, HashMap<String, ChatKind>> {
        self.chats.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Progress senders still running (drained on shutdown).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// A message callback arrived: its reply goes on `req_id`. A repeated callback (same
    /// event id) keeps the first `req_id`, whose stream may already be open.
    pub fn register(&self, event_id: &str, req_id: &str, chat: Chat) {
        self.remember_chat(&chat);
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

    fn remember_chat(&self, chat: &Chat) {
        let mut chats = self.chats();
        if chats.len() >= MAX_KNOWN_CHATS && !chats.contains_key(&chat.conversation) {
            // Forget them all rather than track recency: the type is optional on the wire.
            chats.clear();
        }
        chats.insert(chat.conversation.clone(), chat.kind);
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
            turn = self.turn_now(&slot.chat.conversation);
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
        let outcome = self.stream_frame(&slot.req_id, &frame, now + self.config.ack_timeout).await;
        debug!(event_id = %slot.event_id, ?outcome, "progress frame");
        reply.record(&frame, outcome);
    }

    /// Sends one stream frame on `req_id` and reads its outcome.
    async fn stream_frame(&self, req_id: &str, frame: &StreamFrame, deadline: Instant) -> Outcome {
        let body = ReplyBody::Stream { stream: frame.clone() };
        let text = wire::encode(wire::cmd::RESPOND_MSG, req_id, Some(&body));
        match self.link.command(req_id, text, deadline, self.config.ack_timeout).await {
            Ok(ack) if ack.is_ok() => Outcome::Acked,
            Ok(ack) => Outcome::Refused { errcode: ack.errcode.unwrap_or(-1) },
            Err(CommandError::NotSent(_)) => Outcome::NotSent,
            Err(CommandError::Lost(_)) => Outcome::Lost,
        }
    }

    fn pacer(&self) -> MutexGuard<'_, Pacer> {
        self.pacer.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn gate(&self, conversation: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut gates = self.gates.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if gates.len() >= MAX_GATES && !gates.contains_key(conversation) {
            gates.retain(|_, gate| Arc::strong_count(gate) > 1);
        }
        gates.entry(conversation.to_owned()).or_default().clone()
    }

    /// Waits until `deadline` for `conversation`'s turn to send one message and for the pace
    /// to allow it.
    async fn turn(&self, conversation: &str, deadline: Instant) -> Result<Turn<'_>, PostError> {
        let busy = || {
            PostError::failed(
                format!(
                    "conversation {conversation} is at its message limit ({} a minute, {} an hour) for longer than the send queue time",
                    self.config.pace.per_minute, self.config.pace.per_hour
                ),
                true,
            )
        };
        let gate = self.gate(conversation);
        let held =
            tokio::time::timeout_at(deadline, gate.lock_owned()).await.map_err(|_| busy())?;
        let slot = self.pacer().next_slot(conversation, Instant::now());
        if slot > deadline {
            return Err(busy());
        }
        tokio::time::sleep_until(slot).await;
        Ok(Turn {
            outbound: self,
            conversation: conversation.to_owned(),
            _held: held,
            attempted: false,
        })
    }

    /// `conversation`'s turn, only if it is free and the pace allows a message now.
    fn turn_now(&self, conversation: &str) -> Option<Turn<'_>> {
        let held = self.gate(conversation).try_lock_owned().ok()?;
        let now = Instant::now();
        (self.pacer().next_slot(conversation, now) <= now).then(|| Turn {
            outbound: self,
            conversation: conversation.to_owned(),
            _held: held,
            attempted: false,
        })
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
            return self.proactive(&message.target, &text).await;
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
            turn = Some(self.turn(&slot.chat.conversation, deadline).await?);
        }
        let plan = reply.plan_final(text, Instant::now(), || wire::req_id("stream"));
        let Some(frame) = plan.stream else {
            drop(turn);
            debug!(event_id = %slot.event_id, "stream window over; replying with proactive messages");
            return self.send_parts(target, &plan.proactive, deadline, None).await;
        };
        if let Some(turn) = &mut turn {
            turn.attempted();
        }
        let outcome = self.stream_frame(&slot.req_id, &frame, deadline).await;
        drop(turn);
        reply.record(&frame, outcome);
        match outcome {
            Outcome::Acked => {
                let message_id = frame.id.clone();
                if plan.proactive.is_empty() {
                    return Ok(receipt(target, &message_id));
                }
                self.send_parts(target, &plan.proactive, deadline, Some(&message_id)).await
            }
            Outcome::Refused { errcode } if reply::closes(errcode) => {
                info!(event_id = %slot.event_id, errcode, "the platform refused the stream; replying with proactive messages");
                let parts = convert::split_content(text, wire::MAX_CONTENT_BYTES);
                self.send_parts(target, &parts, deadline, None).await
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

    /// A proactive message (`aibot_send_msg`, markdown) to `target.conversation`.
    pub async fn post(&self, message: &OutboundMessage) -> Result<DeliveryReceipt, PostError> {
        self.proactive(&message.target, &convert::reply_text(&message.body)).await
    }

    async fn proactive(
        &self,
        target: &MessageTarget,
        text: &str,
    ) -> Result<DeliveryReceipt, PostError> {
        let deadline = Instant::now() + self.config.send_queue;
        let parts = convert::split_content(text, wire::MAX_CONTENT_BYTES);
        self.send_parts(target, &parts, deadline, None).await
    }

    /// Sends `parts` in order as markdown messages, each after the previous one's
    /// acknowledgement. `shown` is the id of what already went on a stream: with it, any
    /// failure leaves the reply partly shown, which is reported as unknown (never retried).
    async fn send_parts(
        &self,
        target: &MessageTarget,
        parts: &[&str],
        deadline: Instant,
        shown: Option<&str>,
    ) -> Result<DeliveryReceipt, PostError> {
        let mut first_id = shown.map(str::to_owned);
        let total = parts.len() + usize::from(shown.is_some());
        for (index, part) in parts.iter().enumerate() {
            let number = index + 1 + usize::from(shown.is_some());
            let content =
                SendContent::Markdown { markdown: wire::Text { content: (*part).to_owned() } };
            let sent = self.send_msg(target.conversation.as_str(), content, deadline).await;
            let failure = match sent {
                Ok((req_id, Sent::Acked)) => {
                    first_id.get_or_insert(req_id);
                    continue;
                }
                Ok((_, Sent::Refused(ack))) => PostError::failed(
                    format!("WeCom refused the message: {}", ack.describe()),
                    false,
                ),
                Err(err) => err,
            };
            if first_id.is_none() {
                return Err(failure);
            }
            return Err(PostError::unknown(format!(
                "part {number} of {total} failed after earlier parts were shown: {failure}"
            )));
        }
        let message_id = first_id.unwrap_or_default();
        Ok(receipt(target, &message_id))
    }

    /// One paced `aibot_send_msg`; returns its `req_id` and how it ended.
    async fn send_msg(
        &self,
        conversation: &str,
        content: SendContent,
        deadline: Instant,
    ) -> Result<(String, Sent), PostError> {
        let mut turn = self.turn(conversation, deadline).await?;
        turn.attempted();
        let chat_type = self.chats().get(conversation).map(|kind| kind.chat_type());
        let body = SendMsg { chatid: conversation.to_owned(), chat_type, content };
        let req_id = wire::req_id(wire::cmd::SEND_MSG);
        let text = wire::encode(wire::cmd::SEND_MSG, &req_id, Some(&body));
        match self.link.command(&req_id, text, deadline, self.config.ack_timeout).await {
            Ok(ack) if ack.is_ok() => Ok((req_id, Sent::Acked)),
            Ok(ack) => {
                warn!(%conversation, %req_id, error = %ack.describe(), "WeCom refused a message");
                Ok((req_id, Sent::Refused(ack)))
            }
            Err(CommandError::NotSent(reason)) => Err(PostError::failed(reason, true)),
            Err(CommandError::Lost(reason)) => Err(PostError::unknown(reason)),
        }
    }

    /// Sends a command card to `conversation`.
    pub async fn send_card(&self, conversation: &str, card: TemplateCard) -> Result<(), PostError> {
        let deadline = Instant::now() + self.config.send_queue;
        let content = SendContent::TemplateCard { template_card: card };
        match self.send_msg(conversation, content, deadline).await? {
            (_, Sent::Acked) => Ok(()),
            (_, Sent::Refused(ack)) => {
                Err(PostError::failed(format!("WeCom refused the card: {}", ack.describe()), false))
            }
        }
    }

    /// Answers an `enter_chat` event with the welcome text, within the platform's 5 s.
    pub async fn welcome(&self, req_id: &str, conversation: &str, text: &str) {
        // The platform takes it for 5 s; waiting longer for a turn would be in vain.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut turn = match self.turn(conversation, deadline).await {
            Ok(turn) => turn,
            Err(_) => {
                debug!(%conversation, "conversation at its message limit: no welcome");
                return;
            }
        };
        turn.attempted();
        let body = wire::WelcomeBody::Text { text: wire::Text { content: text.to_owned() } };
        let frame = wire::encode(wire::cmd::RESPOND_WELCOME, req_id, Some(&body));
        self.event_reply(req_id, frame, "welcome").await;
    }

    /// Replaces a clicked card, within the platform's 5 s.
    pub async fn update_card(&self, req_id: &str, card: TemplateCard) {
        let body = wire::UpdateCard::new(card);
        let frame = wire::encode(wire::cmd::RESPOND_UPDATE, req_id, Some(&body));
        self.event_reply(req_id, frame, "card update").await;
    }

    async fn event_reply(&self, req_id: &str, frame: String, what: &str) {
        // The platform takes it for 5 s after the event; it already took some of them.
        let deadline = Instant::now() + Duration::from_secs(4);
        match self.link.command(req_id, frame, deadline, self.config.ack_timeout).await {
            Ok(ack) if ack.is_ok() => debug!(%req_id, "{what} sent"),
            Ok(ack) => warn!(%req_id, error = %ack.describe(), "WeCom refused the {what}"),
            Err(err) => warn!(%req_id, error = %err, "{what} not sent"),
        }
    }
}

/// A conversation's turn to send one message. Held until the message's outcome is known;
/// once a message was attempted, dropping the turn records it with the pacer at that moment
/// (the platform had counted it by then, if it counted it at all).
struct Turn<'a> {
    outbound: &'a Outbound,
    conversation: String,
    _held: tokio::sync::OwnedMutexGuard<()>,
    attempted: bool,
}

impl Turn<'_> {
    /// The message is about to be written.
    fn attempted(&mut self) {
        self.attempted = true;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.attempted {
            self.outbound.pacer().record(&self.conversation, Instant::now());
        }
    }
}

fn receipt(target: &MessageTarget, message_id: &str) -> DeliveryReceipt {
    let message_id = Id::new(message_id).unwrap_or_else(|_| Id::new("wecom").expect("a valid id"));
    let timestamp_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64);
    DeliveryReceipt {
        channel: target.channel.clone(),
        message_id,
        target: target.clone(),
        timestamp_ms: Some(timestamp_ms),
    }
}
