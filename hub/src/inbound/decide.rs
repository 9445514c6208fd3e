//! The inbound decision, free of I/O: from what arrived, what the instance allows, the
//! instance's run queue and what the ledger holds, what the hub does with it.
//!
//! The caller decides twice when the ledger is on: first with [`Lookup::NotAsked`] (which
//! settles everything that needs no ledger: wrong channel, denied sender, busy, already in
//! flight), then, if told to [`Action::Record`], again with the ledger's answer. An inbound
//! the ledger answered for holds its place in the run queue, so the second decision does not
//! look at the slot again.

use crate::config::Allowlist;
use crate::ledger::{InboundState, StoredRun};
use crate::runqueue::Slot;

/// What arrived, as far as the decision needs it.
#[derive(Debug, Clone, Copy)]
pub struct InboundView<'a> {
    /// The channel the inbound's target names.
    pub channel: &'a str,
    /// Who sent it (the actor of an event); `None` when the driver could not say.
    pub sender: Option<&'a str>,
    /// The text of a message; `None` for an event (reaction, edit, …).
    pub text: Option<&'a str>,
}

/// The instance's side of the decision.
#[derive(Debug, Clone, Copy)]
pub struct InstanceView<'a> {
    pub channel: &'a str,
    pub allow: &'a Allowlist,
    /// Whether a denied sender is told so on the platform (`deny_notice`).
    pub deny_notice: bool,
    /// Where the event stands against the instance's run queue.
    pub slot: Slot,
}

/// What the ledger said about the event id.
#[derive(Debug, Clone, Copy)]
pub enum Lookup<'a> {
    /// The ledger is off: nothing is stored, there is nothing to ask.
    Off,
    /// The ledger is on and was not asked yet.
    NotAsked,
    /// Recorded now: the first delivery of this event id.
    New,
    /// Delivered before with the same content.
    Stored(&'a StoredRun),
    /// Delivered before with different content.
    Conflict,
    /// The ledger could not record it.
    Failed,
}

/// A command the hub answers itself; it never reaches the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlashCommand {
    /// `/help`: what the hub's commands do.
    Help,
    /// `/new`: a new conversation session for this route.
    NewSession,
}

/// The error code of a run that ended without a reply.
pub const EMPTY_REPLY: &str = "empty_reply";

/// What a redelivery of an event with a recorded entry gets: never a second run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replay {
    /// The run is still going; its reply goes out when it ends.
    Wait,
    /// The stored reply, delivered again.
    Reply(String),
    /// The run failed (or, recorded by an older hub, ended without a reply): the same error
    /// again.
    Failure { code: String, message: String },
}

/// What the hub does with one inbound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The target names another channel (`invalid_target`).
    WrongChannel,
    /// The sender is not on the allowlist (`sender_denied`); with `notice`, the configured
    /// deny notice is delivered to the conversation first.
    Deny { notice: bool },
    /// It would wait and `max` messages already wait their turn (`busy`, retryable).
    Busy { max: usize },
    /// A run for this event is queued or in flight (`accepted` duplicate, or the
    /// reference's `duplicate` error).
    InFlight,
    /// Take a place in the run queue and record the event in the ledger, then decide again.
    Record,
    /// Seen before with the same content.
    Replay(Replay),
    /// Seen before with different content (`conflict`).
    Conflict,
    /// The ledger failed (`ledger_unavailable`, retryable): the driver retries.
    Unrecorded,
    /// The hub answers it itself.
    Answer(SlashCommand),
    /// Run the runtime.
    Run,
}

/// Decides what to do with one inbound; see the module docs for the two calls.
pub fn decide(inbound: InboundView<'_>, instance: InstanceView<'_>, ledger: Lookup<'_>) -> Action {
    if inbound.channel != instance.channel {
        return Action::WrongChannel;
    }
    // An event without a verified actor is denied: nobody else may stand in for it.
    if !inbound.sender.is_some_and(|sender| instance.allow.permits(sender)) {
        // The notice replies in the conversation, which only a message has.
        return Action::Deny { notice: instance.deny_notice && inbound.text.is_some() };
    }
    if matches!(ledger, Lookup::Off | Lookup::NotAsked) {
        match instance.slot {
            Slot::Free => {}
            Slot::Full { max } => return Action::Busy { max },
            Slot::Taken => return Action::InFlight,
        }
    }
    match ledger {
        Lookup::NotAsked => Action::Record,
        Lookup::Conflict => Action::Conflict,
        Lookup::Failed => Action::Unrecorded,
        Lookup::Stored(run) => Action::Replay(replay(run)),
        Lookup::Off | Lookup::New => match inbound.text.and_then(slash_command) {
            Some(command) => Action::Answer(command),
            None => Action::Run,
        },
    }
}

fn replay(run: &StoredRun) -> Replay {
    match run.state {
        InboundState::Running => Replay::Wait,
        InboundState::Replied | InboundState::Delivered => match &run.reply {
            Some(text) => Replay::Reply(text.clone()),
            // Every run ends with a `deliver` or an `error`, its replay too.
            None => Replay::Failure {
                code: EMPTY_REPLY.to_owned(),
                message: "the agent produced no reply".to_owned(),
            },
        },
        InboundState::Failed => {
            let (code, message) = run
                .error
                .clone()
                .unwrap_or_else(|| ("agent_failed".into(), "the run failed".into()));
            Replay::Failure { code, message }
        }
    }
}

/// `/help` and `/new` (surrounding whitespace ignored); anything else is for the runtime.
pub fn slash_command(text: &str) -> Option<SlashCommand> {
    match text.trim() {
        "/help" => Some(SlashCommand::Help),
        "/new" => Some(SlashCommand::NewSession),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: InboundView<'static> =
        InboundView { channel: "test.one", sender: Some("alice"), text: Some("hi") };

    fn instance(allow: &Allowlist, slot: Slot) -> InstanceView<'_> {
        InstanceView { channel: "test.one", allow, deny_notice: false, slot }
    }

    fn alice_only() -> Allowlist {
        Allowlist::Senders(vec!["alice".into()])
    }

    fn stored(state: InboundState, reply: Option<&str>) -> StoredRun {
        StoredRun {
            run_id: "run-1".into(),
            state,
            reply: reply.map(str::to_owned),
            error: (state == InboundState::Failed)
                .then(|| ("agent_timeout".to_owned(), "too slow".to_owned())),
        }
    }

    #[test]
    fn an_allowed_message_runs_at_once_without_a_ledger_and_is_recorded_first_with_one() {
        let allow = alice_only();
        assert_eq!(decide(ALICE, instance(&allow, Slot::Free), Lookup::Off), Action::Run);
        assert_eq!(decide(ALICE, instance(&allow, Slot::Free), Lookup::NotAsked), Action::Record);
        // Once recorded, the slot is the inbound's own: the decision does not look at it.
        assert_eq!(decide(ALICE, instance(&allow, Slot::Taken), Lookup::New), Action::Run);
    }

    #[test]
    fn a_target_on_another_channel_is_refused_before_anything_else() {
        let allow = Allowlist::All;
        let elsewhere = InboundView { channel: "test.two", ..ALICE };
        assert_eq!(
            decide(elsewhere, instance(&allow, Slot::Full { max: 4 }), Lookup::NotAsked),
            Action::WrongChannel
        );
    }

    #[test]
    fn a_sender_off_the_allowlist_is_denied_and_gets_the_notice_only_for_a_message() {
        let allow = alice_only();
        let mallory = InboundView { sender: Some("mallory"), ..ALICE };
        let mut view = instance(&allow, Slot::Free);
        assert_eq!(decide(mallory, view, Lookup::NotAsked), Action::Deny { notice: false });
        view.deny_notice = true;
        assert_eq!(decide(mallory, view, Lookup::NotAsked), Action::Deny { notice: true });
        let reaction = InboundView { text: None, ..mallory };
        assert_eq!(decide(reaction, view, Lookup::NotAsked), Action::Deny { notice: false });
        // An event without an actor is denied even when everyone is allowed.
        let anonymous = InboundView { sender: None, text: None, ..ALICE };
        let everyone = Allowlist::All;
        assert_eq!(
            decide(anonymous, instance(&everyone, Slot::Free), Lookup::Off),
            Action::Deny { notice: false }
        );
    }

    #[test]
    fn a_full_queue_is_busy_and_a_repeat_of_a_queued_event_is_in_flight() {
        let allow = alice_only();
        assert_eq!(
            decide(ALICE, instance(&allow, Slot::Full { max: 4 }), Lookup::NotAsked),
            Action::Busy { max: 4 }
        );
        assert_eq!(decide(ALICE, instance(&allow, Slot::Taken), Lookup::Off), Action::InFlight);
    }

    #[test]
    fn a_redelivery_replays_what_the_ledger_holds_and_never_runs_again() {
        let allow = alice_only();
        let view = instance(&allow, Slot::Taken);
        let cases = [
            (stored(InboundState::Running, None), Replay::Wait),
            (stored(InboundState::Replied, Some("hello")), Replay::Reply("hello".into())),
            (stored(InboundState::Delivered, Some("hello")), Replay::Reply("hello".into())),
            (
                stored(InboundState::Delivered, None),
                Replay::Failure {
                    code: "empty_reply".into(),
                    message: "the agent produced no reply".into(),
                },
            ),
            (
                stored(InboundState::Failed, None),
                Replay::Failure { code: "agent_timeout".into(), message: "too slow".into() },
            ),
        ];
        for (run, expected) in cases {
            assert_eq!(decide(ALICE, view, Lookup::Stored(&run)), Action::Replay(expected));
        }
        assert_eq!(decide(ALICE, view, Lookup::Conflict), Action::Conflict);
        assert_eq!(decide(ALICE, view, Lookup::Failed), Action::Unrecorded);
    }

    #[test]
    fn help_and_new_are_answered_by_the_hub_and_only_in_messages() {
        let allow = alice_only();
        let view = instance(&allow, Slot::Free);
        let help = InboundView { text: Some("  /help\n"), ..ALICE };
        assert_eq!(decide(help, view, Lookup::Off), Action::Answer(SlashCommand::Help));
        let new = InboundView { text: Some("/new"), ..ALICE };
        assert_eq!(decide(new, view, Lookup::New), Action::Answer(SlashCommand::NewSession));
        let prose = InboundView { text: Some("/new session please"), ..ALICE };
        assert_eq!(decide(prose, view, Lookup::Off), Action::Run);
        // A redelivered /new is a replay, not a second new session.
        let run = stored(InboundState::Delivered, Some("Started a new session."));
        assert!(matches!(decide(new, view, Lookup::Stored(&run)), Action::Replay(_)));
    }
}
