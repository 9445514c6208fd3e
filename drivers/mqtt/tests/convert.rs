//! The pure MQTT ⇄ frame mapping, on payloads as publishers send them (mosquitto_pub lines,
//! JSON from scripts, a spoofing attempt, binary junk).

use channeld_driver_sdk::PostKind;
use channeld_driver_sdk::protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_driver_sdk::protocol::{ChannelId, Id, MAX_LINE_BYTES};
use channeld_mqtt::convert::{
    ConvertError, IdentityTemplate, InboundPayload, OutboundTemplate, PayloadError, TemplateError,
    TopicError, TopicIdentity, event_id, inbound_message, outbound_message_id, outbound_payload,
    parse_payload,
};

fn channel() -> ChannelId {
    ChannelId::new("mqtt.lab").unwrap()
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap()
}

#[test]
fn the_identity_template_reads_sender_and_conversation_from_the_topic() {
    let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
    assert_eq!(template.filter(), "lab/in/+/+");
    assert_eq!(
        template.identify("lab/in/alice/ops"),
        Some(TopicIdentity { sender: "alice", conversation: "ops" })
    );
    for miss in [
        "lab/in/alice",
        "lab/in/alice/ops/extra",
        "lab/out/alice/ops",
        "lab/in//ops",
        "lab/in/alice/",
    ] {
        assert_eq!(template.identify(miss), None, "{miss}");
    }
}

#[test]
fn without_a_conversation_level_the_sender_is_the_conversation() {
    let template = IdentityTemplate::parse("site/+/dm/{sender}").unwrap();
    assert_eq!(template.filter(), "site/+/dm/+");
    assert_eq!(
        template.identify("site/berlin/dm/bob"),
        Some(TopicIdentity { sender: "bob", conversation: "bob" })
    );
}

#[test]
fn bad_templates_are_refused_with_the_reason() {
    assert_eq!(IdentityTemplate::parse(""), Err(TemplateError::Empty));
    assert_eq!(IdentityTemplate::parse("lab/in/{conversation}"), Err(TemplateError::Sender));
    assert_eq!(
        IdentityTemplate::parse("lab/{sender}/{sender}"),
        Err(TemplateError::Repeated("{sender}"))
    );
    assert_eq!(
        IdentityTemplate::parse("lab/in/user-{sender}"),
        Err(TemplateError::BadLevel("user-{sender}".into()))
    );
    assert_eq!(IdentityTemplate::parse("lab/{sender}/#"), Err(TemplateError::BadLevel("#".into())));
    assert_eq!(OutboundTemplate::parse("lab/out/+"), Err(TemplateError::Wildcard("+".into())));
    assert_eq!(
        OutboundTemplate::parse("lab/out/{sender}"),
        Err(TemplateError::InboundOnly("{sender}".into()))
    );
}

#[test]
fn an_outbound_conversation_is_exactly_one_level() {
    let template = OutboundTemplate::parse("lab/out/{conversation}").unwrap();
    assert_eq!(template.render("ops").unwrap(), "lab/out/ops");
    for bad in ["a/b", "+", "x#", ""] {
        assert_eq!(template.render(bad), Err(TopicError::Conversation(bad.into())), "{bad}");
    }
    let fixed = OutboundTemplate::parse("lab/replies").unwrap();
    assert_eq!(fixed.render("anything").unwrap(), "lab/replies");
}

#[test]
fn json_payloads_carry_text_thread_and_id() {
    let payload = parse_payload(br#"{"text":"deploy now?","thread":"t-9","id":"msg-17"}"#).unwrap();
    assert_eq!(
        payload,
        InboundPayload {
            text: "deploy now?".into(),
            thread: Some("t-9".into()),
            id: Some("msg-17".into()),
            claimed_sender: None,
        }
    );
    // Numbers are fine as ids; unknown fields are ignored.
    let numeric =
        parse_payload(br#"{"text":"hi","id":42,"priority":"high","thread":null}"#).unwrap();
    assert_eq!(numeric.id.as_deref(), Some("42"));
    assert_eq!(numeric.thread, None);
}

#[test]
fn raw_text_payloads_lose_one_trailing_newline() {
    // What `mosquitto_pub -l` sends for a typed line.
    assert_eq!(parse_payload(b"hello there\n").unwrap().text, "hello there");
    assert_eq!(parse_payload(b"two lines\r\n").unwrap().text, "two lines");
    assert_eq!(parse_payload("grüße".as_bytes()).unwrap().text, "grüße");
    // JSON that is not an object is text.
    assert_eq!(parse_payload(b"42").unwrap().text, "42");
    assert_eq!(parse_payload(b"[1, 2]").unwrap().text, "[1, 2]");
}

#[test]
fn a_payload_that_starts_like_json_but_does_not_parse_is_refused_not_taken_as_text() {
    // As text, its id would be lost and each redelivery would get a fresh one and run again.
    let deep = format!("{{\"a\":{}1{}}}", "[".repeat(5000), "]".repeat(5000));
    for bad in [
        br#"{"text":"x","id":1e400}"#.as_slice(),
        b"{not json",
        b"  {\"text\":\"x\"",
        deep.as_bytes(),
    ] {
        let err = parse_payload(bad).unwrap_err();
        assert!(
            matches!(err, PayloadError::InvalidJson(_)),
            "{}: {err}",
            String::from_utf8_lossy(&bad[..bad.len().min(40)])
        );
        assert!(err.to_string().starts_with("invalid JSON: "), "{err}");
    }
}

#[test]
fn unusable_payloads_are_reported() {
    assert_eq!(parse_payload(b""), Err(PayloadError::Empty));
    assert_eq!(parse_payload(b"  \n"), Err(PayloadError::Empty));
    assert_eq!(parse_payload(&[0xff, 0xfe, 0x00]), Err(PayloadError::NotUtf8));
    assert_eq!(parse_payload(br#"{"message":"hi"}"#), Err(PayloadError::MissingText));
    assert_eq!(parse_payload(br#"{"text":""}"#), Err(PayloadError::MissingText));
    assert_eq!(parse_payload(br#"{"text":["a"]}"#), Err(PayloadError::MissingText));
    assert_eq!(parse_payload(br#"{"text":"x","id":{"a":1}}"#), Err(PayloadError::BadField("id")));
}

#[test]
fn a_payload_claiming_another_sender_does_not_change_the_sender() {
    let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
    let topic = "lab/in/mallory/ops";
    let payload = parse_payload(br#"{"text":"let me in","sender":"alice","id":"1"}"#).unwrap();
    assert_eq!(payload.claimed_sender.as_deref(), Some("alice"));
    let identity = template.identify(topic).unwrap();
    let message = inbound_message(&channel(), topic, identity, payload, "gen-1").unwrap();
    assert_eq!(message.sender.id, "mallory");
    assert_eq!(message.id, "mallory/1");
    let object = parse_payload(br#"{"text":"x","sender":{"id":"alice"}}"#).unwrap();
    assert_eq!(object.claimed_sender.as_deref(), Some("alice"));
}

#[test]
fn inbound_messages_name_the_channel_target_and_topic() {
    let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
    let topic = "lab/in/alice/ops";
    let payload = parse_payload(br#"{"text":"status?","thread":"t-1","id":"m-1"}"#).unwrap();
    let message =
        inbound_message(&channel(), topic, template.identify(topic).unwrap(), payload, "gen")
            .unwrap();
    assert_eq!(message.id, "alice/m-1");
    let mut target = MessageTarget::new(channel(), id("ops"));
    target.thread = Some(id("t-1"));
    assert_eq!(message.target, target);
    assert_eq!(message.body.text_str(), "status?");
    assert_eq!(message.timestamp_ms, None, "redeliveries must encode identically");
    assert_eq!(message.metadata.get("mqtt_topic").map(String::as_str), Some(topic));

    let raw = parse_payload(b"no id here").unwrap();
    let message =
        inbound_message(&channel(), topic, template.identify(topic).unwrap(), raw, "gen-7")
            .unwrap();
    assert_eq!(message.id, "gen-7", "without a payload id the generated one is used");
}

#[test]
fn event_ids_are_scoped_by_sender_and_bounded() {
    assert_eq!(event_id("alice", Some("7"), "g").unwrap(), "alice/7");
    assert_eq!(event_id("bob", Some("7"), "g").unwrap(), "bob/7");
    assert_eq!(event_id("bob", None, "g-1").unwrap(), "g-1");
}

#[test]
fn a_sender_and_id_too_long_together_get_a_stable_digest_per_sender() {
    // Each part is a valid id alone; together they exceed 256 bytes.
    let sender = "s".repeat(200);
    let long_id = "x".repeat(200);
    let first = event_id(&sender, Some(&long_id), "g-1").unwrap();
    assert!(first.as_str().starts_with("sha256-") && first.as_str().len() == 7 + 64, "{first}");
    assert_eq!(event_id(&sender, Some(&long_id), "g-2").unwrap(), first, "redeliveries agree");
    let other_sender = event_id(&"t".repeat(200), Some(&long_id), "g").unwrap();
    assert_ne!(other_sender, first, "another sender cannot collide with it");

    let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
    let topic = format!("lab/in/{sender}/ops");
    let payload = parse_payload(format!(r#"{{"text":"hi","id":"{long_id}"}}"#).as_bytes()).unwrap();
    let message =
        inbound_message(&channel(), &topic, template.identify(&topic).unwrap(), payload, "g")
            .unwrap();
    assert_eq!(message.id, first, "the message is reported, not dropped");
}

#[test]
fn messages_too_large_for_a_frame_are_refused() {
    let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
    let topic = "lab/in/alice/ops";
    let payload = InboundPayload {
        text: "x".repeat(MAX_LINE_BYTES),
        thread: None,
        id: Some("big".into()),
        claimed_sender: None,
    };
    let err = inbound_message(&channel(), topic, template.identify(topic).unwrap(), payload, "g")
        .unwrap_err();
    assert!(matches!(err, ConvertError::TooLarge(len) if len > MAX_LINE_BYTES), "{err}");
}

#[test]
fn outbound_payloads_are_json_with_a_deterministic_id() {
    let mut target = MessageTarget::new(channel(), id("ops"));
    target.reply_to = Some(id("alice/m-1"));
    let message = OutboundMessage {
        target,
        body: MessageBody::text("on it").unwrap(),
        metadata: Default::default(),
    };
    let kind = PostKind::Reply { event_id: id("alice/m-1") };
    let message_id = outbound_message_id(&kind);
    assert_eq!(message_id, "reply-alice/m-1");
    assert_eq!(outbound_message_id(&kind), message_id, "the same request gets the same id");
    let payload: serde_json::Value =
        serde_json::from_slice(&outbound_payload(&message_id, &message)).unwrap();
    assert_eq!(
        payload,
        serde_json::json!({
            "id": "reply-alice/m-1",
            "text": "on it",
            "conversation": "ops",
            "thread": null,
            "reply_to": "alice/m-1",
        })
    );

    let long = PostKind::Proactive { request_id: id(&"r".repeat(256)) };
    let hashed = outbound_message_id(&long);
    assert!(hashed.as_str().starts_with("send-sha256-") && hashed.as_str().len() == 12 + 64);
}
