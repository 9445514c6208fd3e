//! Pure mapping between the console and frames: a typed line becomes an inbound message, an
//! outbound message becomes the text printed for it, and live effects become a status line.

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{
    BodyError, Effect, InboundMessage, MessageBody, MessageTarget, Participant,
};

use crate::config::ConsoleConfig;

/// The longest input line taken, newline included. Longer lines are skipped: JSON escaping
/// can grow text up to six times, and the inbound frame must stay under the 256 KiB line limit.
pub const MAX_INPUT_LINE: usize = 32 * 1024;

/// Shown before each message in interactive mode.
pub const MESSAGE_MARKER: &str = "agent › ";
/// The input prompt in interactive mode.
pub const PROMPT: &str = "you › ";
/// The longest preview shown on the status line, in characters.
pub const PREVIEW_CHARS: usize = 120;

/// Moves to the start of the line and erases it (the prompt or a status line).
const CLEAR_LINE: &str = "\r\x1b[2K";
const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// The text of a typed line without its line ending, or `None` when it is blank.
pub fn line_text(line: &str) -> Option<&str> {
    let text = line.strip_suffix('\n').unwrap_or(line);
    let text = text.strip_suffix('\r').unwrap_or(text);
    (!text.trim().is_empty()).then_some(text)
}

/// The event id of the `n`th line: `<prefix>-<n>`, where the prefix names this process start.
pub fn event_id(prefix: &str, n: u64) -> Id {
    Id::new(format!("{prefix}-{n}")).expect("console ids are short and free of NUL")
}

/// `console-<pid>-<start in ms>`: unique per process start, so ids never repeat across runs.
pub fn event_id_prefix(pid: u32, started_ms: u64) -> String {
    format!("console-{pid}-{started_ms}")
}

/// The message id of the `n`th message printed.
pub fn outbound_id(n: u64) -> Id {
    Id::new(format!("console-out-{n}")).expect("console ids are short and free of NUL")
}

/// The inbound message for a line of text.
pub fn inbound_message(
    text: &str,
    id: Id,
    config: &ConsoleConfig,
    timestamp_ms: u64,
) -> Result<InboundMessage, BodyError> {
    Ok(InboundMessage {
        id,
        target: MessageTarget::new(config.channel.clone(), config.conversation.clone()),
        sender: Participant::new(config.sender.clone()),
        body: MessageBody::text(text)?,
        timestamp_ms: Some(timestamp_ms),
        metadata: Default::default(),
    })
}

/// What a message prints without a terminal: its text, then each attachment URL, each on its
/// own line(s). Control characters are neutralised here too: output piped through `tee` or
/// `cat` still ends up on a terminal, where an escape sequence could rewrite the screen, the
/// title or the clipboard.
pub fn render_plain(body: &MessageBody) -> String {
    let mut out = String::new();
    push_line(&mut out, &terminal_safe(body.text_str()));
    for attachment in body.attachments() {
        push_line(&mut out, &terminal_safe(&attachment.url));
    }
    out
}

/// What a message prints on a terminal: the prompt line cleared, the marker, the text with
/// continuation lines indented, attachments, and the prompt again. Control characters are
/// neutralised so a message cannot drive the terminal.
pub fn render_interactive(body: &MessageBody) -> String {
    let indent = " ".repeat(MESSAGE_MARKER.chars().count());
    let mut out = String::from(CLEAR_LINE);
    let mut lines: Vec<String> =
        terminal_safe(body.text_str()).lines().map(str::to_owned).collect();
    for attachment in body.attachments() {
        let url = terminal_safe(&attachment.url);
        match &attachment.name {
            Some(name) => lines.push(format!("[attachment] {} {url}", terminal_safe(name))),
            None => lines.push(format!("[attachment] {url}")),
        }
    }
    for (i, line) in lines.iter().enumerate() {
        out.push_str(if i == 0 { MESSAGE_MARKER } else { &indent });
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(PROMPT);
    out
}

/// The status line an effect shows on a terminal: a dimmed `… typing` or preview, or an empty
/// line when typing stops. `None` for effects the console does not show.
pub fn status_line(effect: &Effect) -> Option<String> {
    match effect {
        Effect::Typing { active: true } => Some(format!("{CLEAR_LINE}{DIM}… typing{RESET}")),
        Effect::Typing { active: false } => Some(CLEAR_LINE.to_owned()),
        Effect::Preview { text } => {
            Some(format!("{CLEAR_LINE}{DIM}{}{RESET}", preview_tail(text, PREVIEW_CHARS)))
        }
        _ => None,
    }
}

/// The end of a preview on one line: a growing draft is most useful where it is being written.
fn preview_tail(text: &str, max_chars: usize) -> String {
    let flat: String =
        terminal_safe(text).chars().map(|c| if c == '\n' || c == '\t' { ' ' } else { c }).collect();
    let flat = flat.trim();
    let count = flat.chars().count();
    if count <= max_chars {
        return flat.to_owned();
    }
    let tail: String = flat.chars().skip(count - (max_chars - 1)).collect();
    format!("…{tail}")
}

/// Replaces control characters (C0 but newline and tab, DEL, C1 — ESC and CSI among them)
/// with U+FFFD, in every output mode.
pub fn terminal_safe(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() && c != '\n' && c != '\t' { '\u{fffd}' } else { c })
        .collect()
}

fn push_line(out: &mut String, text: &str) {
    if text.is_empty() {
        return;
    }
    out.push_str(text);
    if !text.ends_with('\n') {
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_driver_sdk::protocol::ChannelId;
    use channeld_driver_sdk::protocol::types::Attachment;

    fn config() -> ConsoleConfig {
        ConsoleConfig {
            channel: ChannelId::new("console.test").unwrap(),
            sender: Id::new("ada").unwrap(),
            conversation: Id::new("console").unwrap(),
        }
    }

    fn body_with_attachment(text: &str) -> MessageBody {
        let attachment = Attachment {
            url: "https://example.org/a.png".into(),
            name: Some("a.png".into()),
            mime: None,
        };
        MessageBody::with_attachments(text.into(), vec![attachment]).unwrap()
    }

    #[test]
    fn line_endings_are_stripped_and_blank_lines_skipped() {
        assert_eq!(line_text("hello\n"), Some("hello"));
        assert_eq!(line_text("hello\r\n"), Some("hello"));
        assert_eq!(line_text("  indented  "), Some("  indented  "));
        assert_eq!(line_text("\n"), None);
        assert_eq!(line_text(" \t\r\n"), None);
    }

    #[test]
    fn a_line_becomes_an_inbound_for_the_configured_conversation() {
        let id = event_id(&event_id_prefix(42, 1_700_000_000_000), 3);
        assert_eq!(id, "console-42-1700000000000-3");
        let message = inbound_message("hi there", id.clone(), &config(), 1234).unwrap();
        assert_eq!(message.id, id);
        assert_eq!(message.target.channel.as_str(), "console.test");
        assert_eq!(message.target.conversation, "console");
        assert_eq!(message.target.thread, None);
        assert_eq!(message.target.reply_to, None);
        assert_eq!(message.sender, Participant::new(Id::new("ada").unwrap()));
        assert_eq!(message.body.text_str(), "hi there");
        assert_eq!(message.timestamp_ms, Some(1234));
    }

    #[test]
    fn a_line_with_nul_is_refused() {
        assert_eq!(inbound_message("a\0b", event_id("p", 1), &config(), 0), Err(BodyError::Nul));
    }

    #[test]
    fn plain_output_is_exactly_the_text_then_attachment_urls() {
        assert_eq!(render_plain(&MessageBody::text("one\ntwo").unwrap()), "one\ntwo\n");
        assert_eq!(render_plain(&MessageBody::text("ends\n").unwrap()), "ends\n");
        assert_eq!(
            render_plain(&body_with_attachment("look")),
            "look\nhttps://example.org/a.png\n"
        );
        assert_eq!(render_plain(&body_with_attachment("")), "https://example.org/a.png\n");
    }

    #[test]
    fn interactive_output_marks_the_message_and_restores_the_prompt() {
        let printed = render_interactive(&body_with_attachment("one\ntwo"));
        assert_eq!(
            printed,
            "\r\x1b[2Kagent › one\n        two\n        [attachment] a.png https://example.org/a.png\nyou › "
        );
    }

    #[test]
    fn plain_output_cannot_drive_the_terminal_either() {
        // OSC 52 (clipboard), a screen clear, a title change, a CR overwrite, CSI as C1, DEL.
        let hostile = "\x1b]52;c;aGk=\x07\x1b[2J\x1b]0;pwned\x07ok\rfake\u{9b}31m\x7f\tend";
        let body = MessageBody::with_attachments(
            hostile.into(),
            vec![Attachment { url: "https://x/\x1b[2J".into(), name: None, mime: None }],
        )
        .unwrap();
        let printed = render_plain(&body);
        assert!(!printed.chars().any(|c| c.is_control() && c != '\n' && c != '\t'), "{printed:?}");
        assert_eq!(
            printed,
            "\u{fffd}]52;c;aGk=\u{fffd}\u{fffd}[2J\u{fffd}]0;pwned\u{fffd}ok\u{fffd}fake\u{fffd}31m\u{fffd}\tend\nhttps://x/\u{fffd}[2J\n"
        );
    }

    #[test]
    fn interactive_output_cannot_inject_escape_sequences() {
        let printed = render_interactive(&MessageBody::text("\x1b]0;pwned\x07hi").unwrap());
        assert_eq!(printed, "\r\x1b[2Kagent › \u{fffd}]0;pwned\u{fffd}hi\nyou › ");
    }

    #[test]
    fn typing_and_previews_become_a_dimmed_status_line() {
        assert_eq!(
            status_line(&Effect::Typing { active: true }).unwrap(),
            "\r\x1b[2K\x1b[2m… typing\x1b[0m"
        );
        assert_eq!(status_line(&Effect::Typing { active: false }).unwrap(), "\r\x1b[2K");
        let preview = status_line(&Effect::Preview { text: "draft\nso far".into() }).unwrap();
        assert_eq!(preview, "\r\x1b[2K\x1b[2mdraft so far\x1b[0m");
        let pin = Effect::Pin { message_id: Id::new("m").unwrap() };
        assert_eq!(status_line(&pin), None);
    }

    #[test]
    fn long_previews_show_their_end() {
        let text = format!("{}END", "x".repeat(500));
        let tail = preview_tail(&text, 10);
        assert_eq!(tail, "…xxxxxxEND");
        assert_eq!(tail.chars().count(), 10);
    }
}
