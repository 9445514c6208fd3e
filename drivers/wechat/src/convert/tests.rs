//! The mapping against recorded-shape payloads (`tests/fixtures/`) and hand-written edge cases.

use channeld_driver_sdk::protocol::types::{
    Attachment, MessageBody, MessageTarget, OutboundMessage,
};
use serde_json::Value;

use super::*;
use crate::ilink::GetUpdatesResponse;

const GETUPDATES: &str = include_str!("../../tests/fixtures/getupdates.json");
const CDN: &str = "https://novac2c.cdn.weixin.qq.com/c2c";

fn channel() -> ChannelId {
    ChannelId::new("wechat.lab").unwrap()
}

/// The fixture's messages, parsed the way the driver parses a `getupdates` answer.
fn recorded() -> Vec<WeixinMessage> {
    let response: GetUpdatesResponse = serde_json::from_str(GETUPDATES).unwrap();
    assert_eq!(response.status.failure(), None);
    assert_eq!(response.longpolling_timeout_ms, Some(35000));
    response.msgs.into_iter().map(|raw| serde_json::from_value(raw).unwrap()).collect()
}

fn convert(message: &WeixinMessage) -> Result<Converted, Skip> {
    inbound(&channel(), message, CDN)
}

#[test]
fn a_text_message_becomes_an_inbound_in_the_senders_conversation() {
    let messages = recorded();
    let converted = convert(&messages[0]).unwrap();
    let message = &converted.message;
    assert_eq!(message.id.as_str(), "wx-7407519216830457345");
    assert_eq!(converted.key, MessageKey::Id(7_407_519_216_830_457_345));
    assert_eq!(message.body.text_str(), "明天上午十点的会议还开吗？");
    assert_eq!(message.sender.id.as_str(), "o9cq800MzhxJx4Lp2Qk1@im.wechat");
    assert_eq!(
        message.target,
        MessageTarget::new(channel(), Id::new("o9cq800MzhxJx4Lp2Qk1@im.wechat").unwrap())
    );
    assert_eq!(message.timestamp_ms, Some(1_767_225_600_123));
    assert_eq!(
        converted.context_token.as_deref(),
        Some("AARzJWAFAAABAAAAAAAtUu1bvgAAAAB9aXFfm8Ew0yNDp1qKkbYa")
    );
    assert_eq!(message.metadata[META_MESSAGE_ID], "7407519216830457345");
    assert_eq!(message.metadata[META_SEQ], "311");
    assert_eq!(message.metadata[META_SESSION_ID], "0a8f3e51@session");
    assert!(
        !message.metadata.values().any(|v| v.contains("AARzJWAF")),
        "the context token stays in the driver"
    );
}

#[test]
fn a_voice_note_brings_its_transcript_and_a_reference_to_the_audio() {
    let converted = convert(&recorded()[1]).unwrap();
    let message = &converted.message;
    assert_eq!(message.id.as_str(), "wx-7407519216830457346", "a string message_id works too");
    assert_eq!(message.body.text_str(), "帮我把会议改到下午三点");
    let attachment = &message.body.attachments()[0];
    assert_eq!(
        attachment.url,
        "https://novac2c.cdn.weixin.qq.com/c2c/download?encrypted_query_param=3057020100044b30490201000204a3e7%2FZx%2Ba%3D%3D"
    );
    assert_eq!(attachment.mime.as_deref(), Some("audio/silk"));
    assert_eq!(message.metadata["wechat.attachment.0.kind"], "voice");
    assert_eq!(message.metadata["wechat.attachment.0.encryption"], "aes-128-ecb");
    assert_eq!(
        message.metadata["wechat.attachment.0.aes_key"],
        "NzM2YjYyMzU2MTM0MzQ2MzMzMzEzMDM4MzczNg=="
    );
}

#[test]
fn an_image_uses_the_servers_full_url_and_keeps_the_caption() {
    let converted = convert(&recorded()[2]).unwrap();
    let message = &converted.message;
    assert_eq!(message.body.text_str(), "这张图里是什么？");
    assert_eq!(
        message.body.attachments(),
        [Attachment {
            url: "https://novac2c.cdn.weixin.qq.com/c2c/download?encrypted_query_param=eqp-img-1&filekey=abc"
                .into(),
            name: None,
            mime: Some("image/*".into()),
        }]
    );
    assert_eq!(
        message.metadata["wechat.attachment.0.aes_key_hex"],
        "31323334353637383930313233343536"
    );
    assert_eq!(message.metadata["wechat.attachment.0.encrypt_type"], "1");
}

#[test]
fn a_file_without_text_is_an_attachment_with_its_name() {
    let converted = convert(&recorded()[3]).unwrap();
    let message = &converted.message;
    assert_eq!(message.body.text_str(), "");
    let attachment = &message.body.attachments()[0];
    assert_eq!(attachment.name.as_deref(), Some("Q3 report.pdf"));
    assert_eq!(attachment.url, format!("{CDN}/download?encrypted_query_param=a%20b%2Bc%2Fd%3D"));
}

#[test]
fn a_quoted_message_comes_first_as_quote_lines() {
    let converted = convert(&recorded()[4]).unwrap();
    let message = &converted.message;
    assert_eq!(message.body.text_str(), "> 好的，会议改到下午三点。\n就按这个时间");
    assert_eq!(message.metadata[META_QUOTED], "好的，会议改到下午三点。");
}

#[test]
fn bot_echoes_generating_messages_and_tool_progress_are_skipped() {
    let messages = recorded();
    assert_eq!(convert(&messages[5]).unwrap_err(), Skip::NotFromUser(Some(2)));
    assert_eq!(convert(&messages[6]).unwrap_err(), Skip::Generating);
    assert_eq!(convert(&messages[7]).unwrap_err(), Skip::Empty);
}

#[test]
fn without_a_message_id_the_client_id_identifies_the_message() {
    let converted = convert(&recorded()[8]).unwrap();
    assert_eq!(converted.key, MessageKey::Client("legacy-client-77".into()));
    assert_eq!(converted.message.id.as_str(), "wx-c-legacy-client-77");
    assert_eq!(
        converted.message.body.text_str(),
        "still there?",
        "message_state 0 is a new message"
    );
}

#[test]
fn replay_keys_fall_back_from_message_id_to_client_id_to_seq() {
    let mut message = WeixinMessage { seq: Some(9), ..WeixinMessage::default() };
    assert_eq!(MessageKey::of(&message), Some(MessageKey::Seq(9)));
    assert_eq!(MessageKey::Seq(9).event_id(), "wx-s-9");
    message.client_id = Some(String::new());
    assert_eq!(MessageKey::of(&message), Some(MessageKey::Seq(9)), "an empty client id is none");
    message.client_id = Some("c".repeat(300));
    let long = MessageKey::of(&message).unwrap().event_id();
    assert!(long.starts_with("wx-c-sha256-") && long.len() == "wx-c-sha256-".len() + 64);
    assert_eq!(MessageKey::of(&WeixinMessage::default()), None);
}

#[test]
fn a_message_without_sender_or_ids_is_skipped() {
    let base: WeixinMessage = serde_json::from_value(serde_json::json!({
        "message_type": 1, "item_list": [{"type": 1, "text_item": {"text": "x"}}]
    }))
    .unwrap();
    assert_eq!(convert(&base).unwrap_err(), Skip::NoSender);
    let anonymous_id = WeixinMessage { from_user_id: Some("u".into()), ..base };
    assert_eq!(convert(&anonymous_id).unwrap_err(), Skip::NoId);
}

#[test]
fn a_malformed_message_does_not_spoil_the_rest_of_the_batch() {
    let raw: Value = serde_json::from_str(GETUPDATES).unwrap();
    let mut raw = raw;
    raw["msgs"][0]["item_list"] = serde_json::json!("not a list");
    let response: GetUpdatesResponse = serde_json::from_value(raw).unwrap();
    let parsed: Vec<Result<WeixinMessage, _>> =
        response.msgs.into_iter().map(serde_json::from_value::<WeixinMessage>).collect();
    assert!(parsed[0].is_err());
    assert!(parsed[1..].iter().all(Result::is_ok));
}

fn outbound(text: &str, attachments: Vec<Attachment>) -> OutboundMessage {
    OutboundMessage {
        target: MessageTarget::new(channel(), Id::new("u@im.wechat").unwrap()),
        body: MessageBody::with_attachments(text.into(), attachments).unwrap(),
        metadata: Default::default(),
    }
}

#[test]
fn outbound_text_simplifies_markdown_and_links_attachments() {
    let attachment = Attachment {
        url: "https://example.com/r.pdf".into(),
        name: Some("report".into()),
        mime: None,
    };
    let message = outbound("##### 结果\n见 ![图](https://x/i.png)", vec![attachment]);
    assert_eq!(
        outbound_text(&message, Markdown::Simplify).unwrap(),
        "结果\n见 图 (https://x/i.png)\nreport: https://example.com/r.pdf"
    );
    let kept = outbound("##### raw", Vec::new());
    assert_eq!(outbound_text(&kept, Markdown::Keep).unwrap(), "##### raw");
    assert_eq!(
        outbound_text(&outbound(" \n ", Vec::new()), Markdown::Keep),
        Err(OutboundError::Empty)
    );
}

#[test]
fn emphasis_around_cjk_loses_its_markers_but_latin_emphasis_bold_and_code_stay() {
    assert_eq!(simplify_markdown("这是*重点*和***非常重要***"), "这是重点和非常重要");
    assert_eq!(simplify_markdown("an *emphasised* word"), "an *emphasised* word");
    assert_eq!(simplify_markdown("**粗体** stays"), "**粗体** stays");
    assert_eq!(simplify_markdown("snake_case_name and _斜体_"), "snake_case_name and 斜体");
    assert_eq!(simplify_markdown("`*代码*` stays"), "`*代码*` stays");
    assert_eq!(
        simplify_markdown("```\n##### *代码*\n![a](b)\n```"),
        "```\n##### *代码*\n![a](b)\n```"
    );
    assert_eq!(simplify_markdown("#### kept\n###### gone"), "#### kept\ngone");
    assert_eq!(
        simplify_markdown("![](https://x/y.png) and ![unclosed"),
        "https://x/y.png and ![unclosed"
    );
}

#[test]
fn long_text_is_cut_in_order_at_paragraphs_lines_or_spaces() {
    let paragraph = "word ".repeat(300); // 1,500 characters
    let text = format!("{p}\n\n{p}\n\n{p}", p = paragraph.trim_end());
    let parts = chunks(&text, 4000);
    assert_eq!(parts.len(), 2);
    assert!(parts.iter().all(|p| p.chars().count() <= 4000));
    assert_eq!(parts.join("\n\n"), text, "cut at a blank line, nothing lost");

    let unbroken: String = "字".repeat(9000);
    let parts = chunks(&unbroken, 4000);
    assert_eq!(parts.len(), 3);
    assert!(parts.iter().all(|p| p.chars().count() <= 4000));
    assert_eq!(parts.concat(), unbroken, "hard cuts on character boundaries, in order");

    assert_eq!(chunks("short", 4000), ["short"]);
    assert!(chunks("", 4000).is_empty());
}

#[test]
fn a_code_fence_cut_in_two_is_closed_and_reopened() {
    let code: String = (0..400).map(|i| format!("let x{i} = {i};\n")).collect();
    let text = format!("Here:\n```rust\n{code}```\ndone");
    let parts = chunks(&text, 1000);
    assert!(parts.len() > 1);
    for part in &parts {
        assert!(part.chars().count() <= 1000, "{} characters", part.chars().count());
        let fences = part.lines().filter(|l| l.starts_with("```")).count();
        assert_eq!(fences % 2, 0, "every part has balanced fences:\n{part}");
    }
    assert!(parts[1].starts_with("```\n"));
    assert!(parts.last().unwrap().ends_with("done"));
}

fn message(value: serde_json::Value) -> WeixinMessage {
    serde_json::from_value(value).unwrap()
}

#[test]
fn a_group_message_stays_in_the_senders_conversation_and_names_the_group() {
    let converted = convert(&message(serde_json::json!({
        "message_id": 5, "from_user_id": "u@im.wechat", "group_id": "g-9@chatroom",
        "message_type": 1, "message_state": 2,
        "item_list": [{"type": 1, "text_item": {"text": "hi all"}}]
    })))
    .unwrap();
    assert_eq!(converted.message.target.conversation.as_str(), "u@im.wechat");
    assert_eq!(converted.message.metadata[META_GROUP_ID], "g-9@chatroom");
}

#[test]
fn several_items_join_in_order_and_quoted_media_becomes_a_placeholder() {
    let converted = convert(&message(serde_json::json!({
        "message_id": 6, "from_user_id": "u", "message_type": 1,
        "item_list": [
            {"type": 1, "text_item": {"text": "first"},
             "ref_msg": {"message_item": {"type": 4, "file_item": {"file_name": "a.pdf"}}}},
            {"type": 5, "video_item": {"media": {"full_url": "https://cdn/v.mp4"}}},
            {"type": 3, "voice_item": {"media": {"encrypt_query_param": "v"}}},
            {"type": 1, "text_item": {"text": "second"}}
        ]
    })))
    .unwrap();
    let message = &converted.message;
    assert_eq!(message.body.text_str(), "> [file a.pdf]\nfirst\nsecond");
    let kinds: Vec<&str> =
        (0..2).map(|i| message.metadata[&format!("wechat.attachment.{i}.kind")].as_str()).collect();
    assert_eq!(kinds, ["video", "voice"], "a voice note without transcript is only an attachment");
    assert_eq!(message.body.attachments()[0].url, "https://cdn/v.mp4");
    assert_eq!(message.body.attachments()[1].mime.as_deref(), Some("audio/*"));
}

#[test]
fn media_without_any_location_is_left_out() {
    let skipped = convert(&message(serde_json::json!({
        "message_id": 7, "from_user_id": "u", "message_type": 1,
        "item_list": [{"type": 2, "image_item": {"media": {"aes_key": "k"}}}]
    })));
    assert_eq!(skipped.unwrap_err(), Skip::Empty);
}

#[test]
fn a_nul_in_the_text_is_dropped_rather_than_refused() {
    let converted = convert(&message(serde_json::json!({
        "message_id": 8, "from_user_id": "u", "message_type": 1,
        "item_list": [{"type": 1, "text_item": {"text": "a\u{0}b"}}]
    })))
    .unwrap();
    assert_eq!(converted.message.body.text_str(), "ab");
}

#[test]
fn chunks_never_split_a_character_and_tables_pass_through() {
    let emoji = "😀".repeat(4500);
    let parts = chunks(&emoji, 4000);
    assert!(parts.iter().all(|p| p.chars().count() <= 4000 && p.chars().all(|c| c == '😀')));
    assert_eq!(parts.concat(), emoji);
    let table = "| a | b |\n|---|---|\n| 中 | 文 |";
    assert_eq!(simplify_markdown(table), table);
}
