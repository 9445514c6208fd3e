//! Pure mapping between Slack and channeld frames: Events API events to inbound messages and
//! events (or a reason to drop them), message ids, posts to `chat.postMessage` requests,
//! Slack error codes to post outcomes, and reaction names.
//!
//! Inbound rules:
//! * conversation = channel id; message id (the hub's event id) = `<channel>:<ts>`, so the
//!   `app_mention` and `message` events of one post, and every redelivery of either, are one
//!   inbound.
//! * thread = `thread_ts` when the post is in a thread; a root post in a channel gets
//!   `thread = ts`, so the reply opens a thread under it; a root post in a DM has no thread,
//!   so the reply stays inline.
//! * sender = the user id. Posts by bots (`bot_id` set, `bot_message`) and by this app's own
//!   user are dropped (loop prevention), and so are `message_changed` / `message_deleted`
//!   unless edits/deletes are forwarded.
//! * with `respond = mentions`, channel posts count only when they @mention the bot; the
//!   mention is stripped from the text. Slack's `&amp;`/`&lt;`/`&gt;` are unescaped and its
//!   links become Markdown.
//! * files become attachment references (`url_private`, name, MIME type; id and size in
//!   metadata). Nothing in them carries a token.
//! * only what is the same in every copy of a post goes into the message, so the hub sees
//!   redeliveries as the same content.

use std::collections::BTreeMap;

use channeld_driver_sdk::PostError;
use channeld_driver_sdk::protocol::types::{
    Attachment, EventContext, InboundMessage, IncomingEvent, MessageBody, MessageTarget,
    Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};

use crate::config::{InboundEvents, Respond};
use crate::wire::{self, Event, EventCallback, MessageEvent};

/// Who the bot is, from `auth.test`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BotIdentity {
    pub user_id: String,
    pub bot_id: Option<String>,
}

/// What to do with an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Classified {
    /// Report to the hub as `inbound`.
    Message(InboundMessage),
    /// Report to the hub as `inbound_event`.
    Event { event_id: Id, event: IncomingEvent },
    /// An assistant thread opened or changed: typing shows as its status there.
    AssistantThread { channel: String, thread_ts: String },
    /// Not for the hub: acknowledge and drop.
    Ignore(Ignored),
}

/// Why an event is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ignored {
    OwnMessage,
    BotMessage,
    /// A message subtype that is not a person's post (joins, topic changes…), or an edit or
    /// deletion that is not forwarded.
    Subtype(String),
    /// A channel post without the bot's @mention while responding to mentions only.
    NotMentioned,
    /// Only a mention, no text or files.
    Empty,
    /// An event type the driver does not handle.
    Unhandled,
    /// Required fields are missing or invalid.
    Malformed(&'static str),
}

/// The event id (and message id) of a Slack message.
pub fn message_id(channel: &str, ts: &str) -> Result<Id, Ignored> {
    Id::new(format!("{channel}:{ts}")).map_err(|_| Ignored::Malformed("channel or ts"))
}

/// `(channel, ts)` of a message id; a bare ts means a message in `conversation`.
pub fn parse_message_id<'a>(id: &'a str, conversation: &'a str) -> (&'a str, &'a str) {
    match id.split_once(':') {
        Some((channel, ts)) if !channel.is_empty() && !ts.is_empty() => (channel, ts),
        _ => (conversation, id),
    }
}

/// Milliseconds since the epoch of a Slack ts (`"1355517523.000005"`).
pub fn ts_millis(ts: &str) -> Option<u64> {
    let (secs, frac) = ts.split_once('.').unwrap_or((ts, "0"));
    let secs: u64 = secs.parse().ok()?;
    let millis: u64 = format!("{frac:0<3}").get(..3)?.parse().ok()?;
    secs.checked_mul(1000)?.checked_add(millis)
}

/// Decides what an Events API callback becomes.
pub fn classify(
    channel: &ChannelId,
    bot: &BotIdentity,
    respond: Respond,
    forward: InboundEvents,
    callback: &EventCallback,
) -> Classified {
    match &callback.event {
        Event::Message(message) => classify_message(channel, bot, respond, forward, message, false),
        Event::AppMention(message) => {
            classify_message(channel, bot, respond, forward, message, true)
        }
        Event::ReactionAdded(reaction) | Event::ReactionRemoved(reaction) => {
            let added = matches!(callback.event, Event::ReactionAdded(_));
            classify_reaction(channel, bot, forward, callback, reaction, added)
        }
        Event::AssistantThreadStarted(started) | Event::AssistantThreadContextChanged(started) => {
            Classified::AssistantThread {
                channel: started.assistant_thread.channel_id.clone(),
                thread_ts: started.assistant_thread.thread_ts.clone(),
            }
        }
        Event::Other => Classified::Ignore(Ignored::Unhandled),
    }
}

fn is_dm(message: &MessageEvent, channel: &str) -> bool {
    match message.channel_type.as_deref() {
        Some(kind) => kind == "im",
        None => channel.starts_with('D'),
    }
}

fn classify_message(
    instance: &ChannelId,
    bot: &BotIdentity,
    respond: Respond,
    forward: InboundEvents,
    message: &MessageEvent,
    mention_event: bool,
) -> Classified {
    let Some(channel) = message.channel.as_deref().filter(|c| !c.is_empty()) else {
        return Classified::Ignore(Ignored::Malformed("channel"));
    };
    match message.subtype.as_deref() {
        None | Some("file_share" | "thread_broadcast" | "me_message") => {}
        Some("bot_message") => return Classified::Ignore(Ignored::BotMessage),
        Some("message_changed") if forward.edits => return edited(instance, bot, message, channel),
        Some("message_deleted") if forward.deletes => return deleted(instance, message, channel),
        Some(other) => return Classified::Ignore(Ignored::Subtype(other.to_owned())),
    }
    if message.bot_id.is_some() {
        return Classified::Ignore(if message.bot_id == bot.bot_id {
            Ignored::OwnMessage
        } else {
            Ignored::BotMessage
        });
    }
    let Some(user) = message.user.as_deref().filter(|u| !u.is_empty()) else {
        return Classified::Ignore(Ignored::Malformed("user"));
    };
    if user == bot.user_id {
        return Classified::Ignore(Ignored::OwnMessage);
    }
    let Some(ts) = message.ts.as_deref().filter(|ts| !ts.is_empty()) else {
        return Classified::Ignore(Ignored::Malformed("ts"));
    };
    let raw = message.text.as_deref().unwrap_or("");
    let dm = is_dm(message, channel);
    let mentioned = mention_event || mentions(raw, &bot.user_id);
    if respond == Respond::Mentions && !dm && !mentioned {
        return Classified::Ignore(Ignored::NotMentioned);
    }
    let text = slack_text_to_markdown(&strip_mention(raw, &bot.user_id));
    let (attachments, mut metadata) = attachments(&message.files);
    let Ok(body) = MessageBody::with_attachments(text, attachments) else {
        return Classified::Ignore(Ignored::Empty);
    };
    let (Ok(id), Ok(conversation), Ok(sender)) =
        (message_id(channel, ts), Id::new(channel), Id::new(user))
    else {
        return Classified::Ignore(Ignored::Malformed("channel, user or ts"));
    };
    let thread = match message.thread_ts.as_deref() {
        Some(thread_ts) => Some(thread_ts),
        None if dm => None,
        None => Some(ts),
    };
    let Ok(thread) = thread.map(Id::new).transpose() else {
        return Classified::Ignore(Ignored::Malformed("thread_ts"));
    };
    metadata.insert("slack.ts".to_owned(), ts.to_owned());
    if let Some(thread_ts) = &message.thread_ts {
        metadata.insert("slack.thread_ts".to_owned(), thread_ts.clone());
    }
    Classified::Message(InboundMessage {
        id,
        target: MessageTarget { channel: instance.clone(), conversation, thread, reply_to: None },
        sender: Participant::new(sender),
        body,
        timestamp_ms: ts_millis(ts),
        metadata,
    })
}

fn edited(
    instance: &ChannelId,
    bot: &BotIdentity,
    message: &MessageEvent,
    channel: &str,
) -> Classified {
    let Some(inner) = message.message.as_deref() else {
        return Classified::Ignore(Ignored::Malformed("message"));
    };
    if inner.bot_id.is_some() || inner.user.as_deref() == Some(bot.user_id.as_str()) {
        return Classified::Ignore(Ignored::BotMessage);
    }
    let (Some(user), Some(ts)) = (inner.user.as_deref(), inner.ts.as_deref()) else {
        return Classified::Ignore(Ignored::Malformed("message.user or message.ts"));
    };
    let text =
        slack_text_to_markdown(&strip_mention(inner.text.as_deref().unwrap_or(""), &bot.user_id));
    let (attachments, metadata) = attachments(&inner.files);
    let Ok(body) = MessageBody::with_attachments(text, attachments) else {
        return Classified::Ignore(Ignored::Empty);
    };
    let edit_ts = message.event_ts.as_deref().or(message.ts.as_deref()).unwrap_or(ts);
    let Some(context) =
        context(instance, channel, inner.thread_ts.as_deref(), Some(user), edit_ts, metadata)
    else {
        return Classified::Ignore(Ignored::Malformed("channel or user"));
    };
    let (Ok(message_id), Ok(event_id)) =
        (message_id(channel, ts), Id::new(format!("{channel}:{ts}:edit:{edit_ts}")))
    else {
        return Classified::Ignore(Ignored::Malformed("ts"));
    };
    Classified::Event {
        event_id,
        event: IncomingEvent::MessageEdited { context, message_id, body },
    }
}

fn deleted(instance: &ChannelId, message: &MessageEvent, channel: &str) -> Classified {
    let Some(ts) = message.deleted_ts.as_deref() else {
        return Classified::Ignore(Ignored::Malformed("deleted_ts"));
    };
    let previous = message.previous_message.as_deref();
    if previous.is_some_and(|p| p.bot_id.is_some()) {
        return Classified::Ignore(Ignored::BotMessage);
    }
    let user = previous.and_then(|p| p.user.as_deref());
    let thread = previous.and_then(|p| p.thread_ts.as_deref());
    let at = message.event_ts.as_deref().or(message.ts.as_deref()).unwrap_or(ts);
    let Some(context) = context(instance, channel, thread, user, at, BTreeMap::new()) else {
        return Classified::Ignore(Ignored::Malformed("channel"));
    };
    let (Ok(message_id), Ok(event_id)) =
        (message_id(channel, ts), Id::new(format!("{channel}:{ts}:delete")))
    else {
        return Classified::Ignore(Ignored::Malformed("ts"));
    };
    Classified::Event { event_id, event: IncomingEvent::MessageDeleted { context, message_id } }
}

fn classify_reaction(
    instance: &ChannelId,
    bot: &BotIdentity,
    forward: InboundEvents,
    callback: &EventCallback,
    reaction: &wire::ReactionEvent,
    added: bool,
) -> Classified {
    if !forward.reactions {
        return Classified::Ignore(Ignored::Unhandled);
    }
    let user = reaction.user.as_deref();
    if user == Some(bot.user_id.as_str()) {
        return Classified::Ignore(Ignored::OwnMessage);
    }
    let (Some(channel), Some(ts)) = (reaction.item.channel.as_deref(), reaction.item.ts.as_deref())
    else {
        return Classified::Ignore(Ignored::Unhandled);
    };
    if reaction.item.kind != "message" {
        return Classified::Ignore(Ignored::Unhandled);
    }
    let at = reaction.event_ts.as_deref().unwrap_or(ts);
    let Some(context) = context(instance, channel, None, user, at, BTreeMap::new()) else {
        return Classified::Ignore(Ignored::Malformed("channel"));
    };
    let (Ok(message_id), Ok(event_id)) = (message_id(channel, ts), Id::new(&callback.event_id))
    else {
        return Classified::Ignore(Ignored::Malformed("ts or event_id"));
    };
    let emoji = reaction.reaction.clone();
    Classified::Event {
        event_id,
        event: IncomingEvent::Reaction { context, message_id, emoji, added },
    }
}

fn context(
    instance: &ChannelId,
    channel: &str,
    thread: Option<&str>,
    user: Option<&str>,
    at: &str,
    metadata: BTreeMap<String, String>,
) -> Option<EventContext> {
    let conversation = Id::new(channel).ok()?;
    let thread = thread.map(Id::new).transpose().ok()?;
    let participant = user.map(|u| Id::new(u).map(Participant::new)).transpose().ok()?;
    Some(EventContext {
        target: MessageTarget { channel: instance.clone(), conversation, thread, reply_to: None },
        participant,
        timestamp_ms: ts_millis(at),
        metadata,
    })
}

/// Whether `text` @mentions `user` (`<@U…>` or `<@U…|name>`).
pub fn mentions(text: &str, user: &str) -> bool {
    text.contains(&format!("<@{user}>")) || text.contains(&format!("<@{user}|"))
}

/// Removes every mention of `user` (with one space after it) and trims the result.
pub fn strip_mention(text: &str, user: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let open = format!("<@{user}");
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let end = match after.chars().next() {
            Some('>') => Some(1),
            Some('|') => after.find('>').map(|i| i + 1),
            // `<@U0BOTX>` is somebody else.
            _ => None,
        };
        out.push_str(&rest[..start]);
        match end {
            Some(end) => rest = after[end..].strip_prefix(' ').unwrap_or(&after[end..]),
            None => {
                out.push_str(&open);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.trim().to_owned()
}

/// Slack's message text to what an agent reads: links as Markdown, channel and special
/// mentions readable, entities unescaped. User mentions stay `<@U…>` so a reply can use them.
pub fn slack_text_to_markdown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('<') {
        out.push_str(&unescape(&rest[..start]));
        let Some(len) = rest[start..].find('>') else {
            out.push_str(&unescape(&rest[start..]));
            return out;
        };
        let inner = &rest[start + 1..start + len];
        let (target, label) = match inner.split_once('|') {
            Some((target, label)) => (target, Some(label)),
            None => (inner, None),
        };
        match target.chars().next() {
            Some('@') => out.push_str(&format!("<{target}>")),
            Some('#') => out.push_str(&format!("#{}", label.unwrap_or(&target[1..]))),
            Some('!') => {
                let special = target[1..].split('^').next().unwrap_or("");
                out.push('@');
                out.push_str(&unescape(label.unwrap_or(special)));
            }
            _ => match label {
                Some(label) => {
                    out.push_str(&format!("[{}]({})", unescape(label), unescape(target)))
                }
                None => out.push_str(&unescape(target.strip_prefix("mailto:").unwrap_or(target))),
            },
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(&unescape(rest));
    out
}

fn unescape(text: &str) -> String {
    text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
}

/// Attachment references for shared files (deleted or hidden files have no URL and are
/// skipped), with ids and sizes in metadata.
fn attachments(files: &[wire::File]) -> (Vec<Attachment>, BTreeMap<String, String>) {
    let mut attachments = Vec::new();
    let mut metadata = BTreeMap::new();
    for file in files {
        let Some(url) = file.url_private.as_deref().filter(|u| !u.is_empty()) else {
            continue;
        };
        let index = attachments.len();
        if let Some(id) = &file.id {
            metadata.insert(format!("slack.file.{index}.id"), id.clone());
        }
        if let Some(size) = file.size {
            metadata.insert(format!("slack.file.{index}.size"), size.to_string());
        }
        attachments.push(Attachment {
            url: url.to_owned(),
            name: file.name.clone().or_else(|| file.title.clone()),
            mime: file.mimetype.clone(),
        });
    }
    (attachments, metadata)
}

/// How a Web API error code ends a post. Slack says `internal_error` and `fatal_error` may
/// have done part of the work, so those are unknown; a rate limit is retryable; the rest
/// certainly posted nothing.
pub fn post_error(code: &str) -> PostError {
    let reason = format!("slack error {code}");
    match code {
        "internal_error" | "fatal_error" | "service_unavailable" | "request_timeout" => {
            PostError::unknown(reason)
        }
        "ratelimited" | "rate_limited" => PostError::failed(reason, true),
        _ => PostError::failed(reason, false),
    }
}

/// A Slack reaction name for an effect's emoji: `eyes`, `:eyes:` or a common emoji character.
pub fn reaction_name(emoji: &str) -> Option<String> {
    let trimmed = emoji.trim().trim_matches(':');
    if crate::config::is_reaction_name(trimmed) {
        return Some(trimmed.to_owned());
    }
    let name = match trimmed.trim_end_matches('\u{fe0f}') {
        "👀" => "eyes",
        "👍" => "+1",
        "👎" => "-1",
        "✅" => "white_check_mark",
        "❌" => "x",
        "⏳" => "hourglass_flowing_sand",
        "⌛" => "hourglass",
        "🎉" => "tada",
        "❤" => "heart",
        "🔥" => "fire",
        "🙏" => "pray",
        "🤔" => "thinking_face",
        "😀" => "grinning",
        "😂" => "joy",
        "🚀" => "rocket",
        "⚠" => "warning",
        "💯" => "100",
        "👋" => "wave",
        "🐛" => "bug",
        "✔" => "heavy_check_mark",
        _ => return None,
    };
    Some(name.to_owned())
}
