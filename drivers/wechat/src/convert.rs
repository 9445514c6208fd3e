//! Pure mapping between iLink messages and channeld frames.
//!
//! Inbound: only finished messages a person wrote (`message_type` 1, `message_state` not 1)
//! become `inbound` frames. The conversation is the sender's user id (bots are one-to-one).
//! Text items, voice transcripts and a quoted message (as `> ` lines before the text) make the
//! text; images, voice notes, files and videos become attachment references to the CDN (the
//! content there is AES-128-ECB encrypted: the key travels in metadata). The event id comes
//! from `message_id`, else `client_id`, else `seq` ([`MessageKey`]): the same message replayed
//! by the server gets the same id.
//!
//! Outbound: Markdown is simplified to what WeChat renders ([`simplify_markdown`]),
//! attachments become links, and long text is split into chunks ([`chunks`]).

use channeld_driver_sdk::protocol::types::{
    Attachment, InboundMessage, MessageBody, MessageTarget, Metadata, OutboundMessage, Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use sha2::{Digest, Sha256};

use crate::config::Markdown;
use crate::ilink::{
    CdnMedia, MESSAGE_STATE_GENERATING, MESSAGE_TYPE_USER, MessageItem, WeixinMessage, item_type,
};

/// Inbound metadata: the platform's message id.
pub const META_MESSAGE_ID: &str = "wechat.message_id";
pub const META_SEQ: &str = "wechat.seq";
pub const META_CLIENT_ID: &str = "wechat.client_id";
pub const META_SESSION_ID: &str = "wechat.session_id";
/// Set when the platform says the message came from a group.
pub const META_GROUP_ID: &str = "wechat.group_id";
/// The quoted message's text, when the message quotes one.
pub const META_QUOTED: &str = "wechat.quoted";

/// Longest client id kept verbatim in an event id; longer ones are digested.
const MAX_VERBATIM_CLIENT_ID: usize = 128;

/// What identifies a message across replays, in the order the platform's ids are trusted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MessageKey {
    Id(u64),
    Client(String),
    Seq(u64),
}

impl MessageKey {
    /// `message_id`, else `client_id`, else `seq`.
    pub fn of(message: &WeixinMessage) -> Option<Self> {
        if let Some(id) = message.message_id {
            return Some(Self::Id(id));
        }
        if let Some(client) = message.client_id.as_deref().filter(|c| !c.is_empty()) {
            return Some(Self::Client(client.to_owned()));
        }
        message.seq.map(Self::Seq)
    }

    /// The event id (and inbound message id): `wx-<message_id>`, `wx-c-<client_id>` (a
    /// SHA-256 digest when long or unusual), `wx-s-<seq>`.
    pub fn event_id(&self) -> String {
        match self {
            Self::Id(id) => format!("wx-{id}"),
            Self::Client(client)
                if client.len() <= MAX_VERBATIM_CLIENT_ID
                    && client.chars().all(|c| c.is_ascii_graphic()) =>
            {
                format!("wx-c-{client}")
            }
            Self::Client(client) => {
                let digest = Sha256::digest(client.as_bytes());
                let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
                format!("wx-c-sha256-{hex}")
            }
            Self::Seq(seq) => format!("wx-s-{seq}"),
        }
    }
}

/// Why a platform message does not become an inbound frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("not written by a person (message_type {0:?})")]
    NotFromUser(Option<i64>),
    #[error("still being generated")]
    Generating,
    #[error("no usable sender id")]
    NoSender,
    #[error("no message_id, client_id or seq to recognise replays by")]
    NoId,
    #[error("nothing the driver can pass on (no text, transcript or media)")]
    Empty,
}

/// A platform message as the driver hands it to the hub, with what the driver keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Converted {
    pub key: MessageKey,
    /// The sender's user id: the conversation.
    pub user: String,
    /// The context token replies to this user must carry.
    pub context_token: Option<String>,
    pub create_time_ms: Option<u64>,
    pub message: InboundMessage,
}

/// Maps a `getupdates` message; `Err` says why it is dropped.
pub fn inbound(
    channel: &ChannelId,
    message: &WeixinMessage,
    cdn_base_url: &str,
) -> Result<Converted, Skip> {
    if message.message_type != Some(MESSAGE_TYPE_USER) {
        return Err(Skip::NotFromUser(message.message_type));
    }
    if message.message_state == Some(MESSAGE_STATE_GENERATING) {
        return Err(Skip::Generating);
    }
    let user = message.from_user_id.clone().unwrap_or_default();
    let sender = Id::new(&user).map_err(|_| Skip::NoSender)?;
    let key = MessageKey::of(message).ok_or(Skip::NoId)?;
    let id = Id::new(key.event_id()).map_err(|_| Skip::NoId)?;

    let mut lines: Vec<String> = Vec::new();
    let mut attachments: Vec<Attachment> = Vec::new();
    let mut metadata = Metadata::new();
    for item in &message.item_list {
        if let Some(quoted) = item.ref_msg.as_deref() {
            let quote = quote_text(quoted.title.as_deref(), quoted.message_item.as_ref());
            if !quote.is_empty() {
                lines.extend(quote.lines().map(|line| format!("> {line}")));
                metadata.insert(META_QUOTED.to_owned(), quote);
            }
        }
        if let Some(text) = item_text(item) {
            lines.push(text);
        }
        if let Some((attachment, key_material)) = item_attachment(item, cdn_base_url) {
            let index = attachments.len();
            for (name, value) in key_material {
                metadata.insert(format!("wechat.attachment.{index}.{name}"), value);
            }
            attachments.push(attachment);
        }
    }
    let text = lines.join("\n");
    // NUL is the one character a frame cannot carry; the text is otherwise kept as sent.
    let body = MessageBody::with_attachments(text.replace('\0', ""), attachments)
        .map_err(|_| Skip::Empty)?;

    if let Some(id) = message.message_id {
        metadata.insert(META_MESSAGE_ID.to_owned(), id.to_string());
    }
    if let Some(seq) = message.seq {
        metadata.insert(META_SEQ.to_owned(), seq.to_string());
    }
    for (key, value) in [
        (META_CLIENT_ID, &message.client_id),
        (META_SESSION_ID, &message.session_id),
        (META_GROUP_ID, &message.group_id),
    ] {
        if let Some(value) = value.as_deref().filter(|v| !v.is_empty()) {
            metadata.insert(key.to_owned(), value.to_owned());
        }
    }
    let target = MessageTarget::new(channel.clone(), sender.clone());
    Ok(Converted {
        key,
        user,
        context_token: message.context_token.clone().filter(|t| !t.is_empty()),
        create_time_ms: message.create_time_ms,
        message: InboundMessage {
            id,
            target,
            sender: Participant::new(sender),
            body,
            timestamp_ms: message.create_time_ms,
            metadata,
        },
    })
}

/// The text an item contributes: a text item's text or a voice note's transcript.
fn item_text(item: &MessageItem) -> Option<String> {
    let text = match item.kind {
        Some(item_type::TEXT) => item.text_item.as_ref()?.text.clone(),
        Some(item_type::VOICE) => item.voice_item.as_ref()?.text.clone(),
        _ => None,
    }?;
    (!text.is_empty()).then_some(text)
}

/// A quoted message as plain text: the server's summary, then the quoted item's text (or a
/// placeholder for media) when it adds something.
fn quote_text(title: Option<&str>, item: Option<&MessageItem>) -> String {
    let quoted = item.and_then(|item| {
        item_text(item).or_else(|| {
            let kind = match item.kind {
                Some(item_type::IMAGE) => "[image]".to_owned(),
                Some(item_type::VOICE) => "[voice]".to_owned(),
                Some(item_type::VIDEO) => "[video]".to_owned(),
                Some(item_type::FILE) => {
                    let name = item.file_item.as_ref().and_then(|f| f.file_name.clone());
                    format!("[file {}]", name.unwrap_or_default()).replace(" ]", "]")
                }
                _ => return None,
            };
            Some(kind)
        })
    });
    match (title.filter(|t| !t.is_empty()), quoted) {
        (Some(title), Some(quoted)) if quoted.contains(title) => quoted,
        (Some(title), Some(quoted)) if title.contains(&quoted) => title.to_owned(),
        (Some(title), Some(quoted)) => format!("{title}\n{quoted}"),
        (Some(title), None) => title.to_owned(),
        (None, Some(quoted)) => quoted,
        (None, None) => String::new(),
    }
}

/// A media item as an attachment reference, with the metadata needed to decrypt it.
fn item_attachment(
    item: &MessageItem,
    cdn_base_url: &str,
) -> Option<(Attachment, Vec<(&'static str, String)>)> {
    let (kind, media, name, mime, hex_key) = match item.kind {
        Some(item_type::IMAGE) => {
            let image = item.image_item.as_ref()?;
            ("image", image.media.as_ref()?, None, Some("image/*".to_owned()), image.aeskey.clone())
        }
        Some(item_type::VIDEO) => {
            let video = item.video_item.as_ref()?;
            ("video", video.media.as_ref()?, None, Some("video/*".to_owned()), None)
        }
        Some(item_type::FILE) => {
            let file = item.file_item.as_ref()?;
            ("file", file.media.as_ref()?, file.file_name.clone(), None, None)
        }
        Some(item_type::VOICE) => {
            let voice = item.voice_item.as_ref()?;
            let mime = match voice.encode_type {
                Some(5) => "audio/amr",
                Some(6) => "audio/silk",
                Some(7) => "audio/mpeg",
                Some(8) => "audio/ogg",
                _ => "audio/*",
            };
            ("voice", voice.media.as_ref()?, None, Some(mime.to_owned()), None)
        }
        _ => return None,
    };
    let url = media_url(media, cdn_base_url)?;
    let mut material = vec![("kind", kind.to_owned()), ("encryption", "aes-128-ecb".to_owned())];
    if let Some(key) = media.aes_key.clone().filter(|k| !k.is_empty()) {
        material.push(("aes_key", key));
    }
    if let Some(hex) = hex_key.filter(|k| !k.is_empty()) {
        material.push(("aes_key_hex", hex));
    }
    if let Some(encrypt_type) = media.encrypt_type {
        material.push(("encrypt_type", encrypt_type.to_string()));
    }
    Some((Attachment { url, name: name.filter(|n| !n.is_empty()), mime }, material))
}

/// `full_url` when the server gave one, else the CDN download URL for `encrypt_query_param`.
pub fn media_url(media: &CdnMedia, cdn_base_url: &str) -> Option<String> {
    if let Some(url) = media.full_url.as_deref().filter(|u| !u.is_empty()) {
        return Some(url.to_owned());
    }
    let param = media.encrypt_query_param.as_deref().filter(|p| !p.is_empty())?;
    Some(format!("{cdn_base_url}/download?encrypted_query_param={}", percent_encode(param)))
}

/// Percent-encodes everything but RFC 3986 unreserved characters (a query value).
fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len() * 3);
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Why an outbound message cannot be posted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboundError {
    #[error("the message has no text to send")]
    Empty,
}

/// The text to post: Markdown handled per `markdown`, attachments appended as links.
pub fn outbound_text(
    message: &OutboundMessage,
    markdown: Markdown,
) -> Result<String, OutboundError> {
    let body = message.body.text_str();
    let mut text = match markdown {
        Markdown::Simplify => simplify_markdown(body),
        Markdown::Keep => body.to_owned(),
    };
    for attachment in message.body.attachments() {
        if !text.is_empty() {
            text.push('\n');
        }
        match &attachment.name {
            Some(name) => text.push_str(&format!("{name}: {}", attachment.url)),
            None => text.push_str(&attachment.url),
        }
    }
    let text = text.trim_end().to_owned();
    if text.trim().is_empty() { Err(OutboundError::Empty) } else { Ok(text) }
}

/// Room kept in each chunk for closing and reopening a code fence cut in two.
const FENCE_RESERVE: usize = 8;

/// Splits `text` into pieces of at most `max_chars` characters, in order, preferring to cut
/// at a blank line, then a line end, then a space, in the second half of each piece. A code
/// fence cut in two is closed at the end of one piece and reopened at the start of the next.
pub fn chunks(text: &str, max_chars: usize) -> Vec<String> {
    let budget = max_chars.saturating_sub(FENCE_RESERVE).max(1);
    let mut out = Vec::new();
    let mut rest = text;
    let mut reopen = false;
    while !rest.is_empty() {
        let prefix = if reopen { "```\n" } else { "" };
        let room = budget.saturating_sub(prefix.len()).max(1);
        let (piece, next) = if rest.chars().count() <= room { (rest, "") } else { cut(rest, room) };
        let mut chunk = format!("{prefix}{piece}");
        reopen = fence_open_at_end(&chunk);
        if reopen && !next.is_empty() {
            chunk.push_str("\n```");
        }
        if !piece.trim().is_empty() {
            out.push(chunk);
        }
        rest = next;
    }
    out
}

/// Cuts `text` (longer than `room` characters) into a piece of at most `room` characters
/// and the rest, dropping the one separator cut at.
fn cut(text: &str, room: usize) -> (&str, &str) {
    let limit = text.char_indices().nth(room).map_or(text.len(), |(i, _)| i);
    let half = text.char_indices().nth(room / 2).map_or(0, |(i, _)| i);
    let window = &text[..limit];
    for separator in ["\n\n", "\n", " "] {
        if let Some(at) = window.rfind(separator).filter(|&at| at >= half && at > 0) {
            return (&text[..at], &text[at + separator.len()..]);
        }
    }
    (window, &text[limit..])
}

/// Whether a code fence opened in `chunk` is still open at its end.
fn fence_open_at_end(chunk: &str) -> bool {
    chunk.lines().filter(|line| line.trim_start().starts_with("```")).count() % 2 == 1
}

/// Rewrites the Markdown WeChat shows as raw characters, outside code: images become their
/// alt text and URL, `#####`/`######` heading markers go, and emphasis markers around CJK
/// text (which WeChat does not render as emphasis) are removed.
pub fn simplify_markdown(text: &str) -> String {
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in text.split('\n') {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            out.push(line.to_owned());
            continue;
        }
        if in_fence {
            out.push(line.to_owned());
            continue;
        }
        let line = strip_small_heading(line);
        let line = rewrite_images(line);
        out.push(strip_cjk_emphasis(&line));
    }
    out.join("\n")
}

fn strip_small_heading(line: &str) -> &str {
    for marker in ["###### ", "##### "] {
        if let Some(rest) = line.strip_prefix(marker) {
            return rest;
        }
    }
    line
}

/// `![alt](url)` → `alt (url)`, or `url` without alt text; inline code is left alone.
fn rewrite_images(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = next_outside_code(rest, "![") {
        let after = &rest[start + 2..];
        let parsed = after.find("](").and_then(|close| {
            let url_start = close + 2;
            after[url_start..].find(')').map(|end| (close, url_start, url_start + end))
        });
        let Some((close, url_start, url_end)) = parsed else { break };
        out.push_str(&rest[..start]);
        let (alt, url) = (&after[..close], &after[url_start..url_end]);
        if alt.trim().is_empty() {
            out.push_str(url);
        } else {
            out.push_str(&format!("{alt} ({url})"));
        }
        rest = &after[url_end + 1..];
    }
    out.push_str(rest);
    out
}

/// The byte index of `needle` in `line` outside inline code spans.
fn next_outside_code(line: &str, needle: &str) -> Option<usize> {
    let mut in_code = false;
    for (i, c) in line.char_indices() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code && line[i..].starts_with(needle) {
            return Some(i);
        }
    }
    None
}

/// Removes `***x***`, `___x___`, `*x*` and `_x_` markers when `x` contains CJK text. Bold
/// (`**x**`) renders and stays; `_` inside words (snake_case) is not a marker.
fn strip_cjk_emphasis(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    let mut in_code = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '`' {
            in_code = !in_code;
        }
        if !in_code && (c == '*' || c == '_') {
            let run = chars[i..].iter().take_while(|&&x| x == c).count();
            // `_` only marks emphasis at word boundaries; `*` also inside words.
            let word = |at: Option<&char>| c == '_' && at.is_some_and(|x| x.is_alphanumeric());
            let opens = (run == 1 || run == 3)
                && !word(i.checked_sub(1).and_then(|before| chars.get(before)));
            if opens && let Some(end) = closing_run(&chars, i + run, c, run) {
                let inner: String = chars[i + run..end].iter().collect();
                if !word(chars.get(end + run))
                    && !inner.starts_with(' ')
                    && inner.chars().any(is_cjk)
                {
                    out.push_str(&inner);
                    i = end + run;
                    continue;
                }
            }
            out.extend(&chars[i..i + run]);
            i += run;
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// Where a run of exactly `run` `marker`s closes an emphasis opened before `from`.
fn closing_run(chars: &[char], from: usize, marker: char, run: usize) -> Option<usize> {
    let mut j = from;
    while j < chars.len() {
        if chars[j] == marker {
            let len = chars[j..].iter().take_while(|&&x| x == marker).count();
            if len == run && j > from {
                return Some(j);
            }
            j += len;
        } else {
            j += 1;
        }
    }
    None
}

fn is_cjk(c: char) -> bool {
    matches!(c as u32, 0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF)
}

#[cfg(test)]
mod tests;
