//! Sending on WeCom: stream frames, proactive messages (`aibot_send_msg`, long text split,
//! in order), command cards, welcome texts and card updates.
//!
//! Messages to one conversation go one at a time, first come first served, each when the
//! conversation's pace allows it ([`Pacer`], counted at the acknowledgement): a [`Turn`] is
//! held from the wait until the message's outcome is known. Stream updates after the first
//! frame are not messages and need no turn.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::PostError;
use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{DeliveryReceipt, MessageTarget, OutboundMessage};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::config::WeComConfig;
use crate::convert::{self, Chat, ChatKind};
use crate::link::{CommandError, Link};
use crate::pacing::Pacer;
use crate::reply::Outcome;
use crate::wire::{self, Ack, ReplyBody, SendContent, SendMsg, StreamFrame, TemplateCard};

/// Conversations whose chat type (single or group) is remembered for proactive sends;
/// beyond it the type is left out of `aibot_send_msg` (it is optional).
pub const MAX_KNOWN_CHATS: usize = 16_384;
/// Conversations with a send gate; beyond it the gates nobody holds are dropped.
const MAX_GATES: usize = 16_384;

/// The sending side of the driver.
#[derive(Debug)]
pub struct Outbound {
    config: Arc<WeComConfig>,
    link: Link,
    pacer: Mutex<Pacer>,
    /// One message in flight per conversation, first come first served.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    chats: Mutex<HashMap<String, ChatKind>>,
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
            chats: Mutex::default(),
        }
    }

    fn chats(&self) -> MutexGuard<'_, HashMap<String, ChatKind>> {
        self.chats.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Remembers whether `chat` is a single or a group chat.
    pub fn remember_chat(&self, chat: &Chat) {
        let mut chats = self.chats();
        if chats.len() >= MAX_KNOWN_CHATS && !chats.contains_key(&chat.conversation) {
            // Forget them all rather than track recency: the type is optional on the wire.
            chats.clear();
        }
        chats.insert(chat.conversation.clone(), chat.kind);
    }

    /// Sends one stream frame on `req_id` and reads its outcome.
    pub async fn stream_frame(
        &self,
        req_id: &str,
        frame: &StreamFrame,
        deadline: Instant,
    ) -> Outcome {
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
    pub async fn turn(&self, conversation: &str, deadline: Instant) -> Result<Turn<'_>, PostError> {
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
    pub fn turn_now(&self, conversation: &str) -> Option<Turn<'_>> {
        let held = self.gate(conversation).try_lock_owned().ok()?;
        let now = Instant::now();
        (self.pacer().next_slot(conversation, now) <= now).then(|| Turn {
            outbound: self,
            conversation: conversation.to_owned(),
            _held: held,
            attempted: false,
        })
    }

    /// A proactive message (`aibot_send_msg`, markdown) to `target.conversation`.
    pub async fn post(&self, message: &OutboundMessage) -> Result<DeliveryReceipt, PostError> {
        self.proactive(&message.target, &convert::reply_text(&message.body)).await
    }

    pub async fn proactive(
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
    pub async fn send_parts(
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
#[derive(Debug)]
pub struct Turn<'a> {
    outbound: &'a Outbound,
    conversation: String,
    _held: tokio::sync::OwnedMutexGuard<()>,
    attempted: bool,
}

impl Turn<'_> {
    /// The message is about to be written.
    pub fn attempted(&mut self) {
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

pub fn receipt(target: &MessageTarget, message_id: &str) -> DeliveryReceipt {
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
