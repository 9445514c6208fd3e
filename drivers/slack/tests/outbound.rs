//! The write side against the fake Slack's Web API: what each post, effect and command
//! becomes on Slack, and how Slack's refusals, rate limits and silences come back.

use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::{
    Choice, Command, CommandResult, Effect, MessageBody, MessageTarget,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_driver_sdk::{DriverLaunchConfig, PostError};
use channeld_slack::SlackConfig;
use channeld_slack::commands::Commands;
use channeld_slack::outbound::Outbound;
use channeld_slack::web::WebApi;
use channeld_tests::fakes::slack::{FakeSlack, FakeSlackOptions, Fault};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(10);

fn id(s: &str) -> Id {
    Id::new(s).unwrap()
}

fn config(fake: &FakeSlack, extra: &[(&str, &str)]) -> SlackConfig {
    // The first value of a variable wins: the test's own settings go first.
    let mut launch =
        DriverLaunchConfig::for_socket(ChannelId::new("slack.test").unwrap(), "/unused");
    for (name, value) in extra {
        launch = launch.with_var(name, *value);
    }
    let launch = launch
        .with_var("SLACK_API_URL", fake.api_url())
        .with_var("SLACK_APP_TOKEN", fake.options().app_token.clone())
        .with_var("SLACK_BOT_TOKEN", fake.options().bot_token.clone())
        .with_var("SLACK_HTTP_TIMEOUT_SECONDS", "2")
        .with_var("SLACK_POST_INTERVAL_MS", "0")
        .with_var("SLACK_PREVIEW_INTERVAL_MS", "200");
    SlackConfig::from_launch(&launch).unwrap()
}

fn outbound(fake: &FakeSlack, extra: &[(&str, &str)]) -> Outbound {
    channeld_driver_sdk::install_crypto_provider();
    let config = config(fake, extra);
    let options = HttpOptions { timeout: config.http_timeout, ..HttpOptions::for_driver("slack") };
    let client = http::client(&options).unwrap();
    let web = WebApi::new(
        client,
        config.api_url.clone(),
        config.app_token.clone(),
        config.bot_token.clone(),
    );
    Outbound::new(web, &config)
}

async fn fake() -> FakeSlack {
    FakeSlack::start_with(FakeSlackOptions {
        echo_bot_messages: false,
        ping_interval: None,
        ..FakeSlackOptions::default()
    })
    .await
}

fn target(conversation: &str, thread: Option<&str>, reply_to: Option<&str>) -> MessageTarget {
    MessageTarget {
        channel: ChannelId::new("slack.test").unwrap(),
        conversation: id(conversation),
        thread: thread.map(id),
        reply_to: reply_to.map(id),
    }
}

fn text(s: &str) -> MessageBody {
    MessageBody::text(s).unwrap()
}

#[tokio::test]
async fn a_reply_goes_into_its_thread_as_mrkdwn() {
    let fake = fake().await;
    let placed = outbound(&fake, &[])
        .post(&target("C1", Some("1.0"), None), &text("**done** see [log](https://x.example)"))
        .await
        .unwrap();
    let record = fake.record();
    let message = record.message("C1", &placed.ts).expect("posted");
    assert_eq!(message.text, "*done* see <https://x.example|log>");
    assert_eq!(message.thread_ts.as_deref(), Some("1.0"));
    let call = &record.calls_to("chat.postMessage")[0];
    assert_eq!(call.token, "bot");
    assert_eq!(call.content_type.as_deref(), Some("application/json; charset=utf-8"));
}

#[tokio::test]
async fn slack_refusals_are_failed_posts_with_the_error_code() {
    let fake = fake().await;
    fake.fail_channel("C404", "channel_not_found");
    let err =
        outbound(&fake, &[]).post(&target("C404", None, None), &text("hi")).await.unwrap_err();
    assert_eq!(err, PostError::failed("slack error channel_not_found", false));
}

#[tokio::test]
async fn a_rate_limited_post_waits_retry_after_and_posts_once() {
    let fake = fake().await;
    fake.fail("chat.postMessage", Fault::RateLimited { retry_after_secs: 1 }, Some(1));
    let started = Instant::now();
    outbound(&fake, &[]).post(&target("C1", None, None), &text("hi")).await.unwrap();
    let record = fake.record();
    let calls = record.calls_to("chat.postMessage");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].status, 429);
    assert!(
        calls[1].at.duration_since(calls[0].at) >= Duration::from_secs(1),
        "Retry-After honoured"
    );
    assert_eq!(record.visible_bot_messages("C1").len(), 1, "posted exactly once");
    assert!(started.elapsed() < WITHIN);
}

#[tokio::test]
async fn a_post_without_an_answer_is_unknown_and_not_retried() {
    let fake = fake().await;
    fake.fail("chat.postMessage", Fault::Hang, None);
    let err = outbound(&fake, &[]).post(&target("C1", None, None), &text("hi")).await.unwrap_err();
    assert!(matches!(err, PostError::Unknown { .. }), "{err:?}");
    assert_eq!(fake.record().calls_to("chat.postMessage").len(), 1, "never a blind retry");
}

#[tokio::test]
async fn posts_to_one_channel_are_paced() {
    let fake = fake().await;
    let out = outbound(&fake, &[("SLACK_POST_INTERVAL_MS", "300")]);
    let target = target("C1", None, None);
    for n in 0..3 {
        out.post(&target, &text(&format!("message {n}"))).await.unwrap();
    }
    let record = fake.record();
    let calls = record.calls_to("chat.postMessage");
    let gaps: Vec<Duration> =
        calls.windows(2).map(|pair| pair[1].at.duration_since(pair[0].at)).collect();
    assert!(gaps.iter().all(|gap| *gap >= Duration::from_millis(250)), "paced: {gaps:?}");
}

#[tokio::test]
async fn long_replies_are_split_and_the_receipt_names_the_first_part() {
    let fake = fake().await;
    let body: Vec<String> = (0..40).map(|i| format!("line {i:02} of a long answer")).collect();
    let placed = outbound(&fake, &[("SLACK_MAX_MESSAGE_CHARS", "200")])
        .post(&target("C1", None, None), &text(&body.join("\n")))
        .await
        .unwrap();
    let record = fake.record();
    let messages = record.visible_bot_messages("C1");
    assert!(messages.len() > 1);
    assert_eq!(messages[0].ts, placed.ts);
    assert!(messages.iter().all(|m| m.text.chars().count() <= 200));
}

#[tokio::test]
async fn a_proactive_send_to_a_user_opens_the_dm_first() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    let placed = out.post(&target("U7", None, None), &text("hello")).await.unwrap();
    out.post(&target("U7", None, None), &text("again")).await.unwrap();
    let record = fake.record();
    assert_eq!(placed.channel, "DU7");
    assert_eq!(record.calls_to("conversations.open").len(), 1, "the DM is remembered");
    assert_eq!(record.calls_to("conversations.open")[0].args["users"], "U7");
    assert!(record.calls_to("chat.postMessage").iter().all(|c| c.args["channel"] == "DU7"));
}

#[tokio::test]
async fn the_final_reply_replaces_the_preview() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    // Like the hub: live effects carry no reply_to, the reply does.
    let live = target("C1", Some("1.0"), None);
    let reply = target("C1", Some("1.0"), Some("C1:1.0"));
    out.inbound_seen(&live, "C1:1.0");
    for text in ["thinking", "thinking harder", "almost"] {
        out.effect(&live, &Effect::Preview { text: text.into() }).await.unwrap();
    }
    let placed = out.post(&reply, &text("the answer")).await.unwrap();
    let record = fake.record();
    let visible = record.visible_bot_messages("C1");
    assert_eq!(visible.len(), 1, "one message: the preview became the reply");
    assert_eq!(visible[0].ts, placed.ts);
    assert_eq!(visible[0].text, "the answer");
    assert_eq!(visible[0].edits.first().map(String::as_str), Some("thinking"));
    // Preview updates are throttled; the final reply replaces the preview at once.
    let updates = record.calls_to("chat.update");
    let previews = &updates[..updates.len() - 1];
    let gaps: Vec<Duration> =
        previews.windows(2).map(|pair| pair[1].at.duration_since(pair[0].at)).collect();
    assert!(gaps.iter().all(|gap| *gap >= Duration::from_millis(150)), "throttled: {gaps:?}");
    assert_eq!(updates.last().unwrap().args["text"], "the answer");
}

#[tokio::test]
async fn typing_is_a_reaction_outside_assistant_threads_and_a_status_inside() {
    let fake = fake().await;
    let said = fake.user_posts("C1", "U1", "hi", None, &[]);
    let out = outbound(&fake, &[]);
    let live = target("C1", Some(&said.ts), None);
    let reply = target("C1", Some(&said.ts), Some(&format!("C1:{}", said.ts)));
    out.inbound_seen(&live, &format!("C1:{}", said.ts));
    out.effect(&live, &Effect::Typing { active: true }).await.unwrap();
    assert_eq!(fake.record().message("C1", &said.ts).unwrap().reactions, vec!["eyes"]);
    out.post(&reply, &text("answer")).await.unwrap();
    assert!(
        fake.record().message("C1", &said.ts).unwrap().reactions.is_empty(),
        "cleared by the reply"
    );

    out.assistant_thread("D1", "5.0");
    out.effect(&target("D1", Some("5.0"), Some("D1:5.1")), &Effect::Typing { active: true })
        .await
        .unwrap();
    let statuses = fake.record().statuses;
    assert_eq!(statuses.len(), 1);
    assert_eq!((statuses[0].channel_id.as_str(), statuses[0].thread_ts.as_str()), ("D1", "5.0"));
}

#[tokio::test]
async fn reactions_edits_and_deletes_reach_slack_and_are_idempotent() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    let placed = out.post(&target("C1", None, None), &text("v1")).await.unwrap();
    let message_id = id(&format!("C1:{}", placed.ts));
    let here = target("C1", None, None);
    for _ in 0..2 {
        let react =
            Effect::Reaction { message_id: message_id.clone(), emoji: "✅".into(), remove: false };
        out.effect(&here, &react).await.unwrap();
    }
    assert_eq!(
        fake.record().message("C1", &placed.ts).unwrap().reactions,
        vec!["white_check_mark"]
    );
    out.effect(&here, &Effect::Edit { message_id: message_id.clone(), body: text("v2") })
        .await
        .unwrap();
    assert_eq!(fake.record().message("C1", &placed.ts).unwrap().text, "v2");
    out.effect(&here, &Effect::Delete { message_id }).await.unwrap();
    assert!(fake.record().visible_bot_messages("C1").is_empty());
}

#[tokio::test]
async fn an_approval_counts_the_click_and_replaces_the_buttons() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    let commands = std::sync::Arc::new(Commands::new(out, WITHIN));
    let command =
        Command::RequestApproval { tool: "deploy".into(), arguments: json!({"env": "prod"}) };
    let asking = {
        let commands = commands.clone();
        tokio::spawn(async move {
            commands.present(&id("cmd-1"), &command, Some(&target("C1", Some("1.0"), None))).await
        })
    };
    let prompt = fake
        .wait_for("the approval prompt", WITHIN, |r| {
            r.visible_bot_messages("C1").first().map(|m| (*m).clone())
        })
        .await;
    assert_eq!(prompt.blocks.as_ref().unwrap()[1]["elements"][0]["action_id"], "channeld.approve");
    // Clicks arrive over Socket Mode (tested through the driver); here one is handed over.
    let payload = json!({"type": "block_actions", "user": {"id": "U9", "username": "nine"}, "actions": [
        {"action_id": "channeld.approve", "block_id": "channeld:cmd-1", "value": "cmd-1"}]});
    let channeld_slack::wire::Interaction::BlockActions(actions) =
        serde_json::from_value(payload).unwrap()
    else {
        panic!("block_actions")
    };
    commands.on_click(&actions);
    let answer = asking.await.unwrap();
    assert_eq!(answer.result, CommandResult::Accepted);
    assert_eq!(answer.responder.unwrap().id.as_str(), "U9");
    let settled = fake.record().message("C1", &prompt.ts).cloned().unwrap();
    assert!(settled.blocks.is_none(), "buttons removed");
    assert!(settled.text.contains("<@U9>"), "{}", settled.text);
}

#[tokio::test]
async fn a_choice_without_a_click_times_out_as_rejected() {
    let fake = fake().await;
    let commands = Commands::new(outbound(&fake, &[]), Duration::from_millis(300));
    let choices =
        vec![Choice { id: id("a"), label: "A".into() }, Choice { id: id("b"), label: "B".into() }];
    let command = Command::RequestChoice { question: "Which?".into(), choices, multiple: false };
    let answer = commands.present(&id("cmd-2"), &command, Some(&target("C1", None, None))).await;
    assert!(matches!(answer.result, CommandResult::Rejected { .. }));
    let record = fake.record();
    let message = &record.visible_bot_messages("C1")[0];
    assert!(message.text.contains("No answer in time"), "{}", message.text);
}

#[tokio::test]
async fn a_preview_arriving_after_its_reply_is_dropped() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    let live = target("C1", Some("1.0"), None);
    let reply = target("C1", Some("1.0"), Some("C1:1.0"));
    out.inbound_seen(&live, "C1:1.0");
    out.post(&reply, &text("final")).await.unwrap();
    out.effect(&live, &Effect::Preview { text: "late draft".into() }).await.unwrap();
    let record = fake.record();
    let visible = record.visible_bot_messages("C1");
    assert_eq!(visible.len(), 1, "no stray preview beside the reply");
    assert_eq!(visible[0].text, "final");
}

#[tokio::test]
async fn the_default_pacing_stays_under_slacks_channel_limit() {
    let fake = FakeSlack::start_with(FakeSlackOptions {
        echo_bot_messages: false,
        ping_interval: None,
        // Slack allows short bursts above one a second; a strict two-a-second window is a
        // conservative stand-in that one post a second never reaches.
        posts_per_channel_second: Some(2),
        ..FakeSlackOptions::default()
    })
    .await;
    let out = outbound(&fake, &[("SLACK_POST_INTERVAL_MS", "1000")]);
    for n in 0..4 {
        out.post(&target("C1", None, None), &text(&format!("burst {n}"))).await.unwrap();
    }
    let record = fake.record();
    assert!(
        record.calls_to("chat.postMessage").iter().all(|c| c.status == 200),
        "never rate limited"
    );
    assert_eq!(record.visible_bot_messages("C1").len(), 4);
}

#[tokio::test]
async fn typing_needs_a_message_to_mark_and_a_new_turn_gets_a_new_preview() {
    let fake = fake().await;
    let out = outbound(&fake, &[]);
    let live = target("DU1", None, None);
    let err = out.effect(&live, &Effect::Typing { active: true }).await.unwrap_err();
    assert!(err.to_string().contains("no message"), "{err}");

    for turn in ["1.0", "2.0"] {
        out.inbound_seen(&live, &format!("DU1:{turn}"));
        out.effect(&live, &Effect::Preview { text: format!("draft {turn}") }).await.unwrap();
        out.post(
            &target("DU1", None, Some(&format!("DU1:{turn}"))),
            &text(&format!("answer {turn}")),
        )
        .await
        .unwrap();
    }
    let record = fake.record();
    let texts: Vec<&str> =
        record.visible_bot_messages("DU1").iter().map(|m| m.text.as_str()).collect();
    assert_eq!(texts, ["answer 1.0", "answer 2.0"], "each turn's preview became its own answer");
}
