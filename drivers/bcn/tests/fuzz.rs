//! Property tests of the BCN frame reader and the `chat.send` mapping: any text or JSON BCN
//! might send is read or refused, never a panic, and an accepted message keeps its text and
//! full session key.

use channeld_bcn::convert::{self, Context};
use channeld_bcn::wire::{self, ChatParams, Incoming};
use channeld_driver_sdk::protocol::ChannelId;
use proptest::prelude::*;
use serde_json::json;

proptest! {
    #[test]
    fn any_text_is_read_or_refused(text in ".{0,400}") {
        let _ = wire::decode(&text);
    }

    #[test]
    fn frames_with_odd_fields_never_panic(
        kind in prop::sample::select(vec!["req", "res", "event", "other"]),
        id in ".{0,40}",
        method in prop::sample::select(vec!["chat.send", "chat.inject", "chat.abort", "chat.history", "x"]),
        text in ".{0,200}",
        key in ".{0,300}",
    ) {
        let frame = json!({"type": kind, "id": id, "method": method, "ok": true,
            "params": {"session_key": key, "message": {"content": [{"type": "text", "text": text}]}}});
        if let Ok(Incoming::Req(request)) = wire::decode(&frame.to_string())
            && let Ok(params) = serde_json::from_value::<ChatParams>(request.params)
        {
            let channel = ChannelId::new("bcn.lab").unwrap();
            if let Ok(message) = convert::inbound_message(&channel, "run-1", &params, &Context::default()) {
                prop_assert_eq!(message.target.conversation.as_str(), key.as_str());
                prop_assert_eq!(message.body.text_str(), text.as_str());
            }
        }
    }
}
