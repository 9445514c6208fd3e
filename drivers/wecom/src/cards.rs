//! Approval and choice cards waiting for a click. A command's card is opened under a fresh
//! `task_id`; a `template_card_event` for it from an allowed responder answers the command
//! (with the responder) and yields the updated card to send within the platform's 5 s. A
//! card closes when answered, when its command stops waiting, or when the table is full.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{CommandAnswer, Participant};
use tokio::sync::oneshot;

use crate::convert::{self, CardKind};
use crate::wire::{CardClick, TemplateCard};

/// Cards open at once. A command beyond it is rejected (the agent hears why) rather than
/// growing the table; the hub's command timeout keeps real use far below it.
pub const MAX_OPEN_CARDS: usize = 256;

#[derive(Debug)]
struct OpenCard {
    card: TemplateCard,
    kind: CardKind,
    answer: oneshot::Sender<CommandAnswer>,
}

/// What a click did.
#[derive(Debug, Clone, PartialEq)]
pub enum Click {
    /// It answered the command; send this card as the update.
    Answered { card: TemplateCard },
    /// From someone not in `CHANNELD_WECOM_RESPONDERS`: ignored, the card stays open.
    NotAllowed,
    /// A button the card does not have.
    UnknownButton,
    /// No open card has this `task_id` (answered, timed out, or from before a restart).
    UnknownCard,
}

/// The open cards.
#[derive(Debug)]
pub struct Cards {
    open: Mutex<HashMap<String, OpenCard>>,
    /// Random per process, so task ids never repeat across restarts (the platform refuses a
    /// reused one).
    prefix: String,
    sequence: AtomicU64,
    responders: BTreeSet<String>,
}

/// Why a card could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{MAX_OPEN_CARDS} cards are already waiting for an answer")]
pub struct TooManyCards;

/// An open card's place in the table; dropping it closes the card (the command stopped
/// waiting), so a late click finds nothing.
#[derive(Debug)]
pub struct CardGuard {
    cards: Arc<Cards>,
    task_id: String,
}

impl Drop for CardGuard {
    fn drop(&mut self) {
        self.cards.table().remove(&self.task_id);
    }
}

impl Cards {
    /// Cards whose clicks count only from `responders` (empty: from anyone; the hub then
    /// checks the responder against its allowlist).
    pub fn new(responders: BTreeSet<String>) -> Self {
        Self {
            open: Mutex::new(HashMap::new()),
            prefix: format!("cd-{:016x}", fastrand::u64(..)),
            sequence: AtomicU64::new(0),
            responders,
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<String, OpenCard>> {
        self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A `task_id` no card of this process used.
    pub fn next_task_id(&self) -> String {
        convert::task_id(&self.prefix, self.sequence.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Opens `card` (built by [`convert::command_card`]); the receiver gets the answer.
    pub fn open(
        self: &Arc<Self>,
        card: TemplateCard,
        kind: CardKind,
    ) -> Result<(CardGuard, oneshot::Receiver<CommandAnswer>), TooManyCards> {
        let (answer, receiver) = oneshot::channel();
        let task_id = card.task_id.clone();
        {
            let mut table = self.table();
            if table.len() >= MAX_OPEN_CARDS {
                return Err(TooManyCards);
            }
            table.insert(task_id.clone(), OpenCard { card, kind, answer });
        }
        Ok((CardGuard { cards: self.clone(), task_id }, receiver))
    }

    /// A click by `user`.
    pub fn click(&self, click: &CardClick, user: &str) -> Click {
        if !self.responders.is_empty() && !self.responders.contains(user) {
            return if self.table().contains_key(&click.task_id) {
                Click::NotAllowed
            } else {
                Click::UnknownCard
            };
        }
        let mut table = self.table();
        let Some(open) = table.get(&click.task_id) else { return Click::UnknownCard };
        let Some(result) = convert::card_answer(&open.kind, &click.event_key, user) else {
            return Click::UnknownButton;
        };
        let Some(open) = table.remove(&click.task_id) else { return Click::UnknownCard };
        let outcome = convert::outcome_text(&open.kind, &result, user);
        let responder = Id::new(user).ok().map(Participant::new);
        // The command may have stopped waiting just now; the card is answered either way.
        let _ = open.answer.send(CommandAnswer { result, responder });
        Click::Answered { card: convert::answered_card(&open.card, &outcome) }
    }

    /// Cards waiting for a click.
    pub fn len(&self) -> usize {
        self.table().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::types::{Command, CommandResult};
    use serde_json::json;

    use super::*;

    fn approval(cards: &Arc<Cards>) -> (CardGuard, oneshot::Receiver<CommandAnswer>, String) {
        let command = Command::RequestApproval { tool: "deploy".into(), arguments: json!({}) };
        let task_id = cards.next_task_id();
        let (card, kind) = convert::command_card(&command, &task_id).unwrap();
        let (guard, answer) = cards.open(card, kind).unwrap();
        (guard, answer, task_id)
    }

    fn click(task_id: &str, key: &str) -> CardClick {
        CardClick { task_id: task_id.into(), event_key: key.into() }
    }

    #[tokio::test]
    async fn a_click_answers_the_command_with_the_responder_and_updates_the_card() {
        let cards = Arc::new(Cards::new(BTreeSet::new()));
        let (_guard, answer, task_id) = approval(&cards);
        let Click::Answered { card } = cards.click(&click(&task_id, "approve"), "lisi") else {
            panic!("not answered")
        };
        assert_eq!(card.task_id, task_id);
        assert!(card.button_list.is_empty());
        let answer = answer.await.unwrap();
        assert_eq!(answer.result, CommandResult::Accepted);
        assert_eq!(answer.responder.unwrap().id, "lisi");
        assert_eq!(cards.click(&click(&task_id, "approve"), "lisi"), Click::UnknownCard);
    }

    #[tokio::test]
    async fn only_listed_responders_answer_and_unknown_buttons_change_nothing() {
        let cards = Arc::new(Cards::new(BTreeSet::from(["boss".to_owned()])));
        let (_guard, mut answer, task_id) = approval(&cards);
        assert_eq!(cards.click(&click(&task_id, "approve"), "intern"), Click::NotAllowed);
        assert_eq!(cards.click(&click(&task_id, "launch"), "boss"), Click::UnknownButton);
        assert!(answer.try_recv().is_err(), "still waiting");
        assert!(matches!(cards.click(&click(&task_id, "reject"), "boss"), Click::Answered { .. }));
        assert!(matches!(answer.await.unwrap().result, CommandResult::Rejected { .. }));
    }

    #[test]
    fn a_card_closes_when_its_command_stops_waiting_and_the_table_is_bounded() {
        let cards = Arc::new(Cards::new(BTreeSet::new()));
        let (guard, _answer, task_id) = approval(&cards);
        drop(guard);
        assert_eq!(cards.click(&click(&task_id, "approve"), "lisi"), Click::UnknownCard);
        let held: Vec<_> = (0..MAX_OPEN_CARDS).map(|_| approval(&cards)).collect();
        let command = Command::RequestApproval { tool: "x".into(), arguments: json!(null) };
        let (card, kind) = convert::command_card(&command, &cards.next_task_id()).unwrap();
        assert_eq!(cards.open(card, kind).unwrap_err(), TooManyCards);
        drop(held);
        assert!(cards.is_empty());
    }
}
