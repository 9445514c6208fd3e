//! Secrets stay secret, WeCom: `channeld-wecom` runs with a canary bot secret (a
//! `LoadCredential=` file, with a second canary in `CHANNELD_WECOM_SECRET` that the credential
//! overrides) against an unreachable endpoint, a fake WeCom that refuses the secret and one
//! that accepts it; neither canary may appear anywhere an operator or the hub can see (see
//! `canary/mod.rs`).

mod canary;

use canary::{Broker, canary, closed_port, credentials, every_frame_on_the_wire, through_the_hub};
use channeld_tests::fakes::wecom::{FakeConfig, FakeWeCom};

const BOT: &str = "aib-canary";

fn wecom_env(
    url: String,
    credentials: &std::path::Path,
    unused: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("CHANNELD_WECOM_WS_URL", url),
        ("CHANNELD_WECOM_BOT_ID", BOT.to_owned()),
        ("CREDENTIALS_DIRECTORY", credentials.display().to_string()),
        ("CHANNELD_WECOM_SECRET", unused.to_owned()),
        ("CHANNELD_WECOM_SEND_QUEUE_SECONDS", "3".to_owned()),
        ("CHANNELD_WECOM_CONNECT_TIMEOUT_SECONDS", "3".to_owned()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wecom_secret_from_a_credential_never_leaks() {
    let secret = canary("wecom-credential");
    let unused = canary("wecom-env-unused");
    let creds = credentials("wecom-secret", &secret);
    let canaries = [secret.as_str(), unused.as_str()];

    let unreachable = format!("ws://127.0.0.1:{}", closed_port());
    let env = wecom_env(unreachable, creds.path(), &unused);
    through_the_hub("channeld-wecom", "wecom.canary", Broker::Unreachable, &env, &canaries).await;
    every_frame_on_the_wire("channeld-wecom", "wecom.canary", &env, &canaries).await;

    let rejecting = FakeWeCom::start(FakeConfig::new(BOT, &canary("other"))).await;
    let env = wecom_env(rejecting.url(), creds.path(), &unused);
    through_the_hub("channeld-wecom", "wecom.canary", Broker::Rejecting, &env, &canaries).await;
    every_frame_on_the_wire("channeld-wecom", "wecom.canary", &env, &canaries).await;
    assert!(rejecting.record().subscribes.iter().all(|subscribe| !subscribe.accepted));

    // The same credential opens a platform that knows it: the driver did read the file.
    let accepting = FakeWeCom::start(FakeConfig::new(BOT, &secret)).await;
    accepting.know_chat("room");
    let env = wecom_env(accepting.url(), creds.path(), &unused);
    through_the_hub("channeld-wecom", "wecom.canary", Broker::Accepting, &env, &canaries).await;
    assert!(accepting.record().accepted_subscribes() >= 1);
    assert_eq!(accepting.record().sent_to("room").len(), 2, "both sends were shown");
}
