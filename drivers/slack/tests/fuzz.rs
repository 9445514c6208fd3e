//! Property fuzzing of the Slack driver's wire and convert layers: recorded Socket Mode frames
//! (`tests/fixtures/`), mutated (values swapped for hostile ones, keys removed, types
//! changed, text cut short), are parsed and classified like `socket.rs` and `envelopes.rs`
//! do. Nothing panics, the same frame is always classified the same way (a redelivery is
//! the same inbound), and what reaches the hub is bounded by what came in.

use channeld_driver_sdk::protocol::ChannelId;
use channeld_slack::blocks;
use channeld_slack::config::{InboundEvents, Respond};
use channeld_slack::convert::{BotIdentity, Classified, classify, slack_text_to_markdown};
use channeld_slack::wire::{EventCallback, Interaction, SocketFrame};
use channeld_tests::fuzz::{mutated_bytes, seeds};
use proptest::prelude::*;

fn fixtures() -> Vec<serde_json::Value> {
    seeds(&[
        include_str!("fixtures/assistant_thread_started.json"),
        include_str!("fixtures/block_actions.json"),
        include_str!("fixtures/bot_message_changed.json"),
        include_str!("fixtures/channel_app_mention.json"),
        include_str!("fixtures/channel_chatter.json"),
        include_str!("fixtures/channel_join.json"),
        include_str!("fixtures/channel_message_twin.json"),
        include_str!("fixtures/channel_thread_reply.json"),
        include_str!("fixtures/disconnect_refresh.json"),
        include_str!("fixtures/dm_message.json"),
        include_str!("fixtures/file_share.json"),
        include_str!("fixtures/hello.json"),
        include_str!("fixtures/message_changed.json"),
        include_str!("fixtures/message_deleted.json"),
        include_str!("fixtures/mpim_message.json"),
        include_str!("fixtures/other_bot_message.json"),
        include_str!("fixtures/own_bot_echo.json"),
        include_str!("fixtures/reaction_added.json"),
        include_str!("fixtures/thread_broadcast.json"),
    ])
}

fn bot() -> BotIdentity {
    BotIdentity { user_id: "U05Q6L8RXAS".into(), bot_id: Some("B05QAH6RUTD".into()) }
}

const EVERYTHING: InboundEvents = InboundEvents { edits: true, deletes: true, reactions: true };

proptest! {
    #[test]
    fn fuzz_any_socket_frame_parses_and_classifies_or_is_dropped(bytes in mutated_bytes(fixtures())) {
        let channel = ChannelId::new("slack.fuzz").unwrap();
        let Ok(text) = std::str::from_utf8(&bytes) else { return Ok(()) };
        let Ok(frame) = serde_json::from_str::<SocketFrame>(text) else { return Ok(()) };
        match frame {
            SocketFrame::EventsApi(envelope) => {
                let Ok(callback) = serde_json::from_value::<EventCallback>(envelope.payload) else {
                    return Ok(());
                };
                for respond in [Respond::Mentions, Respond::All] {
                    for forward in [InboundEvents::default(), EVERYTHING] {
                        let first = classify(&channel, &bot(), respond, forward, &callback);
                        let again = classify(&channel, &bot(), respond, forward, &callback);
                        prop_assert_eq!(&first, &again);
                        if let Classified::Message(message) = &first {
                            let size = serde_json::to_vec(message).unwrap().len();
                            prop_assert!(size <= 4 * bytes.len() + 4096, "{} from {}", size, bytes.len());
                        }
                    }
                }
            }
            SocketFrame::Interactive(envelope) => {
                if let Ok(Interaction::BlockActions(click)) =
                    serde_json::from_value::<Interaction>(envelope.payload)
                {
                    for action in &click.actions {
                        let _ = blocks::command_of(action);
                    }
                }
            }
            _ => {}
        }
    }

    #[test]
    fn fuzz_any_slack_text_converts_to_markdown(text in "(\\PC|<[@#!]?[A-Za-z0-9|:/._-]{0,12}>?|&(amp|lt|gt);|[*_~`]){0,80}") {
        let markdown = slack_text_to_markdown(&text);
        prop_assert!(markdown.len() <= 4 * text.len() + 16);
    }
}
