//! Callback bodies the fake pushes, shaped as WeCom documents them for the long connection
//! (`aibot_msg_callback` / `aibot_event_callback` bodies). The fake adds `aibotid` and
//! `create_time` when a body leaves them out.

use serde_json::{Value, json};

/// A text message in a single (one-to-one) chat: no `chatid`, the conversation is the user.
pub fn text(msgid: &str, user: &str, content: &str) -> Value {
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": "text",
        "text": {"content": content},
    })
}

/// A text message in a group chat. Groups only deliver messages that @mention the bot, so
/// `content` normally starts with `@BotName`.
pub fn group_text(msgid: &str, chatid: &str, user: &str, content: &str) -> Value {
    json!({
        "msgid": msgid,
        "chatid": chatid,
        "chattype": "group",
        "from": {"userid": user},
        "msgtype": "text",
        "text": {"content": content},
    })
}

/// A mixed message: text parts and images (`url` + per-URL `aeskey`), in order.
pub fn mixed(msgid: &str, user: &str, items: &[MixedItem<'_>]) -> Value {
    let items: Vec<Value> = items
        .iter()
        .map(|item| match item {
            MixedItem::Text(content) => json!({"msgtype": "text", "text": {"content": content}}),
            MixedItem::Image { url, aeskey } => {
                json!({"msgtype": "image", "image": {"url": url, "aeskey": aeskey}})
            }
        })
        .collect();
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": "mixed",
        "mixed": {"msg_item": items},
    })
}

/// One part of a [`mixed`] message.
#[derive(Debug, Clone, Copy)]
pub enum MixedItem<'a> {
    Text(&'a str),
    Image { url: &'a str, aeskey: &'a str },
}

/// A voice message: WeCom delivers the transcript, not the audio.
pub fn voice(msgid: &str, user: &str, transcript: &str) -> Value {
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": "voice",
        "voice": {"content": transcript},
    })
}

/// An image, file or video message (`msgtype` is `image`, `file` or `video`): an encrypted
/// download URL valid for five minutes and its AES key.
pub fn media(msgid: &str, user: &str, msgtype: &str, url: &str, aeskey: &str) -> Value {
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": msgtype,
        msgtype: {"url": url, "aeskey": aeskey},
    })
}

/// `enter_chat`: the user opened the single chat with the bot (first time that day).
pub fn enter_chat(msgid: &str, user: &str) -> Value {
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": "event",
        "event": {"eventtype": "enter_chat"},
    })
}

/// `template_card_event`: `user` clicked the button `event_key` of the card `task_id`.
/// `chatid` is set for group chats.
pub fn card_click(
    msgid: &str,
    chatid: Option<&str>,
    user: &str,
    task_id: &str,
    event_key: &str,
) -> Value {
    let mut body = json!({
        "msgid": msgid,
        "chattype": if chatid.is_some() { "group" } else { "single" },
        "from": {"userid": user},
        "msgtype": "event",
        "event": {
            "eventtype": "template_card_event",
            "template_card_event": {
                "card_type": "button_interaction",
                "event_key": event_key,
                "task_id": task_id,
            },
        },
    });
    if let Some(chatid) = chatid {
        body["chatid"] = json!(chatid);
    }
    body
}

/// `feedback_event`: the user rated a reply.
pub fn feedback(msgid: &str, user: &str, feedback_id: &str) -> Value {
    json!({
        "msgid": msgid,
        "chattype": "single",
        "from": {"userid": user},
        "msgtype": "event",
        "event": {
            "eventtype": "feedback_event",
            "feedback_event": {"id": feedback_id, "type": 1},
        },
    })
}

/// `disconnected_event`: sent to the old connection when another one subscribed the bot.
pub fn disconnected(msgid: &str) -> Value {
    json!({
        "msgid": msgid,
        "msgtype": "event",
        "event": {"eventtype": "disconnected_event"},
    })
}
