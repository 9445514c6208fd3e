//! JSON shapes the fake emits, built the way Slack builds them: `message` and `app_mention`
//! events from people, the echoes of the bot's own posts (`bot_id` set), `message_changed` /
//! `message_deleted`, the Events API `event_callback` wrapper, and `block_actions` payloads.

use serde_json::{Value, json};

use super::FakeSlackOptions;
use super::state::StoredMessage;

/// The DM channel between the app and `user` (what `conversations.open` returns).
pub fn dm_channel(user: &str) -> String {
    format!("D{user}")
}

/// `channel_type` of a message event: by the channel id's prefix.
pub fn channel_type(channel: &str) -> &'static str {
    match channel.as_bytes().first() {
        Some(b'D') => "im",
        Some(b'G') => "group",
        _ => "channel",
    }
}

/// A file object as Slack attaches it to a message (`url_private` needs the bot token to read).
pub fn file(id: &str, name: &str, mimetype: &str, size: u64) -> Value {
    json!({
        "id": id,
        "created": 1_700_000_000,
        "name": name,
        "title": name,
        "mimetype": mimetype,
        "filetype": name.rsplit('.').next().unwrap_or("binary"),
        "user": "U0FILEOWNER",
        "mode": "hosted",
        "size": size,
        "url_private": format!("https://files.slack.com/files-pri/T0FAKE-{id}/{name}"),
        "url_private_download": format!("https://files.slack.com/files-pri/T0FAKE-{id}/download/{name}"),
        "permalink": format!("https://fake-workspace.slack.com/files/U0FILEOWNER/{id}/{name}"),
    })
}

fn client_msg_id(ts: &str) -> String {
    let digits: String = ts.chars().filter(char::is_ascii_digit).collect();
    format!("c1a0e5d2-0000-4000-8000-{:0>12}", &digits[digits.len().saturating_sub(12)..])
}

/// The `message` event a person's post produces (`message.im`, `message.channels`…).
pub fn user_message_event(
    options: &FakeSlackOptions,
    message: &StoredMessage,
    files: &[Value],
) -> Value {
    let mut event = json!({
        "type": "message",
        "user": message.user,
        "text": message.text,
        "ts": message.ts,
        "event_ts": message.ts,
        "client_msg_id": client_msg_id(&message.ts),
        "team": options.team_id,
        "channel": message.channel,
        "channel_type": channel_type(&message.channel),
        "blocks": [{
            "type": "rich_text",
            "block_id": "fake",
            "elements": [{"type": "rich_text_section", "elements": [{"type": "text", "text": message.text}]}],
        }],
    });
    if let Some(thread_ts) = &message.thread_ts {
        event["thread_ts"] = json!(thread_ts);
        event["parent_user_id"] = json!("U0THREADPARENT");
    }
    if !files.is_empty() {
        event["subtype"] = json!("file_share");
        event["files"] = json!(files);
        event["upload"] = json!(false);
        event["display_as_bot"] = json!(false);
    }
    event
}

/// The `app_mention` event for a post that mentions the bot.
pub fn app_mention_event(
    options: &FakeSlackOptions,
    message: &StoredMessage,
    files: &[Value],
) -> Value {
    let mut event = json!({
        "type": "app_mention",
        "user": message.user,
        "text": message.text,
        "ts": message.ts,
        "client_msg_id": client_msg_id(&message.ts),
        "team": options.team_id,
        "channel": message.channel,
        "event_ts": message.ts,
    });
    if let Some(thread_ts) = &message.thread_ts {
        event["thread_ts"] = json!(thread_ts);
    }
    if !files.is_empty() {
        event["files"] = json!(files);
    }
    event
}

/// The `message` event Slack sends the app for its own post.
pub fn bot_message_event(options: &FakeSlackOptions, message: &StoredMessage) -> Value {
    let mut event = json!({
        "type": "message",
        "user": options.bot_user_id,
        "bot_id": options.bot_id,
        "app_id": options.app_id,
        "text": message.text,
        "ts": message.ts,
        "event_ts": message.ts,
        "team": options.team_id,
        "channel": message.channel,
        "channel_type": channel_type(&message.channel),
        "bot_profile": {"id": options.bot_id, "app_id": options.app_id, "name": "channeld", "deleted": false},
    });
    if let Some(thread_ts) = &message.thread_ts {
        event["thread_ts"] = json!(thread_ts);
    }
    if let Some(blocks) = &message.blocks {
        event["blocks"] = blocks.clone();
    }
    event
}

fn inner_message(options: &FakeSlackOptions, message: &StoredMessage) -> Value {
    let mut inner = json!({
        "type": "message",
        "text": message.text,
        "user": message.user,
        "ts": message.ts,
        "team": options.team_id,
    });
    if message.by_bot {
        inner["bot_id"] = json!(options.bot_id);
        inner["app_id"] = json!(options.app_id);
    }
    if let Some(thread_ts) = &message.thread_ts {
        inner["thread_ts"] = json!(thread_ts);
    }
    inner
}

/// `message` / `message_changed` for an edit.
pub fn changed_event(
    options: &FakeSlackOptions,
    before: &StoredMessage,
    after: &StoredMessage,
) -> Value {
    let mut message = inner_message(options, after);
    message["edited"] = json!({"user": after.user, "ts": format!("{}1", after.ts)});
    json!({
        "type": "message",
        "subtype": "message_changed",
        "hidden": true,
        "message": message,
        "previous_message": inner_message(options, before),
        "channel": after.channel,
        "channel_type": channel_type(&after.channel),
        "ts": format!("{}2", after.ts),
        "event_ts": format!("{}2", after.ts),
    })
}

/// `message` / `message_deleted`.
pub fn deleted_event(options: &FakeSlackOptions, message: &StoredMessage) -> Value {
    json!({
        "type": "message",
        "subtype": "message_deleted",
        "hidden": true,
        "deleted_ts": message.ts,
        "previous_message": inner_message(options, message),
        "channel": message.channel,
        "channel_type": channel_type(&message.channel),
        "ts": format!("{}3", message.ts),
        "event_ts": format!("{}3", message.ts),
    })
}

/// The Events API wrapper around an event.
pub fn event_callback(
    options: &FakeSlackOptions,
    event: Value,
    event_id: &str,
    event_time: u64,
) -> Value {
    json!({
        "token": "fake-verification-token",
        "team_id": options.team_id,
        "context_team_id": options.team_id,
        "api_app_id": options.app_id,
        "event": event,
        "type": "event_callback",
        "event_id": event_id,
        "event_time": event_time,
        "authorizations": [{
            "enterprise_id": null,
            "team_id": options.team_id,
            "user_id": options.bot_user_id,
            "is_bot": true,
            "is_enterprise_install": false,
        }],
        "is_ext_shared_channel": false,
        "event_context": format!("4-fake-{event_id}"),
    })
}

/// A `block_actions` payload: `user` used `action` (an element of `message`'s blocks, with
/// `value` set for inputs) on the bot's message.
pub fn block_actions(
    options: &FakeSlackOptions,
    user: &str,
    message: &StoredMessage,
    action: Value,
) -> Value {
    let mut container = json!({
        "type": "message",
        "message_ts": message.ts,
        "channel_id": message.channel,
        "is_ephemeral": false,
    });
    let mut posted = json!({
        "type": "message",
        "user": message.user,
        "bot_id": options.bot_id,
        "text": message.text,
        "ts": message.ts,
        "blocks": message.blocks.clone().unwrap_or(Value::Array(Vec::new())),
    });
    if let Some(thread_ts) = &message.thread_ts {
        container["thread_ts"] = json!(thread_ts);
        posted["thread_ts"] = json!(thread_ts);
    }
    json!({
        "type": "block_actions",
        "user": {"id": user, "username": user.to_lowercase(), "name": user.to_lowercase(), "team_id": options.team_id},
        "api_app_id": options.app_id,
        "token": "fake-verification-token",
        "container": container,
        "trigger_id": format!("{}.fake-trigger", message.ts),
        "team": {"id": options.team_id, "domain": "fake-workspace"},
        "enterprise": null,
        "is_enterprise_install": false,
        "channel": {"id": message.channel, "name": "fake-channel"},
        "message": posted,
        "state": {"values": {}},
        "response_url": format!("https://hooks.slack.com/actions/{}/fake/{}", options.team_id, message.ts),
        "actions": [action],
    })
}

/// Finds the interactive element `action_id` in Block Kit `blocks` (with its `block_id`).
pub fn find_element(blocks: &Value, action_id: &str) -> Option<(String, Value)> {
    for block in blocks.as_array()? {
        let block_id = block.get("block_id").and_then(Value::as_str).unwrap_or("").to_owned();
        let elements = match block.get("type").and_then(Value::as_str) {
            Some("actions") => {
                block.get("elements").and_then(Value::as_array).cloned().unwrap_or_default()
            }
            Some("input") | Some("section") => block
                .get("element")
                .or_else(|| block.get("accessory"))
                .cloned()
                .into_iter()
                .collect(),
            _ => Vec::new(),
        };
        if let Some(element) = elements
            .into_iter()
            .find(|e| e.get("action_id").and_then(Value::as_str) == Some(action_id))
        {
            return Some((block_id, element));
        }
    }
    None
}
