//! How runs end, through the real `channeld` and shell agents: every run ends with exactly
//! one `deliver` or `error`, a reply that is too big once escaped is cut to fit its frame,
//! and an agent that leaves a background child holding its stdout still replies.

use std::path::Path;
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_protocol::frame::ErrorFrame;
use channeld_tests::peer::{caps, expect_deliver};
use channeld_tests::{HubProcess, RawPeer, alive, write_script};

const ONE: &str = "test.one";

fn agent_hub(dir: &Path, agent: &str, runtime_extra: &str) -> HubProcess {
    let script = write_script(dir, "agent.sh", agent);
    let dir = tempfile::tempdir().unwrap();
    HubProcess::start_in(
        dir,
        &format!(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n{runtime_extra}\n\
             [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
            script.display()
        ),
    )
}

fn expect_error(frame: Frame) -> ErrorFrame {
    match frame {
        Frame::Error(err) => err,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_run_ends_with_exactly_one_deliver_or_error() {
    let dir = tempfile::tempdir().unwrap();
    let hub = agent_hub(
        dir.path(),
        "IFS= read -r line\n\
         case \"$line\" in\n\
         *'\"text\":\"no text\"'*) echo '{\"type\":\"reply\"}' ;;\n\
         *'\"text\":\"blank\"'*) echo '   ' ; echo ;;\n\
         *'\"text\":\"silent\"'*) ;;\n\
         *'\"text\":\"data\"'*) echo '{\"answer\":42}' ;;\n\
         *) echo '{\"type\":\"thought\",\"text\":\"not for the user\"}' ; echo 'visible' ;;\n\
         esac\n",
        "",
    );
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));

    for (event, text) in [("e-1", "no text"), ("e-2", "blank"), ("e-3", "silent")] {
        driver.inbound(ONE, event, "alice", "c1", text).await;
        assert!(matches!(driver.frame().await, Frame::Accepted(_)), "{text}");
        let err = expect_error(driver.frame().await);
        assert_eq!(err.code, "empty_reply", "{text}: {err:?}");
        assert_eq!(err.request_id.as_ref().map(|r| r.as_str()), Some(event));
        assert!(!err.retryable);
    }
    // A redelivery replays the same ending rather than nothing.
    driver.inbound(ONE, "e-3", "alice", "c1", "silent").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if a.duplicate));
    assert_eq!(expect_error(driver.frame().await).code, "empty_reply");

    // JSON without a `type` is the agent's answer; an unknown `type` is an action the hub
    // does not know, never shown to the user.
    driver.inbound(ONE, "e-4", "alice", "c1", "data").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert_eq!(expect_deliver(driver.frame().await).message.body.text_str(), "{\"answer\":42}");
    driver.inbound(ONE, "e-5", "alice", "c1", "think").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert_eq!(expect_deliver(driver.frame().await).message.body.text_str(), "visible");
    assert!(hub.log().contains("thought"), "the unknown type is logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_too_big_once_escaped_is_cut_to_fit_its_frame_and_delivered_once() {
    let dir = tempfile::tempdir().unwrap();
    // 200,000 quotes: under the reply cut and max_output_bytes, twice that once escaped.
    let mut hub =
        agent_hub(dir.path(), "cat > /dev/null\nhead -c 200000 /dev/zero | tr '\\0' '\"'\n", "");
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "big-1", "alice", "c1", "quote me").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    // The reader refuses lines over the limit, so a frame read here fits it.
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id, "big-1");
    let text = reply.message.body.text_str();
    assert!(text.ends_with("[reply truncated]"), "{}", &text[text.len() - 40..]);
    assert!(text.starts_with("\"\"\"\""));
    let encoded = channeld_protocol::encode(&Frame::Deliver(reply.clone())).unwrap();
    assert!(encoded.len() <= channeld_protocol::MAX_LINE_BYTES);
    assert!(encoded.len() > channeld_protocol::MAX_LINE_BYTES - 4096, "cut no more than needed");
    assert!(!hub.log().contains("driver connection gone"), "{}", hub.log());

    // It was handed over: once the hub recorded it so (the driver takes no reply receipts,
    // so it is `posted` once written), nothing is owed after a crash. Killed before that
    // record, the hub would owe it again, by design: wait for it.
    let posted = |status: &serde_json::Value| status["replies"]["posted"].as_u64() == Some(1);
    hub.wait_status(ONE, "the big reply recorded posted", Duration::from_secs(10), posted, || {
        hub.log()
    })
    .await;
    driver.close().await;
    hub.restart();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "after", "alice", "c1", "next").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if a.event_id == "after"));
    let next = expect_deliver(driver.frame().await);
    assert_eq!(next.request_id, "after", "the big reply was delivered again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_background_child_holds_stdout_still_replies_and_the_child_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("child.pid");
    let hub = agent_hub(
        dir.path(),
        &format!("cat > /dev/null\nsleep 20 &\necho $! > '{}'\necho held\n", pid_file.display()),
        "timeout_secs = 10",
    );
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    let started = Instant::now();
    driver.inbound(ONE, "m-1", "alice", "c1", "hold on").await;
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.message.body.text_str(), "held");
    assert!(started.elapsed() < Duration::from_secs(8), "waited for the background child");

    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    // Bounded poll: the hub kills the agent's process group once the agent exited.
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        assert!(Instant::now() < deadline, "the background child {pid} outlived its run");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
