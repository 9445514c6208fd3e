//! Everything the driver writes to Slack: replies and proactive posts (paced per channel,
//! 429 honoured, long text split, a preview replaced by the final reply), live effects
//! (preview, typing, reactions, edit, delete) and the DM channels of users.
//!
//! Post outcomes follow one rule: a post is `Failed` only when Slack certainly did not show
//! it (an `ok:false` answer, a 429, no connection); anything after the request may have
//! reached Slack is `Unknown` and never retried. A 429 is waited out (`Retry-After`) and the
//! post sent again, at most [`RATE_LIMIT_RETRIES`] times.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::{Effect, MessageBody, MessageTarget};
use channeld_driver_sdk::{EffectError, PostError};
use serde::de::DeserializeOwned;
use tracing::debug;

use crate::config::SlackConfig;
use crate::convert::{self, parse_message_id};
pub use crate::live::Placed;
use crate::live::{Bounded, Live, MAX_REMEMBERED, PreviewStep};
use crate::mrkdwn;
use crate::pacing::Pacer;
use crate::web::{CallError, WebApi};
use crate::wire;

/// Times a rate-limited post is waited out and sent again before it fails (retryable).
pub const RATE_LIMIT_RETRIES: u32 = 3;
/// The longest `Retry-After` a post waits out; longer ones fail the post (retryable).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// Status shown in an assistant thread while the agent works.
pub const THINKING_STATUS: &str = "is thinking…";

#[derive(Debug)]
struct State {
    pacer: Pacer,
    /// DM channels by user id (a forgotten one is opened again).
    dms: Bounded<String>,
    live: Live,
}

/// The write side of the driver.
#[derive(Debug, Clone)]
pub struct Outbound {
    web: WebApi,
    max_chars: usize,
    typing_reaction: String,
    state: Arc<Mutex<State>>,
    /// Held while a preview's first message is posted and while a reply takes its preview,
    /// so a reply never misses a preview that is being posted.
    preview_gate: Arc<tokio::sync::Mutex<()>>,
}

impl Outbound {
    pub fn new(web: WebApi, config: &SlackConfig) -> Self {
        Self {
            web,
            max_chars: config.max_message_chars,
            typing_reaction: config.typing_reaction.clone(),
            state: Arc::new(Mutex::new(State {
                pacer: Pacer::new(config.post_interval),
                dms: Bounded::new(MAX_REMEMBERED),
                live: Live::new(config.preview_interval),
            })),
            preview_gate: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Remembers an assistant thread: typing there is its status, not a reaction.
    pub fn assistant_thread(&self, channel: &str, thread_ts: &str) {
        self.lock().live.assistant_thread(channel, thread_ts);
    }

    /// A new message in a conversation: typing marks it, and a new turn's preview begins.
    pub fn inbound_seen(&self, target: &MessageTarget, message_id: &str) {
        self.lock().live.inbound_seen(target, message_id);
    }

    /// The channel to post to: a user id (`U…`/`W…`) means the DM with that user, opened with
    /// `conversations.open` the first time.
    pub async fn channel_for(&self, conversation: &str) -> Result<String, CallError> {
        if !(conversation.starts_with('U') || conversation.starts_with('W')) {
            return Ok(conversation.to_owned());
        }
        if let Some(channel) = self.lock().dms.get(conversation) {
            return Ok(channel.clone());
        }
        let request = wire::OpenConversation { users: conversation.to_owned() };
        let opened: wire::Opened = self.call_checked("conversations.open", &request).await?;
        self.lock().dms.insert(conversation.to_owned(), opened.channel.id.clone());
        Ok(opened.channel.id)
    }

    /// Runs `call`, waiting out 429s (at most [`RATE_LIMIT_RETRIES`] times, each at most
    /// [`MAX_RETRY_AFTER`]): a rate-limited call was not processed, so sending it again
    /// posts it exactly once.
    async fn rate_limited<R, F, Fut>(&self, mut call: F) -> Result<R, CallError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<R, CallError>>,
    {
        let mut retries = 0;
        loop {
            match call().await {
                Err(CallError::RateLimited(wait))
                    if retries < RATE_LIMIT_RETRIES && wait <= MAX_RETRY_AFTER =>
                {
                    retries += 1;
                    debug!(
                        wait_ms = wait.as_millis() as u64,
                        retries, "rate limited by Slack; waiting as asked"
                    );
                    tokio::time::sleep(wait).await;
                }
                other => return other,
            }
        }
    }

    /// One `chat.postMessage`, paced per channel.
    async fn post_one(&self, request: wire::PostMessage) -> Result<Placed, CallError> {
        let slot = self.lock().pacer.reserve(&request.channel, Instant::now());
        tokio::time::sleep_until(slot.into()).await;
        let posted: wire::Posted =
            self.rate_limited(|| self.web.call("chat.postMessage", &request)).await?;
        Ok(Placed { channel: posted.channel, ts: posted.ts })
    }

    async fn call_checked<B: serde::Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        body: &B,
    ) -> Result<R, CallError> {
        self.rate_limited(|| self.web.call(method, body)).await
    }

    /// Posts a reply or a proactive message; the first message names the receipt. A preview
    /// for the same reply is replaced by the reply's first part.
    pub async fn post(
        &self,
        target: &MessageTarget,
        body: &MessageBody,
    ) -> Result<Placed, PostError> {
        let channel =
            self.channel_for(target.conversation.as_str()).await.map_err(|err| outcome(&err))?;
        let parts = parts(body, self.max_chars);
        let thread_ts = target.thread.as_ref().map(|t| t.as_str().to_owned());
        let preview = {
            let _gate = self.preview_gate.lock().await;
            self.lock().live.take_preview(target)
        };
        let mut first: Option<Placed> = None;
        for (index, text) in parts.into_iter().enumerate() {
            let placed = match (&preview, index) {
                (Some(preview), 0) => {
                    let update = wire::UpdateMessage {
                        channel: preview.channel.clone(),
                        ts: preview.ts.clone(),
                        text: text.clone(),
                        blocks: None,
                    };
                    match self.call_checked::<_, serde_json::Value>("chat.update", &update).await {
                        Ok(_) => Ok(preview.clone()),
                        // The preview is gone (deleted by someone): post the reply instead.
                        Err(CallError::Slack(code)) if code == "message_not_found" => {
                            self.post_one(post_request(&channel, &text, &thread_ts)).await
                        }
                        Err(err) => Err(err),
                    }
                }
                _ => self.post_one(post_request(&channel, &text, &thread_ts)).await,
            };
            match (placed, &first) {
                (Ok(placed), None) => first = Some(placed),
                (Ok(_), Some(_)) => {}
                (Err(err), None) => return Err(outcome(&err)),
                (Err(err), Some(first)) => {
                    // Part of the reply is on screen: that is neither a receipt nor a failure.
                    return Err(PostError::unknown(format!(
                        "only the first parts were posted (from ts {}): {err}",
                        first.ts
                    )));
                }
            }
        }
        let placed = first.ok_or_else(|| PostError::failed("nothing to post", false))?;
        self.clear_typing(target).await;
        Ok(placed)
    }

    /// Applies a live effect.
    pub async fn effect(&self, target: &MessageTarget, effect: &Effect) -> Result<(), EffectError> {
        let conversation = target.conversation.as_str();
        match effect {
            Effect::Preview { text } => self.preview(target, text).await,
            Effect::Typing { active } => self.typing(target, *active).await,
            Effect::Reaction { message_id, emoji, remove } => {
                let name = convert::reaction_name(emoji).ok_or_else(|| {
                    EffectError::Failed(format!("{emoji:?} is not a Slack emoji name"))
                })?;
                let channel = self.channel_for(conversation).await.map_err(effect_error)?;
                let (channel, ts) = parse_message_id(message_id.as_str(), &channel);
                self.react(channel, ts, &name, !*remove).await
            }
            Effect::Edit { message_id, body } => {
                let channel = self.channel_for(conversation).await.map_err(effect_error)?;
                let (channel, ts) = parse_message_id(message_id.as_str(), &channel);
                let mut parts = parts(body, self.max_chars);
                let update = wire::UpdateMessage {
                    channel: channel.to_owned(),
                    ts: ts.to_owned(),
                    text: parts.swap_remove(0),
                    blocks: None,
                };
                self.call_checked::<_, serde_json::Value>("chat.update", &update)
                    .await
                    .map(drop)
                    .map_err(effect_error)
            }
            Effect::Delete { message_id } => {
                let channel = self.channel_for(conversation).await.map_err(effect_error)?;
                let (channel, ts) = parse_message_id(message_id.as_str(), &channel);
                let delete = wire::DeleteMessage { channel: channel.to_owned(), ts: ts.to_owned() };
                self.call_checked::<_, serde_json::Value>("chat.delete", &delete)
                    .await
                    .map(drop)
                    .map_err(effect_error)
            }
            _ => Err(EffectError::Unsupported),
        }
    }

    async fn react(
        &self,
        channel: &str,
        ts: &str,
        name: &str,
        add: bool,
    ) -> Result<(), EffectError> {
        let method = if add { "reactions.add" } else { "reactions.remove" };
        let request = wire::Reaction {
            channel: channel.to_owned(),
            timestamp: ts.to_owned(),
            name: name.to_owned(),
        };
        match self.call_checked::<_, serde_json::Value>(method, &request).await {
            Ok(_) => Ok(()),
            // Already in the wanted state.
            Err(CallError::Slack(code)) if code == "already_reacted" || code == "no_reaction" => {
                Ok(())
            }
            Err(err) => Err(effect_error(err)),
        }
    }

    /// Typing: the assistant thread's status where the conversation is one, otherwise the
    /// typing reaction on the message being answered.
    async fn typing(&self, target: &MessageTarget, active: bool) -> Result<(), EffectError> {
        let channel = self.channel_for(target.conversation.as_str()).await.map_err(effect_error)?;
        let thread = target.thread.as_ref().map(|t| t.as_str());
        let assistant = self.lock().live.is_assistant_thread(&channel, thread);
        if let Some(thread_ts) = thread.filter(|_| assistant) {
            let status = wire::SetStatus {
                channel_id: channel.clone(),
                thread_ts: thread_ts.to_owned(),
                status: if active { THINKING_STATUS.to_owned() } else { String::new() },
            };
            return self
                .call_checked::<_, serde_json::Value>("assistant.threads.setStatus", &status)
                .await
                .map(drop)
                .map_err(effect_error);
        }
        let Some(message) = self.lock().live.typing(target, active) else {
            return Err(EffectError::Failed(
                "no message in this conversation to show typing on".into(),
            ));
        };
        let (channel, ts) = parse_message_id(&message, &channel);
        self.react(channel, ts, &self.typing_reaction, active).await
    }

    /// Removes the typing reaction after a reply, where one is shown.
    async fn clear_typing(&self, target: &MessageTarget) {
        let Some(message) = self.lock().live.typing_shown(target) else { return };
        let (channel, ts) = parse_message_id(&message, target.conversation.as_str());
        if let Err(err) = self.react(channel, ts, &self.typing_reaction, false).await {
            debug!(error = %err, "could not remove the typing reaction");
        }
    }

    /// A preview: posted once, then updated at most once per preview interval; texts in
    /// between are folded into the next update.
    async fn preview(&self, target: &MessageTarget, raw: &str) -> Result<(), EffectError> {
        let body = MessageBody::text(raw).map_err(|err| EffectError::Failed(err.to_string()))?;
        let text = parts(&body, self.max_chars).swap_remove(0);
        let mut step = self.lock().live.preview(target, text.clone(), Instant::now());
        if step == PreviewStep::Post {
            let gate = self.preview_gate.lock().await;
            // Decided again under the gate: a reply or another preview may have come first.
            step = self.lock().live.preview(target, text.clone(), Instant::now());
            if step == PreviewStep::Post {
                let channel =
                    self.channel_for(target.conversation.as_str()).await.map_err(effect_error)?;
                let thread_ts = target.thread.as_ref().map(|t| t.as_str().to_owned());
                let placed = self
                    .post_one(post_request(&channel, &text, &thread_ts))
                    .await
                    .map_err(effect_error)?;
                self.lock().live.preview_posted(target, placed, Instant::now());
                return Ok(());
            }
            drop(gate);
        }
        let PreviewStep::UpdateAt(due) = step else {
            // The reply is already there.
            return Ok(());
        };
        tokio::time::sleep_until(due.into()).await;
        let Some((placed, text)) = self.lock().live.preview_due(target, Instant::now()) else {
            return Ok(());
        };
        let update =
            wire::UpdateMessage { channel: placed.channel, ts: placed.ts, text, blocks: None };
        self.call_checked::<_, serde_json::Value>("chat.update", &update)
            .await
            .map(drop)
            .map_err(effect_error)
    }

    /// Posts a message with blocks (a command prompt) and returns where it landed.
    pub async fn post_blocks(
        &self,
        target: &MessageTarget,
        text: &str,
        blocks: serde_json::Value,
    ) -> Result<Placed, CallError> {
        let channel = self.channel_for(target.conversation.as_str()).await?;
        let thread_ts = target.thread.as_ref().map(|t| t.as_str().to_owned());
        let mut request = post_request(&channel, &mrkdwn::escape(text), &thread_ts);
        request.blocks = Some(blocks);
        self.post_one(request).await
    }

    /// Posts text that is already mrkdwn (a notification) as one message.
    pub async fn post_mrkdwn(
        &self,
        target: &MessageTarget,
        text: &str,
    ) -> Result<Placed, CallError> {
        let channel = self.channel_for(target.conversation.as_str()).await?;
        let thread_ts = target.thread.as_ref().map(|t| t.as_str().to_owned());
        let text: String = text.chars().take(self.max_chars).collect();
        self.post_one(post_request(&channel, &text, &thread_ts)).await
    }

    /// Replaces a message's text and removes its blocks (buttons).
    pub async fn replace(&self, placed: &Placed, text: String) -> Result<(), CallError> {
        let update = wire::UpdateMessage {
            channel: placed.channel.clone(),
            ts: placed.ts.clone(),
            text,
            blocks: None,
        };
        self.call_checked::<_, serde_json::Value>("chat.update", &update).await.map(drop)
    }
}

fn post_request(channel: &str, text: &str, thread_ts: &Option<String>) -> wire::PostMessage {
    wire::PostMessage {
        channel: channel.to_owned(),
        text: text.to_owned(),
        thread_ts: thread_ts.clone(),
        blocks: None,
        mrkdwn: true,
        unfurl_links: false,
    }
}

/// The messages a body becomes: its Markdown as mrkdwn, attachments as links (files are not
/// uploaded), split at `max_chars`.
pub fn parts(body: &MessageBody, max_chars: usize) -> Vec<String> {
    let mut text = mrkdwn::to_mrkdwn(body.text_str());
    for attachment in body.attachments() {
        let label = attachment.name.as_deref().unwrap_or(&attachment.url);
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!(
            "<{}|{}>",
            attachment.url.replace('>', "%3E").replace('|', "%7C"),
            mrkdwn::escape(label)
        ));
    }
    mrkdwn::split(&text, max_chars)
}

/// A call's failure as a post outcome.
pub fn outcome(err: &CallError) -> PostError {
    match err {
        CallError::Slack(code) => convert::post_error(code),
        CallError::RateLimited(wait) => {
            PostError::failed(format!("slack rate limit, retry after {}s", wait.as_secs()), true)
        }
        CallError::NotSent(reason) => {
            PostError::failed(format!("cannot reach slack: {reason}"), true)
        }
        CallError::Unknown(reason) => {
            PostError::unknown(format!("slack may have posted it: {reason}"))
        }
    }
}

fn effect_error(err: CallError) -> EffectError {
    EffectError::Failed(err.to_string())
}
