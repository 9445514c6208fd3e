//! Pure mapping between BCN payloads and channeld messages: `chat.send` to an inbound
//! message, replies to `chat.event` payloads.
//!
//! The inbound's conversation is the complete `session_key` (the guide: "use the complete
//! value as the local history discriminator"); its event id is the run id the driver answers
//! `chat.send` with. Metadata the agent sees:
//!
//! | key | value |
//! |---|---|
//! | `bcn.group_id` | `bcs_group_id` |
//! | `bcn.session_id` | `bcs_session_id` |
//! | `bcn.channel_source` | `channel.source` |
//! | `bcn.session_context` | `session_context`, as compact JSON |
//! | `bcn.timeout_ms` | `timeout_ms` |
//! | `bcn.protocol_version` | the negotiated protocol version |
//! | `env.<NAME>` | each `env` entry of `bot.connect`, only for a hub without the `agent_env` extension (channeld gets them once, in `agent_env`, and keeps them out of its ledger); the exec runtime exports `BCN_*` ones |

use std::collections::BTreeMap;

use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::protocol::types::InboundMessage;
use channeld_driver_sdk::{Inbound, InboundError};
use serde_json::{Value, json};

use crate::wire::{self, ChatParams};

/// The sender when BCN names nobody (no forwarded identity, no originator).
pub const UNKNOWN_SENDER: &str = "bcn";

/// Why a `chat.send` cannot become an inbound message (answered `invalid_request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error("the message has no text")]
    NoText,
    #[error(transparent)]
    Invalid(#[from] InboundError),
}

/// What the connection knows that every inbound carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    pub protocol_version: u32,
    pub env: BTreeMap<String, String>,
}

/// Who sent a message: `channel.user_id` (and `actor_name`) when BCN forwards the identity,
/// else the session's `originator` (or `from`), else [`UNKNOWN_SENDER`].
pub fn sender(params: &ChatParams) -> (String, Option<String>) {
    if let Some(channel) = &params.channel
        && channel.identity_forwarding
        && let Some(user) = channel.user_id.as_deref().filter(|user| !user.is_empty())
    {
        return (user.to_owned(), channel.actor_name.clone());
    }
    let context = params.session_context.as_ref();
    let named = |key: &str| {
        context
            .and_then(|context| context.get(key))
            .and_then(Value::as_str)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
    };
    let originator = named("originator").or_else(|| named("from"));
    (originator.unwrap_or_else(|| UNKNOWN_SENDER.to_owned()), None)
}

/// The inbound message for a `chat.send`, reported with event id `run_id`.
pub fn inbound_message(
    channel: &ChannelId,
    run_id: &str,
    params: &ChatParams,
    context: &Context,
) -> Result<InboundMessage, ConvertError> {
    let text = params.message.text();
    if text.trim().is_empty() {
        return Err(ConvertError::NoText);
    }
    let (sender, sender_name) = sender(params);
    let mut inbound = Inbound::text(&params.session_key, sender, text).id(run_id);
    if let Some(name) = sender_name {
        inbound = inbound.sender_name(name);
    }
    if let Some(timestamp) = params.message.timestamp {
        inbound = inbound.timestamp_ms(timestamp);
    }
    let optional = [
        ("bcn.group_id", params.bcs_group_id.clone()),
        ("bcn.session_id", params.bcs_session_id.clone()),
        ("bcn.channel_source", params.channel.as_ref().and_then(|c| c.source.clone())),
        ("bcn.session_context", params.session_context.as_ref().map(Value::to_string)),
        ("bcn.timeout_ms", params.timeout_ms.map(|ms| ms.to_string())),
    ];
    for (key, value) in optional {
        if let Some(value) = value {
            inbound = inbound.metadata(key, value);
        }
    }
    inbound = inbound.metadata("bcn.protocol_version", context.protocol_version.to_string());
    for (name, value) in &context.env {
        inbound = inbound.metadata(format!("env.{name}"), value.clone());
    }
    Ok(inbound.build(channel)?)
}

/// A `chat.event` payload for `run_id` in `state`, with the assistant's `text` if any.
pub fn chat_event(run_id: &str, group_id: Option<&str>, state: &str, text: Option<&str>) -> Value {
    let mut payload = json!({"run_id": run_id, "state": state});
    if let Some(group) = group_id {
        payload["bcs_group_id"] = json!(group);
    }
    if let Some(text) = text {
        payload["message"] = wire::assistant_message(text, wire::now_ms());
    }
    match state {
        wire::state::FINAL => payload["stop_reason"] = json!("complete"),
        wire::state::ABORTED => payload["stop_reason"] = json!("aborted"),
        _ => {}
    }
    payload
}

/// A tool report as a `chat.event` state and its fields: a `status` of `start`, `started`,
/// `running` or `call` is `tool_call_start` (with `args`), anything else `tool_call_end`
/// (with `result` and `success`, false for `error`/`failed`). `tool_call_id` comes from the
/// report's `id` or `tool_call_id`.
pub fn tool_event(
    name: &str,
    status: &str,
    mut rest: serde_json::Map<String, Value>,
) -> (&'static str, serde_json::Map<String, Value>) {
    let mut fields = serde_json::Map::new();
    fields.insert("tool_name".into(), json!(name));
    if let Some(id) = rest.remove("tool_call_id").or_else(|| rest.remove("id")) {
        fields.insert("tool_call_id".into(), id);
    }
    if matches!(status, "start" | "started" | "running" | "call") {
        fields.insert("args".into(), rest.remove("args").unwrap_or_else(|| json!({})));
        (wire::state::TOOL_CALL_START, fields)
    } else {
        fields.insert("result".into(), rest.remove("result").unwrap_or(Value::Null));
        fields.insert("success".into(), json!(!matches!(status, "error" | "failed")));
        (wire::state::TOOL_CALL_END, fields)
    }
}

/// Extra `final` fields from the reply's metadata: an agent's `routing` entry (a JSON
/// object, the guide's structured routing) goes onto the event as it is. Anything that is not
/// an object is left out with a warning: BCN would fall back to @mention parsing anyway.
pub fn final_extra(metadata: &BTreeMap<String, String>) -> serde_json::Map<String, Value> {
    let mut extra = serde_json::Map::new();
    if let Some(routing) = metadata.get("routing") {
        match serde_json::from_str::<Value>(routing) {
            Ok(value @ Value::Object(_)) => {
                extra.insert("routing".into(), value);
            }
            _ => tracing::warn!("reply metadata `routing` is not a JSON object; left out of final"),
        }
    }
    extra
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routing_object_in_reply_metadata_goes_onto_final_and_anything_else_does_not() {
        let mut metadata = BTreeMap::new();
        assert!(final_extra(&metadata).is_empty());
        metadata.insert("tag".into(), "x".into());
        metadata.insert("routing".into(), r#"{"mode":"required","responders":[]}"#.into());
        let extra = final_extra(&metadata);
        assert_eq!(extra.len(), 1);
        assert_eq!(extra["routing"]["mode"], "required");
        metadata.insert("routing".into(), "DBA please".into());
        assert!(final_extra(&metadata).is_empty());
        metadata.insert("routing".into(), "[1]".into());
        assert!(final_extra(&metadata).is_empty());
    }

    fn params(value: Value) -> ChatParams {
        serde_json::from_value(value).unwrap()
    }

    fn channel() -> ChannelId {
        ChannelId::new("bcn.lab").unwrap()
    }

    #[test]
    fn a_chat_send_becomes_an_inbound_on_the_full_session_key() {
        let params = params(json!({
            "session_key": "grp-456:channel_dingtalk_abcdef12",
            "bcs_group_id": "grp-456",
            "bcs_session_id": "grp-456:channel_dingtalk_abcdef12",
            "message": {"role": "user", "content": [{"type": "text", "text": "Please analyze"}], "timestamp": 1710960000000u64},
            "channel": {"source": "webui", "user_id": "user-001"},
            "session_context": {"originator": "alice", "participants": ["alice", "dba"]},
            "timeout_ms": 300000
        }));
        let context = Context {
            protocol_version: 1,
            env: BTreeMap::from([("BCN_BOT_UUID".into(), "bot-1".into())]),
        };
        let message = inbound_message(&channel(), "run-1", &params, &context).unwrap();
        assert_eq!(message.id, "run-1");
        assert_eq!(message.target.conversation, "grp-456:channel_dingtalk_abcdef12");
        assert_eq!(message.sender.id, "alice", "no identity forwarding: the originator");
        assert_eq!(message.timestamp_ms, Some(1710960000000));
        assert_eq!(message.metadata["bcn.group_id"], "grp-456");
        assert_eq!(message.metadata["bcn.channel_source"], "webui");
        assert_eq!(message.metadata["env.BCN_BOT_UUID"], "bot-1");
        assert_eq!(message.metadata["bcn.protocol_version"], "1");
        let context: Value =
            serde_json::from_str(&message.metadata["bcn.session_context"]).unwrap();
        assert_eq!(context["participants"][1], "dba");
    }

    #[test]
    fn the_sender_is_the_forwarded_user_only_when_forwarding_is_on() {
        let forwarded = params(json!({
            "session_key": "s",
            "channel": {"user_id": "u-9", "actor_name": "Uma", "identity_forwarding": true},
            "session_context": {"originator": "alice"}
        }));
        assert_eq!(sender(&forwarded), ("u-9".to_owned(), Some("Uma".to_owned())));
        let not = params(json!({
            "session_key": "s",
            "channel": {"user_id": "u-9", "identity_forwarding": false},
            "session_context": {"from": "user-001"}
        }));
        assert_eq!(sender(&not), ("user-001".to_owned(), None));
        assert_eq!(sender(&params(json!({"session_key": "s"}))).0, UNKNOWN_SENDER);
    }

    #[test]
    fn empty_or_invalid_messages_are_refused() {
        let context = Context::default();
        let empty = params(json!({"session_key": "s", "message": {"content": []}}));
        assert_eq!(
            inbound_message(&channel(), "run-1", &empty, &context),
            Err(ConvertError::NoText)
        );
        let bad_key = params(json!({"session_key": "", "message": {"content": "hi"}}));
        assert!(matches!(
            inbound_message(&channel(), "run-1", &bad_key, &context),
            Err(ConvertError::Invalid(_))
        ));
    }

    #[test]
    fn tool_reports_become_start_and_end_events() {
        let rest = |v: Value| v.as_object().cloned().unwrap();
        let (state, fields) =
            tool_event("search", "start", rest(json!({"id": "tc-1", "args": {"q": "x"}})));
        assert_eq!(state, wire::state::TOOL_CALL_START);
        assert_eq!(fields["tool_call_id"], "tc-1");
        assert_eq!(fields["args"]["q"], "x");
        let (state, fields) = tool_event("search", "error", rest(json!({"tool_call_id": "tc-1"})));
        assert_eq!(state, wire::state::TOOL_CALL_END);
        assert_eq!(fields["success"], false);
    }

    #[test]
    fn chat_events_carry_the_guide_fields() {
        let event = chat_event("run-1", Some("grp"), wire::state::FINAL, Some("done"));
        assert_eq!(event["bcs_group_id"], "grp");
        assert_eq!(event["message"]["content"][0]["text"], "done");
        assert_eq!(event["stop_reason"], "complete");
        let aborted = chat_event("run-1", None, wire::state::ABORTED, None);
        assert_eq!(
            aborted,
            json!({"run_id": "run-1", "state": "aborted", "stop_reason": "aborted"})
        );
    }
}
