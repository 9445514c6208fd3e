//! Property fuzzing of the MQTT driver's convert layer: any topic and any payload bytes either
//! become an inbound message whose frame fits on one line, or are refused with a typed error;
//! nothing panics, and the event id of a message with a payload id is the same every time.

use channeld_mqtt::convert::{IdentityTemplate, inbound_message, parse_payload};
use channeld_protocol::ChannelId;
use proptest::prelude::*;

/// Topic levels: mostly short ids, sometimes empty, wildcard or hostile text.
fn topic() -> impl Strategy<Value = String> {
    let level = prop_oneof![
        6 => "[a-z0-9_.-]{1,12}",
        1 => Just(String::new()),
        1 => Just("+".to_owned()),
        1 => "\\PC{0,300}",
        1 => "[\\x00-\\x1f/#+]{0,4}",
    ];
    prop::collection::vec(level, 1..6).prop_map(|levels| format!("lab/in/{}", levels.join("/")))
}

/// Payloads: raw bytes, text, and JSON objects with arbitrary `text`/`id`/`thread` values.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    let scalar = prop_oneof![
        "\\PC{0,40}".prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        Just(serde_json::Value::Null),
        Just(serde_json::json!({"nested": [1, 2]})),
        "\\PC{200,400}".prop_map(serde_json::Value::from),
    ];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        "\\PC{0,200}".prop_map(String::into_bytes),
        (scalar.clone(), scalar.clone(), scalar).prop_map(|(text, id, thread)| {
            serde_json::to_vec(&serde_json::json!({"text": text, "id": id, "thread": thread}))
                .unwrap()
        }),
        // Truncated or broken JSON.
        "\\{\"text\":\"[a-z]{0,8}(\"|,|\\}|\\[){0,3}".prop_map(String::into_bytes),
    ]
}

proptest! {
    #[test]
    fn fuzz_any_topic_and_payload_converts_or_is_refused(topic in topic(), bytes in payload()) {
        let template = IdentityTemplate::parse("lab/in/{sender}/{conversation}").unwrap();
        let channel = ChannelId::new("mqtt.lab").unwrap();
        let Some(identity) = template.identify(&topic) else { return Ok(()) };
        let Ok(payload) = parse_payload(&bytes) else { return Ok(()) };
        let has_id = payload.id.is_some();
        let first = inbound_message(&channel, &topic, identity, payload.clone(), "gen-1");
        if let Ok(message) = first {
            // A payload id makes the event id stable across redeliveries (another generated id).
            let again = inbound_message(&channel, &topic, identity, payload, "gen-2").unwrap();
            prop_assert_eq!(has_id, message.id == again.id);
        }
    }

    #[test]
    fn fuzz_any_template_text_parses_or_is_refused(raw in "(\\{sender\\}|\\{conversation\\}|\\+|#|[a-z]{1,4}|/|\\PC){0,12}") {
        if let Ok(template) = IdentityTemplate::parse(&raw) {
            // The subscription filter of a valid template is itself a valid filter text.
            let filter = template.filter();
            prop_assert!(!filter.is_empty());
        }
    }
}
