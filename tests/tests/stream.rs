//! Streaming (extension `stream`) through the real `channeld`, a raw driver and a shell agent
//! that writes `delta` and `tool` lines: a driver with `stream` gets ordered `stream` frames
//! (seq from 0) and then the final `deliver` carrying its seq and the agent's reply metadata;
//! a failed run ends with the stream's `error` end; a reference peer (no extensions) sees
//! none of the new frames, only the reply.

use std::path::{Path, PathBuf};

use channeld_protocol::Frame;
use channeld_protocol::ext::{StreamEnd, StreamFrame};
use channeld_tests::peer::{caps, expect_deliver};
use channeld_tests::{HubProcess, RawPeer, write_script};

const ONE: &str = "stream.one";

/// Deltas `Hel`, `lo`, a tool report, one more delta, then the reply with metadata; an
/// event id starting `fail-` streams one delta and exits 3.
fn agent(dir: &Path) -> PathBuf {
    write_script(
        dir,
        "agent.sh",
        "IFS= read -r line\n\
         id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
         echo '{\"type\":\"delta\",\"text\":\"Hel\"}'\n\
         case \"$id\" in fail-*) exit 3;; esac\n\
         echo '{\"type\":\"delta\",\"text\":\"lo\"}'\n\
         echo '{\"type\":\"tool\",\"name\":\"search\",\"status\":\"done\",\"hits\":2}'\n\
         echo '{\"type\":\"delta\",\"text\":\"!\"}'\n\
         echo '{\"type\":\"reply\",\"text\":\"Hello!\",\"metadata\":{\"routing\":{\"to\":\"ops\"},\"lang\":\"en\"}}'\n",
    )
}

fn config(agent: &Path) -> String {
    format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 30\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    )
}

fn step(frame: Frame) -> StreamFrame {
    match frame {
        Frame::Stream(step) => step,
        other => panic!("expected a stream frame, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_arrive_in_order_then_the_final_reply_with_its_seq_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProcess::start(&config(&agent(dir.path())));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "stream"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));

    driver.inbound(ONE, "m-1", "alice", "room", "hi").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let mut steps = Vec::new();
    for _ in 0..4 {
        steps.push(step(driver.frame().await));
    }
    assert!(steps.iter().all(|s| s.event_id.as_str() == "m-1" && s.end.is_none()));
    assert_eq!(steps.iter().map(|s| s.seq).collect::<Vec<_>>(), [0, 1, 2, 3]);
    let texts: Vec<Option<&str>> = steps.iter().map(|s| s.text.as_deref()).collect();
    assert_eq!(texts, [Some("Hel"), Some("lo"), None, Some("!")]);
    let tool = steps[2].tool.as_ref().expect("a tool report");
    assert_eq!((tool.name.as_str(), tool.status.as_str()), ("search", "done"));
    assert_eq!(tool.rest.get("hits"), Some(&serde_json::json!(2)));

    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), "m-1");
    assert_eq!(reply.message.body.text_str(), "Hello!");
    let metadata = &reply.message.metadata;
    assert_eq!(metadata.get("stream_seq").map(String::as_str), Some("4"));
    assert_eq!(metadata.get("lang").map(String::as_str), Some("en"));
    let routing: serde_json::Value = serde_json::from_str(&metadata["routing"]).unwrap();
    assert_eq!(routing, serde_json::json!({"to": "ops"}));

    // A failed run: its deltas, then the stream's error end in place of an error frame.
    driver.inbound(ONE, "fail-1", "alice", "room", "break").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let first = step(driver.frame().await);
    assert_eq!((first.seq, first.text.as_deref()), (0, Some("Hel")));
    let end = step(driver.frame().await);
    assert_eq!(end.event_id.as_str(), "fail-1");
    assert_eq!(end.seq, 1);
    assert_eq!(end.end, Some(StreamEnd::Error));
    assert_eq!(end.code.as_deref(), Some("agent_failed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_peer_sees_none_of_the_new_frames() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProcess::start(&config(&agent(dir.path())));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    // No extensions: no hello_ack, no accepted, no stream frames; the reply and the error
    // as the reference hub sends them.
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    driver.inbound(ONE, "m-1", "alice", "room", "hi").await;
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.message.body.text_str(), "Hello!");
    assert!(!reply.message.metadata.contains_key("stream_seq"));
    driver.inbound(ONE, "fail-1", "alice", "room", "break").await;
    let err = driver.error().await;
    assert_eq!(err.code, "agent_failed");
    assert_eq!(err.request_id.as_ref().map(|i| i.as_str()), Some("fail-1"));
}
