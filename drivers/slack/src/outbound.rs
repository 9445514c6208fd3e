//! Everything the driver writes to Slack: replies and proactive posts (paced per channel,
//! 429 honoured, long text split, a preview replaced by the final reply), live effects
//! (preview, typing, reactions, edit, delete) and the DM channels of users.
//!
//! Post outcomes follow one rule: a post is `Failed` only when Slack certainly did not show
//! it (an `ok:false` answer, a 429, no connection); anything after the request may have
//! reached Slack is `Unknown` and never retried. A 429 is waited out (`Retry-After`) and the
//! post sent again, at most [`RATE_LIMIT_RETRIES`] times.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::{Effect, MessageBody, MessageTarget};
use channeld_driver_sdk::{EffectError, PostError};
use serde::de::DeserializeOwned;
use tracing::debug;

use crate::config::SlackConfig;
use crate::convert::{self, parse_message_id};
use crate::mrkdwn;
use crate::pacing::Pacer;
use crate::web::{CallError, WebApi};
use crate::wire;

/// Times a rate-limited post is waited out and sent again before it fails (retryable).
pub const RATE_LIMIT_RETRIES: u32 = 3;
/// The longest `Retry-After` a post waits out; longer ones fail the post (retryable).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// Previews remembered at once (oldest dropped: its run is long over).
const MAX_PREVIEWS: usize = 1024;
/// DM channels and assistant threads remembered (oldest forgotten; a forgotten DM is
/// opened again, a forgotten assistant thread shows typing as a reaction).
const MAX_REMEMBERED: usize = 4096;
/// Status shown in an assistant thread while the agent works.
pub const THINKING_STATUS: &str = "is thinking…";

/// A message posted: where and its ts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub channel: String,
    pub ts: String,
}

/// Which reply a preview stands in for: its conversation and thread (the hub sends live
/// effects without `reply_to`).
type PreviewKey = (String, Option<String>);

fn preview_key(target: &MessageTarget) -> PreviewKey {
    (target.conversation.as_str().to_owned(), target.thread.as_ref().map(|t| t.as_str().to_owned()))
}

/// A conversation and thread as one map key.
fn place_key(target: &MessageTarget) -> String {
    format!("{}\u{0}{}", target.conversation, target.thread.as_ref().map_or("", |t| t.as_str()))
}

#[derive(Debug)]
struct Preview {
    placed: Placed,
    last_update: Instant,
    /// Text waiting for the next allowed update (only the newest is kept).
    pending: Option<String>,
}

/// A bounded insertion-ordered map (oldest evicted).
#[derive(Debug)]
struct Bounded<V> {
    map: HashMap<String, V>,
    order: VecDeque<String>,
    capacity: usize,
}

impl<V> Bounded<V> {
    fn new(capacity: usize) -> Self {
        Self { map: HashMap::new(), order: VecDeque::new(), capacity }
    }

    fn get(&self, key: &str) -> Option<&V> {
        self.map.get(key)
    }

    fn remove(&mut self, key: &str) -> Option<V> {
        let value = self.map.remove(key)?;
        self.order.retain(|k| k != key);
        Some(value)
    }

    fn insert(&mut self, key: String, value: V) {
        if self.map.insert(key.clone(), value).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

#[derive(Debug)]
struct State {
    pacer: Pacer,
    previews: HashMap<PreviewKey, Preview>,
    preview_order: VecDeque<PreviewKey>,
    /// Replies already posted: a preview arriving after its reply is dropped.
    replied: VecDeque<PreviewKey>,
    dms: Bounded<String>,
    assistant_threads: Bounded<()>,
    /// The latest inbound message per conversation and thread: what typing marks.
    last_inbound: Bounded<String>,
    /// Where the typing reaction is shown now, per conversation and thread.
    typing_on: Bounded<String>,
}

/// The write side of the driver.
#[derive(Debug, Clone)]
pub struct Outbound {
    web: WebApi,
    max_chars: usize,
    preview_interval: Duration,
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
            preview_interval: config.preview_interval,
            typing_reaction: config.typing_reaction.clone(),
            state: Arc::new(Mutex::new(State {
                pacer: Pacer::new(config.post_interval),
                previews: HashMap::new(),
                preview_order: VecDeque::new(),
                replied: VecDeque::new(),
                dms: Bounded::new(MAX_REMEMBERED),
                assistant_threads: Bounded::new(MAX_REMEMBERED),
                last_inbound: Bounded::new(MAX_REMEMBERED),
                typing_on: Bounded::new(MAX_REMEMBERED),
            })),
            preview_gate: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Remembers an assistant thread: typing there is its status, not a reaction.
    pub fn assistant_thread(&self, channel: &str, thread_ts: &str) {
        self.lock().assistant_threads.insert(format!("{channel}:{thread_ts}"), ());
    }

    /// Remembers the message being answered in a conversation: typing marks it.
    /// A new turn starts there: the previous reply's preview bookkeeping is forgotten.
    pub fn inbound_seen(&self, target: &MessageTarget, message_id: &str) {
        let key = preview_key(target);
        let mut state = self.lock();
        state.last_inbound.insert(place_key(target), message_id.to_owned());
        state.replied.retain(|k| k != &key);
        state.preview_order.retain(|k| k != &key);
        state.previews.remove(&key);
    }

    fn is_assistant_thread(&self, channel: &str, thread: Option<&str>) -> bool {
        thread.is_some_and(|ts| {
            self.lock().assistant_threads.get(&format!("{channel}:{ts}")).is_some()
        })
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
            self.take_preview(target)
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

    /// Takes the reply's preview, and marks the reply as posted so a late preview is dropped.
    fn take_preview(&self, target: &MessageTarget) -> Option<Placed> {
        let key = preview_key(target);
        let mut state = self.lock();
        state.preview_order.retain(|k| k != &key);
        if target.reply_to.is_some() {
            state.replied.push_back(key.clone());
            while state.replied.len() > MAX_PREVIEWS {
                state.replied.pop_front();
            }
        }
        state.previews.remove(&key).map(|preview| preview.placed)
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
        if let Some(thread_ts) = thread.filter(|_| self.is_assistant_thread(&channel, thread)) {
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
        // The hub sends live effects without `reply_to`: mark the latest inbound message.
        let key = place_key(target);
        let marked = {
            let mut state = self.lock();
            let message = target
                .reply_to
                .as_ref()
                .map(|r| r.as_str().to_owned())
                .or_else(|| state.last_inbound.get(&key).cloned());
            match (active, message) {
                (true, Some(message)) => {
                    state.typing_on.insert(key, message.clone());
                    Some(message)
                }
                (false, message) => state.typing_on.remove(&key).or(message),
                (true, None) => None,
            }
        };
        let Some(message) = marked else {
            return Err(EffectError::Failed(
                "no message in this conversation to show typing on".into(),
            ));
        };
        let (channel, ts) = parse_message_id(&message, &channel);
        self.react(channel, ts, &self.typing_reaction, active).await
    }

    /// Removes the typing reaction after a reply, where one is shown.
    async fn clear_typing(&self, target: &MessageTarget) {
        let Some(message) = self.lock().typing_on.remove(&place_key(target)) else { return };
        let (channel, ts) = parse_message_id(&message, target.conversation.as_str());
        if let Err(err) = self.react(channel, ts, &self.typing_reaction, false).await {
            debug!(error = %err, "could not remove the typing reaction");
        }
    }

    /// A preview: posted once, then updated at most once per preview interval; updates in
    /// between are folded into the next one.
    async fn preview(&self, target: &MessageTarget, raw: &str) -> Result<(), EffectError> {
        let key = preview_key(target);
        let text = parts(
            &MessageBody::text(raw).map_err(|err| EffectError::Failed(err.to_string()))?,
            self.max_chars,
        )
        .swap_remove(0);
        let due = {
            let mut state = self.lock();
            match state.previews.get_mut(&key) {
                None => None,
                Some(preview) => {
                    preview.pending = Some(text.clone());
                    Some(preview.last_update + self.preview_interval)
                }
            }
        };
        let Some(due) = due else {
            let gate = self.preview_gate.lock().await;
            let (replied, exists) = {
                let state = self.lock();
                (state.replied.contains(&key), state.previews.contains_key(&key))
            };
            if replied {
                // The reply is already there: a late preview would stand beside it.
                return Ok(());
            }
            if exists {
                // Another preview posted it meanwhile: this text goes out as its update.
                drop(gate);
                return Box::pin(self.preview(target, raw)).await;
            }
            let channel = self.channel_for(&key.0).await.map_err(effect_error)?;
            let placed =
                self.post_one(post_request(&channel, &text, &key.1)).await.map_err(effect_error)?;
            let mut state = self.lock();
            state.previews.insert(
                key.clone(),
                Preview { placed, last_update: Instant::now(), pending: None },
            );
            state.preview_order.push_back(key);
            while state.preview_order.len() > MAX_PREVIEWS {
                if let Some(old) = state.preview_order.pop_front() {
                    state.previews.remove(&old);
                }
            }
            return Ok(());
        };
        tokio::time::sleep_until(due.into()).await;
        // The newest text goes out once; a final reply that took the preview meanwhile wins.
        let update = {
            let mut state = self.lock();
            let Some(preview) = state.previews.get_mut(&key) else { return Ok(()) };
            let Some(text) = preview.pending.take() else { return Ok(()) };
            preview.last_update = Instant::now();
            wire::UpdateMessage {
                channel: preview.placed.channel.clone(),
                ts: preview.placed.ts.clone(),
                text,
                blocks: None,
            }
        };
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
