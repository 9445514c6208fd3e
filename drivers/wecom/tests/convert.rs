//! The pure WeCom mapping on frames in the platform's documented shapes (`tests/fixtures/`):
//! callbacks become the inbound messages the hub sees, acknowledgements decode, and the
//! commands the driver sends are exactly the platform's JSON.

use channeld_driver_sdk::protocol::types::{Choice, Command, CommandResult};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_wecom::convert::{self, CardKind, Chat, ChatKind, Skip};
use channeld_wecom::wire::{self, Incoming, ReplyBody, SendContent, SendMsg, StreamFrame, Text};
use serde_json::{Value, json};

fn fixture(name: &str) -> Incoming {
    let path = format!("{}/tests/fixtures/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path}: {err}"));
    wire::decode(&text).unwrap_or_else(|err| panic!("{name} does not decode: {err}"))
}

fn channel() -> ChannelId {
    ChannelId::new("wecom.ops").unwrap()
}

/// The inbound message a message fixture becomes, as the JSON the hub receives.
fn inbound(name: &str, bot_name: Option<&str>) -> Value {
    let Incoming::Message { callback, .. } = fixture(name) else {
        panic!("{name} is not a message")
    };
    let message = convert::inbound_message(&callback, bot_name)
        .unwrap_or_else(|err| panic!("{name}: {err}"))
        .build(&channel())
        .unwrap_or_else(|err| panic!("{name}: {err}"));
    serde_json::to_value(message).unwrap()
}

#[test]
fn a_single_chat_text_is_from_and_to_the_user() {
    let Incoming::Message { req_id, .. } = fixture("text_single") else { unreachable!() };
    assert_eq!(req_id, "c7d2f0b2a1e64f1f9f1e6c0d3b2a1f00");
    assert_eq!(
        inbound("text_single", None),
        json!({
            "id": "CAIQ0qLR9gUYAiCAgIDwgICAgAE",
            "target": {"channel": "wecom.ops", "conversation": "zhangsan", "thread": null, "reply_to": null},
            "sender": {"id": "zhangsan", "display_name": null, "handle": null},
            "body": {"text": "How much disk is left on db-2?"},
            "timestamp_ms": 1_735_689_600_000u64,
            "metadata": {"wecom.chattype": "single", "wecom.msgtype": "text"},
        })
    );
}

#[test]
fn a_group_text_belongs_to_the_group_without_the_mention() {
    let message = inbound("text_group", None);
    assert_eq!(message["target"]["conversation"], "wrkSFfCgAAxxxxxxxxxxxxxxxxxxxx");
    assert_eq!(message["sender"]["id"], "lisi");
    assert_eq!(message["body"]["text"], "restart the nightly job please");
    assert_eq!(message["metadata"]["wecom.chattype"], "group");
    // The configured name matches the same mention.
    assert_eq!(
        inbound("text_group", Some("运维助手"))["body"]["text"],
        "restart the nightly job please"
    );
}

#[test]
fn a_mixed_message_keeps_its_text_parts_and_references_its_images() {
    let message = inbound("mixed_group", None);
    assert_eq!(
        message["body"]["text"],
        "what does this error mean?\nit shows up after every deploy"
    );
    assert_eq!(
        message["body"]["attachments"],
        json!([{"url": "https://ww-aibot-img-1258476243.cos.ap-guangzhou.myqcloud.com/BHoPdA3/7571665296904772241", "name": null, "mime": null}])
    );
    assert_eq!(message["metadata"]["wecom.attachment.0.type"], "image");
    assert_eq!(
        message["metadata"]["wecom.attachment.0.aeskey"],
        "bXlhZXNrZXlteWFlc2tleW15YWVza2V5bXlhZXNrZXk="
    );
}

#[test]
fn voice_arrives_as_its_transcript() {
    let message = inbound("voice", None);
    assert_eq!(message["body"], json!({"text": "remind me about the backup at five"}));
    assert_eq!(message["metadata"]["wecom.msgtype"], "voice");
}

#[test]
fn images_files_and_videos_are_attachment_references() {
    for (name, kind) in [("image", "image"), ("file", "file"), ("video", "video")] {
        let message = inbound(name, None);
        assert_eq!(message["body"]["text"], "", "{name}");
        let url = message["body"]["attachments"][0]["url"].as_str().unwrap();
        assert!(url.starts_with("https://ww-aibot-"), "{name}: {url}");
        assert_eq!(message["metadata"]["wecom.attachment.0.type"], kind);
        assert!(message["metadata"]["wecom.attachment.0.aeskey"].is_string(), "{name}");
    }
}

#[test]
fn a_quoted_message_travels_in_the_metadata() {
    let message = inbound("quote", None);
    assert_eq!(message["body"]["text"], "and this one?");
    assert_eq!(message["metadata"]["wecom.quote"], "db-2 has 14 GB free");
}

#[test]
fn a_mixed_message_of_images_alone_has_empty_text_and_numbered_keys() {
    let message = inbound("mixed_images_only", None);
    assert_eq!(message["body"]["text"], "");
    assert_eq!(message["body"]["attachments"].as_array().unwrap().len(), 2);
    let metadata = &message["metadata"];
    assert_eq!(metadata["wecom.attachment.0.type"], "image");
    assert!(
        metadata.get("wecom.attachment.0.aeskey").is_none(),
        "the first image came without a key"
    );
    assert_eq!(
        metadata["wecom.attachment.1.aeskey"],
        "c2Vjb25ka2V5c2Vjb25ka2V5c2Vjb25ka2V5c2Vjb24="
    );
}

#[test]
fn a_quoted_mixed_message_keeps_its_text_and_a_leading_space_before_the_mention_is_fine() {
    let message = inbound("quote_mixed", None);
    assert_eq!(message["body"]["text"], "summarise this");
    assert_eq!(message["metadata"]["wecom.quote"], "disk at 91%\non db-2");
    assert_eq!(message["target"]["conversation"], "wrkSFfCgAAxxxxxxxxxxxxxxxxxxxx");
}

#[test]
fn a_message_with_nothing_to_pass_on_is_skipped() {
    let Incoming::Message { mut callback, .. } = fixture("text_group") else { unreachable!() };
    callback.text = Some(Text { content: "@运维助手\u{2005}".into() });
    assert_eq!(convert::inbound_message(&callback, None), Err(Skip::Empty("text".into())));
    callback.msgtype = "location".into();
    assert_eq!(
        convert::inbound_message(&callback, None),
        Err(Skip::Unsupported("location".into()))
    );
    // Ids the protocol cannot carry are refused when the message is built.
    callback.msgtype = "text".into();
    callback.text = Some(Text { content: "hi".into() });
    callback.msgid = "x".repeat(300);
    assert!(convert::inbound_message(&callback, None).unwrap().build(&channel()).is_err());
}

#[test]
fn events_decode_with_their_type_and_sender() {
    let Incoming::Event { req_id, callback } = fixture("enter_chat") else { unreachable!() };
    assert_eq!(req_id, "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff");
    assert_eq!(callback.event.eventtype, wire::event::ENTER_CHAT);
    assert_eq!(callback.from.unwrap().userid, "wangwu");

    let Incoming::Event { callback, .. } = fixture("disconnected_event") else { unreachable!() };
    assert_eq!(callback.event.eventtype, wire::event::DISCONNECTED);
    assert!(callback.from.is_none());

    let Incoming::Event { callback, .. } = fixture("feedback_event") else { unreachable!() };
    assert_eq!(callback.event.eventtype, wire::event::FEEDBACK);
}

#[test]
fn card_clicks_are_read_from_the_documented_and_the_flat_shape() {
    let Incoming::Event { callback, .. } = fixture("template_card_event") else { unreachable!() };
    let click = callback.event.card_click().unwrap();
    assert_eq!(
        (click.task_id.as_str(), click.event_key.as_str()),
        ("cd-3f9a6c2e5b7d1a08_1", "approve")
    );
    let chat = Chat::of(callback.chatid.as_deref(), callback.chattype.as_deref(), "lisi");
    assert_eq!(chat.kind, ChatKind::Group);

    let Incoming::Event { callback, .. } = fixture("template_card_event_flat") else {
        unreachable!()
    };
    let click = callback.event.card_click().unwrap();
    assert_eq!(
        (click.task_id.as_str(), click.event_key.as_str()),
        ("cd-3f9a6c2e5b7d1a08_2", "choice_1")
    );
}

#[test]
fn acknowledgements_carry_the_req_id_and_errcode() {
    let Incoming::Ack(ok) = fixture("ack_ok") else { unreachable!() };
    assert!(ok.is_ok());
    assert_eq!(ok.req_id, "aibot_subscribe_1735689599000_6c1f0a9e");
    let Incoming::Ack(expired) = fixture("ack_stream_expired") else { unreachable!() };
    assert_eq!(expired.errcode, Some(wire::ERR_STREAM_EXPIRED));
    let Incoming::Ack(unknown) = fixture("ack_unknown_req_id") else { unreachable!() };
    assert_eq!(unknown.errcode, Some(wire::ERR_UNKNOWN_REQ_ID));
    let Incoming::Ack(refused) = fixture("ack_subscribe_refused") else { unreachable!() };
    assert!(!refused.is_ok());
    assert_eq!(refused.describe(), "errcode 40001: invalid secret");
    // No errcode at all is not a success (as in the official SDK).
    let Incoming::Ack(bare) = wire::decode(r#"{"headers":{"req_id":"r"}}"#).unwrap() else {
        unreachable!()
    };
    assert!(!bare.is_ok());
}

#[test]
fn unreadable_frames_are_errors_and_unknown_commands_are_named() {
    assert!(wire::decode("not json").is_err());
    assert!(wire::decode(r#"{"cmd":"aibot_msg_callback","headers":{},"body":{}}"#).is_err());
    assert!(
        wire::decode(
            r#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r"},"body":{"msgid":"m"}}"#
        )
        .is_err()
    );
    assert_eq!(
        wire::decode(r#"{"cmd":"aibot_new_thing","headers":{"req_id":"r"}}"#).unwrap(),
        Incoming::Other { cmd: "aibot_new_thing".into() }
    );
}

fn frame(text: String) -> Value {
    serde_json::from_str(&text).unwrap()
}

#[test]
fn commands_are_the_platforms_json() {
    let subscribe = wire::Subscribe { bot_id: "aib5mZb3qJ0", secret: "s3cret" };
    assert_eq!(
        frame(wire::encode(wire::cmd::SUBSCRIBE, "sub-1", Some(&subscribe))),
        json!({"cmd": "aibot_subscribe", "headers": {"req_id": "sub-1"}, "body": {"bot_id": "aib5mZb3qJ0", "secret": "s3cret"}})
    );
    assert!(!format!("{subscribe:?}").contains("s3cret"));
    assert_eq!(
        frame(wire::encode::<()>(wire::cmd::PING, "ping-1", None)),
        json!({"cmd": "ping", "headers": {"req_id": "ping-1"}})
    );
    let stream = ReplyBody::Stream {
        stream: StreamFrame { id: "st-1".into(), finish: false, content: "<think></think>".into() },
    };
    assert_eq!(
        frame(wire::encode(wire::cmd::RESPOND_MSG, "c7d2", Some(&stream))),
        json!({"cmd": "aibot_respond_msg", "headers": {"req_id": "c7d2"},
               "body": {"msgtype": "stream", "stream": {"id": "st-1", "finish": false, "content": "<think></think>"}}})
    );
    let send = SendMsg {
        chatid: "wrkSFfCgAA".into(),
        chat_type: Some(ChatKind::Group.chat_type()),
        content: SendContent::Markdown { markdown: Text { content: "**done**".into() } },
    };
    assert_eq!(
        frame(wire::encode(wire::cmd::SEND_MSG, "send-1", Some(&send))),
        json!({"cmd": "aibot_send_msg", "headers": {"req_id": "send-1"},
               "body": {"chatid": "wrkSFfCgAA", "chat_type": 2, "msgtype": "markdown", "markdown": {"content": "**done**"}}})
    );
    let welcome = wire::WelcomeBody::Text { text: Text { content: "Hi!".into() } };
    assert_eq!(
        frame(wire::encode(wire::cmd::RESPOND_WELCOME, "f0f1", Some(&welcome)))["body"],
        json!({"msgtype": "text", "text": {"content": "Hi!"}})
    );
    let req_id = wire::req_id(wire::cmd::SEND_MSG);
    assert!(req_id.starts_with("aibot_send_msg_"), "{req_id}");
}

#[test]
fn an_approval_is_a_button_card_and_its_clicks_answer_it() {
    let command = Command::RequestApproval {
        tool: "restart_job".into(),
        arguments: json!({"job": "nightly"}),
    };
    let (card, kind) = convert::command_card(&command, "cd-ab_1").unwrap();
    let send = SendMsg {
        chatid: "zhangsan".into(),
        chat_type: Some(1),
        content: SendContent::TemplateCard { template_card: card.clone() },
    };
    assert_eq!(
        frame(wire::encode(wire::cmd::SEND_MSG, "send-2", Some(&send)))["body"],
        json!({
            "chatid": "zhangsan", "chat_type": 1, "msgtype": "template_card",
            "template_card": {
                "card_type": "button_interaction",
                "main_title": {"title": "Approve restart_job?"},
                "sub_title_text": "{\"job\":\"nightly\"}",
                "button_list": [
                    {"text": "Approve", "style": 1, "key": "approve"},
                    {"text": "Reject", "style": 2, "key": "reject"},
                ],
                "task_id": "cd-ab_1",
            },
        })
    );
    assert_eq!(convert::card_answer(&kind, "approve", "lisi"), Some(CommandResult::Accepted));
    assert_eq!(
        convert::card_answer(&kind, "reject", "lisi"),
        Some(CommandResult::rejected("rejected by lisi"))
    );
    assert_eq!(convert::card_answer(&kind, "choice_0", "lisi"), None);

    let answered = convert::answered_card(
        &card,
        &convert::outcome_text(&kind, &CommandResult::Accepted, "lisi"),
    );
    let update = wire::UpdateCard::new(answered);
    assert_eq!(
        frame(wire::encode(wire::cmd::RESPOND_UPDATE, "1a1b", Some(&update)))["body"],
        json!({
            "response_type": "update_template_card",
            "template_card": {
                "card_type": "button_interaction",
                "main_title": {"title": "Approve restart_job?", "desc": "Approved by lisi"},
                "sub_title_text": "{\"job\":\"nightly\"}",
                "button_list": [],
                "task_id": "cd-ab_1",
            },
        })
    );
}

#[test]
fn a_choice_has_one_button_per_option_and_answers_with_the_option() {
    let choices: Vec<Choice> = ["blue", "green"]
        .iter()
        .map(|id| Choice { id: Id::new(*id).unwrap(), label: id.to_uppercase() })
        .collect();
    let command = Command::RequestChoice {
        question: "Which deploy?".into(),
        choices: choices.clone(),
        multiple: false,
    };
    let (card, kind) = convert::command_card(&command, "cd-ab_2").unwrap();
    let keys: Vec<&str> = card.button_list.iter().map(|button| button.key.as_str()).collect();
    assert_eq!(keys, ["choice_0", "choice_1"]);
    assert_eq!(kind, CardKind::Choice(choices.clone()));
    assert_eq!(
        convert::card_answer(&kind, "choice_1", "lisi"),
        Some(CommandResult::Value { payload: json!({"choice": "green", "label": "GREEN"}) })
    );
    assert_eq!(convert::card_answer(&kind, "choice_9", "lisi"), None);

    let seven = (0..7)
        .map(|n| Choice { id: Id::new(format!("c{n}")).unwrap(), label: n.to_string() })
        .collect();
    let too_many = Command::RequestChoice { question: "?".into(), choices: seven, multiple: false };
    assert!(convert::command_card(&too_many, "t").is_err());
    let multiple = Command::RequestChoice { question: "?".into(), choices, multiple: true };
    assert!(convert::command_card(&multiple, "t").is_err());
    let input = Command::RequestInput { prompt: "name?".into() };
    assert!(convert::command_card(&input, "t").is_err());
}
