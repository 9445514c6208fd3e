//! Property fuzzing of the WeCom driver's wire and convert layers: the platform's frames in
//! their documented shapes (`tests/fixtures/`), mutated (hostile values, removed keys,
//! changed types, text cut short), are decoded and converted like the session does. Nothing
//! panics, a message converts the same way every time (a redelivered callback is the same
//! inbound), and the text splitter keeps its contract for any text and limit.

use channeld_driver_sdk::protocol::ChannelId;
use channeld_tests::fuzz::{mutated_bytes, seeds};
use channeld_wecom::convert;
use channeld_wecom::wire::{self, Incoming};
use proptest::prelude::*;

fn fixtures() -> Vec<serde_json::Value> {
    seeds(&[
        include_str!("fixtures/ack_ok.json"),
        include_str!("fixtures/ack_stream_expired.json"),
        include_str!("fixtures/ack_subscribe_refused.json"),
        include_str!("fixtures/ack_unknown_req_id.json"),
        include_str!("fixtures/disconnected_event.json"),
        include_str!("fixtures/enter_chat.json"),
        include_str!("fixtures/feedback_event.json"),
        include_str!("fixtures/file.json"),
        include_str!("fixtures/image.json"),
        include_str!("fixtures/mixed_group.json"),
        include_str!("fixtures/mixed_images_only.json"),
        include_str!("fixtures/quote.json"),
        include_str!("fixtures/quote_mixed.json"),
        include_str!("fixtures/template_card_event.json"),
        include_str!("fixtures/template_card_event_flat.json"),
        include_str!("fixtures/text_group.json"),
        include_str!("fixtures/text_single.json"),
        include_str!("fixtures/video.json"),
        include_str!("fixtures/voice.json"),
    ])
}

proptest! {
    #[test]
    fn fuzz_any_frame_decodes_and_converts_or_is_refused(bytes in mutated_bytes(fixtures())) {
        let channel = ChannelId::new("wecom.fuzz").unwrap();
        let Ok(text) = std::str::from_utf8(&bytes) else { return Ok(()) };
        let Ok(incoming) = wire::decode(text) else { return Ok(()) };
        if let Incoming::Message { callback, .. } = incoming {
            for bot_name in [None, Some("ops-bot")] {
                let first = convert::inbound_message(&callback, bot_name)
                    .ok()
                    .and_then(|inbound| inbound.build(&channel).ok());
                let again = convert::inbound_message(&callback, bot_name)
                    .ok()
                    .and_then(|inbound| inbound.build(&channel).ok());
                prop_assert_eq!(&first, &again);
                if let Some(message) = first {
                    let size = serde_json::to_vec(&message).unwrap().len();
                    prop_assert!(size <= 4 * bytes.len() + 4096, "{} from {}", size, bytes.len());
                }
            }
        }
    }

    #[test]
    fn fuzz_split_content_concatenates_back_within_the_limit(text in "\\PC{0,400}", max in 1usize..64) {
        let parts = convert::split_content(&text, max);
        prop_assert_eq!(parts.concat(), text.clone());
        for part in &parts {
            // A part is longer than `max` only when it is one character wider than `max`.
            prop_assert!(part.len() <= max || part.chars().count() == 1);
        }
        let cut = convert::truncate_content(&text, max);
        prop_assert!(cut.len() <= max && text.starts_with(cut));
    }

}
