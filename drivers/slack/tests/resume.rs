//! The `resume` operator action through the SDK's fake hub (the hub's `channelctl resume`
//! reaches the same frame): after an operator fixed the tokens, `resume` ends the slow retry
//! at once instead of after `CHANNELD_SLACK_SLOW_RETRY_SECONDS`.

use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::HealthState;
use channeld_driver_sdk::testing::{AckMode, DriverTask, FakeHub};
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_slack::{SlackConfig, SlackDriver};
use channeld_tests::fakes::slack::FakeSlack;

const WITHIN: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_retries_a_refused_link_at_once() {
    let fake = FakeSlack::start().await;
    fake.revoke_tokens(true);
    let hub = FakeHub::bind().await;
    let launch = hub
        .launch_config("slack.test")
        .with_var("SLACK_API_URL", fake.api_url())
        .with_var("SLACK_APP_TOKEN", fake.options().app_token.clone())
        .with_var("SLACK_BOT_TOKEN", fake.options().bot_token.clone())
        // Without resume the next attempt would be an hour away.
        .with_var("SLACK_SLOW_RETRY_SECONDS", "3600");
    let config = SlackConfig::from_launch(&launch).unwrap();
    let client = http::client(&HttpOptions::for_driver("slack")).unwrap();
    let task = DriverTask::spawn(SlackDriver::new(config, client), launch);
    let mut conn = hub.accept().await;
    let hello = conn.handshake(AckMode::Extensions).await;
    assert!(hello.operator_actions.iter().any(|name| name == "resume"), "resume is declared");

    let mut probe = 0;
    let mut health_until = async |conn: &mut channeld_driver_sdk::testing::FakeConnection,
                                  state: HealthState| {
        let deadline = Instant::now() + WITHIN;
        loop {
            probe += 1;
            let request = format!("probe-{probe}");
            conn.health_request(&request).await;
            let health = conn.expect_health_response(&request).await;
            if health.state == state {
                return health;
            }
            assert!(Instant::now() < deadline, "health stayed {health:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let refused = health_until(&mut conn, HealthState::Unavailable).await;
    assert_eq!(refused.status.and_then(|s| s.reason).as_deref(), Some("auth_rejected"));

    fake.revoke_tokens(false);
    conn.operator_action("resume-1", "resume", serde_json::json!({})).await;
    let result = conn.expect_operator_action_result("resume-1").await;
    assert!(result.ok, "{result:?}");
    health_until(&mut conn, HealthState::Ready).await;
    assert!(fake.record().hello_sockets().len() == 1, "connected after resume");
    task.stop().await.unwrap();
}
