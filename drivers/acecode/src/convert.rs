//! Pure mapping between the plugin's frames and channeld's: `status` → [`LinkState`],
//! `inbound` → [`Inbound`], an outbound target → the plugin's `address`.
//!
//! Conversation ids carry the chat kind: `p:<chat>` for a private chat, `g:<chat>` for a
//! group, so a reply or proactive send knows which `address.kind` to use without state.

use channeld_driver_sdk::protocol::acecode::{
    Address, InboundParams, KIND_GROUP, KIND_PRIVATE, StatusParams, valid_plugin_id,
};
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::{Inbound, LinkState};

/// What a `status` event means for the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusView {
    pub link: LinkState,
    /// `extra.login_required`: no automatic restart until an operator acts.
    pub login_required: bool,
}

/// A `status` event as a link state. `attempt` counts restarts so far.
pub fn status(status: &StatusParams, attempt: u32) -> StatusView {
    let detail = |fallback: &str| {
        if status.detail.trim().is_empty() { fallback.to_owned() } else { status.detail.clone() }
    };
    if status.extra.login_required {
        return StatusView {
            link: LinkState::AuthExpired {
                detail: detail("sign in required: run channelctl action INSTANCE login"),
            },
            login_required: true,
        };
    }
    let link = match status.state.as_str() {
        "connected" => match (&status.display_name, &status.account) {
            (Some(name), _) if !name.is_empty() => LinkState::up_as(format!("signed in as {name}")),
            (_, Some(account)) if !account.is_empty() => {
                LinkState::up_as(format!("signed in as {account}"))
            }
            _ => LinkState::up(),
        },
        "connecting" => LinkState::Connecting { attempt },
        "retrying" => LinkState::Retrying { attempt, error: detail("the plugin is reconnecting") },
        "failed" => LinkState::SetupRefused { detail: detail("the plugin failed") },
        "stopped" => LinkState::SetupRefused { detail: detail("the plugin stopped") },
        other => {
            LinkState::Retrying { attempt, error: format!("the plugin reports state {other:?}") }
        }
    };
    StatusView { link, login_required: false }
}

/// The conversation id of a chat.
pub fn conversation(address: &Address) -> String {
    let prefix = if address.kind == KIND_GROUP { "g" } else { "p" };
    format!("{prefix}:{}", address.chat)
}

/// Why an outbound target has no plugin address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("conversation {0:?} is not p:<chat> or g:<chat> with an ACECode id")]
pub struct NotAnAddress(pub String);

/// The plugin address a target names (see the module doc).
pub fn address(target: &MessageTarget) -> Result<Address, NotAnAddress> {
    let conversation = target.conversation.as_str();
    let (kind, chat) = match conversation.split_once(':') {
        Some(("p", chat)) => (KIND_PRIVATE, chat),
        Some(("g", chat)) => (KIND_GROUP, chat),
        _ => return Err(NotAnAddress(conversation.to_owned())),
    };
    if !valid_plugin_id(chat) {
        return Err(NotAnAddress(conversation.to_owned()));
    }
    // A private chat's sender is the chat; a group reply names no sender.
    let sender = (kind == KIND_PRIVATE).then(|| chat.to_owned());
    Ok(Address {
        platform: None,
        account: None,
        kind: kind.to_owned(),
        chat: chat.to_owned(),
        sender,
    })
}

/// Why an `inbound` event is dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    #[error("no account known yet (the plugin has not said status with an account)")]
    NoAccount,
    #[error("{0} is not an ACECode id")]
    BadId(&'static str),
    #[error("a private chat whose chat differs from its sender")]
    PrivateMismatch,
    #[error("a message this host sent, echoed back")]
    OwnSend,
}

/// An `inbound` event as an inbound message, or why it is dropped. `own_send` says whether
/// the host sent this text to this chat itself (the plugin should not echo it; if it does,
/// it stops here).
pub fn inbound(
    event: &InboundParams,
    account: Option<&str>,
    own_send: impl Fn(&str, &str) -> bool,
) -> Result<Inbound, Dropped> {
    if account.is_none() {
        return Err(Dropped::NoAccount);
    }
    let address = &event.address;
    let sender = address.sender.clone().unwrap_or_else(|| address.chat.clone());
    for (what, id) in
        [("chat", address.chat.as_str()), ("sender", &sender), ("message_id", &event.message_id)]
    {
        if !valid_plugin_id(id) {
            return Err(Dropped::BadId(what));
        }
    }
    if address.kind != KIND_GROUP && address.chat != sender {
        return Err(Dropped::PrivateMismatch);
    }
    if own_send(&address.chat, &event.text) {
        return Err(Dropped::OwnSend);
    }
    let mut inbound = Inbound::text(conversation(address), sender, event.text.clone())
        .id(event.message_id.clone())
        .metadata(
            "acecode_kind",
            if address.kind == KIND_GROUP { KIND_GROUP } else { KIND_PRIVATE },
        );
    if let Some(name) = event.sender_name.as_ref().filter(|n| !n.is_empty()) {
        inbound = inbound.sender_name(name.clone());
    }
    if let Some(ms) = event.timestamp_ms {
        inbound = inbound.timestamp_ms(ms);
    }
    if event.mentioned {
        inbound = inbound.metadata("mentioned", "true");
    }
    if event.from_self {
        inbound = inbound.metadata("from_self", "true");
    }
    if let Some(chat_name) = event.chat_name.as_ref().filter(|n| !n.is_empty()) {
        inbound = inbound.metadata("chat_name", chat_name.clone());
    }
    if !event.quote_text.is_empty() {
        inbound = inbound.metadata("quote_text", event.quote_text.clone());
    }
    Ok(inbound)
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::acecode::StatusExtra;
    use channeld_driver_sdk::protocol::types::HealthState;
    use channeld_driver_sdk::protocol::{ChannelId, Id};

    use super::*;

    fn status_of(state: &str, login_required: bool) -> StatusParams {
        StatusParams {
            state: state.into(),
            detail: String::new(),
            account: Some("me".into()),
            extra: StatusExtra { login_required },
            ..StatusParams::default()
        }
    }

    #[test]
    fn plugin_states_map_to_health_and_login_required_is_unavailable() {
        let health = |s: &str, login| status(&status_of(s, login), 0).link.health().state;
        assert_eq!(health("connected", false), HealthState::Ready);
        assert_eq!(health("connecting", false), HealthState::Degraded);
        assert_eq!(health("retrying", false), HealthState::Degraded);
        assert_eq!(health("failed", false), HealthState::Unavailable);
        assert_eq!(health("stopped", false), HealthState::Unavailable);
        let login = status(&status_of("failed", true), 0);
        assert!(login.login_required);
        let reason = login.link.health().status.and_then(|s| s.reason);
        assert_eq!(reason.as_deref(), Some("auth_expired"));
    }

    fn event(kind: &str, chat: &str, sender: Option<&str>) -> InboundParams {
        serde_json::from_value(serde_json::json!({
            "address": {"kind": kind, "chat": chat, "sender": sender},
            "message_id": "m-1", "text": "hi", "mentioned": true, "sender_name": "Bob",
        }))
        .unwrap()
    }

    #[test]
    fn inbound_needs_an_account_valid_ids_and_a_consistent_private_chat() {
        let never = |_: &str, _: &str| false;
        let channel = ChannelId::new("acecode.test").unwrap();
        let group = inbound(&event("group", "grp-1", Some("bob")), Some("me"), never).unwrap();
        let message = group.build(&channel).unwrap();
        assert_eq!(message.target.conversation, "g:grp-1");
        assert_eq!(message.sender.id, "bob");
        assert_eq!(message.metadata.get("mentioned").map(String::as_str), Some("true"));
        let private = inbound(&event("private", "me", Some("me")), Some("me"), never).unwrap();
        assert_eq!(private.build(&channel).unwrap().target.conversation, "p:me");
        assert_eq!(
            inbound(&event("group", "g", Some("b")), None, never).unwrap_err(),
            Dropped::NoAccount
        );
        let mismatch = inbound(&event("private", "alice", Some("bob")), Some("me"), never);
        assert_eq!(mismatch.unwrap_err(), Dropped::PrivateMismatch);
        let bad = inbound(&event("group", "has space", Some("b")), Some("me"), never);
        assert_eq!(bad.unwrap_err(), Dropped::BadId("chat"));
        let echo = inbound(&event("group", "grp-1", Some("me")), Some("me"), |chat, text| {
            chat == "grp-1" && text == "hi"
        });
        assert_eq!(echo.unwrap_err(), Dropped::OwnSend);
    }

    #[test]
    fn conversations_round_trip_to_addresses() {
        let target = |conversation: &str| MessageTarget {
            channel: ChannelId::new("acecode.test").unwrap(),
            conversation: Id::new(conversation).unwrap(),
            thread: None,
            reply_to: None,
        };
        let group = address(&target("g:grp-1")).unwrap();
        assert_eq!(
            (group.kind.as_str(), group.chat.as_str(), group.sender),
            ("group", "grp-1", None)
        );
        let private = address(&target("p:me")).unwrap();
        assert_eq!(private.sender.as_deref(), Some("me"));
        assert_eq!(conversation(&private), "p:me");
        assert!(address(&target("grp-1")).is_err());
        assert!(address(&target("g:")).is_err());
    }
}
