//! Socket access by peer credentials, through a real hub: a process the instance's
//! `allow_uids` / `allow_gids` do not name gets `peer_not_allowed` and is closed before the
//! hub reads a frame; a listed user or group, and by default the hub's own user, get in.

use std::time::Duration;

use channeld_protocol::Frame;
use channeld_tests::peer::caps;
use channeld_tests::{HubProcess, RawPeer};
use serde_json::Value;

const ONE: &str = "test.one";

fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn own_gid() -> u32 {
    // SAFETY: getegid has no preconditions.
    unsafe { libc::getegid() }
}

/// A uid that is neither ours nor root.
fn stranger_uid() -> u32 {
    if own_uid() == 12_345 { 12_346 } else { 12_345 }
}

fn hub_with(rules: &str) -> HubProcess {
    HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow_all = true\n{rules}"))
}

/// Says hello and expects the handshake to be answered (the connection is admitted).
async fn expect_admitted(hub: &HubProcess) {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["health_status"]).await;
    match driver.frame().await {
        Frame::HelloAck(ack) => assert!(ack.extensions.contains(&"health_status".to_owned())),
        other => panic!("expected hello_ack, got {other:?}\n{}", hub.log()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_outside_the_allowed_uids_is_refused_and_closed() {
    let hub = hub_with(&format!("allow_uids = [{}]\n", stranger_uid()));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    let err = driver.error().await;
    assert_eq!(err.code, "peer_not_allowed");
    assert!(!err.retryable);
    assert!(err.message.contains(&format!("uid {}", own_uid())), "{}", err.message);
    assert!(driver.closed_within(Duration::from_secs(5)).await, "the hub kept the connection");

    let log = hub.log();
    assert!(log.contains("peer not allowed on this socket"), "{log}");
    let out = hub.ctl(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let status: Value = serde_json::from_slice(&out.stdout).expect("status json");
    let row = &status["instances"][0];
    assert_eq!(row["connected"], false, "a refused peer became the driver: {row}");
    let last = row["last_error"].as_str().unwrap_or_default();
    assert!(last.starts_with(&format!("refused a connection from uid {}", own_uid())), "{row}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_user_is_admitted_by_default() {
    expect_admitted(&hub_with("")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_uid_or_group_is_admitted() {
    expect_admitted(&hub_with(&format!("allow_uids = [{}]\n", own_uid()))).await;
    let rules = format!("allow_uids = [{}]\nallow_gids = [{}]\n", stranger_uid(), own_gid());
    expect_admitted(&hub_with(&rules)).await;
}

#[test]
fn an_unknown_group_name_fails_the_config_check_with_status_78() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = channeld_tests::write_file(
        dir.path(),
        "channeld.toml",
        "[instance.\"test.one\"]\nallow_gids = [\"no-such-group-for-channeld\"]\n",
    );
    let output = std::process::Command::new(channeld_tests::workspace_bin("channeld"))
        .arg("check")
        .arg("--config")
        .arg(&config)
        .output()
        .expect("run channeld check");
    assert_eq!(output.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "instance.\"test.one\".allow_gids: no group named \"no-such-group-for-channeld\""
        ),
        "{stderr}"
    );
}
