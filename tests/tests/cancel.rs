//! Cancelling a run (extension `cancel`, `channelctl cancel`) through the real `channeld`, a
//! raw driver and a shell agent: a running agent that ignores SIGTERM is gone (its pid no
//! longer exists) when the cancel is answered, the driver gets the run's one ending
//! (`error` `aborted`) and nothing of it afterwards, a second cancel is idempotent, an
//! unknown event id is refused, a queued run leaves the queue without ever starting, and
//! the aborted outcome is in the ledger (a redelivery after a restart is not run again).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_protocol::ext::{CancelRequest, CancelResult};
use channeld_tests::peer::{caps, expect_deliver, id};
use channeld_tests::{HubProcess, RawPeer, write_script};

const ONE: &str = "cancel.one";

/// An agent that records its pid in `pid-<event id>`; `slow-*` events then ignore SIGTERM
/// and sleep (as one process: `exec`), anything else answers `reply <event id>` at once.
fn agent(dir: &Path) -> PathBuf {
    let pids = dir.display();
    write_script(
        dir,
        "agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo $$ > '{pids}/pid-'\"$id\".tmp && mv '{pids}/pid-'\"$id\".tmp '{pids}/pid-'\"$id\"\n\
             case \"$id\" in slow-*) trap '' TERM; exec sleep 60;; esac\n\
             echo \"reply $id\"\n"
        ),
    )
}

fn config(agent: &Path) -> String {
    format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 120\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    )
}

async fn connect(hub: &HubProcess) -> RawPeer {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "cancel"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver
}

/// The agent's pid for `event`, once it started.
fn pid_of(dir: &Path, event: &str) -> i32 {
    let path = dir.join(format!("pid-{event}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(text) = std::fs::read_to_string(&path) {
            return text.trim().parse().expect("a pid");
        }
        assert!(Instant::now() < deadline, "the agent for {event} never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn cancel(driver: &mut RawPeer, request_id: &str, event_id: &str) {
    let request = CancelRequest { request_id: id(request_id), event_id: id(event_id) };
    driver.send(Frame::Cancel(request)).await;
}

fn expect_result(frame: Frame, request_id: &str) -> CancelResult {
    match frame {
        Frame::CancelResult(result) if result.request_id.as_str() == request_id => result,
        other => panic!("expected cancel_result {request_id}, got {other:?}"),
    }
}

fn expect_aborted(frame: Frame, event_id: &str) {
    match frame {
        Frame::Error(err) => {
            assert_eq!(err.request_id.as_ref().map(|i| i.as_str()), Some(event_id));
            assert_eq!(err.code, "aborted");
            assert!(!err.retryable);
        }
        other => panic!("expected the aborted ending of {event_id}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_agent_is_gone_and_nothing_of_its_run_follows() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProcess::start(&config(&agent(dir.path())));
    let mut driver = connect(&hub).await;

    driver.inbound(ONE, "slow-1", "alice", "room", "take your time").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let pid = pid_of(dir.path(), "slow-1");
    assert!(Path::new(&format!("/proc/{pid}")).exists());

    cancel(&mut driver, "c-1", "slow-1").await;
    // The run's ending first, then the answer: by then the agent (which ignores SIGTERM,
    // so it took the SIGKILL after the grace period) no longer exists.
    expect_aborted(driver.frame().await, "slow-1");
    let result = expect_result(driver.frame().await, "c-1");
    assert_eq!(result.cancelled, vec![id("slow-1")]);
    assert_eq!(result.state, "aborted");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "agent {pid} outlived its cancel");

    // Idempotent: nothing more to cancel.
    cancel(&mut driver, "c-2", "slow-1").await;
    let again = expect_result(driver.frame().await, "c-2");
    assert!(again.cancelled.is_empty());
    assert_eq!(again.state, "aborted");
    // An event id the hub never accepted.
    cancel(&mut driver, "c-3", "never-seen").await;
    let refused = driver.error().await;
    assert_eq!(refused.request_id.as_ref().map(|i| i.as_str()), Some("c-3"));
    assert_eq!(refused.code, "unknown_event");

    // The conversation goes on, and the next frames are this message's: no late reply,
    // preview or error of the cancelled run in between.
    driver.inbound(ONE, "quick-1", "alice", "room", "and now?").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if a.event_id.as_str() == "quick-1"));
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), "quick-1");
    assert_eq!(reply.message.body.text_str(), "reply quick-1");

    // A run that ended is not cancelled.
    let out = hub.ctl(&["cancel", ONE, "quick-1"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing cancelled (replied)"));
    let out = hub.ctl(&["cancel", ONE, "never-seen"]);
    assert_eq!(out.status.code(), Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_run_leaves_the_queue_and_its_abort_outlives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut hub = HubProcess::start(&config(&agent(dir.path())));
    let mut driver = connect(&hub).await;

    // slow-a runs; slow-b waits behind it in the same conversation.
    driver.inbound(ONE, "slow-a", "alice", "room", "first").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    driver.inbound(ONE, "slow-b", "alice", "room", "second").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    pid_of(dir.path(), "slow-a");

    let out = hub.ctl_async(&["cancel", ONE, "slow-b"]);
    expect_aborted(driver.frame().await, "slow-b");
    let out = out.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("slow-b: cancelled"));

    cancel(&mut driver, "c-a", "slow-a").await;
    expect_aborted(driver.frame().await, "slow-a");
    assert_eq!(expect_result(driver.frame().await, "c-a").cancelled, vec![id("slow-a")]);
    // The session's next run starts now; slow-b, removed, never did (it came before).
    driver.inbound(ONE, "quick-b", "alice", "room", "third").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert_eq!(expect_deliver(driver.frame().await).request_id.as_str(), "quick-b");
    assert!(!dir.path().join("pid-slow-b").exists(), "the withdrawn run started");

    // Recorded aborted: after a restart a redelivery is answered, not run.
    driver.close().await;
    hub.restart();
    let mut driver = connect(&hub).await;
    driver.inbound(ONE, "slow-b", "alice", "room", "second").await;
    // quick-b's reply was written just before the kill; the hub may not have recorded it
    // posted yet, so it may be owed (and delivered) again first.
    loop {
        match driver.frame().await {
            Frame::Deliver(delivery) if delivery.request_id.as_str() == "quick-b" => continue,
            Frame::Accepted(accepted) => {
                assert!(accepted.duplicate, "{accepted:?}");
                break;
            }
            other => panic!("expected accepted (duplicate), got {other:?}"),
        }
    }
    expect_aborted(driver.frame().await, "slow-b");
    assert!(!dir.path().join("pid-slow-b").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_without_the_extension_cannot_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProcess::start(&config(&agent(dir.path())));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    driver.inbound(ONE, "quick-1", "alice", "room", "hi").await;
    assert_eq!(expect_deliver(driver.frame().await).request_id.as_str(), "quick-1");
    cancel(&mut driver, "c-1", "quick-1").await;
    assert_eq!(driver.error().await.code, "unexpected_frame");
}
