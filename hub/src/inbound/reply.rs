//! What goes back to the driver about an inbound: `accepted`, an `error` frame, and the reply
//! (`deliver`) — recorded as handed over, or, with `reply_receipt`, once the driver's
//! receipt says it was posted. Also the sweep that hands a reconnected driver the replies it
//! missed.

use std::time::SystemTime;

use channeld_protocol::frame::{Accepted, Delivery};
use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{Frame, Id, MAX_LINE_BYTES};
use tracing::{debug, info, warn};

use crate::connection::Connection;
use crate::hub::Hub;
use crate::instance::{Counters, Instance, unix_ms};

/// Replies are cut to this many bytes so the `deliver` frame fits in one line.
pub const MAX_REPLY_BYTES: usize = MAX_LINE_BYTES - 16 * 1024;

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

/// Removes NULs and cuts an over-long reply at a character boundary, saying so.
pub fn fit_reply(mut text: String) -> String {
    if text.contains('\0') {
        text = text.replace('\0', "");
    }
    if text.len() <= MAX_REPLY_BYTES {
        return text;
    }
    let mut end = MAX_REPLY_BYTES - 32;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str("\n[reply truncated]");
    text
}

/// Sends the reply for `event_id` on `conn` and records that it was handed over (or, with
/// `reply_receipt`, leaves that to the driver's receipt).
pub async fn deliver(
    hub: &Hub,
    inst: &Instance,
    conn: &Connection,
    event_id: &Id,
    target: MessageTarget,
    text: String,
) {
    let body = match MessageBody::text(fit_reply(text)) {
        Ok(body) => body,
        Err(err) => {
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply is not a valid body; dropped");
            return;
        }
    };
    let frame = Frame::Deliver(Delivery {
        request_id: event_id.clone(),
        message: OutboundMessage { target, body, metadata: Default::default() },
    });
    match conn.sink.send(&frame).await {
        Ok(()) => {
            Counters::bump(&inst.counters.replies);
            if hub.ledger.is_on()
                && !conn.declaration.extensions.reply_receipt
                && let Err(err) = hub
                    .ledger
                    .mark_delivered(inst.config.id.to_string(), event_id.to_string(), now_ms())
                    .await
            {
                warn!(instance = %inst.config.id, %event_id, error = %err, "delivery not recorded");
            }
        }
        Err(err) => {
            inst.record_error(format!("reply for {event_id} not delivered: {err}"));
            warn!(instance = %inst.config.id, %event_id, error = %err, "reply not delivered: driver connection gone");
        }
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
    use super::*;

    #[test]
    fn long_replies_are_cut_to_fit_a_frame() {
        let text = "é".repeat(MAX_REPLY_BYTES);
        let fitted = fit_reply(text);
        assert!(fitted.len() <= MAX_REPLY_BYTES);
        assert!(fitted.ends_with("[reply truncated]"));
        assert_eq!(fit_reply("a\0b".into()), "ab");
    }
}
