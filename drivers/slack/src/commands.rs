//! Commands presented in Slack and answered by a click: the prompt is posted with buttons (or
//! a text field), the command waits for the matching `block_actions` click (or its timeout),
//! the buttons are replaced by what happened, and the answer names who clicked so the hub
//! can count it only for allowlisted people.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{
    Choice, Command, CommandAnswer, CommandResult, MessageTarget, Participant,
};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::blocks::{self, Outcome, Prompt};
use crate::outbound::{Outbound, Placed, outcome};
use crate::wire::BlockActions;

/// Commands waiting for a click at once; more are refused.
pub const MAX_WAITING: usize = 256;

#[derive(Debug)]
struct Waiting {
    answer: oneshot::Sender<(Outcome, Participant)>,
    choices: Vec<Choice>,
}

/// Commands waiting for clicks, by command id.
#[derive(Debug)]
pub struct Commands {
    outbound: Outbound,
    timeout: Duration,
    waiting: Mutex<HashMap<String, Waiting>>,
}

impl Commands {
    pub fn new(outbound: Outbound, timeout: Duration) -> Self {
        Self { outbound, timeout, waiting: Mutex::new(HashMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Presents `command` in `target` and waits for its answer.
    pub async fn present(
        &self,
        command_id: &Id,
        command: &Command,
        target: Option<&MessageTarget>,
    ) -> CommandAnswer {
        let Some(target) = target else {
            return CommandAnswer::rejected("the command names no conversation to ask in");
        };
        let (prompt, choices) = match command {
            Command::Notify { level, text } => {
                return match self.outbound.post_mrkdwn(target, &blocks::notify(level, text)).await {
                    Ok(_) => CommandAnswer { result: CommandResult::Accepted, responder: None },
                    Err(err) => CommandAnswer::rejected(format!(
                        "notification not posted: {}",
                        outcome(&err)
                    )),
                };
            }
            Command::RequestApproval { tool, arguments } => {
                (blocks::approval(command_id, tool, arguments), Vec::new())
            }
            Command::RequestChoice { question, choices, multiple: false } => {
                match blocks::choice(command_id, question, choices) {
                    Ok(prompt) => (prompt, choices.clone()),
                    Err(reason) => return CommandAnswer::rejected(reason),
                }
            }
            Command::RequestInput { prompt } => (blocks::input(command_id, prompt), Vec::new()),
            Command::RequestChoice { multiple: true, .. } | Command::Invoke { .. } => {
                return CommandAnswer::rejected(format!(
                    "{} is not supported by the Slack driver",
                    command.kind()
                ));
            }
        };
        self.ask(command_id, prompt, choices, target).await
    }

    async fn ask(
        &self,
        command_id: &Id,
        prompt: Prompt,
        choices: Vec<Choice>,
        target: &MessageTarget,
    ) -> CommandAnswer {
        let (answer, answered) = oneshot::channel();
        {
            let mut waiting = self.lock();
            if waiting.contains_key(command_id.as_str()) {
                return CommandAnswer::rejected("a command with this id is already waiting");
            }
            if waiting.len() >= MAX_WAITING {
                return CommandAnswer::rejected("too many commands are waiting for an answer");
            }
            waiting.insert(command_id.as_str().to_owned(), Waiting { answer, choices });
        }
        let placed = match self.outbound.post_blocks(target, &prompt.text, prompt.blocks).await {
            Ok(placed) => placed,
            Err(err) => {
                self.lock().remove(command_id.as_str());
                return CommandAnswer::rejected(format!(
                    "the question was not posted: {}",
                    outcome(&err)
                ));
            }
        };
        match tokio::time::timeout(self.timeout, answered).await {
            Ok(Ok((outcome, responder))) => {
                self.settle_message(&placed, &prompt.text, &outcome.summary).await;
                CommandAnswer { result: outcome.result, responder: Some(responder) }
            }
            _ => {
                self.lock().remove(command_id.as_str());
                self.settle_message(&placed, &prompt.text, "_No answer in time._").await;
                CommandAnswer::rejected("no answer in time")
            }
        }
    }

    /// Replaces the buttons with the prompt and what happened.
    async fn settle_message(&self, placed: &Placed, prompt: &str, summary: &str) {
        let text = format!("{}\n{summary}", crate::mrkdwn::escape(prompt));
        if let Err(err) = self.outbound.replace(placed, text).await {
            warn!(error = %err, ts = %placed.ts, "could not replace the buttons with the outcome");
        }
    }

    /// A `block_actions` click: answers the command it belongs to, if any is waiting.
    pub fn on_click(&self, click: &BlockActions) {
        for action in &click.actions {
            let Some(command_id) = blocks::command_of(action) else {
                debug!(action_id = %action.action_id, "click on an element that is not ours");
                continue;
            };
            let mut waiting = self.lock();
            let Some(entry) = waiting.get(command_id) else {
                info!(%command_id, "click for a command that is no longer waiting");
                continue;
            };
            let Some(outcome) = blocks::outcome(action, &click.user.id, &entry.choices) else {
                debug!(%command_id, action_id = %action.action_id, "click does not match the command");
                continue;
            };
            let Some(entry) = waiting.remove(command_id) else { continue };
            let Ok(id) = Id::new(&click.user.id) else { continue };
            let mut responder = Participant::new(id);
            responder.handle = click.user.username.clone();
            responder.display_name = click.user.name.clone();
            let _ = entry.answer.send((outcome, responder));
        }
    }
}
