//! Commands as Block Kit messages, and clicks back to command results: approvals as two
//! buttons, single choices as one button per option, input as a text field that submits on
//! Enter, notifications as plain messages. Pure.
//!
//! Every interactive element's `action_id` starts with [`ACTION_PREFIX`] and its block id is
//! `channeld:<command id>`, so a click names the command it answers.

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{Choice, CommandResult};
use serde_json::{Value, json};

use crate::mrkdwn::escape;
use crate::wire::Action;

/// Prefix of the driver's action ids.
pub const ACTION_PREFIX: &str = "channeld.";
const APPROVE: &str = "channeld.approve";
const DENY: &str = "channeld.deny";
const INPUT: &str = "channeld.input";
const CHOICE: &str = "channeld.choice.";
const BLOCK_PREFIX: &str = "channeld:";

/// Slack's limits: section text, button label, elements per actions block.
const MAX_SECTION_CHARS: usize = 3_000;
const MAX_BUTTON_CHARS: usize = 75;
const MAX_ELEMENTS: usize = 25;
/// Choices one message can offer (two actions blocks of 25 leave room for the question).
pub const MAX_CHOICES: usize = 50;

/// A command's message: fallback text (notifications, screen readers) and blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub blocks: Value,
}

fn block_id(command_id: &Id) -> String {
    format!("{BLOCK_PREFIX}{command_id}")
}

/// The command id a clicked element belongs to.
pub fn command_of(action: &Action) -> Option<&str> {
    action.block_id.as_deref()?.strip_prefix(BLOCK_PREFIX)
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn section(text: &str) -> Value {
    json!({"type": "section", "text": {"type": "mrkdwn", "text": truncate(text, MAX_SECTION_CHARS)}})
}

fn button(action_id: &str, label: &str, value: &str, style: Option<&str>) -> Value {
    let mut button = json!({
        "type": "button",
        "action_id": action_id,
        "text": {"type": "plain_text", "text": truncate(label, MAX_BUTTON_CHARS), "emoji": true},
        "value": value,
    });
    if let Some(style) = style {
        button["style"] = json!(style);
    }
    button
}

/// Approve / Deny for running `tool` with `arguments`.
pub fn approval(command_id: &Id, tool: &str, arguments: &Value) -> Prompt {
    let args = serde_json::to_string_pretty(arguments).unwrap_or_default();
    let mut text = format!("*Approval needed:* run `{}`?", escape(tool));
    if !arguments.is_null() && args != "{}" {
        // Leave room for the fences inside the section limit.
        text.push_str(&format!(
            "\n```\n{}\n```",
            escape(&truncate(&args, MAX_SECTION_CHARS - 200))
        ));
    }
    let blocks = json!([
        section(&text),
        {"type": "actions", "block_id": block_id(command_id), "elements": [
            button(APPROVE, "Approve", command_id.as_str(), Some("primary")),
            button(DENY, "Deny", command_id.as_str(), Some("danger")),
        ]},
    ]);
    Prompt { text: format!("Approval needed: run {tool}?"), blocks }
}

/// One button per choice (at most [`MAX_CHOICES`]).
pub fn choice(command_id: &Id, question: &str, choices: &[Choice]) -> Result<Prompt, String> {
    if choices.is_empty() || choices.len() > MAX_CHOICES {
        return Err(format!("a choice needs 1 to {MAX_CHOICES} options, got {}", choices.len()));
    }
    let mut blocks = vec![section(&escape(question))];
    for (group, chunk) in choices.chunks(MAX_ELEMENTS).enumerate() {
        let elements: Vec<Value> = chunk
            .iter()
            .enumerate()
            .map(|(i, c)| {
                button(
                    &format!("{CHOICE}{}", group * MAX_ELEMENTS + i),
                    &c.label,
                    c.id.as_str(),
                    None,
                )
            })
            .collect();
        // Block ids are unique per message: the second group gets a suffix after the id.
        let id = if group == 0 {
            block_id(command_id)
        } else {
            format!("{}#{group}", block_id(command_id))
        };
        blocks.push(json!({"type": "actions", "block_id": id, "elements": elements}));
    }
    Ok(Prompt { text: question.to_owned(), blocks: Value::Array(blocks) })
}

/// A text field; Enter submits it as a click.
pub fn input(command_id: &Id, prompt: &str) -> Prompt {
    let blocks = json!([
        section(&escape(prompt)),
        {
            "type": "input",
            "block_id": block_id(command_id),
            "dispatch_action": true,
            "label": {"type": "plain_text", "text": "Your answer"},
            "element": {
                "type": "plain_text_input",
                "action_id": INPUT,
                "dispatch_action_config": {"trigger_actions_on": ["on_enter_pressed"]},
            },
        },
    ]);
    Prompt { text: prompt.to_owned(), blocks }
}

/// A notification's text.
pub fn notify(level: &str, text: &str) -> String {
    let label = match level {
        "error" | "critical" => ":rotating_light: *Error*",
        "warning" | "warn" => ":warning: *Warning*",
        _ => ":information_source:",
    };
    format!("{label} {}", escape(text))
}

/// What a click means for its command, with the line that replaces the buttons.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub result: CommandResult,
    pub summary: String,
}

/// Interprets a click by `user` on one of this driver's elements.
pub fn outcome(action: &Action, user: &str, choices: &[Choice]) -> Option<Outcome> {
    let by = format!("<@{user}>");
    if action.action_id == APPROVE {
        return Some(Outcome {
            result: CommandResult::Accepted,
            summary: format!(":white_check_mark: Approve, clicked by {by}"),
        });
    }
    if action.action_id == DENY {
        return Some(Outcome {
            result: CommandResult::rejected(format!("denied by {user}")),
            summary: format!(":no_entry: Deny, clicked by {by}"),
        });
    }
    if action.action_id == INPUT {
        let text = action.value.clone().unwrap_or_default();
        let summary = format!("Answered by {by}: {}", escape(&truncate(&text, 500)));
        return Some(Outcome {
            result: CommandResult::Value { payload: json!({"text": text}) },
            summary,
        });
    }
    let index: usize = action.action_id.strip_prefix(CHOICE)?.parse().ok()?;
    let chosen = choices.get(index)?;
    if action.value.as_deref() != Some(chosen.id.as_str()) {
        return None;
    }
    Some(Outcome {
        result: CommandResult::Value { payload: json!({"choice": chosen.id.as_str()}) },
        summary: format!("{} — chosen by {by}", escape(&chosen.label)),
    })
}

/// The text that replaces a prompt whose time ran out.
pub fn expired(prompt: &str) -> String {
    format!("{}\n_No answer in time._", escape(prompt))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    fn click(action_id: &str, block_id: &str, value: Option<&str>) -> Action {
        Action {
            action_id: action_id.into(),
            block_id: Some(block_id.into()),
            value: value.map(Into::into),
        }
    }

    #[test]
    fn an_approval_has_two_buttons_naming_the_command() {
        let prompt = approval(&id("cmd-1"), "rm", &json!({"path": "/tmp/<x>"}));
        let actions = &prompt.blocks[1];
        assert_eq!(actions["block_id"], "channeld:cmd-1");
        assert_eq!(actions["elements"][0]["action_id"], APPROVE);
        assert_eq!(actions["elements"][1]["style"], "danger");
        let text = prompt.blocks[0]["text"]["text"].as_str().unwrap();
        assert!(text.contains("`rm`") && text.contains("&lt;x&gt;"), "{text}");
        let approve = outcome(&click(APPROVE, "channeld:cmd-1", Some("cmd-1")), "U1", &[]).unwrap();
        assert_eq!(approve.result, CommandResult::Accepted);
        assert!(approve.summary.contains("<@U1>"));
        assert!(matches!(
            outcome(&click(DENY, "channeld:cmd-1", None), "U1", &[]).unwrap().result,
            CommandResult::Rejected { .. }
        ));
        assert_eq!(command_of(&click(APPROVE, "channeld:cmd-1", None)), Some("cmd-1"));
    }

    #[test]
    fn choices_are_buttons_in_groups_of_25_and_a_click_returns_the_id() {
        let choices: Vec<Choice> = (0..30)
            .map(|i| Choice { id: id(&format!("c{i}")), label: format!("Option {i}") })
            .collect();
        let prompt = choice(&id("cmd-2"), "Pick", &choices).unwrap();
        let blocks = prompt.blocks.as_array().unwrap();
        assert_eq!(blocks.len(), 3);
        assert_eq!(blocks[1]["elements"].as_array().unwrap().len(), 25);
        assert_eq!(blocks[2]["block_id"], "channeld:cmd-2#1");
        assert_eq!(blocks[2]["elements"][4]["action_id"], "channeld.choice.29");
        let picked =
            outcome(&click("channeld.choice.29", "channeld:cmd-2#1", Some("c29")), "U2", &choices)
                .unwrap();
        assert_eq!(picked.result, CommandResult::Value { payload: json!({"choice": "c29"}) });
        assert!(
            outcome(&click("channeld.choice.29", "x", Some("c1")), "U2", &choices).is_none(),
            "value must match"
        );
        assert!(choice(&id("c"), "q", &[]).is_err());
    }

    #[test]
    fn input_submits_the_typed_text() {
        let prompt = input(&id("cmd-3"), "Name?");
        assert_eq!(prompt.blocks[1]["element"]["action_id"], INPUT);
        assert_eq!(prompt.blocks[1]["dispatch_action"], true);
        let typed = outcome(&click(INPUT, "channeld:cmd-3", Some("Ada")), "U3", &[]).unwrap();
        assert_eq!(typed.result, CommandResult::Value { payload: json!({"text": "Ada"}) });
    }

    #[test]
    fn long_labels_and_sections_fit_slack_limits() {
        let long = "x".repeat(5_000);
        let prompt =
            choice(&id("c"), &long, &[Choice { id: id("a"), label: long.clone() }]).unwrap();
        assert!(
            prompt.blocks[0]["text"]["text"].as_str().unwrap().chars().count() <= MAX_SECTION_CHARS
        );
        assert!(
            prompt.blocks[1]["elements"][0]["text"]["text"].as_str().unwrap().chars().count()
                <= MAX_BUTTON_CHARS
        );
    }
}
