//! The WeChat driver in-process between the SDK's fake hub and the fake iLink server: what it
//! does with context tokens, replays, the cursor, long replies, typing, refusals, `-14`,
//! server errors and a silent server, observed on both sides.

use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::{Health, HealthState, MessageTarget};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{AckMode, FakeConnection, FakeHub};
use channeld_driver_sdk::{CancellationToken, RunError, run_driver};
use channeld_tests::fakes::wechat::{FakeIlink, FakeOptions, Mode};
use channeld_wechat::state::{StateDir, StoredLogin};
use channeld_wechat::{WechatConfig, WechatDriver};
use tokio::task::JoinHandle;

const CHANNEL: &str = "wechat.test";
const ALICE: &str = "alice@im.wechat";
/// How long a test waits for the driver to get somewhere.
const WITHIN: Duration = Duration::from_secs(15);

/// A driver wired to a fake hub and a fake iLink server.
struct Rig {
    fake: FakeIlink,
    conn: FakeConnection,
    state: tempfile::TempDir,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RunError>>,
    _hub: FakeHub,
}

impl Rig {
    async fn start(options: FakeOptions, settings: &[(&str, &str)]) -> Self {
        let fake = FakeIlink::start_with(options).await;
        let hub = FakeHub::bind().await;
        let state = tempfile::tempdir().unwrap();
        let mut launch = hub
            .launch_config(CHANNEL)
            .with_var("WECHAT_BASE_URL", fake.base_url())
            .with_var("WECHAT_BOT_TOKEN", fake.options().bot_token)
            .with_var("WECHAT_STATE_DIR", state.path().display().to_string());
        for (name, value) in settings {
            launch = launch.with_var(name, *value);
        }
        let config = WechatConfig::from_launch(&launch, None).unwrap();
        let driver =
            WechatDriver::new(config, channeld_wechat::client::http_client().unwrap()).unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run_driver(driver, launch, shutdown.clone()));
        let mut conn = hub.accept().await;
        conn.handshake(AckMode::Extensions).await;
        Rig { fake, conn, state, shutdown, task, _hub: hub }
    }

    async fn quick(settings: &[(&str, &str)]) -> Self {
        let options = FakeOptions {
            hold: Duration::from_millis(500),
            advertised_timeout: Duration::from_millis(500),
            ..FakeOptions::default()
        };
        Self::start(options, settings).await
    }

    fn target(user: &str) -> MessageTarget {
        MessageTarget::new(ChannelId::new(CHANNEL).unwrap(), Id::new(user).unwrap())
    }

    /// A new login, as `channeld-wechat login` saves it.
    fn save_login(&self, token: &str) {
        StateDir::open(self.state.path())
            .unwrap()
            .save_login(&StoredLogin {
                bot_token: token.into(),
                bot_id: "bot@im.bot".into(),
                user_id: None,
                base_url: None,
                saved_at_ms: 0,
                previous_tokens: Vec::new(),
            })
            .unwrap();
    }

    fn cursor(&self) -> String {
        StateDir::open(self.state.path()).unwrap().load_cursor().unwrap()
    }

    /// Probes until the driver reports `state`; returns the report.
    async fn health(&mut self, state: HealthState, what: &str) -> Health {
        let what = format!("{state:?} ({what})");
        self.conn.wait_health(WITHIN, &what, |health| health.state == state).await
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        let (result, ()) = tokio::join!(self.task, async {
            self.conn.expect_stop().await;
        });
        assert!(matches!(result, Ok(Ok(()))), "the driver did not stop cleanly: {result:?}");
        self.fake.assert_no_violations();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_carries_the_context_token_and_the_cursor_moves_only_after_the_hub_accepted() {
    let mut rig = Rig::quick(&[]).await;
    let pushed = rig.fake.push_text(ALICE, "ping");
    let inbound = rig.conn.expect_inbound().await;
    assert_eq!(inbound.event_id.as_str(), format!("wx-{}", pushed.message_id));
    assert_eq!(inbound.message.body.text_str(), "ping");
    assert_eq!(inbound.message.target.conversation.as_str(), ALICE);
    assert_eq!(rig.cursor(), "", "nothing is committed before the hub answered");

    rig.conn.accept_inbound(&inbound.event_id).await;
    let deadline = Instant::now() + WITHIN;
    while rig.cursor().is_empty() {
        assert!(Instant::now() < deadline, "the cursor was never saved after the acceptance");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cursor = rig.cursor();
    rig.fake
        .wait_for(WITHIN, "a poll with the new cursor", |r| {
            r.of("getupdates")
                .iter()
                .any(|p| p.body["get_updates_buf"] == cursor.as_str())
                .then_some(())
        })
        .await;

    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), "pong").await;
    let receipt = rig.conn.expect_receipt(&inbound.event_id).await;
    let sent = rig.fake.records().sent;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].text.as_deref(), Some("pong"));
    assert_eq!(sent[0].context_token, pushed.context_token);
    assert_eq!(receipt.message_id.as_str(), sent[0].client_id);
    let start = rig.fake.records().notifications;
    assert_eq!(start, ["msg/notifystart"]);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_message_is_not_passed_on_again() {
    let mut rig = Rig::quick(&[]).await;
    let first = rig.fake.push_text(ALICE, "once");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.fake
        .wait_for(WITHIN, "the first batch", |r| (r.batches_handed_out == 1).then_some(()))
        .await;
    rig.fake.replay(first.message_id);
    rig.fake.wait_for(WITHIN, "the replay", |r| (r.batches_handed_out == 2).then_some(())).await;
    rig.fake.push_text(ALICE, "twice?");
    let next = rig.conn.expect_inbound().await;
    assert_eq!(next.message.body.text_str(), "twice?", "the replay was dropped");
    rig.conn.accept_inbound(&next.event_id).await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reply_is_posted_in_order_one_chunk_per_request() {
    let mut rig = Rig::quick(&[]).await;
    rig.fake.push_text(ALICE, "tell me a lot");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    let text: String = (0..1000).map(|n| format!("line {n:04}\n")).collect();
    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), &text).await;
    rig.conn.expect_receipt(&inbound.event_id).await;
    let parts = rig.fake.records().texts_to(ALICE);
    assert_eq!(parts.len(), 3, "10,000 characters in 4,000-character requests");
    assert!(parts.iter().all(|p| p.chars().count() <= 4000));
    assert_eq!(parts.join("\n"), text.trim_end(), "in order, nothing lost");
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_without_a_usable_context_token_fails_and_is_not_retried() {
    let mut rig = Rig::quick(&[]).await;
    rig.conn.outbound("send-1", Rig::target("stranger@im.wechat"), "hello?").await;
    let err = rig.conn.expect_error("send-1").await;
    assert_eq!(err.code, "send_failed");
    assert!(err.message.contains("no context token"), "{}", err.message);
    assert_eq!(rig.fake.records().count("sendmessage"), 0, "nothing sent without a token");

    rig.fake.push_text(ALICE, "hi");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.fake.revoke_context_tokens(ALICE);
    rig.conn.outbound("send-2", Rig::target(ALICE), "refused").await;
    let err = rig.conn.expect_error("send-2").await;
    assert_eq!(err.code, "send_failed");
    assert!(
        err.message.contains("code -2") && err.message.contains("write to the bot again"),
        "{}",
        err.message
    );
    rig.conn.outbound("send-3", Rig::target(ALICE), "again").await;
    let err = rig.conn.expect_error("send-3").await;
    assert!(err.message.contains("refused the last context token"), "{}", err.message);
    assert_eq!(
        rig.fake.records().count("sendmessage"),
        1,
        "the refused token is not presented again"
    );

    rig.fake.push_text(ALICE, "back");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.conn.outbound("send-4", Rig::target(ALICE), "welcome back").await;
    rig.conn.expect_receipt("send-4").await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_is_refreshed_while_the_run_goes_and_cancelled_after_the_reply() {
    let mut rig = Rig::quick(&[("WECHAT_TYPING_INTERVAL_SECONDS", "0.2")]).await;
    rig.fake.push_text(ALICE, "think hard");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.fake
        .wait_for(WITHIN, "three typing refreshes", |r| {
            (r.typing.iter().filter(|t| t.status == 1).count() >= 3).then_some(())
        })
        .await;
    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), "done").await;
    rig.conn.expect_receipt(&inbound.event_id).await;
    let records = rig
        .fake
        .wait_for(WITHIN, "typing cancelled", |r| {
            (r.typing.last().is_some_and(|t| t.status == 2)).then(|| r.clone())
        })
        .await;
    assert_eq!(records.configs, [ALICE], "one ticket, cached");
    let reply_at = records.sent[0].at;
    assert!(records.typing.last().unwrap().at >= reply_at, "cancelled after the reply");
    assert!(records.typing.iter().all(|t| t.user == ALICE));
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_pauses_polling_until_a_new_login_appears() {
    let mut rig = Rig::quick(&[("WECHAT_AUTH_RETRY_SECONDS", "0")]).await;
    rig.health(HealthState::Ready, "polling").await;
    rig.fake.expire_bot_token();
    let health = rig.health(HealthState::Unavailable, "after -14").await;
    let detail = health.detail.unwrap_or_default();
    assert_eq!(health.status.unwrap().reason.as_deref(), Some("auth_expired"));
    assert!(detail.starts_with("auth_expired"), "{detail}");
    let old = format!("Bearer {}", rig.fake.options().bot_token);
    let polls_with_old = |r: &channeld_tests::fakes::wechat::Records| {
        r.of("getupdates")
            .iter()
            .filter(|p| p.header("authorization") == Some(old.as_str()))
            .count()
    };
    let paused_at = polls_with_old(&rig.fake.records());

    rig.conn.outbound("send-1", Rig::target(ALICE), "while expired").await;
    let err = rig.conn.expect_error("send-1").await;
    assert!(err.message.contains("auth_expired"), "{}", err.message);

    rig.fake.set_bot_token("renewed");
    rig.save_login("renewed");
    rig.health(HealthState::Ready, "after the new login").await;
    let records = rig
        .fake
        .wait_for(WITHIN, "a poll with the new token", |r| {
            r.of("getupdates")
                .iter()
                .any(|p| p.header("authorization") == Some("Bearer renewed"))
                .then(|| r.clone())
        })
        .await;
    assert_eq!(polls_with_old(&records), paused_at, "no poll with the expired token while paused");
    assert_eq!(records.notifications, ["msg/notifystart", "msg/notifystart"], "a new session");
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_then_backed_off_with_the_attempt_in_the_health() {
    let settings = [
        ("WECHAT_RETRY_SECONDS", "0.05"),
        ("WECHAT_BACKOFF_SECONDS", "2"),
        ("WECHAT_BACKOFF_AFTER", "3"),
    ];
    let mut rig = Rig::quick(&settings).await;
    // Polls recorded from here on get 502 (one held before may still end normally).
    let first = rig.fake.records().count("getupdates");
    rig.fake.set_op_mode("getupdates", Mode::Http(502));
    let records = rig
        .fake
        .wait_for(WITHIN, "five failing polls", |r| {
            (r.count("getupdates") >= first + 5).then(|| r.clone())
        })
        .await;
    let health = rig.health(HealthState::Degraded, "HTTP 502").await;
    assert!(health.detail.as_deref().is_some_and(|d| d.contains("HTTP 502")), "{health:?}");
    assert!(health.status.and_then(|s| s.attempt).is_some_and(|n| n >= 3), "the attempt count");
    let at: Vec<Instant> = records.of("getupdates")[first..].iter().map(|p| p.at).collect();
    // Failures 1-3 are followed by the short retry; from the third on, by the backoff.
    // The bounds are far apart (0.05 s against 2 s), so a loaded machine cannot blur them.
    assert!(at[1] - at[0] < Duration::from_millis(1500), "retried quickly after the first");
    assert!(at[2] - at[1] < Duration::from_millis(1500), "retried quickly after the second");
    assert!(at[3] - at[2] >= Duration::from_millis(1950), "backed off after three failures");
    rig.fake.set_op_mode("getupdates", Mode::Normal);
    rig.health(HealthState::Ready, "after the server recovered").await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_is_an_empty_poll_with_the_servers_timeout_not_an_error() {
    let options = FakeOptions {
        hold: Duration::from_millis(200),
        advertised_timeout: Duration::from_millis(1000),
        ..FakeOptions::default()
    };
    let mut rig = Rig::start(options, &[]).await;
    rig.fake
        .wait_for(WITHIN, "an answered poll", |r| (r.count("getupdates") >= 2).then_some(()))
        .await;
    rig.fake.set_op_mode("getupdates", Mode::Silent);
    let health = rig.health(HealthState::Degraded, "three unanswered polls").await;
    let idle = health.status.and_then(|s| s.idle_seconds).unwrap_or_default();
    assert!(idle >= 6, "stalled after three unanswered polls of 3 s: idle {idle}s");
    let records = rig.fake.records();
    let silent: Vec<Instant> =
        records.of("getupdates").iter().rev().take(3).map(|p| p.at).collect();
    // 1 s from the server plus the 2 s grace, with no retry delay after a client timeout.
    assert!(silent[0] - silent[1] >= Duration::from_millis(2900));
    assert!(silent[0] - silent[1] < Duration::from_secs(8), "no retry delay after a timeout");
    rig.fake.set_op_mode("getupdates", Mode::Normal);
    rig.health(HealthState::Ready, "the server answers again").await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_without_an_answer_is_unknown_and_never_sent_again() {
    let mut rig = Rig::quick(&[("WECHAT_SEND_TIMEOUT_SECONDS", "0.3")]).await;
    rig.fake.push_text(ALICE, "hello");
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.fake.set_op_mode("sendmessage", Mode::Slow(Duration::from_secs(2)));
    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), "slow answer").await;
    let err = rig.conn.expect_error(&inbound.event_id).await;
    assert_eq!(err.code, "send_unknown", "{}", err.message);

    // The hub delivers the reply again (as after a reconnect): it is not posted again.
    rig.fake.set_op_mode("sendmessage", Mode::Normal);
    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), "slow answer").await;
    let again = rig.conn.expect_error(&inbound.event_id).await;
    assert_eq!(again.code, "send_unknown");
    assert!(again.message.contains("not sent again"), "{}", again.message);
    assert_eq!(rig.fake.records().count("sendmessage"), 1);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resume_operator_action_tries_a_refused_token_again_at_once() {
    let mut rig = Rig::quick(&[("WECHAT_AUTH_RETRY_SECONDS", "0")]).await;
    assert!(rig.conn.hello().unwrap().operator_actions.iter().any(|a| a == "resume"));
    rig.health(HealthState::Ready, "polling").await;
    rig.fake.expire_bot_token();
    rig.health(HealthState::Unavailable, "after -14").await;

    // Tencent's side is fixed; the same token works again, but nothing new appeared locally.
    let token = rig.fake.options().bot_token;
    rig.fake.set_bot_token(&token);
    rig.conn.operator_action("op-1", "resume", serde_json::json!({})).await;
    let result = rig.conn.expect_operator_action_result("op-1").await;
    assert!(result.ok, "{result:?}");
    assert_eq!(result.data, Some(serde_json::json!({"auth": "usable"})));
    rig.health(HealthState::Ready, "after resume").await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_notifystop_does_not_hold_the_stop_past_the_drain() {
    let mut rig = Rig::quick(&[]).await;
    rig.health(HealthState::Ready, "polling").await;
    rig.fake.set_op_mode("msg/notifystop", Mode::Silent);
    let began = Instant::now();
    // `stop` fails if `run` is aborted at the fake hub's drain deadline.
    rig.stop().await;
    assert!(began.elapsed() < channeld_driver_sdk::testing::DRAIN, "{:?}", began.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_an_unanswered_notifystart_ends_at_once() {
    let mut rig = Rig::quick(&[]).await;
    rig.health(HealthState::Ready, "polling").await;
    rig.fake.expire_bot_token();
    rig.health(HealthState::Unavailable, "after -14").await;
    // A new login: the driver announces its new session with `msg/notifystart`, which the
    // server never answers.
    rig.fake.set_op_mode("msg/notifystart", Mode::Silent);
    rig.fake.set_bot_token("renewed");
    rig.save_login("renewed");
    rig.fake
        .wait_for(WITHIN, "the second notifystart", |r| {
            (r.count("msg/notifystart") >= 2).then_some(())
        })
        .await;
    let began = Instant::now();
    // `stop` fails if `run` is aborted at the fake hub's drain deadline.
    rig.stop().await;
    assert!(began.elapsed() < channeld_driver_sdk::testing::DRAIN, "{:?}", began.elapsed());
}
