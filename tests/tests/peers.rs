//! Socket access by peer credentials, through a real hub: a process the instance's
//! `allow_uids` / `allow_gids` do not name gets `peer_not_allowed` and is closed before the
//! hub reads a frame; a listed user or group, and by default the hub's own user, get in. The
//! control socket checks its peers the same way (`control_allow_uids` / `control_allow_gids`)
//! and serves a bounded number of connections.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

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
    // The hub refuses before it reads anything, so no hello is written: it could race the
    // close and fail with a broken pipe.
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

#[test]
fn a_process_outside_the_control_allow_lists_gets_a_clear_refusal_and_exit_3() {
    let hub = HubProcess::start(&format!(
        "[hub]\ncontrol_allow_uids = [{}]\n[instance.\"{ONE}\"]\nallow_all = true\n",
        stranger_uid()
    ));
    let out = hub.ctl(&["status"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("peer_not_allowed"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "uid {} gid {} may not use the control socket",
            own_uid(),
            own_gid()
        )),
        "{stderr}"
    );
    assert!(hub.log().contains("control connection refused: peer not allowed"), "{}", hub.log());

    // The hub's own user is admitted by default, as on instance sockets.
    let open = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow_all = true\n"));
    assert_eq!(open.ctl(&["status"]).status.code(), Some(0));
}

/// Sends `status` on `stream` and returns the answer line.
fn ask_status(stream: &mut UnixStream) -> String {
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    // A refused connection is answered and closed before the request is read, so the write
    // may fail; the answer is there to read either way.
    let _ = stream.write_all(b"{\"id\":1,\"op\":\"status\"}\n");
    first_line(stream)
}

fn first_line(stream: &UnixStream) -> String {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).expect("read answer");
    line
}

#[test]
fn the_control_socket_serves_at_most_64_connections_and_frees_a_slot_on_close() {
    let hub = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow_all = true\n"));
    let control = hub.control_socket();
    // HubProcess's readiness probe used one connection, which the hub may still hold for a
    // moment: fill the slots by asking until a refusal comes, so each held one is served.
    let mut held = Vec::new();
    let refusal = loop {
        let mut stream = UnixStream::connect(&control).expect("connect");
        let answer = ask_status(&mut stream);
        if answer.contains("too_many_connections") {
            break answer;
        }
        assert!(answer.contains("\"ok\":true"), "{answer}");
        held.push(stream);
        assert!(held.len() <= 64, "more than 64 control connections were served");
    };
    assert_eq!(held.len(), 64, "the limit is 64 connections");
    let refusal: Value = serde_json::from_str(&refusal).expect("json");
    assert_eq!(refusal["id"], 0);
    assert!(refusal["error"]["message"].as_str().unwrap().contains("try again"), "{refusal}");

    // One client leaves: a new one is served once the hub has seen it go.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut stream = UnixStream::connect(&control).expect("connect");
        let answer = ask_status(&mut stream);
        if answer.contains("\"ok\":true") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no slot was freed within 10 s of a client leaving: {answer}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
