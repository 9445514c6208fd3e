//! Pure mapping between channel-socket frames and ACECode plugin frames for the `--acecode`
//! transport: a driver's declaration → `initialize` capabilities, its health → `status`,
//! its inbound → `inbound`, ACECode's `send_text`/`set_typing` → `outbound`/`effect`.

use channeld_protocol::acecode::{
    Address, InboundParams, KIND_GROUP, KIND_PRIVATE, PluginCapabilities, SendTextParams,
    StatusExtra, StatusParams, valid_plugin_id,
};
use channeld_protocol::types::{
    Health, HealthState, InboundMessage, MessageBody, MessageTarget, OutboundMessage,
    UnavailableReason,
};
use channeld_protocol::{ChannelId, Id};
use serde_json::{Value, json};

use crate::driver::Declaration;

/// The text length the transport announces: drivers split longer text for their platform
/// themselves, and 4000 (ACECode's default) keeps every `outbound` far below the line limit.
pub const TEXT_UNITS: u64 = 4000;

/// The capabilities a driver's declaration amounts to.
pub fn capabilities(declaration: &Declaration) -> PluginCapabilities {
    PluginCapabilities {
        max_text_units: Some(TEXT_UNITS),
        count_utf16: false,
        batch_turn_output: false,
        supports_typing: declaration.actions.typing,
        max_upload_bytes: None,
        max_download_bytes: None,
    }
}

/// The `status` event for a health, with the account ACECode keys inbound messages by.
pub fn status(health: &Health, account: &str) -> StatusParams {
    let reason = health.status.as_ref().and_then(|s| s.reason.as_deref());
    let operator_only = matches!(
        reason,
        Some(r) if r == UnavailableReason::AuthExpired.as_str()
            || r == UnavailableReason::AuthRejected.as_str()
            || r == UnavailableReason::Fenced.as_str()
    );
    let state = match health.state {
        HealthState::Ready => "connected",
        HealthState::Degraded => {
            let connecting = health.detail.as_deref().is_some_and(|d| d.starts_with("connecting"));
            if connecting { "connecting" } else { "retrying" }
        }
        HealthState::Unavailable => "failed",
    };
    StatusParams {
        state: state.to_owned(),
        detail: health.detail.clone().unwrap_or_default(),
        retry_stopped: health.state == HealthState::Unavailable,
        account: Some(account.to_owned()),
        display_name: None,
        extra: StatusExtra { login_required: operator_only },
    }
}

/// Why an inbound message cannot be an ACECode `inbound` event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} {value:?} is not an ACECode id (letters, digits, - _ . : @ + / = $; at most 128 bytes)"
)]
pub struct NotRepresentable {
    pub what: &'static str,
    pub value: String,
}

fn plugin_id(what: &'static str, value: &str) -> Result<String, NotRepresentable> {
    if valid_plugin_id(value) {
        Ok(value.to_owned())
    } else {
        Err(NotRepresentable { what, value: value.to_owned() })
    }
}

/// An inbound message as an ACECode `inbound` event. A conversation named after its sender
/// is a private chat; any other is a group. The reply context carries what `send_text` needs
/// to answer in the same conversation and thread.
pub fn inbound(message: &InboundMessage) -> Result<InboundParams, NotRepresentable> {
    let sender = plugin_id("sender", message.sender.id.as_str())?;
    let chat = plugin_id("conversation", message.target.conversation.as_str())?;
    let kind = if chat == sender { KIND_PRIVATE } else { KIND_GROUP };
    let mut reply_context = json!({ "message_id": message.id.as_str() });
    if let Some(thread) = &message.target.thread {
        reply_context["thread"] = json!(thread.as_str());
    }
    let mentioned = message.metadata.get("mentioned").is_some_and(|v| v == "true");
    Ok(InboundParams {
        address: Address {
            platform: None,
            account: None,
            kind: kind.to_owned(),
            chat,
            sender: Some(sender),
        },
        message_id: plugin_id("message id", message.id.as_str())?,
        text: message.body.text_str().to_owned(),
        mentioned,
        from_self: false,
        sender_name: message.sender.display_name.clone(),
        chat_name: None,
        timestamp_ms: message.timestamp_ms,
        quote_text: String::new(),
        attachments: message
            .body
            .attachments()
            .iter()
            .map(|a| json!({ "url": a.url, "name": a.name, "mime_type": a.mime }))
            .collect(),
        reply_context,
    })
}

/// Why a `send_text` cannot become an `outbound`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadSend(pub String);

/// The target a plugin address (and reply context) names.
pub fn target(
    channel: &ChannelId,
    address: &Address,
    reply_context: &Value,
) -> Result<MessageTarget, BadSend> {
    let conversation =
        Id::new(address.chat.as_str()).map_err(|err| BadSend(format!("address.chat: {err}")))?;
    let field =
        |name: &str| reply_context.get(name).and_then(Value::as_str).and_then(|v| Id::new(v).ok());
    Ok(MessageTarget {
        channel: channel.clone(),
        conversation,
        thread: field("thread"),
        reply_to: field("message_id"),
    })
}

/// A `send_text` as the message to post.
pub fn outbound(channel: &ChannelId, send: &SendTextParams) -> Result<OutboundMessage, BadSend> {
    let body =
        MessageBody::text(send.text.clone()).map_err(|err| BadSend(format!("text: {err}")))?;
    Ok(OutboundMessage {
        target: target(channel, &send.address, &send.reply_context)?,
        body,
        metadata: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use channeld_protocol::types::{HealthStatus, Participant};

    use super::*;

    fn message(conversation: &str, sender: &str) -> InboundMessage {
        InboundMessage {
            id: Id::new("m-1").unwrap(),
            target: MessageTarget {
                channel: ChannelId::new("mqtt.lab").unwrap(),
                conversation: Id::new(conversation).unwrap(),
                thread: Some(Id::new("t-1").unwrap()),
                reply_to: None,
            },
            sender: Participant::new(Id::new(sender).unwrap()),
            body: MessageBody::text("hi").unwrap(),
            timestamp_ms: Some(5),
            metadata: Default::default(),
        }
    }

    #[test]
    fn a_conversation_named_after_its_sender_is_private_and_others_are_groups() {
        let private = inbound(&message("alice", "alice")).unwrap();
        assert_eq!(private.address.kind, "private");
        assert_eq!(private.address.chat, "alice");
        let group = inbound(&message("room/1", "alice")).unwrap();
        assert_eq!(group.address.kind, "group");
        assert_eq!(group.address.sender.as_deref(), Some("alice"));
        assert_eq!(group.reply_context, json!({"message_id": "m-1", "thread": "t-1"}));
        let err = inbound(&message("room 1", "alice")).unwrap_err();
        assert_eq!(err.what, "conversation");
    }

    #[test]
    fn a_reply_context_sends_back_into_the_same_thread() {
        let channel = ChannelId::new("mqtt.lab").unwrap();
        let send = SendTextParams {
            address: Address { kind: "group".into(), chat: "room/1".into(), ..Address::default() },
            text: "ok".into(),
            reply_context: json!({"message_id": "m-1", "thread": "t-1"}),
        };
        let out = outbound(&channel, &send).unwrap();
        assert_eq!(out.target.conversation, "room/1");
        assert_eq!(out.target.thread.as_ref().map(Id::as_str), Some("t-1"));
        assert_eq!(out.target.reply_to.as_ref().map(Id::as_str), Some("m-1"));
        let empty = SendTextParams { text: String::new(), ..send };
        assert!(outbound(&channel, &empty).is_err());
    }

    #[test]
    fn health_becomes_status_and_operator_only_conditions_ask_for_a_login() {
        let ready = status(&Health::new(HealthState::Ready, None), "me");
        assert_eq!((ready.state.as_str(), ready.account.as_deref()), ("connected", Some("me")));
        let fenced = Health {
            state: HealthState::Unavailable,
            detail: Some("displaced".into()),
            status: Some(HealthStatus { reason: Some("fenced".into()), ..HealthStatus::default() }),
        };
        let s = status(&fenced, "me");
        assert_eq!(s.state, "failed");
        assert!(s.retry_stopped && s.extra.login_required);
        let degraded = Health::new(HealthState::Degraded, Some("retrying: timeout".into()));
        assert_eq!(status(&degraded, "me").state, "retrying");
        let connecting =
            Health::new(HealthState::Degraded, Some("connecting to the platform".into()));
        assert_eq!(status(&connecting, "me").state, "connecting");
    }
}
