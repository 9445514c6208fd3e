//! Live-effect bookkeeping, pure: which message is a conversation's preview, when it may be
//! updated next and with what text, whether its reply is already out; which message shows
//! the typing reaction; which threads are assistant threads. [`crate::outbound`] does the
//! Slack calls these decisions ask for.
//!
//! The hub sends live effects without `reply_to`, so previews and typing belong to a
//! conversation and thread; a new inbound message there starts a new turn.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::MessageTarget;

/// Previews remembered at once (oldest dropped: its run is long over).
const MAX_PREVIEWS: usize = 1024;
/// Threads, messages and DMs remembered (oldest forgotten first).
pub const MAX_REMEMBERED: usize = 4096;

/// A message posted: where and its ts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub channel: String,
    pub ts: String,
}

/// A bounded insertion-ordered map (oldest evicted).
#[derive(Debug)]
pub struct Bounded<V> {
    map: HashMap<String, V>,
    order: VecDeque<String>,
    capacity: usize,
}

impl<V> Bounded<V> {
    pub fn new(capacity: usize) -> Self {
        Self { map: HashMap::new(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    pub fn get(&self, key: &str) -> Option<&V> {
        self.map.get(key)
    }

    pub fn remove(&mut self, key: &str) -> Option<V> {
        let value = self.map.remove(key)?;
        self.order.retain(|k| k != key);
        Some(value)
    }

    pub fn insert(&mut self, key: String, value: V) {
        if self.map.insert(key.clone(), value).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// A conversation and thread as one key.
fn place(target: &MessageTarget) -> String {
    format!("{}\u{0}{}", target.conversation, target.thread.as_ref().map_or("", |t| t.as_str()))
}

#[derive(Debug)]
struct Preview {
    placed: Placed,
    last_update: Instant,
    /// Text waiting for the next allowed update (only the newest is kept).
    pending: Option<String>,
}

/// What to do with a preview's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreviewStep {
    /// No preview yet: post it (then [`Live::preview_posted`]).
    Post,
    /// The text waits; at this instant [`Live::preview_due`] hands out the newest.
    UpdateAt(Instant),
    /// The reply is already out: a preview now would stand beside it.
    Drop,
}

/// The live-effect state of every conversation.
#[derive(Debug)]
pub struct Live {
    previews: Bounded<Preview>,
    /// Places whose reply is out (until their next inbound message).
    replied: Bounded<()>,
    assistant_threads: Bounded<()>,
    /// The latest inbound message per place: what typing marks.
    last_inbound: Bounded<String>,
    /// Where the typing reaction shows now, per place.
    typing_on: Bounded<String>,
    interval: Duration,
}

impl Live {
    /// `interval`: the least time between two updates of one preview.
    pub fn new(interval: Duration) -> Self {
        Self {
            previews: Bounded::new(MAX_PREVIEWS),
            replied: Bounded::new(MAX_PREVIEWS),
            assistant_threads: Bounded::new(MAX_REMEMBERED),
            last_inbound: Bounded::new(MAX_REMEMBERED),
            typing_on: Bounded::new(MAX_REMEMBERED),
            interval,
        }
    }

    pub fn assistant_thread(&mut self, channel: &str, thread_ts: &str) {
        self.assistant_threads.insert(format!("{channel}:{thread_ts}"), ());
    }

    pub fn is_assistant_thread(&self, channel: &str, thread: Option<&str>) -> bool {
        thread.is_some_and(|ts| self.assistant_threads.get(&format!("{channel}:{ts}")).is_some())
    }

    /// A new message arrived at `target`'s place: a new turn (typing marks it; the previous
    /// turn's preview and reply are forgotten).
    pub fn inbound_seen(&mut self, target: &MessageTarget, message_id: &str) {
        let key = place(target);
        self.last_inbound.insert(key.clone(), message_id.to_owned());
        self.replied.remove(&key);
        self.previews.remove(&key);
    }

    /// A preview's (converted) text arrives at `now`.
    pub fn preview(&mut self, target: &MessageTarget, text: String, now: Instant) -> PreviewStep {
        let key = place(target);
        if self.replied.get(&key).is_some() {
            return PreviewStep::Drop;
        }
        match self.previews.map.get_mut(&key) {
            None => PreviewStep::Post,
            Some(preview) => {
                preview.pending = Some(text);
                PreviewStep::UpdateAt((preview.last_update + self.interval).max(now))
            }
        }
    }

    /// The preview's first message is posted.
    pub fn preview_posted(&mut self, target: &MessageTarget, placed: Placed, now: Instant) {
        self.previews.insert(place(target), Preview { placed, last_update: now, pending: None });
    }

    /// The newest waiting text and where it goes, if any (nothing when a reply took the
    /// preview meanwhile or another update already sent it).
    pub fn preview_due(
        &mut self,
        target: &MessageTarget,
        now: Instant,
    ) -> Option<(Placed, String)> {
        let preview = self.previews.map.get_mut(&place(target))?;
        let text = preview.pending.take()?;
        preview.last_update = now;
        Some((preview.placed.clone(), text))
    }

    /// A post is going out at `target`: its preview (to replace). For a reply (`reply_to`
    /// set) later previews are dropped until the next turn; a proactive send leaves them be.
    pub fn take_preview(&mut self, target: &MessageTarget) -> Option<Placed> {
        let key = place(target);
        if target.reply_to.is_some() {
            self.replied.insert(key.clone(), ());
        }
        self.previews.remove(&key).map(|preview| preview.placed)
    }

    /// The message typing shows on (`active`) or is taken off (`!active`): the effect's
    /// `reply_to`, else the latest inbound message there.
    pub fn typing(&mut self, target: &MessageTarget, active: bool) -> Option<String> {
        let key = place(target);
        let message = target
            .reply_to
            .as_ref()
            .map(|r| r.as_str().to_owned())
            .or_else(|| self.last_inbound.get(&key).cloned());
        if active {
            let message = message?;
            self.typing_on.insert(key, message.clone());
            Some(message)
        } else {
            self.typing_on.remove(&key).or(message)
        }
    }

    /// The message still showing the typing reaction after a reply, if any.
    pub fn typing_shown(&mut self, target: &MessageTarget) -> Option<String> {
        self.typing_on.remove(&place(target))
    }
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::{ChannelId, Id};

    use super::*;

    fn at(conversation: &str, thread: Option<&str>) -> MessageTarget {
        let mut target =
            MessageTarget::new(ChannelId::new("slack.t").unwrap(), Id::new(conversation).unwrap());
        target.thread = thread.map(|t| Id::new(t).unwrap());
        target
    }

    fn placed(ts: &str) -> Placed {
        Placed { channel: "C1".into(), ts: ts.into() }
    }

    #[test]
    fn a_preview_is_posted_once_then_updated_with_the_newest_text_per_interval() {
        let start = Instant::now();
        let mut live = Live::new(Duration::from_secs(1));
        let here = at("C1", Some("1.0"));
        assert_eq!(live.preview(&here, "a".into(), start), PreviewStep::Post);
        live.preview_posted(&here, placed("2.0"), start);
        let due = start + Duration::from_secs(1);
        assert_eq!(live.preview(&here, "b".into(), start), PreviewStep::UpdateAt(due));
        assert_eq!(live.preview(&here, "c".into(), start), PreviewStep::UpdateAt(due));
        assert_eq!(live.preview_due(&here, due), Some((placed("2.0"), "c".into())));
        assert_eq!(live.preview_due(&here, due), None, "one update for the folded texts");
        assert_eq!(live.preview(&at("C1", Some("9.0")), "x".into(), start), PreviewStep::Post);
    }

    #[test]
    fn the_reply_takes_the_preview_and_drops_later_ones_until_the_next_turn() {
        let now = Instant::now();
        let mut live = Live::new(Duration::ZERO);
        let here = at("D1", None);
        let mut reply = here.clone();
        reply.reply_to = Some(channeld_driver_sdk::protocol::Id::new("D1:1.0").unwrap());
        live.preview_posted(&here, placed("2.0"), now);
        assert_eq!(live.take_preview(&reply), Some(placed("2.0")));
        assert_eq!(live.preview_due(&here, now), None);
        assert_eq!(live.preview(&here, "late".into(), now), PreviewStep::Drop);
        live.inbound_seen(&here, "D1:3.0");
        assert_eq!(live.preview(&here, "next turn".into(), now), PreviewStep::Post);
    }

    #[test]
    fn typing_marks_the_latest_inbound_and_is_cleared_once() {
        let mut live = Live::new(Duration::ZERO);
        let here = at("C1", Some("1.0"));
        assert_eq!(live.typing(&here, true), None, "nothing to mark yet");
        live.inbound_seen(&here, "C1:1.5");
        assert_eq!(live.typing(&here, true).as_deref(), Some("C1:1.5"));
        assert_eq!(live.typing_shown(&here).as_deref(), Some("C1:1.5"));
        assert_eq!(live.typing_shown(&here), None);
        live.assistant_thread("D1", "5.0");
        assert!(live.is_assistant_thread("D1", Some("5.0")));
        assert!(!live.is_assistant_thread("D1", None));
    }

    #[test]
    fn bounded_maps_forget_the_oldest() {
        let mut map = Bounded::new(2);
        for key in ["a", "b", "c"] {
            map.insert(key.to_owned(), ());
        }
        assert_eq!(map.len(), 2);
        assert!(map.get("a").is_none() && map.get("c").is_some());
    }
}
