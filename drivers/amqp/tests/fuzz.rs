//! Property fuzzing of the AMQP driver's convert layer: any properties (ids, `user_id`,
//! `reply_to`, `content_type`, headers of any AMQP type) and any body either become an
//! inbound message or a typed refusal; nothing panics, a redelivery (the same properties and
//! body) converts to exactly the same frame, and a digest event id differs when the body does.

use channeld_amqp::config::{InboundRules, MissingMessageId, Trust};
use channeld_amqp::convert::{Received, inbound};
use channeld_driver_sdk::protocol::ChannelId;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use proptest::prelude::*;

/// Short strings: mostly plausible ids, sometimes empty, as long as AMQP allows (255 bytes:
/// a longer one cannot be on the wire, and lapin's `ShortString` refuses it) or hostile.
fn short_text() -> impl Strategy<Value = String> {
    prop_oneof![
        5 => "[a-zA-Z0-9:._@-]{1,24}",
        1 => Just(String::new()),
        1 => "\\PC{250,300}".prop_map(cap_short),
        1 => "[\\x00-\\x1f \"\\\\]{1,6}",
        1 => "\\PC{0,24}".prop_map(cap_short),
    ]
}

/// `text` cut to at most 255 bytes, on a character boundary.
fn cap_short(mut text: String) -> String {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

fn header_value() -> impl Strategy<Value = AMQPValue> {
    prop_oneof![
        short_text().prop_map(|s| AMQPValue::LongString(LongString::from(s))),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(|b| AMQPValue::ByteArray(b.into())),
        short_text().prop_map(|s| AMQPValue::ShortString(ShortString::from(s))),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        any::<bool>().prop_map(AMQPValue::Boolean),
        Just(AMQPValue::Void),
        short_text().prop_map(|s| {
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(s.into())]))
        }),
    ]
}

fn headers() -> impl Strategy<Value = Option<FieldTable>> {
    let name = prop_oneof![
        Just("x-conversation".to_owned()),
        Just("x-thread".to_owned()),
        Just("x-sender".to_owned()),
        "[a-z-]{1,10}",
    ];
    prop::option::of(prop::collection::vec((name, header_value()), 0..5).prop_map(|pairs| {
        let mut table = FieldTable::default();
        for (key, value) in pairs {
            table.insert(key.into(), value);
        }
        table
    }))
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    let scalar = prop_oneof![
        "\\PC{0,40}".prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        Just(serde_json::Value::Null),
        Just(serde_json::json!([{"kind": "image"}])),
        Just(serde_json::json!([{"url": "https://x/y.png", "kind": "image", "name": 7}])),
    ];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        "\\PC{0,200}".prop_map(String::into_bytes),
        (scalar.clone(), scalar).prop_map(|(text, attachments)| {
            serde_json::to_vec(&serde_json::json!({"text": text, "attachments": attachments}))
                .unwrap()
        }),
        "\\{\"text\":\"[a-z]{0,8}(\"|,|\\}|\\[){0,3}".prop_map(String::into_bytes),
    ]
}

#[derive(Debug, Clone)]
struct Props {
    message_id: Option<String>,
    user_id: Option<String>,
    app_id: Option<String>,
    reply_to: Option<String>,
    correlation_id: Option<String>,
    content_type: Option<String>,
    timestamp: Option<u64>,
    headers: Option<FieldTable>,
}

fn props() -> impl Strategy<Value = Props> {
    let content_type = prop_oneof![
        Just("application/json".to_owned()),
        Just("application/json; charset=utf-8".to_owned()),
        Just("text/plain".to_owned()),
        short_text(),
    ];
    (
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::option::of(content_type),
        prop::option::of(any::<u64>()),
        headers(),
    )
        .prop_map(
            |(
                message_id,
                user_id,
                app_id,
                reply_to,
                correlation_id,
                content_type,
                timestamp,
                headers,
            )| {
                Props {
                    message_id,
                    user_id,
                    app_id,
                    reply_to,
                    correlation_id,
                    content_type,
                    timestamp,
                    headers,
                }
            },
        )
}

fn basic(p: &Props) -> BasicProperties {
    let mut props = BasicProperties::default();
    if let Some(v) = &p.message_id {
        props = props.with_message_id(v.clone().into());
    }
    if let Some(v) = &p.user_id {
        props = props.with_user_id(v.clone().into());
    }
    if let Some(v) = &p.app_id {
        props = props.with_app_id(v.clone().into());
    }
    if let Some(v) = &p.reply_to {
        props = props.with_reply_to(v.clone().into());
    }
    if let Some(v) = &p.correlation_id {
        props = props.with_correlation_id(v.clone().into());
    }
    if let Some(v) = &p.content_type {
        props = props.with_content_type(v.clone().into());
    }
    if let Some(v) = p.timestamp {
        props = props.with_timestamp(v);
    }
    if let Some(v) = &p.headers {
        props = props.with_headers(v.clone());
    }
    props
}

fn all_rules() -> Vec<InboundRules> {
    let trusts = [Trust::UserId, Trust::AppId, Trust::Header("x-sender".into())];
    let mut rules = Vec::new();
    for trust in trusts {
        for missing in [MissingMessageId::Reject, MissingMessageId::Digest] {
            rules.push(InboundRules {
                trust: trust.clone(),
                conversation_header: "x-conversation".into(),
                thread_header: "x-thread".into(),
                missing_message_id: missing,
            });
        }
    }
    rules
}

proptest! {
    #[test]
    fn fuzz_any_delivery_converts_or_is_refused(
        p in props(),
        bytes in body(),
        routing_key in short_text(),
        extra in any::<u8>(),
    ) {
        let channel = ChannelId::new("amqp.fuzz").unwrap();
        let properties = basic(&p);
        for rules in all_rules() {
            let received = Received { exchange: "in", routing_key: &routing_key, properties: &properties, body: &bytes };
            let first = inbound(&channel, &rules, &received);
            // A redelivery: the same message again.
            let again = inbound(&channel, &rules, &received);
            prop_assert_eq!(&first, &again);
            if let Ok(message) = first {
                let size = serde_json::to_vec(&message).unwrap().len();
                prop_assert!(size <= 2 * (bytes.len() + 4 * 300 + routing_key.len()) + 4096);
                // A digest id changes with the body.
                if message.metadata.get("amqp.event_id_source").map(String::as_str) == Some("digest") {
                    let mut other = bytes.clone();
                    other.push(extra);
                    let changed = Received { body: &other, ..received };
                    if let Ok(second) = inbound(&channel, &rules, &changed) {
                        prop_assert_ne!(second.id, message.id);
                    }
                }
            }
        }
    }
}
