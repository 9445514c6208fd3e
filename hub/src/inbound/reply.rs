//! What goes back to the driver about an inbound: `accepted`, an `error` frame, and the reply
//! (`deliver`) — recorded as handed over, or, with `reply_receipt`, once the driver's
//! receipt says it was posted. Also the sweep that hands a reconnected driver the replies it
//! missed.

use std::time::SystemTime;

use channeld_protocol::frame::{Accepted, Delivery};
use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{EncodeError, Frame, Id, MAX_LINE_BYTES, encode};
use tracing::{debug, info, warn};

use super::decide::EMPTY_REPLY;
use crate::connection::Connection;
use crate::hub::Hub;
use crate::instance::{Counters, Instance, unix_ms};

/// Ends a reply that was cut so that its `deliver` frame fits in one line.
pub const CUT_MARKER: &str = "\n[reply truncated]";

/// More than the envelope, the event id and the target's ids (each at most 256 bytes,
/// escaped at most six times over) add to a reply's escaped text in its `deliver` frame.
const FRAME_SLACK: usize = 16 * 1024;

fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// Answers an inbound with an `error` frame. It waits for room in the connection's queue:
/// the driver relies on this answer to settle the message.
pub async fn refuse(
    conn: &Connection,
    event_id: &Id,
    code: &str,
    message: String,
    retryable: bool,
) {
    let _ = conn.sink.send(&Frame::error(Some(event_id.clone()), code, message, retryable)).await;
}

/// Tells the driver the hub took responsibility (extension `accepted`). Like [`refuse`], it
/// waits for room rather than drop the answer.
pub async fn accept(conn: &Connection, event_id: &Id, duplicate: bool) {
    if conn.declaration.extensions.accepted {
        let frame = Frame::Accepted(Accepted { event_id: event_id.clone(), duplicate });
        let _ = conn.sink.send(&frame).await;
    }
}

/// Where a reply goes: the conversation and thread of the inbound, answering `reply_to`.
pub fn reply_target(origin: &MessageTarget, reply_to: Option<Id>) -> MessageTarget {
    MessageTarget {
        channel: origin.channel.clone(),
        conversation: origin.conversation.clone(),
        thread: origin.thread.clone(),
        reply_to,
    }
}

/// What a reply becomes so that its `deliver` frame fits in one line: NULs removed (no body
/// holds one) and, when the frame would exceed [`MAX_LINE_BYTES`] once JSON-escaped, cut at
/// a character boundary and marked with [`CUT_MARKER`]. Cut rather than split: an event gets
/// exactly one `deliver`, and drivers split text for their platform's own limits. Pure.
pub fn fit_reply(event_id: &Id, target: &MessageTarget, mut text: String) -> String {
    if text.contains('\0') {
        text = text.replace('\0', "");
    }
    // Escaping at most sextuples a byte, and ids and envelope add less than the slack: a
    // reply this short fits without measuring.
    if text.len() * 6 + FRAME_SLACK <= MAX_LINE_BYTES {
        return text;
    }
    let len = match MessageBody::text(text.clone())
        .map(|body| encode(&deliver_frame(event_id, target, body)))
    {
        Ok(Err(EncodeError::TooLong { len, .. })) => len,
        _ => return text,
    };
    // Escaping is per character, so dropping characters from the end shortens the frame by
    // exactly their escaped length.
    let excess = len - MAX_LINE_BYTES + escaped_len(CUT_MARKER);
    let mut dropped = 0;
    let mut cut = text.len();
    for (at, c) in text.char_indices().rev() {
        if dropped >= excess {
            break;
        }
        dropped += escaped_char_len(c);
        cut = at;
    }
    text.truncate(cut);
    text.push_str(CUT_MARKER);
    text
}

/// How many bytes `c` takes inside a JSON string as `serde_json` writes it.
fn escaped_char_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{08}' | '\u{0c}' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

fn escaped_len(text: &str) -> usize {
    text.chars().map(escaped_char_len).sum()
}

fn deliver_frame(event_id: &Id, target: &MessageTarget, body: MessageBody) -> Frame {
    Frame::Deliver(Delivery {
        request_id: event_id.clone(),
        message: OutboundMessage { target: target.clone(), body, metadata: Default::default() },
    })
}

/// The encoded `deliver` line of a reply, fitted; or the `error` the driver gets instead
/// when the reply cannot be a frame (nothing left after removing NULs).
fn deliver_line(
    event_id: &Id,
    target: &MessageTarget,
    text: String,
) -> Result<Vec<u8>, (&'static str, String)> {
    let body = MessageBody::text(fit_reply(event_id, target, text))
        .map_err(|err| (EMPTY_REPLY, format!("the reply is not a message body: {err}")))?;
    encode(&deliver_frame(event_id, target, body))
        .map_err(|err| ("agent_output_too_large", err.to_string()))
}

/// Sends the reply for `event_id` on `conn` and records that it was handed over (or, with
/// `reply_receipt`, leaves that to the driver's receipt). A reply that cannot be a frame is
/// answered with an `error` instead and recorded as handed over: it never becomes one.
pub async fn deliver(
    hub: &Hub,
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    text: String,
) {
    let line = match deliver_line(event_id, &target, text) {
        Ok(line) => line,
        Err((code, message)) => {
            inst.record_error(format!("reply for {event_id} not deliverable: {message}"));
            warn!(instance = %inst.config.id, %event_id, code, error = %message, "reply cannot be a frame; the driver gets an error instead");
            refuse(conn, event_id, code, message, false).await;
            mark_delivered(hub, inst, event_id).await;
            return;
        }
    };
    match conn.sink.send_encoded(line).await {
        Ok(()) => {
            Counters::bump(&inst.counters.replies);
            if !conn.declaration.extensions.reply_receipt {
                mark_delivered(hub, inst, event_id).await;
            }
        }
        Err(err) => {
            inst.record_error(format!("reply for {event_id} not delivered: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply not delivered: driver connection gone");
        }
    }
}

async fn mark_delivered(hub: &Hub, inst: &Instance, event_id: &Id) {
    if !hub.ledger.is_on() {
        return;
    }
    let recorded =
        hub.ledger.mark_delivered(inst.config.id.to_string(), event_id.to_string(), now_ms()).await;
    if let Err(err) = recorded {
        warn!(instance = %inst.config.id, %event_id, error = %err, "delivery not recorded");
    }
}

/// A `receipt` no outbound waited for: with `reply_receipt` it confirms the reply to the
/// event it names, which the ledger then records as delivered (off the reader).
pub fn on_receipt(hub: &Hub, inst: &Instance, conn: &Connection, event_id: Id) {
    if !(conn.declaration.extensions.reply_receipt && hub.ledger.is_on()) {
        debug!(instance = %inst.config.id, request_id = %event_id, "receipt nobody waits for");
        return;
    }
    let ledger = hub.ledger.clone();
    let instance = inst.config.id.to_string();
    hub.tasks.spawn(async move {
        if let Err(err) = ledger.mark_delivered(instance, event_id.into_string(), now_ms()).await {
            warn!(error = %err, "reply receipt not recorded");
        }
    });
}

/// Hands a (re)connected driver the replies the ledger still owes its instance, oldest
/// first; a reply its run is handing over right now is left to that run.
pub async fn deliver_missed(hub: &Hub, inst: &Instance, conn: &Connection) {
    let pending = match hub.ledger.pending_replies(inst.config.id.to_string()).await {
        Ok(pending) => pending,
        Err(err) => {
            warn!(instance = %inst.config.id, error = %err, "pending replies not read");
            return;
        }
    };
    if !pending.is_empty() {
        info!(instance = %inst.config.id, replies = pending.len(), "delivering replies the driver missed");
    }
    for reply in pending {
        if inst.is_replying(&reply.event_id) {
            continue;
        }
        let target = match channeld_protocol::decode(&reply.frame) {
            Ok(Frame::Inbound(inbound)) => {
                reply_target(&inbound.message.target, Some(inbound.message.id.clone()))
            }
            Ok(Frame::InboundEvent(event)) => reply_target(&event.event.context().target, None),
            _ => continue,
        };
        let Ok(event_id) = Id::new(reply.event_id) else { continue };
        deliver(hub, inst, conn, &event_id, target, reply.reply).await;
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::ChannelId;

    use super::*;

    fn target(conversation: &str) -> MessageTarget {
        let channel = ChannelId::new("test.one").unwrap();
        let mut target = MessageTarget::new(channel, Id::new(conversation).unwrap());
        target.reply_to = Some(Id::new(conversation).unwrap());
        target
    }

    fn frame_len(event_id: &Id, target: &MessageTarget, text: &str) -> usize {
        let body = MessageBody::text(text.to_owned()).unwrap();
        match encode(&deliver_frame(event_id, target, body)) {
            Ok(line) => line.len(),
            Err(EncodeError::TooLong { len, .. }) => len,
            Err(err) => panic!("{err}"),
        }
    }

    #[test]
    fn escaped_lengths_are_what_serde_json_writes() {
        let mut samples: Vec<char> = (0u8..0x80).map(char::from).collect();
        samples.extend(['é', '€', '😀', '\u{2028}', '\u{feff}']);
        for c in samples {
            let written = serde_json::to_string(&c.to_string()).unwrap().len() - 2;
            assert_eq!(escaped_char_len(c), written, "{c:?}");
        }
    }

    #[test]
    fn a_reply_that_fits_is_left_alone_and_nuls_are_removed() {
        let event = Id::new("e-1").unwrap();
        assert_eq!(fit_reply(&event, &target("c1"), "a\0b".into()), "ab");
        let text = "x".repeat(100_000);
        assert_eq!(fit_reply(&event, &target("c1"), text.clone()), text);
    }

    #[test]
    fn a_reply_too_big_once_escaped_is_cut_to_exactly_fit_its_frame() {
        let event = Id::new("e-1").unwrap();
        // Quotes and backslashes double, control characters take six bytes, é two, the
        // emoji four; the conversation id is escaped too.
        let cases = [
            "\"".repeat(200_000),
            "\\".repeat(140_000),
            "\u{1}".repeat(50_000),
            "é".repeat(150_000),
            format!("{}{}", "a".repeat(262_000), "😀".repeat(10)),
            "\"é\u{2}😀x\n".repeat(30_000),
        ];
        for conversation in ["c1", &"\"".repeat(256)] {
            let target = target(conversation);
            for text in &cases {
                let fitted = fit_reply(&event, &target, text.clone());
                let kept = fitted.strip_suffix(CUT_MARKER).expect("marked as cut");
                assert!(text.starts_with(kept));
                let len = frame_len(&event, &target, &fitted);
                assert!(len <= MAX_LINE_BYTES, "{len}");
                // Nothing more than needed was cut: one more character would not fit.
                let next = text[kept.len()..].chars().next().unwrap();
                let longer = format!("{kept}{next}{CUT_MARKER}");
                assert!(frame_len(&event, &target, &longer) > MAX_LINE_BYTES);
                assert!(deliver_line(&event, &target, text.clone()).is_ok());
            }
        }
    }

    #[test]
    fn a_reply_of_only_nuls_becomes_an_empty_reply_error() {
        let event = Id::new("e-1").unwrap();
        let refused = deliver_line(&event, &target("c1"), "\0\0".into()).unwrap_err();
        assert_eq!(refused.0, "empty_reply");
    }
}
