//! The reply to one callback as a state machine, free of I/O. A reply is a stream on the
//! callback's `req_id`: a placeholder or preview opens it (`finish: false`), every later
//! frame replaces the whole content, and `finish: true` freezes it. The stream takes frames
//! for a limited window after its first one; a final reply that would land after it, or that
//! the platform refuses as expired (846608) or unknown (846605), goes as proactive messages
//! instead, once. Content over the platform's limit is split: the stream carries the first
//! part, proactive messages the rest, in order.
//!
//! Stream frames replace content, so sending one again is harmless; proactive messages are
//! not, so a proactive fallback happens only when the stream certainly did not show the
//! final text.

use std::time::Duration;

use tokio::time::Instant;

use crate::convert;
use crate::wire::{self, StreamFrame};

/// Where the stream stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stream {
    /// Nothing sent yet.
    Idle,
    /// Frames went out on `id`; the first at `started`.
    Open { id: String, started: Instant },
    /// A frame's outcome is unknown (no acknowledgement in time, or the connection dropped):
    /// the stream may show its content or the one before.
    Uncertain { id: String, started: Instant },
    /// `finish: true` was acknowledged.
    Finished { id: String },
    /// The platform refused the stream (expired or unknown `req_id`); it takes no more frames.
    Closed,
}

/// How a frame ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Acked,
    Refused {
        errcode: i64,
    },
    /// Written, but no acknowledgement came (timeout or connection lost).
    Lost,
    /// Never written (no connection): the platform did not see it.
    NotSent,
}

/// How a final reply goes out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalPlan<'a> {
    /// The stream's last frame with the first part, if the stream can take it.
    pub stream: Option<StreamFrame>,
    /// Parts for `aibot_send_msg`, in order, after the stream frame (or all of them).
    pub proactive: Vec<&'a str>,
}

/// One callback's reply.
#[derive(Debug, Clone)]
pub struct Reply {
    stream: Stream,
    /// A frame of the current stream reached the platform (acknowledged or lost after
    /// writing): until then a failed opening frame leaves nothing open.
    reached: bool,
    window: Duration,
    ack_timeout: Duration,
}

impl Reply {
    /// A reply whose stream takes frames for `window` after its first one; a frame is
    /// planned only if its acknowledgement (at most `ack_timeout`) can come within it.
    pub fn new(window: Duration, ack_timeout: Duration) -> Self {
        Self { stream: Stream::Idle, reached: false, window, ack_timeout }
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Whether a frame sent `now` lands within the window of a stream opened at `started`.
    fn in_window(&self, started: Instant, now: Instant) -> bool {
        now + self.ack_timeout < started + self.window
    }

    /// Whether nothing was sent yet (a placeholder may open the stream).
    pub fn is_idle(&self) -> bool {
        self.stream == Stream::Idle
    }

    /// A progress frame (placeholder or preview) showing `content`, opening the stream with
    /// `new_id()` if needed; `None` when the stream can take no more progress (finished,
    /// closed or past its window). Over-long content is cut: the final reply is split instead.
    pub fn progress(
        &mut self,
        content: &str,
        now: Instant,
        new_id: impl FnOnce() -> String,
    ) -> Option<StreamFrame> {
        let content = convert::truncate_content(content, wire::MAX_CONTENT_BYTES).to_owned();
        let id = match &self.stream {
            Stream::Idle => {
                let id = new_id();
                self.stream = Stream::Open { id: id.clone(), started: now };
                id
            }
            Stream::Open { id, started } | Stream::Uncertain { id, started }
                if self.in_window(*started, now) =>
            {
                id.clone()
            }
            _ => return None,
        };
        Some(StreamFrame { id, finish: false, content })
    }

    /// How the final `text` goes out `now`.
    pub fn plan_final<'a>(
        &mut self,
        text: &'a str,
        now: Instant,
        new_id: impl FnOnce() -> String,
    ) -> FinalPlan<'a> {
        let parts = convert::split_content(text, wire::MAX_CONTENT_BYTES);
        let id = match &self.stream {
            Stream::Idle => {
                let id = new_id();
                self.stream = Stream::Open { id: id.clone(), started: now };
                Some(id)
            }
            Stream::Open { id, started } | Stream::Uncertain { id, started }
                if self.in_window(*started, now) =>
            {
                Some(id.clone())
            }
            _ => None,
        };
        match id {
            Some(id) => FinalPlan {
                stream: Some(StreamFrame { id, finish: true, content: parts[0].to_owned() }),
                proactive: parts[1..].to_vec(),
            },
            None => FinalPlan { stream: None, proactive: parts },
        }
    }

    /// Records how `frame` ended.
    pub fn record(&mut self, frame: &StreamFrame, outcome: Outcome) {
        let started = match &self.stream {
            Stream::Open { started, .. } | Stream::Uncertain { started, .. } => Some(*started),
            _ => None,
        };
        if matches!(outcome, Outcome::Acked | Outcome::Lost) {
            self.reached = true;
        }
        self.stream = match (outcome, started) {
            (Outcome::Acked, _) if frame.finish => Stream::Finished { id: frame.id.clone() },
            (Outcome::Acked, Some(started)) => Stream::Open { id: frame.id.clone(), started },
            (Outcome::Refused { errcode }, _) if closes(errcode) => Stream::Closed,
            (Outcome::Lost, Some(started)) => Stream::Uncertain { id: frame.id.clone(), started },
            // The opening frame never took: nothing is open, the next frame opens anew.
            (Outcome::Refused { .. } | Outcome::NotSent, Some(_)) if !self.reached => Stream::Idle,
            // Any other failure leaves the stream as it was.
            _ => return,
        };
    }
}

/// Whether `errcode` means the stream on this `req_id` takes no more frames.
pub fn closes(errcode: i64) -> bool {
    errcode == wire::ERR_STREAM_EXPIRED || errcode == wire::ERR_UNKNOWN_REQ_ID
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(360);
    const ACK: Duration = Duration::from_secs(5);

    fn ids() -> impl FnMut() -> String {
        let mut next = 0;
        move || {
            next += 1;
            format!("s{next}")
        }
    }

    #[test]
    fn placeholder_preview_and_final_share_one_stream() {
        let mut reply = Reply::new(WINDOW, ACK);
        let mut id = ids();
        let t0 = Instant::now();
        let placeholder = reply.progress("…", t0, &mut id).unwrap();
        assert_eq!(
            placeholder,
            StreamFrame { id: "s1".into(), finish: false, content: "…".into() }
        );
        reply.record(&placeholder, Outcome::Acked);
        let preview = reply.progress("draft", t0 + Duration::from_secs(10), &mut id).unwrap();
        assert_eq!(preview.id, "s1");
        reply.record(&preview, Outcome::Acked);
        let plan = reply.plan_final("done", t0 + Duration::from_secs(20), &mut id);
        let last = plan.stream.clone().unwrap();
        assert_eq!(last, StreamFrame { id: "s1".into(), finish: true, content: "done".into() });
        assert!(plan.proactive.is_empty());
        reply.record(&last, Outcome::Acked);
        assert_eq!(reply.stream(), &Stream::Finished { id: "s1".into() });
        assert_eq!(reply.progress("late", t0 + Duration::from_secs(21), &mut id), None);
    }

    #[test]
    fn a_final_reply_that_would_land_after_the_window_goes_proactive() {
        let mut reply = Reply::new(WINDOW, ACK);
        let t0 = Instant::now();
        let placeholder = reply.progress("…", t0, ids()).unwrap();
        reply.record(&placeholder, Outcome::Acked);
        // Its acknowledgement could come after the window closes.
        let late = t0 + WINDOW - ACK;
        assert_eq!(reply.progress("draft", late, ids()), None);
        let plan = reply.plan_final("done", late, ids());
        assert_eq!(plan, FinalPlan { stream: None, proactive: vec!["done"] });
    }

    #[test]
    fn an_expired_or_unknown_stream_closes_and_the_final_goes_proactive() {
        for errcode in [wire::ERR_STREAM_EXPIRED, wire::ERR_UNKNOWN_REQ_ID] {
            let mut reply = Reply::new(WINDOW, ACK);
            let t0 = Instant::now();
            let plan = reply.plan_final("done", t0, ids());
            reply.record(plan.stream.as_ref().unwrap(), Outcome::Refused { errcode });
            assert_eq!(reply.stream(), &Stream::Closed);
            assert_eq!(reply.plan_final("done", t0, ids()).proactive, ["done"]);
        }
    }

    #[test]
    fn long_content_is_split_between_the_stream_and_proactive_messages() {
        let mut reply = Reply::new(WINDOW, ACK);
        let text = "x".repeat(wire::MAX_CONTENT_BYTES * 2 + 10);
        let plan = reply.plan_final(&text, Instant::now(), ids());
        let first = plan.stream.unwrap().content;
        assert_eq!(first.len(), wire::MAX_CONTENT_BYTES);
        assert_eq!(
            plan.proactive.iter().map(|part| part.len()).collect::<Vec<_>>(),
            [wire::MAX_CONTENT_BYTES, 10]
        );
        assert_eq!(first + &plan.proactive.concat(), text);
    }

    #[test]
    fn a_lost_frame_leaves_the_stream_uncertain_and_still_replaceable() {
        let mut reply = Reply::new(WINDOW, ACK);
        let t0 = Instant::now();
        let placeholder = reply.progress("…", t0, ids()).unwrap();
        reply.record(&placeholder, Outcome::Lost);
        assert!(matches!(reply.stream(), Stream::Uncertain { .. }));
        // Replacing content is harmless, so the final still goes on the same stream.
        let plan = reply.plan_final("done", t0 + Duration::from_secs(1), ids());
        assert_eq!(plan.stream.unwrap().id, "s1");
    }

    #[test]
    fn another_refusal_leaves_the_stream_as_it_was() {
        let mut reply = Reply::new(WINDOW, ACK);
        let t0 = Instant::now();
        let placeholder = reply.progress("…", t0, ids()).unwrap();
        reply.record(&placeholder, Outcome::Acked);
        let preview = reply.progress("draft", t0, ids()).unwrap();
        reply.record(&preview, Outcome::Refused { errcode: 45009 });
        assert_eq!(reply.stream(), &Stream::Open { id: "s1".into(), started: t0 });
    }

    #[test]
    fn an_opening_frame_that_never_took_leaves_nothing_open() {
        let mut reply = Reply::new(WINDOW, ACK);
        let t0 = Instant::now();
        let mut id = ids();
        let placeholder = reply.progress("…", t0, &mut id).unwrap();
        reply.record(&placeholder, Outcome::NotSent);
        assert!(reply.is_idle());
        // The next frame opens a new stream with a new window.
        let later = t0 + WINDOW;
        let plan = reply.plan_final("done", later, &mut id);
        assert_eq!(plan.stream.unwrap().id, "s2");
        assert_eq!(reply.stream(), &Stream::Open { id: "s2".into(), started: later });
    }
}
