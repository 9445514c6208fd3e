//! Agent Markdown to Slack mrkdwn, and long text split into messages.
//!
//! Conversion: `**bold**`/`__bold__` → `*bold*`, `*italic*`/`_italic_` → `_italic_`,
//! `~~strike~~` → `~strike~`, `[text](url)` → `<url|text>`, headings → bold lines, `-`/`*`/`+`
//! bullets → `•`, fenced code blocks keep their content (the language tag goes: Slack has no
//! highlighting), inline code keeps its content. `&`, `<` and `>` are escaped everywhere, as
//! Slack requires, except in the link and quote syntax this module writes itself.
//!
//! Splitting: at line boundaries where possible, never inside an escape; a code block cut in
//! two is closed at the end of one message and reopened at the start of the next, so each
//! message renders on its own.

/// The fence Slack renders as a code block.
const FENCE: &str = "```";

/// Converts Markdown to mrkdwn.
pub fn to_mrkdwn(markdown: &str) -> String {
    let mut out = Vec::new();
    let mut in_code = false;
    for line in markdown.split('\n') {
        let trimmed = line.trim_start();
        if let Some(after_fence) = trimmed.strip_prefix(FENCE) {
            if in_code {
                // A closing fence ends the block even with trailing text after it.
                out.push(FENCE.to_owned());
                in_code = false;
            } else {
                // The language tag is dropped; code on the opening line is kept.
                let rest = after_fence.trim();
                let rest_is_code = rest.contains(' ') || rest.ends_with(FENCE);
                out.push(FENCE.to_owned());
                if let Some(inline) = rest.strip_suffix(FENCE) {
                    if let Some(last) = out.last_mut() {
                        last.push_str(&escape(inline));
                        last.push_str(FENCE);
                    }
                    continue;
                }
                if rest_is_code {
                    out.push(escape(rest));
                }
                in_code = true;
            }
            continue;
        }
        if in_code {
            out.push(escape(line));
        } else {
            out.push(convert_line(line));
        }
    }
    if in_code {
        out.push(FENCE.to_owned());
    }
    out.join("\n")
}

fn convert_line(line: &str) -> String {
    let indent_len = line.len() - line.trim_start().len();
    let (indent, body) = line.split_at(indent_len);
    // Headings: `# Title` → `*Title*`.
    let hashes = body.chars().take_while(|&c| c == '#').count();
    if (1..=6).contains(&hashes) && body[hashes..].starts_with(' ') {
        let title = body[hashes..].trim().trim_end_matches('#').trim_end();
        return format!("{indent}*{}*", inline(&strip_emphasis_markers(title)));
    }
    // Quotes keep Slack's `>` marker (escaping it would show a literal `&gt;`).
    if let Some(quoted) = body.strip_prefix('>') {
        return format!("{indent}>{}", convert_line(quoted));
    }
    for bullet in ["- ", "* ", "+ "] {
        if let Some(item) = body.strip_prefix(bullet) {
            // A task list item keeps its box.
            let item = item
                .strip_prefix("[ ] ")
                .map(|rest| format!("☐ {rest}"))
                .or_else(|| item.strip_prefix("[x] ").map(|rest| format!("☑ {rest}")))
                .unwrap_or_else(|| item.to_owned());
            return format!("{indent}• {}", inline(&item));
        }
    }
    if body.chars().all(|c| c == '-' || c == '*' || c == '_') && body.len() >= 3 {
        return format!("{indent}──────────");
    }
    format!("{indent}{}", inline(body))
}

/// Bold in a heading would nest inside the heading's own bold.
fn strip_emphasis_markers(text: &str) -> String {
    text.replace("**", "").replace("__", "")
}

/// Escapes the three characters Slack treats as markup.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Inline Markdown to mrkdwn.
fn inline(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '`' => {
                let ticks = run_len(&chars, i, '`');
                if let Some(end) = find_run(&chars, i + ticks, '`', ticks) {
                    let code: String = chars[i + ticks..end].iter().collect();
                    out.push('`');
                    out.push_str(&escape(code.trim()));
                    out.push('`');
                    i = end + ticks;
                    continue;
                }
                out.push_str(&"`".repeat(ticks));
                i += ticks;
            }
            '[' => match link(&chars, i) {
                Some((label, url, next)) => {
                    let url = url.replace('>', "%3E").replace('|', "%7C");
                    out.push_str(&format!("<{}|{}>", url, inline(&label).replace('|', "¦")));
                    i = next;
                }
                None => {
                    out.push('[');
                    i += 1;
                }
            },
            '<' => match autolink(&chars, i) {
                Some((url, next)) => {
                    out.push_str(&format!("<{url}>"));
                    i = next;
                }
                None => {
                    out.push_str("&lt;");
                    i += 1;
                }
            },
            '*' | '_' | '~' => {
                let run = run_len(&chars, i, c);
                match emphasis(&chars, i, c, run) {
                    Some((inner, next, marker)) => {
                        out.push(marker);
                        out.push_str(&inline(&inner));
                        out.push(marker);
                        i = next;
                    }
                    None => {
                        for _ in 0..run {
                            out.push(c);
                        }
                        i += run;
                    }
                }
            }
            '&' => {
                out.push_str("&amp;");
                i += 1;
            }
            '>' => {
                out.push_str("&gt;");
                i += 1;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

fn run_len(chars: &[char], from: usize, c: char) -> usize {
    chars[from..].iter().take_while(|&&x| x == c).count()
}

/// The index of the next run of exactly `len` `c`s at or after `from`.
fn find_run(chars: &[char], from: usize, c: char, len: usize) -> Option<usize> {
    let mut i = from;
    while i < chars.len() {
        if chars[i] == c {
            let run = run_len(chars, i, c);
            if run == len {
                return Some(i);
            }
            i += run;
        } else {
            i += 1;
        }
    }
    None
}

/// `[label](url)` at `from`: label, url and the index after it.
fn link(chars: &[char], from: usize) -> Option<(String, String, usize)> {
    let close = (from + 1..chars.len()).find(|&i| chars[i] == ']')?;
    if chars.get(close + 1) != Some(&'(') {
        return None;
    }
    let end = (close + 2..chars.len()).find(|&i| chars[i] == ')')?;
    let label: String = chars[from + 1..close].iter().collect();
    let url: String = chars[close + 2..end].iter().collect();
    let url = url.trim();
    let ok = ["http://", "https://", "mailto:"].iter().any(|p| url.starts_with(p));
    if !ok || url.contains(char::is_whitespace) {
        return None;
    }
    Some((label, url.to_owned(), end + 1))
}

/// `<https://…>` at `from`: the url and the index after it.
fn autolink(chars: &[char], from: usize) -> Option<(String, usize)> {
    let end = (from + 1..chars.len()).find(|&i| chars[i] == '>')?;
    let url: String = chars[from + 1..end].iter().collect();
    let ok = ["http://", "https://", "mailto:"].iter().any(|p| url.starts_with(p));
    (ok && !url.contains(char::is_whitespace) && !url.contains('|')).then_some((url, end + 1))
}

/// Emphasis opening at `from` with a run of `run` markers: the inner text, the index after
/// the closing run and the mrkdwn marker.
fn emphasis(chars: &[char], from: usize, c: char, run: usize) -> Option<(String, usize, char)> {
    let marker = match (c, run) {
        ('*' | '_', 2) => '*',
        ('*' | '_', 1) => '_',
        ('~', 2) => '~',
        _ => return None,
    };
    let open_end = from + run;
    // An opening marker is followed by a non-space; single markers only open at a word
    // start and close at a word end, so snake_case and 2*3*4 stay as written.
    let next = *chars.get(open_end)?;
    if next.is_whitespace() {
        return None;
    }
    let single = run == 1 || c == '_';
    if single && from > 0 && chars[from - 1].is_alphanumeric() {
        return None;
    }
    let close = find_run(chars, open_end, c, run)?;
    if chars[close - 1].is_whitespace() {
        return None;
    }
    if single && chars.get(close + run).is_some_and(|ch| ch.is_alphanumeric()) {
        return None;
    }
    let inner: String = chars[open_end..close].iter().collect();
    Some((inner, close + run, marker))
}

/// Splits mrkdwn into messages of at most `limit` characters.
pub fn split(text: &str, limit: usize) -> Vec<String> {
    // Room for a closing fence and its newline, so a cut code block still fits.
    let limit = limit.max(FENCE.len() * 2 + 4);
    if text.chars().count() <= limit {
        return vec![text.to_owned()];
    }
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut current_len = 0;
    let mut in_code = false;
    let reserve = FENCE.len() + 1;
    for line in text.split('\n') {
        let is_fence = line.trim_start().starts_with(FENCE)
            && !line.trim_start()[FENCE.len()..].contains(FENCE);
        let mut rest = line;
        loop {
            let budget = limit - if in_code || is_fence { reserve } else { 0 };
            let sep = usize::from(!current.is_empty());
            let rest_len = rest.chars().count();
            if current_len + sep + rest_len <= budget {
                if sep == 1 {
                    current.push('\n');
                }
                current.push_str(rest);
                current_len += sep + rest_len;
                break;
            }
            if !current.is_empty() {
                flush(&mut chunks, &mut current, &mut current_len, in_code);
                continue;
            }
            // A single line longer than a message: cut it at a space where possible.
            let cut = cut_point(rest, budget);
            current.push_str(&rest[..cut]);
            current_len += rest[..cut].chars().count();
            rest = rest[cut..].trim_start_matches(' ');
            flush(&mut chunks, &mut current, &mut current_len, in_code);
            if rest.is_empty() {
                break;
            }
        }
        if is_fence {
            in_code = !in_code;
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

fn flush(chunks: &mut Vec<String>, current: &mut String, len: &mut usize, in_code: bool) {
    let mut chunk = std::mem::take(current);
    if in_code {
        chunk.push('\n');
        chunk.push_str(FENCE);
        current.push_str(FENCE);
    }
    *len = current.chars().count();
    chunks.push(chunk);
}

/// A byte index at most `budget` characters into `line`: the last space, else the limit,
/// never inside an `&…;` escape.
fn cut_point(line: &str, budget: usize) -> usize {
    let hard = line.char_indices().nth(budget).map_or(line.len(), |(i, _)| i);
    let window = &line[..hard];
    if let Some(space) = window.rfind(' ').filter(|&i| i > hard / 2) {
        return space;
    }
    match window.rfind('&') {
        Some(amp) if !window[amp..].contains(';') && amp > 0 => amp,
        _ => hard.max(line.char_indices().nth(1).map_or(line.len(), |(i, _)| i)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emphasis_links_and_code_become_mrkdwn() {
        let cases = [
            ("**bold** and __also__", "*bold* and *also*"),
            ("*italic* and _this_", "_italic_ and _this_"),
            ("~~gone~~", "~gone~"),
            (
                "see [the docs](https://x.example/a?b=1) now",
                "see <https://x.example/a?b=1|the docs> now",
            ),
            ("<https://x.example>", "<https://x.example>"),
            ("`a < b && c`", "`a &lt; b &amp;&amp; c`"),
            ("keep snake_case_names and 2*3*4", "keep snake_case_names and 2*3*4"),
            ("x < y > z & w", "x &lt; y &gt; z &amp; w"),
            ("# Title", "*Title*"),
            ("## **Bold** heading ##", "*Bold heading*"),
            ("- one\n  * two\n+ three", "• one\n  • two\n• three"),
            ("1. first\n2. second", "1. first\n2. second"),
            ("> quoted **text**", "> quoted *text*"),
            ("- [ ] todo\n- [x] done", "• ☐ todo\n• ☑ done"),
            ("[not a link](javascript:x)", "[not a link](javascript:x)"),
        ];
        for (markdown, expected) in cases {
            assert_eq!(to_mrkdwn(markdown), expected, "{markdown}");
        }
    }

    #[test]
    fn code_blocks_keep_their_content_and_lose_the_language() {
        let markdown = "Run:\n```rust\nlet a = b && *c;\n// **not bold**\n```\ndone";
        assert_eq!(
            to_mrkdwn(markdown),
            "Run:\n```\nlet a = b &amp;&amp; *c;\n// **not bold**\n```\ndone"
        );
        assert_eq!(to_mrkdwn("```\nunclosed"), "```\nunclosed\n```");
        assert_eq!(to_mrkdwn("```one liner```"), "```one liner```");
    }

    #[test]
    fn short_text_is_one_message() {
        assert_eq!(split("hello", 100), vec!["hello"]);
    }

    #[test]
    fn long_text_splits_at_lines_within_the_limit() {
        let text: Vec<String> = (0..50).map(|i| format!("line number {i:02}")).collect();
        let text = text.join("\n");
        let chunks = split(&text, 100);
        assert!(chunks.len() > 1);
        assert!(chunks.iter().all(|c| c.chars().count() <= 100), "{chunks:?}");
        assert_eq!(chunks.join("\n"), text, "nothing lost or added");
    }

    #[test]
    fn a_code_block_cut_in_two_is_closed_and_reopened() {
        let code: Vec<String> = (0..30).map(|i| format!("    statement_{i:02}();")).collect();
        let text = format!("intro\n```\n{}\n```\noutro", code.join("\n"));
        let chunks = split(&text, 120);
        assert!(chunks.len() > 2, "{chunks:?}");
        for chunk in &chunks {
            assert!(chunk.chars().count() <= 120, "{chunk}");
            assert_eq!(chunk.matches(FENCE).count() % 2, 0, "unbalanced fences in {chunk:?}");
        }
        let rejoined = chunks.join("\n").replace("\n```\n```\n", "\n");
        assert_eq!(rejoined, text);
    }

    #[test]
    fn an_overlong_line_is_cut_at_spaces_and_never_inside_an_escape() {
        let line = "word ".repeat(100);
        let chunks = split(line.trim_end(), 60);
        assert!(chunks.iter().all(|c| c.chars().count() <= 60 && !c.starts_with(' ')));
        assert_eq!(chunks.join(" "), line.trim_end());
        let escapes = "&amp;".repeat(40);
        let chunks = split(&escapes, 23);
        assert!(chunks.iter().all(|c| c.ends_with(';') && c.starts_with('&')), "{chunks:?}");
        assert_eq!(chunks.concat(), escapes);
        let unicode = "é".repeat(250);
        assert!(split(&unicode, 100).iter().all(|c| c.chars().count() <= 100));
    }
}
