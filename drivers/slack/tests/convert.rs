//! The pure Slack mapping against recorded Socket Mode frames (`tests/fixtures/`, shaped like
//! what Slack sends): which events reach the hub, as what, and which are dropped.

use channeld_driver_sdk::PostError;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::protocol::types::IncomingEvent;
use channeld_slack::config::{InboundEvents, Respond};
use channeld_slack::convert::{
    self, BotIdentity, Classified, Ignored, classify, parse_message_id, post_error, reaction_name,
    slack_text_to_markdown, strip_mention, ts_millis,
};
use channeld_slack::wire::{EventCallback, Interaction, SocketFrame};

const BOT_USER: &str = "U05Q6L8RXAS";

fn bot() -> BotIdentity {
    BotIdentity { user_id: BOT_USER.into(), bot_id: Some("B05QAH6RUTD".into()) }
}

fn instance() -> ChannelId {
    ChannelId::new("slack.test").unwrap()
}

fn frame(raw: &str) -> SocketFrame {
    serde_json::from_str(raw).expect("a Socket Mode frame")
}

fn callback(raw: &str) -> (EventCallback, u32) {
    match frame(raw) {
        SocketFrame::EventsApi(envelope) => (
            serde_json::from_value(envelope.payload).expect("an event_callback"),
            envelope.retry_attempt,
        ),
        other => panic!("not events_api: {other:?}"),
    }
}

fn classified(raw: &str, respond: Respond, forward: InboundEvents) -> Classified {
    classify(&instance(), &bot(), respond, forward, &callback(raw).0)
}

fn mentions_only(raw: &str) -> Classified {
    classified(raw, Respond::Mentions, InboundEvents::default())
}

#[test]
fn hello_and_disconnect_frames_parse() {
    let SocketFrame::Hello(hello) = frame(include_str!("fixtures/hello.json")) else {
        panic!("hello")
    };
    assert_eq!(hello.debug_info.and_then(|d| d.approximate_connection_time), Some(18_060));
    for (raw, reason) in [
        (include_str!("fixtures/disconnect_refresh.json"), "refresh_requested"),
        (include_str!("fixtures/disconnect_link_disabled.json"), "link_disabled"),
    ] {
        let SocketFrame::Disconnect(disconnect) = frame(raw) else { panic!("disconnect") };
        assert_eq!(disconnect.reason, reason);
    }
    assert_eq!(frame(r#"{"type":"something_new","x":1}"#), SocketFrame::Other);
}

#[test]
fn a_dm_becomes_an_inline_conversation_with_readable_text() {
    let Classified::Message(message) = mentions_only(include_str!("fixtures/dm_message.json"))
    else {
        panic!("a DM reaches the hub")
    };
    assert_eq!(message.id.as_str(), "D0612P6N2KS:1718031456.214309");
    assert_eq!(message.target.conversation.as_str(), "D0612P6N2KS");
    assert_eq!(message.target.thread, None, "a DM reply stays inline");
    assert_eq!(message.sender.id.as_str(), "U061F7AUR");
    assert_eq!(
        message.body.text_str(),
        "Can you check the deploy? <prod> & staging, see [status page](https://status.example.com)"
    );
    assert_eq!(message.timestamp_ms, Some(1_718_031_456_214));
    assert_eq!(message.metadata["slack.ts"], "1718031456.214309");
}

#[test]
fn a_channel_mention_and_its_message_twin_are_one_inbound_in_a_thread() {
    let (mention, _) = callback(include_str!("fixtures/channel_app_mention.json"));
    let (twin, retry) = callback(include_str!("fixtures/channel_message_twin.json"));
    assert_eq!(retry, 1);
    assert_ne!(mention.event_id, twin.event_id, "Slack sends two events");
    let convert = |cb: &EventCallback| match classify(
        &instance(),
        &bot(),
        Respond::Mentions,
        InboundEvents::default(),
        cb,
    ) {
        Classified::Message(message) => message,
        other => panic!("expected a message, got {other:?}"),
    };
    let (a, b) = (convert(&mention), convert(&twin));
    assert_eq!(a, b, "both copies map to the same inbound");
    assert_eq!(a.id.as_str(), "C05R8N8LCHN:1718032000.000200");
    assert_eq!(
        a.target.thread.as_ref().map(|t| t.as_str()),
        Some("1718032000.000200"),
        "the reply opens a thread"
    );
    assert_eq!(a.body.text_str(), "what broke last night?", "the bot's mention is stripped");
}

#[test]
fn a_thread_reply_stays_in_its_thread() {
    let Classified::Message(message) =
        mentions_only(include_str!("fixtures/channel_thread_reply.json"))
    else {
        panic!("a mentioned thread reply reaches the hub")
    };
    assert_eq!(message.target.thread.as_ref().map(|t| t.as_str()), Some("1718032000.000200"));
    assert_eq!(message.body.text_str(), "and the follow-up");
    assert_eq!(message.metadata["slack.thread_ts"], "1718032000.000200");
}

#[test]
fn channel_chatter_needs_a_mention_unless_responding_to_all() {
    let raw = include_str!("fixtures/channel_chatter.json");
    assert_eq!(mentions_only(raw), Classified::Ignore(Ignored::NotMentioned));
    let Classified::Message(message) = classified(raw, Respond::All, InboundEvents::default())
    else {
        panic!("respond=all takes every message")
    };
    assert_eq!(message.body.text_str(), "lunch anyone?");
}

#[test]
fn bot_posts_are_dropped_including_our_own_echo() {
    assert_eq!(
        mentions_only(include_str!("fixtures/own_bot_echo.json")),
        Classified::Ignore(Ignored::OwnMessage)
    );
    let all = classified(
        include_str!("fixtures/other_bot_message.json"),
        Respond::All,
        InboundEvents::default(),
    );
    assert_eq!(all, Classified::Ignore(Ignored::BotMessage));
}

#[test]
fn edits_and_deletes_are_dropped_unless_forwarded() {
    let changed = include_str!("fixtures/message_changed.json");
    let deleted = include_str!("fixtures/message_deleted.json");
    assert_eq!(
        mentions_only(changed),
        Classified::Ignore(Ignored::Subtype("message_changed".into()))
    );
    assert_eq!(
        mentions_only(deleted),
        Classified::Ignore(Ignored::Subtype("message_deleted".into()))
    );

    let forward = InboundEvents { edits: true, deletes: true, reactions: false };
    let Classified::Event { event_id, event } = classified(changed, Respond::Mentions, forward)
    else {
        panic!("a forwarded edit")
    };
    assert_eq!(event_id.as_str(), "D0612P6N2KS:1718031456.214309:edit:1718031500.000100");
    let IncomingEvent::MessageEdited { context, message_id, body } = event else {
        panic!("edited")
    };
    assert_eq!(message_id.as_str(), "D0612P6N2KS:1718031456.214309");
    assert_eq!(body.text_str(), "Can you check the deploy on prod?");
    assert_eq!(context.participant.map(|p| p.id.as_str().to_owned()).as_deref(), Some("U061F7AUR"));

    let Classified::Event { event, .. } = classified(deleted, Respond::Mentions, forward) else {
        panic!("a forwarded delete")
    };
    let IncomingEvent::MessageDeleted { message_id, .. } = event else { panic!("deleted") };
    assert_eq!(message_id.as_str(), "D0612P6N2KS:1718031456.214309");
}

#[test]
fn files_become_references_without_tokens() {
    let Classified::Message(message) = mentions_only(include_str!("fixtures/file_share.json"))
    else {
        panic!("a file share reaches the hub")
    };
    let attachments = message.body.attachments();
    assert_eq!(attachments.len(), 1, "the tombstoned file has no URL and is skipped");
    assert_eq!(
        attachments[0].url,
        "https://files.slack.com/files-pri/T05Q2JN5B-F07A1B2C3D4/deploy.log"
    );
    assert_eq!(attachments[0].name.as_deref(), Some("deploy.log"));
    assert_eq!(attachments[0].mime.as_deref(), Some("text/plain"));
    assert_eq!(message.metadata["slack.file.0.size"], "48213");
    assert_eq!(message.metadata["slack.file.0.id"], "F07A1B2C3D4");
    assert!(!format!("{message:?}").contains("xox"), "no token anywhere");
}

#[test]
fn reactions_are_forwarded_only_when_asked() {
    let raw = include_str!("fixtures/reaction_added.json");
    assert_eq!(mentions_only(raw), Classified::Ignore(Ignored::Unhandled));
    let forward = InboundEvents { reactions: true, ..InboundEvents::default() };
    let Classified::Event { event_id, event } = classified(raw, Respond::Mentions, forward) else {
        panic!("a forwarded reaction")
    };
    assert_eq!(event_id.as_str(), "Ev0791G6G6G6");
    let IncomingEvent::Reaction { message_id, emoji, added, .. } = event else {
        panic!("reaction")
    };
    assert_eq!(
        (message_id.as_str(), emoji.as_str(), added),
        ("C05R8N8LCHN:1718032001.000900", "thumbsup", true)
    );
}

#[test]
fn an_assistant_thread_is_remembered_for_its_status() {
    assert_eq!(
        mentions_only(include_str!("fixtures/assistant_thread_started.json")),
        Classified::AssistantThread {
            channel: "D0612P6N2KS".into(),
            thread_ts: "1718033200.000800".into()
        }
    );
}

#[test]
fn a_button_click_names_the_command_and_the_user() {
    let SocketFrame::Interactive(envelope) = frame(include_str!("fixtures/block_actions.json"))
    else {
        panic!("interactive")
    };
    let Interaction::BlockActions(click) = serde_json::from_value(envelope.payload).unwrap() else {
        panic!("block_actions")
    };
    assert_eq!(click.user.id, "U061F7AUR");
    let action = &click.actions[0];
    assert_eq!(channeld_slack::blocks::command_of(action), Some("cmd-42"));
    let outcome = channeld_slack::blocks::outcome(action, &click.user.id, &[]).unwrap();
    assert_eq!(outcome.result, channeld_driver_sdk::protocol::types::CommandResult::Accepted);
}

#[test]
fn text_helpers_follow_slack_syntax() {
    assert_eq!(strip_mention("<@U05Q6L8RXAS> hi <@U05Q6L8RXASX>", BOT_USER), "hi <@U05Q6L8RXASX>");
    assert_eq!(strip_mention("ping <@U05Q6L8RXAS|bot>", BOT_USER), "ping");
    assert_eq!(
        slack_text_to_markdown("<#C1|ops> <!here> <mailto:a@b.c|a@b.c> <@U1>"),
        "#ops @here [a@b.c](mailto:a@b.c) <@U1>"
    );
    assert_eq!(ts_millis("1355517523.000005"), Some(1_355_517_523_000));
    assert_eq!(ts_millis("1718031456.2"), Some(1_718_031_456_200));
    assert_eq!(parse_message_id("C1:1.2", "D9"), ("C1", "1.2"));
    assert_eq!(parse_message_id("1.2", "D9"), ("D9", "1.2"));
    assert_eq!(convert::message_id("C1", "1.2").unwrap().as_str(), "C1:1.2");
}

#[test]
fn slack_errors_map_to_failed_or_unknown_posts() {
    assert_eq!(
        post_error("channel_not_found"),
        PostError::failed("slack error channel_not_found", false)
    );
    assert_eq!(post_error("ratelimited"), PostError::failed("slack error ratelimited", true));
    assert!(
        matches!(post_error("internal_error"), PostError::Unknown { .. }),
        "it may have posted"
    );
}

#[test]
fn reaction_names_accept_names_colons_and_common_emoji() {
    assert_eq!(reaction_name("eyes").as_deref(), Some("eyes"));
    assert_eq!(reaction_name(":white_check_mark:").as_deref(), Some("white_check_mark"));
    assert_eq!(reaction_name("👀").as_deref(), Some("eyes"));
    assert_eq!(reaction_name("❤️").as_deref(), Some("heart"));
    assert_eq!(reaction_name("🦀"), None);
    assert_eq!(reaction_name("Not A Name"), None);
}

#[test]
fn joins_are_dropped_and_broadcast_thread_replies_stay_in_their_thread() {
    let all = |raw| classified(raw, Respond::All, InboundEvents::default());
    assert_eq!(
        all(include_str!("fixtures/channel_join.json")),
        Classified::Ignore(Ignored::Subtype("channel_join".into()))
    );
    let Classified::Message(message) =
        mentions_only(include_str!("fixtures/thread_broadcast.json"))
    else {
        panic!("a broadcast reply is a person's post")
    };
    assert_eq!(message.target.thread.as_ref().map(|t| t.as_str()), Some("1718032000.000200"));
    assert_eq!(message.body.text_str(), "also posting this to the channel");
}

#[test]
fn edits_of_bot_posts_are_never_forwarded() {
    let forward = InboundEvents { edits: true, deletes: true, reactions: true };
    let edited =
        classified(include_str!("fixtures/bot_message_changed.json"), Respond::All, forward);
    assert_eq!(
        edited,
        Classified::Ignore(Ignored::BotMessage),
        "our own preview updates do not loop back"
    );
}

#[test]
fn a_group_dm_needs_a_mention_like_a_channel() {
    let raw = include_str!("fixtures/mpim_message.json");
    assert_eq!(mentions_only(raw), Classified::Ignore(Ignored::NotMentioned));
    let Classified::Message(message) = classified(raw, Respond::All, InboundEvents::default())
    else {
        panic!("respond=all takes group DMs")
    };
    assert_eq!(message.body.text_str(), "shall we ask the bot? > maybe");
    assert_eq!(
        message.target.thread.as_ref().map(|t| t.as_str()),
        Some("1718034300.000500"),
        "threads like a channel"
    );
}
