//! Commands (input, approval, choice, notify, invoke) presented on a driver connection: gated
//! by the driver's declaration, answered by a person, and failing closed — a timeout, a
//! disconnect or an answer from someone not on the allowlist is a rejection.

use std::time::Duration;

use channeld_protocol::ext::CommandRefusal;
use channeld_protocol::frame::CommandFrame;
use channeld_protocol::types::{Command, CommandAnswer, CommandResult, MessageTarget};
use channeld_protocol::{ChannelId, Frame, Id};
use tracing::{info, warn};

use crate::config::Allowlist;
use crate::connection::Connection;
use crate::metrics::{CommandOutcome, InstanceMetrics};

/// Why a command did not get an answer from a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Refused(#[from] CommandRefusal),
    #[error("driver disconnected before answering")]
    Disconnected,
    #[error("no answer within {0} s")]
    Timeout(u64),
    #[error("command could not be sent: {0}")]
    Send(String),
}

/// One command to present.
#[derive(Debug, Clone)]
pub struct Presented {
    /// The wire request id of the `command` frame.
    pub request_id: Id,
    /// The conversation session the command belongs to.
    pub session: Id,
    pub command_id: Id,
    pub command: Command,
    pub target: Option<MessageTarget>,
}

/// Presents a command on `conn` and waits up to `timeout` for the answer; counts how it
/// ended in `metrics`.
pub async fn present(
    conn: &Connection,
    presented: Presented,
    timeout: Duration,
    metrics: &InstanceMetrics,
) -> Result<CommandAnswer, CommandError> {
    let result = present_once(conn, presented, timeout).await;
    metrics.command(match &result {
        Ok(_) => CommandOutcome::Answered,
        Err(CommandError::Refused(_)) => CommandOutcome::Refused,
        Err(CommandError::Timeout(_)) => CommandOutcome::Timeout,
        Err(CommandError::Disconnected | CommandError::Send(_)) => CommandOutcome::Disconnected,
    });
    result
}

async fn present_once(
    conn: &Connection,
    presented: Presented,
    timeout: Duration,
) -> Result<CommandAnswer, CommandError> {
    let Presented { request_id, session, command_id, command, target } = presented;
    conn.declaration.command_gate(&command)?;
    let waiter = conn.expect_command(request_id.clone()).ok_or(CommandError::Disconnected)?;
    let frame = Frame::Command(CommandFrame {
        request_id: request_id.clone(),
        session: session.clone(),
        command_id: command_id.clone(),
        command,
        target,
    });
    if let Err(err) = conn.sink.send(&frame).await {
        conn.forget_command(&request_id);
        return Err(CommandError::Send(err.to_string()));
    }
    match tokio::time::timeout(timeout, waiter).await {
        Ok(Ok(result)) => {
            if result.session != session || result.command_id != command_id {
                warn!(%request_id, "command_result does not match its command; treated as rejected");
                return Ok(CommandAnswer::rejected("mismatched command result"));
            }
            Ok(CommandAnswer { result: result.result, responder: result.responder })
        }
        Ok(Err(_)) => Err(CommandError::Disconnected),
        Err(_) => {
            conn.forget_command(&request_id);
            Err(CommandError::Timeout(timeout.as_secs()))
        }
    }
}

/// A command's answer counts only when an allowlisted participant gave it: an `accepted` or
/// `value` result is turned into a rejection unless the driver negotiated `responder` and
/// named someone the allowlist permits (with `allow_all`, anyone). Pure.
pub fn vet_answer(
    instance: &ChannelId,
    allow: &Allowlist,
    responder_negotiated: bool,
    answer: CommandAnswer,
) -> CommandAnswer {
    if matches!(answer.result, CommandResult::Rejected { .. }) {
        return answer;
    }
    if matches!(allow, Allowlist::All) {
        return answer;
    }
    let responder = answer.responder.as_ref().filter(|_| responder_negotiated);
    match responder {
        Some(who) if allow.permits(who.id.as_str()) => answer,
        Some(who) => {
            info!(%instance, responder = %who.id, "command answered by someone not on the allowlist; rejected");
            CommandAnswer::rejected("answered by a participant who is not allowed")
        }
        None => CommandAnswer::rejected("the driver did not say who answered"),
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::types::Participant;

    use super::*;

    fn answer(result: CommandResult, responder: Option<&str>) -> CommandAnswer {
        CommandAnswer {
            result,
            responder: responder.map(|id| Participant::new(Id::new(id).unwrap())),
        }
    }

    fn vet(allow: &Allowlist, negotiated: bool, answer: CommandAnswer) -> CommandAnswer {
        vet_answer(&ChannelId::new("a.b").unwrap(), allow, negotiated, answer)
    }

    fn is_rejected(answer: &CommandAnswer) -> bool {
        matches!(answer.result, CommandResult::Rejected { .. })
    }

    #[test]
    fn an_approval_counts_only_from_an_allowlisted_responder_the_driver_named() {
        let allow = Allowlist::Senders(vec!["alice".into()]);
        let ok = vet(&allow, true, answer(CommandResult::Accepted, Some("alice")));
        assert!(!is_rejected(&ok));
        let stranger = vet(&allow, true, answer(CommandResult::Accepted, Some("mallory")));
        assert!(is_rejected(&stranger));
        let anonymous = vet(&allow, true, answer(CommandResult::Accepted, None));
        assert!(is_rejected(&anonymous));
        // Without the `responder` extension the driver cannot vouch for anyone.
        let unnegotiated = vet(&allow, false, answer(CommandResult::Accepted, Some("alice")));
        assert!(is_rejected(&unnegotiated));
    }

    #[test]
    fn allow_all_accepts_any_answer_and_rejections_pass_through() {
        let anyone = vet(&Allowlist::All, false, answer(CommandResult::Accepted, None));
        assert!(!is_rejected(&anyone));
        let allow = Allowlist::Senders(vec![]);
        let rejected = CommandResult::Rejected { reason: "no".into() };
        let passed = vet(&allow, false, answer(rejected.clone(), None));
        assert_eq!(passed.result, rejected);
    }
}
