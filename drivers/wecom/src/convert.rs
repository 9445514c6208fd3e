//! Pure mapping between WeCom payloads and channeld frames: callbacks to inbound messages
//! (conversation, sender, mention stripping, attachments), reply text to content that fits
//! the platform, and commands to template cards and back.

use channeld_driver_sdk::Inbound;
use channeld_driver_sdk::protocol::types::{Choice, Command, CommandResult, MessageBody};
use serde_json::json;

use crate::wire::{self, Button, MainTitle, Media, MessageCallback, TemplateCard};

/// Inbound metadata: the chat type (`single` or `group`).
pub const META_CHATTYPE: &str = "wecom.chattype";
/// Inbound metadata: the platform's `msgtype`.
pub const META_MSGTYPE: &str = "wecom.msgtype";
/// Inbound metadata: the text of a quoted message.
pub const META_QUOTE: &str = "wecom.quote";

/// Inbound metadata key of attachment `index`'s `field` (`type`: image, file or video;
/// `aeskey`: the base64 AES-256 key that decrypts the download).
pub fn attachment_meta(index: usize, field: &str) -> String {
    format!("wecom.attachment.{index}.{field}")
}

/// Single or group chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChatKind {
    Single,
    Group,
}

impl ChatKind {
    /// `chat_type` of `aibot_send_msg`.
    pub fn chat_type(self) -> u8 {
        match self {
            ChatKind::Single => 1,
            ChatKind::Group => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ChatKind::Single => "single",
            ChatKind::Group => "group",
        }
    }
}

/// Where a callback belongs: a group's `chatid`, else the sender's user id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chat {
    pub conversation: String,
    pub kind: ChatKind,
}

impl Chat {
    pub fn of(chatid: Option<&str>, chattype: Option<&str>, userid: &str) -> Self {
        match chatid.filter(|id| !id.is_empty()) {
            Some(chatid) if chattype != Some("single") => {
                Chat { conversation: chatid.to_owned(), kind: ChatKind::Group }
            }
            _ => Chat { conversation: userid.to_owned(), kind: ChatKind::Single },
        }
    }
}

/// Why a callback does not become an inbound message (it is logged and dropped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("a {0} message with nothing to pass on")]
    Empty(String),
    #[error("msgtype {0:?} is not supported")]
    Unsupported(String),
}

/// An `aibot_msg_callback` as the message to report: event id = `msgid`, sender =
/// `from.userid`, conversation = `chatid` for groups else the sender; in groups the leading
/// `@mention` of the bot is stripped. Voice arrives as its transcript; images, files and
/// videos as attachment references whose AES keys travel in the metadata. Ids are checked
/// when the message is built.
pub fn inbound_message(
    callback: &MessageCallback,
    bot_name: Option<&str>,
) -> Result<Inbound, Skip> {
    let chat =
        Chat::of(callback.chatid.as_deref(), callback.chattype.as_deref(), &callback.from.userid);
    let group = chat.kind == ChatKind::Group;
    let mut media: Vec<(&str, &Media)> = Vec::new();
    let text = match callback.msgtype.as_str() {
        "text" => {
            let content = callback.text.as_ref().map_or("", |text| text.content.as_str());
            if group { strip_leading_mention(content, bot_name) } else { content }.to_owned()
        }
        "voice" => callback.voice.as_ref().map(|voice| voice.content.clone()).unwrap_or_default(),
        "mixed" => {
            let mut parts = Vec::new();
            for item in callback.mixed.iter().flat_map(|mixed| &mixed.msg_item) {
                match (item.msgtype.as_str(), &item.text, &item.image) {
                    ("text", Some(text), _) => {
                        let content = if group && parts.is_empty() {
                            strip_leading_mention(&text.content, bot_name)
                        } else {
                            &text.content
                        };
                        if !content.is_empty() {
                            parts.push(content.to_owned());
                        }
                    }
                    ("image", _, Some(image)) => media.push(("image", image)),
                    _ => {}
                }
            }
            parts.join("\n")
        }
        kind @ ("image" | "file" | "video") => {
            let found = match kind {
                "image" => &callback.image,
                "file" => &callback.file,
                _ => &callback.video,
            };
            media.extend(found.iter().map(|item| (kind, item)));
            String::new()
        }
        other => return Err(Skip::Unsupported(other.to_owned())),
    };
    media.retain(|(_, item)| !item.url.is_empty());
    if text.trim().is_empty() && media.is_empty() {
        return Err(Skip::Empty(callback.msgtype.clone()));
    }
    let mut inbound = Inbound::text(chat.conversation, callback.from.userid.clone(), text)
        .id(callback.msgid.clone())
        .metadata(META_CHATTYPE, chat.kind.as_str())
        .metadata(META_MSGTYPE, callback.msgtype.clone());
    if let Some(seconds) = callback.create_time {
        inbound = inbound.timestamp_ms(seconds.saturating_mul(1000));
    }
    for (index, (kind, item)) in media.into_iter().enumerate() {
        inbound = inbound
            .attachment(item.url.clone(), None, None)
            .metadata(attachment_meta(index, "type"), kind);
        if let Some(key) = &item.aeskey {
            inbound = inbound.metadata(attachment_meta(index, "aeskey"), key.clone());
        }
    }
    if let Some(quote) = callback.quote.as_ref().and_then(quote_text) {
        inbound = inbound.metadata(META_QUOTE, quote);
    }
    Ok(inbound)
}

fn quote_text(quote: &wire::Quote) -> Option<String> {
    let text = match quote.msgtype.as_str() {
        "text" => quote.text.as_ref()?.content.clone(),
        "voice" => quote.voice.as_ref()?.content.clone(),
        "mixed" => quote
            .mixed
            .as_ref()?
            .msg_item
            .iter()
            .filter_map(|item| item.text.as_ref().map(|text| text.content.as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => return None,
    };
    (!text.is_empty()).then_some(text)
}

/// Drops the `@mention` a group message starts with, and the space after it. With the bot's
/// name the mention is matched exactly (names may contain spaces); without it the mention
/// ends at the first whitespace (WeCom puts U+2005, a four-per-em space, after a mention).
pub fn strip_leading_mention<'a>(text: &'a str, bot_name: Option<&str>) -> &'a str {
    let Some(rest) = text.trim_start().strip_prefix('@') else { return text };
    let after = match bot_name.and_then(|name| rest.strip_prefix(name)) {
        Some(after) if after.is_empty() || after.starts_with(char::is_whitespace) => after,
        _ => {
            let end = rest.find(['\u{2005}', ' ', '\t', '\n', '\u{3000}']).unwrap_or(rest.len());
            &rest[end..]
        }
    };
    after.trim_start()
}

/// The text a reply shows: the body's text, then each attachment as a Markdown link on its
/// own line (the platform takes no URL attachments).
pub fn reply_text(body: &MessageBody) -> String {
    let mut text = body.text_str().to_owned();
    for attachment in body.attachments() {
        if !text.is_empty() {
            text.push('\n');
        }
        let label = attachment.name.as_deref().unwrap_or(attachment.url.as_str());
        text.push_str(&format!("[{label}]({})", attachment.url));
    }
    text
}

/// Splits `text` into parts of at most `max` UTF-8 bytes that concatenate back to `text`,
/// cutting after a newline in the second half of a part when there is one, else at a
/// character boundary. Empty text is one empty part.
pub fn split_content(text: &str, max: usize) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut rest = text;
    while rest.len() > max {
        let mut cut = floor_char_boundary(rest, max);
        if let Some(newline) = rest[..cut].rfind('\n')
            && newline + 1 > cut / 2
        {
            cut = newline + 1;
        }
        if cut == 0 {
            // `max` is smaller than one character: take the character whole.
            cut = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        parts.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    parts.push(rest);
    parts
}

/// The longest prefix of `text` within `max` bytes, cut at a character boundary.
pub fn truncate_content(text: &str, max: usize) -> &str {
    &text[..floor_char_boundary(text, max)]
}

fn floor_char_boundary(text: &str, max: usize) -> usize {
    if max >= text.len() {
        return text.len();
    }
    (0..=max).rev().find(|&at| text.is_char_boundary(at)).unwrap_or(0)
}

/// Button key of an approval's yes.
pub const KEY_APPROVE: &str = "approve";
/// Button key of an approval's no.
pub const KEY_REJECT: &str = "reject";
/// Longest button label the driver sends (the platform suggests ten characters).
const MAX_LABEL_CHARS: usize = 24;
/// Longest card title and description.
const MAX_TITLE_CHARS: usize = 120;
/// Longest rendering of an approval's arguments on the card.
const MAX_ARGUMENTS_CHARS: usize = 400;

/// What a card asks, to read its clicks back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CardKind {
    Approval,
    /// One button per choice, keyed `choice_<index>`.
    Choice(Vec<Choice>),
}

/// Why a command cannot be shown as a card.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unpresentable(pub String);

/// A command as a `button_interaction` card with `task_id`: an approval gets Approve and
/// Reject; a single choice one button per option (at most six).
pub fn command_card(
    command: &Command,
    task_id: &str,
) -> Result<(TemplateCard, CardKind), Unpresentable> {
    let card = |title: String, desc: Option<String>, buttons: Vec<Button>| TemplateCard {
        card_type: "button_interaction".into(),
        main_title: Some(MainTitle { title: Some(title), desc }),
        sub_title_text: None,
        button_list: buttons,
        task_id: task_id.to_owned(),
    };
    match command {
        Command::RequestApproval { tool, arguments } => {
            let mut card = card(
                chars(&format!("Approve {tool}?"), MAX_TITLE_CHARS),
                None,
                vec![
                    Button { text: "Approve".into(), style: 1, key: KEY_APPROVE.into() },
                    Button { text: "Reject".into(), style: 2, key: KEY_REJECT.into() },
                ],
            );
            if !arguments.is_null() {
                card.sub_title_text = Some(chars(&arguments.to_string(), MAX_ARGUMENTS_CHARS));
            }
            Ok((card, CardKind::Approval))
        }
        Command::RequestChoice { multiple: true, .. } => {
            Err(Unpresentable("multiple-choice questions are not supported".into()))
        }
        Command::RequestChoice { question, choices, .. } => {
            if choices.is_empty() || choices.len() > wire::MAX_CARD_BUTTONS {
                return Err(Unpresentable(format!(
                    "a choice needs 1 to {} options, not {}",
                    wire::MAX_CARD_BUTTONS,
                    choices.len()
                )));
            }
            let buttons = choices
                .iter()
                .enumerate()
                .map(|(index, choice)| Button {
                    text: chars(&choice.label, MAX_LABEL_CHARS),
                    style: 1,
                    key: format!("choice_{index}"),
                })
                .collect();
            Ok((
                card(chars(question, MAX_TITLE_CHARS), None, buttons),
                CardKind::Choice(choices.clone()),
            ))
        }
        other => Err(Unpresentable(format!("{} cannot be shown as a card", other.kind()))),
    }
}

/// The answer a click on button `event_key` gives, or `None` for a key the card never had.
/// A choice answers `{"choice": <id>, "label": <label>}`.
pub fn card_answer(kind: &CardKind, event_key: &str, responder: &str) -> Option<CommandResult> {
    match kind {
        CardKind::Approval => match event_key {
            KEY_APPROVE => Some(CommandResult::Accepted),
            KEY_REJECT => Some(CommandResult::rejected(format!("rejected by {responder}"))),
            _ => None,
        },
        CardKind::Choice(choices) => {
            let index: usize = event_key.strip_prefix("choice_")?.parse().ok()?;
            let choice = choices.get(index)?;
            Some(CommandResult::Value {
                payload: json!({"choice": choice.id.as_str(), "label": choice.label}),
            })
        }
    }
}

/// The card after it was answered: same type and `task_id`, the outcome as its description,
/// no buttons left to click.
pub fn answered_card(card: &TemplateCard, outcome: &str) -> TemplateCard {
    let title = card.main_title.as_ref().and_then(|title| title.title.clone());
    TemplateCard {
        main_title: Some(MainTitle { title, desc: Some(chars(outcome, MAX_TITLE_CHARS)) }),
        button_list: Vec::new(),
        ..card.clone()
    }
}

/// What a card's description says once `result` came from `responder`.
pub fn outcome_text(kind: &CardKind, result: &CommandResult, responder: &str) -> String {
    match (kind, result) {
        (_, CommandResult::Accepted) => format!("Approved by {responder}"),
        (_, CommandResult::Rejected { .. }) => format!("Rejected by {responder}"),
        (CardKind::Choice(_), CommandResult::Value { payload }) => {
            let label = payload["label"].as_str().unwrap_or_default();
            format!("{responder} chose {label}")
        }
        (CardKind::Approval, CommandResult::Value { .. }) => format!("Answered by {responder}"),
    }
}

/// A `task_id` the platform accepts (digits, ASCII letters and `_-@`, at most 128 bytes):
/// `prefix` (already in that alphabet) and a sequence number.
pub fn task_id(prefix: &str, sequence: u64) -> String {
    let id = format!("{prefix}_{sequence}");
    debug_assert!(
        id.len() <= wire::MAX_TASK_ID_BYTES
            && id.chars().all(|c| c.is_ascii_alphanumeric() || "_-@".contains(c))
    );
    id
}

/// At most `max` characters, with `…` when cut.
fn chars(text: &str, max: usize) -> String {
    match text.char_indices().nth(max.saturating_sub(1)) {
        Some((at, _)) if text[at..].chars().count() > 1 => format!("{}…", &text[..at]),
        _ => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mentions_are_stripped_by_name_or_by_shape() {
        assert_eq!(strip_leading_mention("@Bot hello", None), "hello");
        assert_eq!(strip_leading_mention("@Bot\u{2005}hello there", None), "hello there");
        assert_eq!(strip_leading_mention("@Ops Bot\u{2005}status", Some("Ops Bot")), "status");
        assert_eq!(strip_leading_mention("@Ops Bot status", Some("Ops Bot")), "status");
        // Another name: the shape rule still drops one leading mention.
        assert_eq!(strip_leading_mention("@Other hi", Some("Ops Bot")), "hi");
        assert_eq!(strip_leading_mention("no mention @Bot", None), "no mention @Bot");
        assert_eq!(strip_leading_mention("@Bot", None), "");
    }

    #[test]
    fn split_parts_fit_and_concatenate_back() {
        let text = format!("{}\n{}", "a".repeat(30), "é".repeat(40));
        let parts = split_content(&text, 32);
        assert!(parts.iter().all(|part| part.len() <= 32), "{parts:?}");
        assert_eq!(parts.concat(), text);
        assert_eq!(parts[0], format!("{}\n", "a".repeat(30)), "cut after the newline");
        assert_eq!(split_content("short", 32), ["short"]);
        assert_eq!(split_content("", 32), [""]);
        // A cut never falls inside a character.
        let parts = split_content("ééé", 3);
        assert_eq!(parts, ["é", "é", "é"]);
        assert_eq!(truncate_content("éé", 3), "é");
    }

    #[test]
    fn task_ids_stay_in_the_platform_alphabet() {
        assert_eq!(task_id("cd-1a2b", 7), "cd-1a2b_7");
    }

    #[test]
    fn long_labels_are_cut_with_an_ellipsis() {
        assert_eq!(chars("abcdef", 4), "abc…");
        assert_eq!(chars("abcd", 4), "abcd");
    }
}
