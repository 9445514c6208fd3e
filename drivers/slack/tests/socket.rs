//! The Socket Mode loop in-process, through the SDK's fake hub and the fake Slack: how each
//! way a socket ends shows in health, how the driver replaces it, and the `resume` operator
//! action (the frame `channelctl resume` sends once the hub side is wired) ending a slow retry.

use std::time::Duration;

use channeld_driver_sdk::protocol::types::{Health, HealthState};
use channeld_driver_sdk::testing::{AckMode, DriverTask, FakeConnection, FakeHub};
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_slack::{SlackConfig, SlackDriver};
use channeld_tests::fakes::slack::{FakeSlack, FakeSlackOptions, Fault, SocketEnd};

const WITHIN: Duration = Duration::from_secs(20);

struct Setup {
    fake: FakeSlack,
    _hub: FakeHub,
    conn: FakeConnection,
    task: DriverTask,
}

async fn setup(options: FakeSlackOptions) -> Setup {
    setup_with(FakeSlack::start_with(options).await).await
}

/// The driver against `fake` (prepared by the test before the driver starts).
async fn setup_with(fake: FakeSlack) -> Setup {
    let hub = FakeHub::bind().await;
    let launch = hub
        .launch_config("slack.test")
        .with_var("SLACK_API_URL", fake.api_url())
        .with_var("SLACK_APP_TOKEN", fake.options().app_token.clone())
        .with_var("SLACK_BOT_TOKEN", fake.options().bot_token.clone())
        .with_var("SLACK_RECONNECT_MAX_SECONDS", "1")
        // A slow retry would be an hour away: only `resume` brings the link back sooner.
        .with_var("SLACK_SLOW_RETRY_SECONDS", "3600");
    let config = SlackConfig::from_launch(&launch).unwrap();
    let client = http::client(&HttpOptions::for_driver("slack")).unwrap();
    let task = DriverTask::spawn(SlackDriver::new(config, client), launch);
    let mut conn = hub.accept().await;
    let hello = conn.handshake(AckMode::Extensions).await;
    assert!(hello.operator_actions.iter().any(|name| name == "resume"), "resume is declared");
    Setup { fake, _hub: hub, conn, task }
}

impl Setup {
    /// Probes until the health satisfies `wanted`.
    async fn health(&mut self, what: &str, wanted: impl Fn(&Health) -> bool) -> Health {
        self.conn.wait_health(WITHIN, what, wanted).await
    }

    async fn ready(&mut self) {
        self.health("Ready", |h| h.state == HealthState::Ready).await;
    }
}

fn reason(health: &Health) -> Option<&str> {
    health.status.as_ref().and_then(|s| s.reason.as_deref())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_websockets_is_degraded_with_its_reason_and_retried() {
    let mut s = setup(FakeSlackOptions::default()).await;
    s.ready().await;
    s.fake.disconnect("too_many_websockets", Some(Duration::ZERO)).await;
    let degraded = s
        .health("Degraded/too_many_websockets", |h| reason(h) == Some("too_many_websockets"))
        .await;
    assert_eq!(degraded.state, HealthState::Degraded);
    s.ready().await;
    assert!(s.fake.record().hello_sockets().len() >= 2, "reconnected");
    s.task.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warning_opens_the_next_socket_before_the_old_one_goes() {
    let mut s = setup(FakeSlackOptions::default()).await;
    s.ready().await;
    // `warning`: Slack keeps the socket open for now; the driver opens the next one.
    s.fake.disconnect("warning", None).await;
    let record = s
        .fake
        .wait_for("a second socket", WITHIN, |r| (r.hello_sockets().len() == 2).then(|| r.clone()))
        .await;
    assert!(
        record.sockets[0]
            .closed_at
            .is_none_or(|closed| closed > record.sockets[1].hello_at.unwrap())
    );
    let end = s
        .fake
        .wait_for("the old socket closed by the driver", WITHIN, |r| r.sockets[0].end.clone())
        .await;
    assert_eq!(end, SocketEnd::ByClient);
    let said = s.fake.user_dms("U1", "after the switch");
    let inbound = s.conn.expect_inbound().await;
    assert_eq!(inbound.message.body.text_str(), "after the switch");
    s.conn.accept_inbound(&inbound.event_id).await;
    s.fake
        .wait_for("acked on the new socket", WITHIN, |r| {
            r.deliveries_of(&said.event_ids[0])
                .iter()
                .any(|e| e.socket == 2 && e.acked_at.is_some())
                .then_some(())
        })
        .await;
    s.task.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abrupt_close_is_retried_and_unacknowledged_events_come_back() {
    let mut s = setup(FakeSlackOptions {
        redeliver_after: Duration::from_millis(500),
        ..FakeSlackOptions::default()
    })
    .await;
    s.ready().await;
    let said = s.fake.user_dms("U1", "in flight");
    let inbound = s.conn.expect_inbound().await;
    // The socket dies before the hub answered: no ack went out, so Slack redelivers.
    s.fake.close_abruptly().await;
    s.fake.wait_for("a new socket", WITHIN, |r| (r.hello_sockets().len() >= 2).then_some(())).await;
    s.conn.accept_inbound(&inbound.event_id).await;
    // If the redelivery reached the driver after the hub's answer, it is reported again and
    // the hub answers it as a duplicate (as channeld does); either way Slack gets its ack.
    let acked = s.fake.wait_for("the redelivery acknowledged", WITHIN, |r| {
        r.event_acked(&said.event_ids[0]).then_some(())
    });
    {
        tokio::pin!(acked);
        loop {
            tokio::select! {
                () = &mut acked => break,
                again = s.conn.expect_inbound() => {
                    assert_eq!(again.event_id, inbound.event_id, "only the redelivered message");
                    s.conn.accept_inbound(&again.event_id).await;
                }
            }
        }
    }
    s.ready().await;
    s.task.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_connection_open_waits_retry_after() {
    let fake = FakeSlack::start().await;
    fake.fail("apps.connections.open", Fault::RateLimited { retry_after_secs: 2 }, Some(1));
    let mut s = setup_with(fake).await;
    s.ready().await;
    let record = s.fake.record();
    let opens = record.calls_to("apps.connections.open");
    assert_eq!(opens.len(), 2);
    assert!(
        opens[1].at.duration_since(opens[0].at) >= Duration::from_secs(2),
        "Retry-After honoured"
    );
    s.task.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_retries_a_refused_link_at_once() {
    let fake = FakeSlack::start().await;
    fake.revoke_tokens(true);
    let mut s = setup_with(fake).await;
    let refused = s.health("Unavailable", |h| h.state == HealthState::Unavailable).await;
    assert_eq!(reason(&refused), Some("auth_rejected"));

    s.fake.revoke_tokens(false);
    s.conn.operator_action("resume-1", "resume", serde_json::json!({})).await;
    let result = s.conn.expect_operator_action_result("resume-1").await;
    assert!(result.ok, "{result:?}");
    s.ready().await;
    assert_eq!(s.fake.record().hello_sockets().len(), 1, "connected after resume");
    s.task.stop().await.unwrap();
}
