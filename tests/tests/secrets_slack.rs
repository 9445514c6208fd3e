//! Secrets stay secret, Slack: `channeld-slack` runs with canary tokens from `LoadCredential=`
//! files against an unreachable Web API, a fake Slack that refuses the tokens and one that
//! accepts them; the canaries must appear nowhere an operator or the hub can see (see
//! `canary/mod.rs`).

mod canary;

use std::path::Path;

use canary::{Broker, canary, closed_port, credentials, every_frame_on_the_wire, through_the_hub};
use channeld_tests::fakes::slack::{FakeSlack, FakeSlackOptions};
use channeld_tests::write_file;

fn slack_env(credentials: &Path, api_url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CREDENTIALS_DIRECTORY", credentials.display().to_string()),
        ("CHANNELD_SLACK_API_URL", api_url.to_owned()),
        ("CHANNELD_SLACK_HTTP_TIMEOUT_SECONDS", "3".to_owned()),
        ("CHANNELD_SLACK_RECONNECT_MAX_SECONDS", "1".to_owned()),
        ("CHANNELD_SLACK_POST_INTERVAL_MS", "0".to_owned()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_tokens_from_credentials_never_leak() {
    let app = format!("xapp-{}", canary("slack-app"));
    let bot = format!("xoxb-{}", canary("slack-bot"));
    let dir = credentials("slack-app-token", &app);
    write_file(dir.path(), "slack-bot-token", &format!("{bot}\n"));
    let canaries = [app.as_str(), bot.as_str()];

    let unreachable = format!("http://127.0.0.1:{}/api/", closed_port());
    let env = slack_env(dir.path(), &unreachable);
    through_the_hub("channeld-slack", "slack.canary", Broker::Unreachable, &env, &canaries).await;
    every_frame_on_the_wire("channeld-slack", "slack.canary", &env, &canaries).await;

    // A workspace that knows other tokens: invalid_auth for ours.
    let refusing = FakeSlack::start().await;
    let env = slack_env(dir.path(), &refusing.api_url());
    through_the_hub("channeld-slack", "slack.canary", Broker::Rejecting, &env, &canaries).await;

    let accepting = FakeSlack::start_with(FakeSlackOptions {
        app_token: app.clone(),
        bot_token: bot.clone(),
        ..FakeSlackOptions::default()
    })
    .await;
    let env = slack_env(dir.path(), &accepting.api_url());
    through_the_hub("channeld-slack", "slack.canary", Broker::Accepting, &env, &canaries).await;
    assert_eq!(accepting.record().calls_to("chat.postMessage").len(), 2, "the sends were posted");
}
