//! Property fuzzing of the WeChat driver's wire and convert layers: the recorded-shape
//! `getupdates` answer (`tests/fixtures/`), mutated (hostile values, removed keys, changed
//! types, text cut short), is parsed the way `poll.rs` parses it, message by message, and
//! each message converted. Nothing panics, a message converts the same way every time (a
//! redelivered message is the same inbound), and the outbound splitter keeps its bound.

use channeld_driver_sdk::protocol::ChannelId;
use channeld_tests::fuzz::{mutated_bytes, seeds};
use channeld_wechat::convert::{self, chunks, simplify_markdown};
use channeld_wechat::ilink::{GetUpdatesResponse, WeixinMessage};
use proptest::prelude::*;

const CDN: &str = "https://novac2c.cdn.weixin.qq.com/c2c";

fn fixtures() -> Vec<serde_json::Value> {
    let mut all =
        seeds(&[include_str!("fixtures/getupdates.json"), include_str!("fixtures/expired.json")]);
    // Each recorded message on its own too, so mutations land inside messages more often.
    let messages = all[0]["msgs"].as_array().cloned().unwrap_or_default();
    all.extend(
        messages.into_iter().map(|message| serde_json::json!({"ret": 0, "msgs": [message]})),
    );
    all
}

proptest! {
    #[test]
    fn fuzz_any_getupdates_answer_parses_and_converts_or_is_skipped(bytes in mutated_bytes(fixtures())) {
        let channel = ChannelId::new("wechat.fuzz").unwrap();
        let Ok(response) = serde_json::from_slice::<GetUpdatesResponse>(&bytes) else { return Ok(()) };
        let _ = response.status.failure();
        for raw in response.msgs {
            let Ok(message) = serde_json::from_value::<WeixinMessage>(raw) else { continue };
            let first = convert::inbound(&channel, &message, CDN);
            let again = convert::inbound(&channel, &message, CDN);
            prop_assert_eq!(&first, &again);
            if let Ok(converted) = first {
                let size = serde_json::to_vec(&converted.message).unwrap().len();
                prop_assert!(size <= 4 * bytes.len() + 4096, "{} from {}", size, bytes.len());
            }
        }
    }

    #[test]
    fn fuzz_chunks_stay_within_the_limit(
        text in "(\\PC|\n|```|\n\n| ){0,300}",
        max_chars in 16usize..120,
    ) {
        let pieces = chunks(&text, max_chars);
        for piece in &pieces {
            prop_assert!(piece.chars().count() <= max_chars, "{} > {}", piece.chars().count(), max_chars);
            prop_assert!(!piece.trim().is_empty());
        }
        if !text.trim().is_empty() {
            prop_assert!(!pieces.is_empty());
        }
        let simple = simplify_markdown(&text);
        prop_assert!(simple.len() <= 2 * text.len() + 16);
    }
}
