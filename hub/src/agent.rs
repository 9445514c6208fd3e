//! Agents as users of the hub: the control ops `inbox`, `read`, `respond` and `complete`,
//! which name an admitted inbound item by its locator (`locator.rs`).
//!
//! `respond` posts through the outbox (recorded, receipted, idempotent): its key is derived
//! from the item, so a repeated or concurrent `respond` never posts twice and returns the
//! first reply's outcome. Then the item is marked handled: by the driver's effect where it
//! declares one (a ✅ reaction on the message), and in the ledger. A reply posted whose
//! marking failed is answered `replied: true, handled: false` with a warning.

use std::sync::Arc;
use std::time::Duration;

use channeld_control::{
    CompleteResult, InboxItem, InboxResult, MAX_CONTROL_LINE, MAX_READ_CONTEXT, MAX_READ_TEXT,
    ReadEntry, ReadResult, RespondResult, code,
};
use channeld_protocol::frame::EffectFrame;
use channeld_protocol::types::{Effect, MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{ChannelId, Frame, Id};
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use crate::connection::ReceiptOutcome;
use crate::hub::Hub;
use crate::instance::Instance;
use crate::ledger::{Item, ItemView, LedgerError};
use crate::locator::{Locator, LocatorError};
use crate::outbox::SendRequest;
use crate::send::{SendError, SendOutcome, SendState};

/// The reaction that marks an item handled on platforms whose driver declares `reaction`.
pub const HANDLED_REACTION: &str = "✅";

/// How long the driver has to refuse the handled reaction (`error` with its request id)
/// before it counts as done: effects have no receipt in the protocol.
pub const HANDLED_EFFECT_WAIT: Duration = Duration::from_secs(2);

/// Previous entries `read` returns unless asked otherwise.
pub const DEFAULT_READ_CONTEXT: usize = 10;

/// Why an agent op failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Locator(#[from] LocatorError),
    #[error("no instance named {0}")]
    UnknownInstance(String),
    #[error(
        "no item for this locator (pruned after hub.retention_days, or recorded by a hub without the inbox)"
    )]
    NotFound,
    #[error("text: {0}")]
    InvalidText(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Send(#[from] SendError),
}

impl AgentError {
    /// The control protocol's error code.
    pub fn code(&self) -> &'static str {
        match self {
            AgentError::Locator(_) => code::INVALID_LOCATOR,
            AgentError::UnknownInstance(_) => code::UNKNOWN_INSTANCE,
            AgentError::NotFound => code::NOT_FOUND,
            AgentError::InvalidText(_) => code::INVALID_REQUEST,
            AgentError::Ledger(LedgerError::Off) => code::LEDGER_OFF,
            AgentError::Ledger(_) => code::LEDGER_UNAVAILABLE,
            AgentError::Send(err) => err.code(),
        }
    }
}

fn now_ms() -> u64 {
    crate::clock::now_ms()
}

/// The item a locator names, with what `read` shows of it.
async fn resolve(hub: &Hub, locator: &str) -> Result<(Locator, ItemView), AgentError> {
    let loc = Locator::decode(locator, hub.locator_key())?;
    if !hub.ledger.is_on() {
        return Err(LedgerError::Off.into());
    }
    let view = hub
        .ledger
        .item_get(loc.instance.to_string(), loc.event_id.to_string())
        .await?
        .ok_or(AgentError::NotFound)?;
    Ok((loc, view))
}

/// The locator of a stored item.
fn locator_of(hub: &Hub, item: &Item) -> Option<String> {
    let id = |text: &str| Id::new(text).ok();
    Some(
        Locator {
            instance: ChannelId::new(item.instance.as_str()).ok()?,
            conversation: id(&item.conversation)?,
            thread: item.thread.as_deref().and_then(id),
            message: item.message_id.as_deref().and_then(id),
            event_id: id(&item.event_id)?,
            entry: Some(item.id),
        }
        .encode(hub.locator_key()),
    )
}

/// `inbox`: items newest first, without text, as many as fit in one answer line.
pub async fn inbox(
    hub: &Hub,
    instance: Option<String>,
    unhandled: bool,
    limit: usize,
    before: Option<i64>,
) -> Result<InboxResult, AgentError> {
    if let Some(name) = &instance
        && hub.instance(name).is_none()
    {
        return Err(AgentError::UnknownInstance(name.clone()));
    }
    let rows = hub.ledger.items_list(instance, unhandled, before, limit + 1).await?;
    let more = rows.len() > limit;
    let mut items = Vec::new();
    let mut used = 0;
    for item in rows.iter().take(limit) {
        let Some(locator) = locator_of(hub, item) else { continue };
        let entry = InboxItem {
            entry_id: item.id,
            locator,
            instance: item.instance.clone(),
            event_id: item.event_id.clone(),
            conversation: item.conversation.clone(),
            thread: item.thread.clone(),
            message_id: item.message_id.clone(),
            sender: item.sender.clone(),
            received_ms: item.received_ms,
            replied: item.outbox_id.is_some(),
            handled: item.handled_ms.is_some(),
            handled_by: item.handled_by.clone(),
            handled_ms: item.handled_ms,
        };
        used += serde_json::to_vec(&entry).map_or(MAX_CONTROL_LINE, |json| json.len() + 1);
        if used > PAGE_BUDGET && !items.is_empty() {
            break;
        }
        items.push(entry);
    }
    let cut = items.len() < rows.len().min(limit);
    let next_before = (more || cut).then(|| items.last().map(|i| i.entry_id)).flatten();
    Ok(InboxResult { items, next_before })
}

/// Room the entries of one answer may take; the rest of the line fits in what is left.
const PAGE_BUDGET: usize = MAX_CONTROL_LINE - 16 * 1024;

/// `read`: the item and up to `limit` items before it in its conversation (thread), each
/// with the replies that answered it, every text marked untrusted.
pub async fn read(hub: &Hub, locator: &str, limit: usize) -> Result<ReadResult, AgentError> {
    let (loc, view) = resolve(hub, locator).await?;
    let limit = limit.min(MAX_READ_CONTEXT);
    let item = &view.item;
    let mut earlier = if limit == 0 {
        Vec::new()
    } else {
        hub.ledger
            .item_context(
                item.instance.clone(),
                item.conversation.clone(),
                item.thread.clone(),
                item.id,
                limit,
            )
            .await?
    };
    earlier.reverse();
    let mut context = Vec::new();
    for earlier in &earlier {
        context.push(inbound_entry(hub, earlier));
        context.extend(reply_entries(earlier));
    }
    Ok(ReadResult {
        locator: locator.to_owned(),
        instance: loc.instance.to_string(),
        conversation: item.conversation.clone(),
        thread: item.thread.clone(),
        handled: item.handled_ms.is_some(),
        handled_by: item.handled_by.clone(),
        replied: item.outbox_id.is_some(),
        target: inbound_entry(hub, &view),
        context,
    })
}

/// What a sender wrote, as recorded: the message text (attachments named), or the event.
fn inbound_entry(hub: &Hub, view: &ItemView) -> ReadEntry {
    let text = match view.frame.as_deref().map(channeld_protocol::decode) {
        Some(Ok(Frame::Inbound(inbound))) => {
            let message = &inbound.message;
            let mut text = message.body.text_str().to_owned();
            for attachment in message.body.attachments() {
                let name = attachment.name.as_deref().unwrap_or("unnamed");
                text.push_str(&format!("\n[attachment: {name}]"));
            }
            text
        }
        Some(Ok(Frame::InboundEvent(event))) => {
            serde_json::to_string(&event.event).unwrap_or_default()
        }
        _ => String::new(),
    };
    let (text, truncated) = cut(text);
    ReadEntry {
        role: "inbound".into(),
        entry_id: Some(view.item.id),
        locator: locator_of(hub, &view.item),
        sender: view.item.sender.clone(),
        message_id: view.item.message_id.clone(),
        text,
        truncated,
        untrusted: true,
        at_ms: view.item.received_ms,
    }
}

/// The replies posted to an item: its run's and the one `respond` sent.
fn reply_entries(view: &ItemView) -> Vec<ReadEntry> {
    let posted = [
        view.run_reply.as_ref().filter(|(_, state)| state == "posted"),
        view.respond_reply.as_ref().filter(|(_, state)| state == "receipted"),
    ];
    posted
        .into_iter()
        .flatten()
        .filter_map(|(message, _)| serde_json::from_slice::<OutboundMessage>(message).ok())
        .map(|message| {
            let (text, truncated) = cut(message.body.text_str().to_owned());
            ReadEntry {
                role: "reply".into(),
                entry_id: None,
                locator: None,
                sender: None,
                message_id: None,
                text,
                truncated,
                // An agent wrote it, but it may quote what a sender wrote.
                untrusted: true,
                at_ms: view.item.received_ms,
            }
        })
        .collect()
}

/// A text cut to [`MAX_READ_TEXT`] bytes at a character boundary.
fn cut(mut text: String) -> (String, bool) {
    if text.len() <= MAX_READ_TEXT {
        return (text, false);
    }
    let mut at = MAX_READ_TEXT;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text.truncate(at);
    (text, true)
}

/// The idempotency key of an item's reply: derived from its instance and event id, so every
/// locator of the item (and every repeat) names the same outbox record.
pub fn respond_key(instance: &str, event_id: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(instance.as_bytes());
    hash.update([0]);
    hash.update(event_id.as_bytes());
    let digest = hash.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("respond-{hex}")
}

/// `respond`: the reply, once, then the handled marking.
pub async fn respond(hub: &Hub, locator: &str, text: String) -> Result<RespondResult, AgentError> {
    let (loc, view) = resolve(hub, locator).await?;
    let inst = hub
        .instance(loc.instance.as_str())
        .ok_or_else(|| AgentError::UnknownInstance(loc.instance.to_string()))?;
    let item = view.item;
    let key = respond_key(&item.instance, &item.event_id);
    // A reply already sent is never sent again: its own message is repeated, so the outbox
    // answers with its outcome (waiting for it if it is still on its way).
    let earlier = match &view.respond_reply {
        Some((message, _)) => serde_json::from_slice::<OutboundMessage>(message).ok(),
        None => None,
    };
    let message = match earlier {
        Some(message) => message,
        None => {
            let body =
                MessageBody::text(text).map_err(|err| AgentError::InvalidText(err.to_string()))?;
            OutboundMessage {
                target: MessageTarget {
                    channel: loc.instance.clone(),
                    conversation: loc.conversation.clone(),
                    thread: loc.thread.clone(),
                    reply_to: loc.message.clone(),
                },
                body,
                metadata: Default::default(),
            }
        }
    };
    let mut outcome = submit(hub, &item, message, &key).await;
    if let Err(AgentError::Send(SendError::Conflict { outbox_id })) = &outcome {
        // Another respond with another text won the race: its outcome is the answer.
        let record = hub.ledger.outbox_get(*outbox_id).await?.ok_or(AgentError::NotFound)?;
        let first: OutboundMessage = serde_json::from_slice(&record.message)
            .map_err(|err| AgentError::Ledger(LedgerError::Sql(err.to_string())))?;
        outcome = submit(hub, &item, without_key(first), &key).await;
    }
    let (sent, first) = outcome?;
    let repeated = !first;
    let mut result = RespondResult {
        replied: sent.state == SendState::Receipted,
        handled: false,
        response_id: sent.receipt.as_ref().map(|r| r.message_id.to_string()),
        warning: None,
        outbox_id: sent.outbox_id,
        repeated,
    };
    match sent.state {
        SendState::Receipted => {
            let (handled, warning) = mark_handled(hub, &inst, &item, "respond").await;
            result.handled = handled;
            result.warning = warning;
        }
        SendState::Handed => {
            result.warning = Some(
                "the reply was handed to the driver and its receipt has not come yet; do not \
                 respond again (a repeat returns this reply's outcome)"
                    .into(),
            );
        }
        SendState::Queued => {
            result.warning = Some(
                "the driver is offline: the reply is queued and posted when it connects; \
                 respond again later to mark the item handled (it will not post twice)"
                    .into(),
            );
        }
    }
    info!(instance = %item.instance, event_id = %item.event_id, replied = result.replied, handled = result.handled, repeated, "respond");
    Ok(result)
}

/// The stored message minus the metadata the outbox adds itself (the key).
fn without_key(mut message: OutboundMessage) -> OutboundMessage {
    message.metadata.remove(crate::outbox::IDEMPOTENCY_METADATA);
    message
}

/// Sends through the outbox under the item's key; also whether this call recorded the reply
/// on the item first (false: an earlier or concurrent respond did).
async fn submit(
    hub: &Hub,
    item: &Item,
    message: OutboundMessage,
    key: &str,
) -> Result<(SendOutcome, bool), AgentError> {
    let request = SendRequest {
        instance: item.instance.clone(),
        message: without_key(message),
        wait: Some(hub.config.receipt_timeout),
        idempotency_key: Some(key.to_owned()),
    };
    let result = hub.outbox.submit(request).await;
    let outbox_id = match &result {
        Ok(sent) => sent.outbox_id,
        Err(SendError::Failed { request_id, .. } | SendError::Unknown { request_id, .. }) => {
            outbox_id_of(request_id.as_str())
        }
        Err(_) => None,
    };
    let mut first = false;
    if let Some(id) = outbox_id {
        first = hub
            .ledger
            .item_set_reply(item.instance.clone(), item.event_id.clone(), id, now_ms())
            .await?;
    }
    Ok((result?, first))
}

/// The outbox record id in a request id `ob-<ledger>-<id>`.
fn outbox_id_of(request_id: &str) -> Option<i64> {
    request_id.rsplit('-').next()?.parse().ok()
}

/// `complete`: the handled marking without a reply.
pub async fn complete(hub: &Hub, locator: &str) -> Result<CompleteResult, AgentError> {
    let (loc, view) = resolve(hub, locator).await?;
    let inst = hub
        .instance(loc.instance.as_str())
        .ok_or_else(|| AgentError::UnknownInstance(loc.instance.to_string()))?;
    let (handled, warning) = mark_handled(hub, &inst, &view.item, "complete").await;
    Ok(CompleteResult { handled, warning })
}

/// Marks an item handled: the driver's ✅ reaction where the connected driver declares
/// `reaction` (refused or cut off: not handled, with a warning), then the ledger. An item
/// already handled stays as it was.
async fn mark_handled(
    hub: &Hub,
    inst: &Arc<Instance>,
    item: &Item,
    by: &'static str,
) -> (bool, Option<String>) {
    if item.handled_ms.is_some() {
        return (true, None);
    }
    if let Some(warning) = handled_effect(hub, inst, item).await {
        warn!(instance = %item.instance, event_id = %item.event_id, %warning, "item not marked handled");
        return (false, Some(warning));
    }
    let marked = hub
        .ledger
        .item_mark_handled(item.instance.clone(), item.event_id.clone(), by, now_ms())
        .await;
    match marked {
        Ok(true) => (true, None),
        Ok(false) => (false, Some("the item is gone from the ledger".into())),
        Err(err) => (false, Some(format!("the handled state was not recorded: {err}"))),
    }
}

/// The driver's handled effect; `None` when it was done or there is none to do.
async fn handled_effect(hub: &Hub, inst: &Instance, item: &Item) -> Option<String> {
    let conn = inst.live()?;
    if !conn.declaration.actions.reaction {
        return None;
    }
    let message_id = Id::new(item.message_id.clone()?).ok()?;
    let target = MessageTarget {
        channel: inst.config.id.clone(),
        conversation: Id::new(item.conversation.as_str()).ok()?,
        thread: item.thread.as_deref().and_then(|t| Id::new(t).ok()),
        reply_to: None,
    };
    let request_id = hub.ids.request("fx");
    let answer = conn.expect_receipt(request_id.clone())?;
    let frame = Frame::Effect(EffectFrame {
        request_id: request_id.clone(),
        target,
        effect: Effect::Reaction { message_id, emoji: HANDLED_REACTION.into(), remove: false },
    });
    if let Err(err) = conn.sink.send(&frame).await {
        conn.forget_receipt(&request_id);
        return Some(format!("the handled reaction could not be sent: {err}"));
    }
    match tokio::time::timeout(HANDLED_EFFECT_WAIT, answer).await {
        // No refusal in time: effects have no receipt, so silence is success.
        Err(_) => {
            conn.forget_receipt(&request_id);
            None
        }
        Ok(Ok(ReceiptOutcome::Failed { code, message })) => {
            Some(format!("the driver refused the handled reaction: {code}: {message}"))
        }
        Ok(Ok(ReceiptOutcome::Unknown { reason })) => {
            Some(format!("the handled reaction may not have been made: {reason}"))
        }
        Ok(Ok(ReceiptOutcome::Receipted(_))) => None,
        Ok(Err(_)) => {
            debug!(%request_id, "handled reaction wait dropped");
            Some("the driver connection ended before the handled reaction".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_respond_key_depends_on_the_item_only() {
        let key = respond_key("mqtt.lab", "alice/1");
        assert!(key.starts_with("respond-") && key.len() == 8 + 32, "{key}");
        assert_eq!(key, respond_key("mqtt.lab", "alice/1"));
        assert_ne!(key, respond_key("mqtt.lab", "alice/2"));
        assert_ne!(respond_key("a", "bc"), respond_key("ab", "c"));
    }

    #[test]
    fn texts_are_cut_at_a_character_boundary() {
        let (text, cut_off) = cut("é".repeat(MAX_READ_TEXT));
        assert!(cut_off && text.len() <= MAX_READ_TEXT && text.len() >= MAX_READ_TEXT - 1);
        assert_eq!(cut("short".into()), ("short".into(), false));
        assert_eq!(outbox_id_of("ob-a1b2c3d4e5f6-17"), Some(17));
    }
}
