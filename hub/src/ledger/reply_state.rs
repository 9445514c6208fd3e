//! The state machine of a reply's delivery, free of I/O: where a reply stands, what a
//! driver's answer (or its silence) makes of it, and when a retryable failure is tried again.
//!
//! ```text
//! pending ──► handed ──► posted                      (receipt)
//!    ▲          │  ├───► failed                      (final refusal: never retried)
//!    │          │  ├───► unknown                     (send_unknown, or no answer in time)
//!    │          │  └───► failed_retryable ──► handed (after its backoff, or at once when
//!    │          │              │                      the instance is Ready again)
//!    │          │              └──► expired          (its TTL passed)
//!    └──────────┘  the connection closed before an answer, or the hub restarted
//! ```
//!
//! `unknown`, `failed` and `expired` go back to `pending` only on an operator's request
//! (`channelctl replies retry`). A late answer to an `unknown` reply is believed: a receipt
//! makes it `posted`, an error `failed`/`failed_retryable` (the driver says nothing was
//! posted). `replies.rs` performs these transitions in SQL, asking this module first.

use std::fmt;
use std::time::Duration;

/// Where a reply stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplyState {
    /// Recorded, not yet handed to a driver (or handed to one that left before answering).
    Pending,
    /// Handed to the driver; its receipt or error has not come yet.
    Handed,
    /// The driver's receipt says it was posted.
    Posted,
    /// The driver said it was not posted and may be tried again: retried with backoff.
    FailedRetryable,
    /// The platform refused it for good: never retried automatically.
    Failed,
    /// Handed, but the driver said the outcome is unknown or never answered: it may have been
    /// posted, so it is never resent automatically.
    Unknown,
    /// Its TTL passed before it could be posted.
    Expired,
}

/// Every reply state, for queries that select by a property of the state.
pub const REPLY_STATES: [ReplyState; 7] = [
    ReplyState::Pending,
    ReplyState::Handed,
    ReplyState::Posted,
    ReplyState::FailedRetryable,
    ReplyState::Failed,
    ReplyState::Unknown,
    ReplyState::Expired,
];

impl ReplyState {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplyState::Pending => "pending",
            ReplyState::Handed => "handed",
            ReplyState::Posted => "posted",
            ReplyState::FailedRetryable => "failed_retryable",
            ReplyState::Failed => "failed",
            ReplyState::Unknown => "unknown",
            ReplyState::Expired => "expired",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        REPLY_STATES.into_iter().find(|state| state.as_str() == value)
    }

    /// Nothing more happens to it without an operator (or, for `unknown`, a late answer).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            ReplyState::Posted | ReplyState::Failed | ReplyState::Unknown | ReplyState::Expired
        )
    }

    /// Still on its way: the replies after it in its conversation wait for it.
    pub fn holds_conversation(self) -> bool {
        !self.is_final()
    }

    /// Whether a reply may move from `self` to `next`.
    pub fn may_become(self, next: ReplyState) -> bool {
        use ReplyState::*;
        matches!(
            (self, next),
            (Pending, Handed)
                | (Pending, Expired)
                | (Handed, Posted)
                | (Handed, FailedRetryable)
                | (Handed, Failed)
                | (Handed, Unknown)
                | (Handed, Pending)
                | (Handed, Expired)
                | (FailedRetryable, Handed)
                | (FailedRetryable, Expired)
                | (Unknown, Posted)
                | (Unknown, FailedRetryable)
                | (Unknown, Failed)
                | (Unknown, Expired)
                | (Unknown, Pending)
                | (Failed, Pending)
                | (Expired, Pending)
        )
    }

    /// What a reply in this state becomes when the hub restarts: one handed to a driver goes
    /// back to `pending` (the connection it was handed on is gone; see [`Answer::Lost`]).
    pub fn after_restart(self) -> ReplyState {
        match self {
            ReplyState::Handed => ReplyState::Pending,
            other => other,
        }
    }

    /// What a reply in this state becomes once its TTL passed: one waiting to be handed over
    /// expires; one handed over waits for its answer.
    pub fn after_expiry(self) -> ReplyState {
        match self {
            ReplyState::Pending | ReplyState::FailedRetryable => ReplyState::Expired,
            other => other,
        }
    }

    /// Whether an operator may ask for it to be sent again.
    pub fn operator_may_retry(self) -> bool {
        self.may_become(ReplyState::Pending) && self != ReplyState::Handed
    }
}

impl fmt::Display for ReplyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What became of a reply handed to a driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A `receipt` (or, for a driver without `reply_receipt`, the frame was written).
    Posted,
    /// An `error` frame; `retryable` as the driver said.
    Failed { retryable: bool },
    /// An `error` frame with code `send_unknown`.
    Unknown,
    /// No answer within the receipt timeout while the connection stayed up.
    NoAnswer,
    /// The connection closed before an answer came (or the frame never left the hub).
    Lost,
}

/// The first retry waits this long; each further one twice as long as the last.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
/// No retry waits longer than this.
pub const MAX_RETRY: Duration = Duration::from_secs(300);

/// How long to wait before the next attempt after `attempts` attempts failed retryably, with
/// `jitter` in `[0, 1)`: 1 s doubling per attempt up to 5 min, scaled by 0.75–1.25 (and never
/// above 5 min), so replies that failed together do not all come back in the same instant.
pub fn retry_delay(attempts: u32, jitter: f64) -> Duration {
    let doublings = attempts.saturating_sub(1).min(16);
    let base = FIRST_RETRY.saturating_mul(1 << doublings).min(MAX_RETRY);
    base.mul_f64(0.75 + 0.5 * jitter.clamp(0.0, 1.0)).min(MAX_RETRY)
}

/// Where a reply goes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Next {
    pub state: ReplyState,
    /// When it may be handed over again (meaningful for `pending` and `failed_retryable`).
    pub next_ms: u64,
}

/// What an answer makes of a reply in state `current` that was tried `attempts` times and
/// expires at `expires_ms`; `None` when the answer does not apply to it (a duplicate, an
/// answer to a reply already settled, silence from a reply that is not handed over).
pub fn after_answer(
    current: ReplyState,
    answer: Answer,
    attempts: u32,
    now_ms: u64,
    expires_ms: u64,
    jitter: f64,
) -> Option<Next> {
    let late = current == ReplyState::Unknown;
    if current != ReplyState::Handed && !late {
        return None;
    }
    let next = match answer {
        Answer::Posted => Next { state: ReplyState::Posted, next_ms: now_ms },
        Answer::Failed { retryable: false } => Next { state: ReplyState::Failed, next_ms: now_ms },
        Answer::Failed { retryable: true } if now_ms >= expires_ms => {
            Next { state: ReplyState::Expired, next_ms: now_ms }
        }
        Answer::Failed { retryable: true } => Next {
            state: ReplyState::FailedRetryable,
            next_ms: now_ms + retry_delay(attempts, jitter).as_millis() as u64,
        },
        // Only the answer itself can change an `unknown`: silence cannot.
        Answer::Unknown | Answer::NoAnswer if late => return None,
        Answer::Unknown | Answer::NoAnswer => Next { state: ReplyState::Unknown, next_ms: now_ms },
        Answer::Lost if late => return None,
        Answer::Lost => Next { state: ReplyState::Pending, next_ms: now_ms },
    };
    current.may_become(next.state).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;
    const LATER: u64 = NOW + 86_400_000;

    #[test]
    fn retries_start_at_a_second_and_double_to_five_minutes() {
        let mid: Vec<u64> = (1..=11).map(|n| retry_delay(n, 0.5).as_millis() as u64).collect();
        assert_eq!(
            mid,
            [
                1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 300_000,
                300_000
            ]
        );
        assert_eq!(retry_delay(u32::MAX, 0.999), MAX_RETRY, "no overflow, never above the cap");
        assert_eq!(retry_delay(0, 0.5), FIRST_RETRY);
    }

    #[test]
    fn jitter_spreads_a_retry_by_a_quarter_either_way() {
        assert_eq!(retry_delay(3, 0.0), Duration::from_millis(3_000));
        assert_eq!(retry_delay(3, 0.999_999).as_millis(), 4_999);
        assert_eq!(retry_delay(3, 7.0), Duration::from_millis(5_000), "jitter is clamped");
        assert!(retry_delay(9, 0.9) <= MAX_RETRY);
    }

    #[test]
    fn a_retryable_failure_is_retried_after_its_backoff_until_the_ttl() {
        let next = after_answer(
            ReplyState::Handed,
            Answer::Failed { retryable: true },
            2,
            NOW,
            LATER,
            0.5,
        );
        assert_eq!(next, Some(Next { state: ReplyState::FailedRetryable, next_ms: NOW + 2_000 }));
        assert!(ReplyState::FailedRetryable.may_become(ReplyState::Handed));
        let past = after_answer(
            ReplyState::Handed,
            Answer::Failed { retryable: true },
            9,
            LATER,
            LATER,
            0.5,
        );
        assert_eq!(past.map(|n| n.state), Some(ReplyState::Expired));
    }

    #[test]
    fn a_final_refusal_and_an_unknown_outcome_are_never_retried_by_themselves() {
        let refused = after_answer(
            ReplyState::Handed,
            Answer::Failed { retryable: false },
            1,
            NOW,
            LATER,
            0.,
        );
        assert_eq!(refused.map(|n| n.state), Some(ReplyState::Failed));
        for answer in [Answer::Unknown, Answer::NoAnswer] {
            let next = after_answer(ReplyState::Handed, answer, 1, NOW, LATER, 0.0);
            assert_eq!(next.map(|n| n.state), Some(ReplyState::Unknown));
        }
        for state in [ReplyState::Failed, ReplyState::Unknown, ReplyState::Expired] {
            assert!(state.is_final());
            assert!(
                !state.may_become(ReplyState::Handed),
                "{state} is never handed again by itself"
            );
            assert_eq!(state.after_expiry(), state);
            assert_eq!(state.after_restart(), state);
            assert!(state.operator_may_retry(), "{state} may be retried by an operator");
        }
        assert!(!ReplyState::Posted.operator_may_retry());
        assert!(!ReplyState::Handed.operator_may_retry());
        assert!(!ReplyState::Pending.operator_may_retry());
    }

    #[test]
    fn a_late_answer_settles_an_unknown_reply_but_silence_does_not() {
        let late = |answer| after_answer(ReplyState::Unknown, answer, 1, NOW, LATER, 0.0);
        assert_eq!(late(Answer::Posted).map(|n| n.state), Some(ReplyState::Posted));
        assert_eq!(
            late(Answer::Failed { retryable: true }).map(|n| n.state),
            Some(ReplyState::FailedRetryable)
        );
        assert_eq!(
            late(Answer::Failed { retryable: false }).map(|n| n.state),
            Some(ReplyState::Failed)
        );
        assert_eq!(late(Answer::NoAnswer), None);
        assert_eq!(late(Answer::Unknown), None);
        assert_eq!(late(Answer::Lost), None);
    }

    #[test]
    fn answers_to_replies_not_handed_over_change_nothing() {
        for state in [
            ReplyState::Pending,
            ReplyState::Posted,
            ReplyState::FailedRetryable,
            ReplyState::Failed,
            ReplyState::Expired,
        ] {
            for answer in [
                Answer::Posted,
                Answer::Failed { retryable: true },
                Answer::Failed { retryable: false },
                Answer::Unknown,
                Answer::NoAnswer,
                Answer::Lost,
            ] {
                assert_eq!(
                    after_answer(state, answer, 1, NOW, LATER, 0.0),
                    None,
                    "{state} {answer:?}"
                );
            }
        }
    }

    #[test]
    fn a_reply_whose_connection_closed_is_handed_over_again() {
        let next = after_answer(ReplyState::Handed, Answer::Lost, 1, NOW, LATER, 0.0);
        assert_eq!(next, Some(Next { state: ReplyState::Pending, next_ms: NOW }));
        assert_eq!(ReplyState::Handed.after_restart(), ReplyState::Pending);
    }

    #[test]
    fn only_replies_waiting_to_be_handed_over_expire() {
        assert_eq!(ReplyState::Pending.after_expiry(), ReplyState::Expired);
        assert_eq!(ReplyState::FailedRetryable.after_expiry(), ReplyState::Expired);
        assert_eq!(ReplyState::Handed.after_expiry(), ReplyState::Handed);
        assert!(ReplyState::Pending.may_become(ReplyState::Expired));
    }

    #[test]
    fn a_conversation_waits_only_for_replies_still_on_their_way() {
        let holding: Vec<&str> = REPLY_STATES
            .into_iter()
            .filter(|s| s.holds_conversation())
            .map(ReplyState::as_str)
            .collect();
        assert_eq!(holding, ["pending", "handed", "failed_retryable"]);
        for state in REPLY_STATES {
            assert_eq!(ReplyState::parse(state.as_str()), Some(state));
        }
        assert_eq!(ReplyState::parse("delivered"), None);
    }
}
