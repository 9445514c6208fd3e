//! Secrets stay secret, WeChat: `channeld-wechat` runs with a canary bot token (a
//! `LoadCredential=` file, with another canary in the environment that the file overrides)
//! against an unreachable iLink, a fake that refuses the token (`-14`, shown as `auth_expired`)
//! and one that accepts
//! it; the canaries must appear nowhere an operator or the hub can see (see `canary/mod.rs`).

mod canary;

use std::path::Path;
use std::time::Duration;

use canary::{Broker, canary, closed_port, credentials, every_frame_on_the_wire, through_the_hub};
use channeld_tests::fakes::wechat::{FakeIlink, FakeOptions};

fn wechat_env(
    base_url: String,
    credentials: &Path,
    state: &Path,
    unused: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("CREDENTIALS_DIRECTORY", credentials.display().to_string()),
        ("CHANNELD_WECHAT_BOT_TOKEN", unused.to_owned()),
        ("CHANNELD_WECHAT_BASE_URL", base_url),
        ("CHANNELD_WECHAT_STATE_DIR", state.display().to_string()),
        ("CHANNELD_WECHAT_SEND_TIMEOUT_SECONDS", "3".to_owned()),
        ("CHANNELD_WECHAT_RETRY_SECONDS", "0.5".to_owned()),
    ]
}

async fn fake_accepting(token: &str) -> FakeIlink {
    FakeIlink::start_with(FakeOptions {
        bot_token: token.to_owned(),
        hold: Duration::from_secs(1),
        advertised_timeout: Duration::from_secs(1),
        ..FakeOptions::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wechat_bot_token_from_a_credential_never_leaks() {
    let secret = canary("wechat-token");
    let unused = canary("wechat-env-unused");
    let canaries = [secret.as_str(), unused.as_str()];
    let creds = credentials("wechat-bot-token", &secret);
    let state = tempfile::tempdir().unwrap();

    let unreachable = format!("http://127.0.0.1:{}", closed_port());
    let env = wechat_env(unreachable, creds.path(), state.path(), &unused);
    through_the_hub("channeld-wechat", "wechat.canary", Broker::Unreachable, &env, &canaries).await;
    every_frame_on_the_wire("channeld-wechat", "wechat.canary", &env, &canaries).await;

    let rejecting = fake_accepting(&canary("other")).await;
    let env = wechat_env(rejecting.base_url(), creds.path(), state.path(), &unused);
    through_the_hub("channeld-wechat", "wechat.canary", Broker::Expiring, &env, &canaries).await;

    // The same credential opens a server that knows it: the driver did read the file. The
    // conversation of the hub's test send wrote first, so the send has a context token.
    let accepting = fake_accepting(&secret).await;
    accepting.push_text("room", "hello bot");
    let env = wechat_env(accepting.base_url(), creds.path(), state.path(), &unused);
    through_the_hub("channeld-wechat", "wechat.canary", Broker::Accepting, &env, &canaries).await;
    accepting.assert_no_violations();
}
