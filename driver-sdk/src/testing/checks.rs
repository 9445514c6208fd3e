//! The pure rules behind the conformance checks: what makes a `hello`, an `inbound`, a
//! receipt, a command's answer or a reconnect schedule wrong, as plain functions that return
//! the problems they found. The in-process suite ([`conformance`](super::conformance)) asserts
//! them; `channeld-conformance` (any driver, any language, over a real socket) reports them.

use std::time::Duration;

use channeld_protocol::ChannelId;
use channeld_protocol::ext::valid_operator_action_name;
use channeld_protocol::frame::{CommandFrame, CommandResultFrame, Hello, Inbound};
use channeld_protocol::types::{
    Capabilities, Choice, Command, CommandResult, DeliveryReceipt, Effect, MessageBody,
};
use channeld_protocol::{Frame, Id};

/// What is inconsistent in a declaration; empty when it is fine (the rules of
/// [`Capabilities::REQUIRES`]).
pub fn declaration_problems(caps: &Capabilities) -> Vec<String> {
    caps.unmet_requirements().iter().map(ToString::to_string).collect()
}

/// What is wrong with a driver's `hello` for `channel`: another channel, an inconsistent
/// declaration, invalid operator action names, operator actions without their extension.
/// Empty when it is well-formed.
pub fn hello_problems(hello: &Hello, channel: &ChannelId) -> Vec<String> {
    let mut problems = Vec::new();
    if hello.channel != *channel {
        problems.push(format!("hello names channel {}, launched as {channel}", hello.channel));
    }
    problems.extend(declaration_problems(&hello.capabilities));
    for name in &hello.operator_actions {
        if !valid_operator_action_name(name) {
            problems.push(format!("operator action name {name:?} is invalid"));
        }
    }
    if !hello.operator_actions.is_empty()
        && !hello.extensions.iter().any(|e| e == "operator_action")
    {
        problems.push("hello lists operator_actions without the operator_action extension".into());
    }
    problems
}

/// What is wrong with an `inbound` reporting the platform message `text`: it must be declared
/// (`receive`, `threads`, attachments), name the launch channel, carry its message id as its
/// event id (so a redelivery keeps it) and contain the text.
pub fn inbound_problems(
    hello: &Hello,
    channel: &ChannelId,
    inbound: &Inbound,
    text: &str,
) -> Vec<String> {
    let caps = &hello.capabilities;
    let message = &inbound.message;
    let mut problems = Vec::new();
    if !caps.receive {
        problems.push("the driver sent an inbound without declaring receive".to_owned());
    }
    if inbound.event_id != message.id {
        problems.push(format!(
            "an inbound's event_id is its message id: event_id {} but message id {}",
            inbound.event_id, message.id
        ));
    }
    if message.target.channel != *channel {
        problems.push(format!("inbound target names channel {}", message.target.channel));
    }
    if let Some(thread) = &message.target.thread
        && !caps.threads
    {
        problems.push(format!("inbound carries thread {thread} but threads was not declared"));
    }
    let attachments_declared = caps.receive_attachments || caps.attachments;
    if !message.body.attachments().is_empty() && !attachments_declared {
        problems.push(
            "inbound carries attachments but neither receive_attachments nor attachments was declared"
                .to_owned(),
        );
    }
    if !message.body.text_str().contains(text) {
        problems.push(format!(
            "inbound text {:?} does not contain the injected {text:?}",
            message.body.text_str()
        ));
    }
    problems
}

/// What is wrong with a receipt from a driver launched as `channel`.
pub fn receipt_problem(receipt: &DeliveryReceipt, channel: &ChannelId) -> Option<String> {
    if receipt.channel != *channel {
        Some(format!("receipt names channel {}", receipt.channel))
    } else if receipt.target.channel != *channel {
        Some(format!("receipt target names channel {}", receipt.target.channel))
    } else {
        None
    }
}

/// What is wrong with the answer to a command the driver had to reject.
pub fn rejection_problem(sent: &CommandFrame, got: &CommandResultFrame) -> Option<String> {
    if got.session != sent.session {
        Some(format!("command_result for session {}, sent {}", got.session, sent.session))
    } else if got.command_id != sent.command_id {
        Some(format!("command_result for command {}, sent {}", got.command_id, sent.command_id))
    } else if !matches!(got.result, CommandResult::Rejected { .. }) {
        Some(format!("expected rejected, got {:?}", got.result))
    } else {
        None
    }
}

/// Whether `frame` answers the hub request `request_id` (a receipt, an error, a health
/// response, a command result or an operator action result carrying it).
pub fn answers(frame: &Frame, request_id: &str) -> bool {
    match frame {
        Frame::Receipt(receipt) => receipt.request_id == request_id,
        Frame::Error(err) => err.request_id.as_ref().is_some_and(|id| id == request_id),
        Frame::HealthResponse(response) => response.request_id == request_id,
        Frame::CommandResult(result) => result.request_id == request_id,
        Frame::OperatorActionResult(result) => result.request_id == request_id,
        _ => false,
    }
}

/// How much longer than the first wait the last one must be for a reconnect schedule to
/// count as growing backoff (the SDK doubles: 1 s, 2 s, 4 s, each ±25 %).
pub const BACKOFF_GROWTH: f64 = 1.5;

/// Why the waits between a hub closing the connection and the driver's next connection are
/// not a growing backoff, or `None` when they are: at least two waits, none more than 10 %
/// shorter than the one before, and the last at least [`BACKOFF_GROWTH`] times the first.
pub fn backoff_problem(gaps: &[Duration]) -> Option<String> {
    let shown = || gaps.iter().map(|g| format!("{:.2} s", g.as_secs_f64())).collect::<Vec<_>>();
    let (Some(first), Some(last)) = (gaps.first(), gaps.last()) else {
        return Some("no reconnect was observed".into());
    };
    if gaps.len() < 2 {
        return Some(format!("only one reconnect was observed ({})", shown().join(", ")));
    }
    let shrinks = gaps.windows(2).any(|pair| pair[1].as_secs_f64() < pair[0].as_secs_f64() * 0.9);
    if shrinks || last.as_secs_f64() < first.as_secs_f64() * BACKOFF_GROWTH {
        return Some(format!(
            "the waits before reconnecting ({}) do not grow: back off, e.g. 1 s doubling",
            shown().join(", ")
        ));
    }
    None
}

/// One effect per action, in [`Actions::NAMES`](channeld_protocol::types::Actions::NAMES) order.
pub fn sample_effects() -> Vec<Effect> {
    let message_id = id("conformance-message");
    vec![
        Effect::Typing { active: true },
        Effect::Preview { text: "conformance preview".into() },
        Effect::Reaction { message_id: message_id.clone(), emoji: "eyes".into(), remove: false },
        Effect::Edit {
            message_id: message_id.clone(),
            body: MessageBody::text("conformance edit").expect("static text is a valid body"),
        },
        Effect::Delete { message_id: message_id.clone() },
        Effect::MarkRead { message_id: message_id.clone() },
        Effect::Pin { message_id: message_id.clone() },
        Effect::Unpin { message_id: message_id.clone() },
        Effect::Redact { message_id, reason: Some("conformance".into()) },
    ]
}

/// The commands a driver with `caps` must reject, each with a short name.
pub fn commands_to_reject(caps: &Capabilities) -> Vec<(&'static str, Command)> {
    let choices = vec![
        Choice { id: id("yes"), label: "Yes".into() },
        Choice { id: id("no"), label: "No".into() },
    ];
    let approval = Command::RequestApproval {
        tool: "conformance_tool".into(),
        arguments: serde_json::json!({"path": "/tmp/conformance"}),
    };
    let invoke =
        Command::Invoke { name: "conformance_tool".into(), payload: serde_json::json!({}) };
    let single = Command::RequestChoice {
        question: "Continue?".into(),
        choices: choices.clone(),
        multiple: false,
    };
    let multiple = Command::RequestChoice { question: "Which?".into(), choices, multiple: true };
    let mut rejected = Vec::new();
    if !caps.commands {
        rejected.push(("request_approval", approval));
    }
    if !caps.tool_control {
        rejected.push(("invoke", invoke));
    }
    if !caps.commands || !caps.choices {
        rejected.push(("request_choice", single));
    }
    if !caps.commands || !caps.choices || !caps.multi_choice {
        rejected.push(("request_choice_multiple", multiple));
    }
    rejected
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap_or_else(|err| panic!("{value:?} is not a valid id: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_protocol::types::Actions;

    fn secs(values: &[f64]) -> Vec<Duration> {
        values.iter().map(|&s| Duration::from_secs_f64(s)).collect()
    }

    #[test]
    fn sample_effects_cover_every_action_in_order() {
        let actions: Vec<&str> = sample_effects().iter().map(Effect::action).collect();
        assert_eq!(actions, Actions::NAMES);
    }

    #[test]
    fn declaration_rules_name_what_is_missing() {
        // The rules themselves are tested with `Capabilities::REQUIRES` in the protocol crate.
        let mut caps = Capabilities { receive: true, multi_choice: true, ..Default::default() };
        caps.send_attachments = true;
        let problems = declaration_problems(&caps);
        assert_eq!(problems, vec!["multi_choice needs choices", "send_attachments needs send"]);
        assert!(declaration_problems(&Capabilities::default()).is_empty());
    }

    #[test]
    fn a_hello_for_another_channel_or_with_stray_operator_actions_has_problems() {
        let channel = ChannelId::new("a.b").unwrap();
        let mut hello = Hello {
            request_id: id("h"),
            channel: channel.clone(),
            capabilities: Capabilities { receive: true, ..Default::default() },
            actions: Actions::default(),
            extensions: Vec::new(),
            operator_actions: Vec::new(),
        };
        assert!(hello_problems(&hello, &channel).is_empty());
        hello.channel = ChannelId::new("a.c").unwrap();
        hello.operator_actions = vec!["Resume".into()];
        assert_eq!(
            hello_problems(&hello, &channel),
            [
                "hello names channel a.c, launched as a.b",
                "operator action name \"Resume\" is invalid",
                "hello lists operator_actions without the operator_action extension",
            ]
        );
    }

    #[test]
    fn a_driver_with_every_command_capability_has_nothing_to_reject() {
        let caps = Capabilities {
            commands: true,
            choices: true,
            multi_choice: true,
            tool_control: true,
            ..Default::default()
        };
        assert!(commands_to_reject(&caps).is_empty());
        let names: Vec<&str> =
            commands_to_reject(&Capabilities::default()).iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            ["request_approval", "invoke", "request_choice", "request_choice_multiple"]
        );
    }

    #[test]
    fn the_sdk_schedule_is_growing_backoff_and_a_fixed_delay_is_not() {
        assert_eq!(backoff_problem(&secs(&[0.8, 2.4, 3.1])), None, "jitter within ±25 %");
        assert_eq!(backoff_problem(&secs(&[1.2, 1.6, 4.9])), None);
        let fixed = backoff_problem(&secs(&[0.2, 0.2, 0.21])).unwrap();
        assert!(fixed.contains("0.20 s, 0.20 s, 0.21 s"), "{fixed}");
        assert!(backoff_problem(&secs(&[2.0, 1.0, 4.0])).is_some(), "a wait that shrinks");
        assert!(backoff_problem(&secs(&[1.0])).unwrap().contains("only one"));
        assert!(backoff_problem(&[]).is_some());
    }
}
