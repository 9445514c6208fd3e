//! What goes back to the driver about an inbound: `accepted`, an `error` frame, and the reply
//! (`deliver`). A driver's reply is recorded for the courier (`crate::courier`), which
//! delivers and retries it; here are the reply's record, the direct hand-over of a reply the
//! ledger does not track (ledger off, legacy peers), and the answer to a redelivered event.

use channeld_protocol::frame::{Accepted, Delivery};
use channeld_protocol::types::{MessageBody, MessageTarget, Metadata, OutboundMessage};
use channeld_protocol::{EncodeError, Frame, Id, MAX_LINE_BYTES, encode};
use tracing::{debug, warn};

use super::decide::EMPTY_REPLY;
use crate::connection::{Connection, PeerKind};
use crate::hub::Hub;
use crate::instance::{Counters, Instance};
use crate::ledger::{NewReply, ReplyState, StoredReply};

/// Ends a reply that was cut so that its `deliver` frame fits in one line.
pub const CUT_MARKER: &str = "\n[reply truncated]";

/// More than the envelope, the event id and the target's ids (each at most 256 bytes,
/// escaped at most six times over) and the reply's metadata (at most 8 KiB of JSON, the
/// runtime's bound) add to a reply's escaped text in its `deliver` frame.
const FRAME_SLACK: usize = 32 * 1024;

/// Answers an inbound with an `error` frame. It waits for room in the connection's queue:
/// the driver relies on this answer to settle the message.
pub async fn refuse(
    conn: &Connection,
    event_id: &Id,
    code: &str,
    message: String,
    retryable: bool,
) {
    // Made and encoded in a statement of its own: the frame is not kept across the wait.
    let sending = conn.sink.send(&Frame::error(Some(event_id.clone()), code, message, retryable));
    let _ = sending.await;
}

/// Tells the driver the hub took responsibility (extension `accepted`). Like [`refuse`], it
/// waits for room rather than drop the answer.
pub async fn accept(conn: &Connection, event_id: &Id, duplicate: bool) {
    if conn.declaration.extensions.accepted {
        let sending =
            conn.sink.send(&Frame::Accepted(Accepted { event_id: event_id.clone(), duplicate }));
        let _ = sending.await;
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
pub fn fit_reply(
    event_id: &Id,
    target: &MessageTarget,
    metadata: &Metadata,
    mut text: String,
) -> String {
    if text.contains('\0') {
        text = text.replace('\0', "");
    }
    // Escaping at most sextuples a byte, and ids and envelope add less than the slack: a
    // reply this short fits without measuring.
    if text.len() * 6 + FRAME_SLACK <= MAX_LINE_BYTES {
        return text;
    }
    let len = match MessageBody::text(text.clone())
        .map(|body| encode(&deliver_frame(event_id, target, metadata, body)))
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

fn deliver_frame(
    event_id: &Id,
    target: &MessageTarget,
    metadata: &Metadata,
    body: MessageBody,
) -> Frame {
    Frame::Deliver(Delivery {
        request_id: event_id.clone(),
        message: OutboundMessage { target: target.clone(), body, metadata: metadata.clone() },
    })
}

/// The encoded `deliver` line of a reply, fitted; or the `error` the driver gets instead
/// when the reply cannot be a frame (nothing left after removing NULs).
fn deliver_line(
    event_id: &Id,
    target: &MessageTarget,
    metadata: &Metadata,
    text: String,
) -> Result<Vec<u8>, (&'static str, String)> {
    let body = MessageBody::text(fit_reply(event_id, target, metadata, text))
        .map_err(|err| (EMPTY_REPLY, format!("the reply is not a message body: {err}")))?;
    encode(&deliver_frame(event_id, target, metadata, body))
        .map_err(|err| ("agent_output_too_large", err.to_string()))
}

/// The delivery record of a run's reply, for the courier: its `deliver` message, due now,
/// tried until the reply TTL. `None` when the reply cannot be a message body (it is then
/// handed over directly, where it becomes an `error`).
pub fn new_reply(
    hub: &Hub,
    inst: &Instance,
    event_id: &Id,
    target: &MessageTarget,
    metadata: &Metadata,
    text: &str,
    stream_seq: Option<u64>,
) -> Option<NewReply> {
    let body = MessageBody::text(fit_reply(event_id, target, metadata, text.to_owned())).ok()?;
    let message = OutboundMessage { target: target.clone(), body, metadata: metadata.clone() };
    let now = crate::clock::now_ms();
    Some(NewReply {
        instance: inst.config.id.to_string(),
        event_id: event_id.to_string(),
        conversation: target.conversation.to_string(),
        message: serde_json::to_vec(&StoredReply { message, stream_seq }).ok()?,
        expires_ms: now + hub.config.reply_ttl.as_millis() as u64,
    })
}

/// Sends a reply the ledger does not track on `conn`, once. A reply that cannot be a frame is
/// answered with an `error` instead.
pub async fn deliver(
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    metadata: &Metadata,
    text: String,
) {
    let line = match deliver_line(event_id, &target, metadata, text) {
        Ok(line) => line,
        Err((code, message)) => {
            inst.record_error(format!("reply for {event_id} not deliverable: {message}"));
            warn!(instance = %inst.config.id, %event_id, code, error = %message, "reply cannot be a frame; the driver gets an error instead");
            refuse(conn, event_id, code, message, false).await;
            return;
        }
    };
    match conn.sink.send_encoded(line).await {
        Ok(()) => Counters::bump(&inst.counters.replies),
        Err(err) => {
            inst.record_error(format!("reply for {event_id} not delivered: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply not delivered: driver connection gone");
        }
    }
}

/// The error code a redelivered event gets when its reply was never posted and will not be
/// sent again by itself (`failed`, `unknown`, `expired`).
pub const REPLY_NOT_POSTED: &str = "reply_not_posted";

/// Answers a redelivered event whose run replied: a reply still on its way is left to the
/// courier; a posted one (or one the ledger does not track) is delivered again, for the
/// driver to answer from what it remembers; one that ended without being posted is an
/// `error`, so the redelivery does not post what the hub will not resend by itself.
pub async fn replay(
    hub: &Hub,
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    text: String,
) {
    let instance = inst.config.id.to_string();
    let state = if hub.ledger.is_on() && conn.kind == PeerKind::Driver {
        match hub.ledger.reply_state(instance.clone(), event_id.to_string()).await {
            Ok(state) => state,
            Err(err) => {
                warn!(%instance, %event_id, error = %err, "reply state not read; delivering the reply again");
                None
            }
        }
    } else {
        None
    };
    match state {
        Some(state) if !state.is_final() => {
            debug!(%instance, %event_id, %state, "redelivered event; its reply is on its way");
        }
        None | Some(ReplyState::Posted) => {
            deliver(inst, conn, event_id, target, &Metadata::new(), text).await
        }
        Some(state) => {
            let message = format!("the reply was not posted ({state}); an operator may retry it");
            refuse(conn, event_id, REPLY_NOT_POSTED, message, false).await;
        }
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
        match encode(&deliver_frame(event_id, target, &Metadata::new(), body)) {
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
        assert_eq!(fit_reply(&event, &target("c1"), &Metadata::new(), "a\0b".into()), "ab");
        let text = "x".repeat(100_000);
        assert_eq!(fit_reply(&event, &target("c1"), &Metadata::new(), text.clone()), text);
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
                let fitted = fit_reply(&event, &target, &Metadata::new(), text.clone());
                let kept = fitted.strip_suffix(CUT_MARKER).expect("marked as cut");
                assert!(text.starts_with(kept));
                let len = frame_len(&event, &target, &fitted);
                assert!(len <= MAX_LINE_BYTES, "{len}");
                // Nothing more than needed was cut: one more character would not fit.
                let next = text[kept.len()..].chars().next().unwrap();
                let longer = format!("{kept}{next}{CUT_MARKER}");
                assert!(frame_len(&event, &target, &longer) > MAX_LINE_BYTES);
                assert!(deliver_line(&event, &target, &Metadata::new(), text.clone()).is_ok());
            }
        }
    }

    #[test]
    fn a_reply_of_only_nuls_becomes_an_empty_reply_error() {
        let event = Id::new("e-1").unwrap();
        let refused =
            deliver_line(&event, &target("c1"), &Metadata::new(), "\0\0".into()).unwrap_err();
        assert_eq!(refused.0, "empty_reply");
    }
}
