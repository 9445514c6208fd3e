//! Golden vectors: every valid line decodes and re-encodes to the same JSON value (unknown
//! fields dropped); every invalid line is rejected with a typed error.

use channeld_protocol::{DecodeError, Frame, decode, encode};
use serde_json::Value;

const VALID: &str = include_str!("vectors/valid.jsonl");
const INVALID: &str = include_str!("vectors/invalid.jsonl");

/// Removes the fields the vectors add to exercise "unknown fields are ignored".
fn without_unknown_fields(mut value: Value) -> Value {
    let envelope = value.as_object_mut().unwrap();
    envelope.remove("also_unknown");
    if let Some(frame) = envelope.get_mut("frame").and_then(Value::as_object_mut) {
        frame.remove("unknown_future_field");
    }
    value
}

#[test]
fn every_valid_vector_round_trips_to_an_equal_value() {
    let mut count = 0;
    for (number, line) in VALID.lines().enumerate() {
        let frame = decode(line.as_bytes())
            .unwrap_or_else(|err| panic!("valid line {} failed: {err}\n{line}", number + 1));
        let encoded = encode(&frame).unwrap();
        assert_eq!(encoded.last(), Some(&b'\n'));
        let reencoded: Value = serde_json::from_slice(&encoded).unwrap();
        let expected = without_unknown_fields(serde_json::from_str(line).unwrap());
        assert_eq!(reencoded, expected, "line {} re-encoded differently", number + 1);
        // Decoding our own output gives the same frame back.
        assert_eq!(decode(&encoded[..encoded.len() - 1]).unwrap(), frame);
        count += 1;
    }
    assert_eq!(count, 56, "the vector file changed; review this test");
}

#[test]
fn known_field_order_is_byte_identical_to_the_reference() {
    // Lines without unknown fields re-encode byte for byte: same field order, same escapes.
    for line in VALID.lines().filter(|line| !line.contains("unknown")) {
        let frame = decode(line.as_bytes()).unwrap();
        let encoded = encode(&frame).unwrap();
        assert_eq!(std::str::from_utf8(&encoded).unwrap().trim_end(), line);
    }
}

#[test]
fn every_invalid_vector_is_rejected_with_a_typed_error() {
    let expected_codes = [
        "unsupported_abi",    // abi v2
        "unsupported_abi",    // no abi
        "unknown_frame_type", // teleport
        "invalid_frame",      // no type
        "invalid_frame",      // start without request_id
        "invalid_frame",      // bad channel id
        "invalid_frame",      // empty request id
        "invalid_frame",      // empty conversation
        "invalid_frame",      // empty body
        "invalid_frame",      // NUL in text
        "invalid_frame",      // empty message id
        "invalid_frame",      // lowercase health state
        "invalid_frame",      // error without retryable
        "invalid_frame",      // array
        "invalid_frame",      // string
        "invalid_json",       // not JSON
        "invalid_json",       // truncated
        "invalid_frame",      // operator_action without a name
    ];
    let lines: Vec<&str> = INVALID.lines().collect();
    assert_eq!(lines.len(), expected_codes.len());
    for (line, code) in lines.iter().zip(expected_codes) {
        let err = decode(line.as_bytes()).expect_err(line);
        assert_eq!(err.code(), code, "{line}: {err}");
        // Every rejection can be answered on the wire.
        let answer = err.to_error_frame();
        assert!(matches!(answer, Frame::Error(_)));
        encode(&answer).unwrap();
    }
}

#[test]
fn specific_rejections_name_their_cause() {
    let err = decode(
        br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"teleport","request_id":"a"}}"#,
    )
    .unwrap_err();
    assert_eq!(err, DecodeError::UnknownType("teleport".into()));
    let err = decode(br#"{"frame":{"type":"start","request_id":"a"}}"#).unwrap_err();
    assert_eq!(err, DecodeError::MissingAbi);
    let err = decode(b"[1,2,3]").unwrap_err();
    assert_eq!(err, DecodeError::NotObject);
}

#[test]
fn an_operator_action_without_args_gets_an_empty_object() {
    let line = br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"operator_action","request_id":"op-9","name":"resume"}}"#;
    match decode(line).unwrap() {
        Frame::OperatorAction(action) => {
            assert_eq!(action.name, "resume");
            assert_eq!(action.args, serde_json::json!({}));
        }
        other => panic!("decoded as {}", other.type_name()),
    }
}
