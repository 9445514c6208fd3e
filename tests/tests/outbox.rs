//! The outbox through the real `channeld` and `channelctl`: an operator's retry of a send
//! whose outcome is unknown (a driver that never answered, a hub killed mid-send), refusals
//! decided before a send is queued, idempotency keys that conflict, listings that stay under
//! the control line limit, and queued sends answered at once.

use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_tests::control::ControlClient;
use channeld_tests::peer::{caps, expect_deliver, expect_outbound, receipt_for};
use channeld_tests::{HubProcess, RawPeer};
use serde_json::{Value, json};

const ONE: &str = "test.one";

fn hub(extra_hub: &str) -> HubProcess {
    HubProcess::start(&format!("[hub]\n{extra_hub}\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"))
}

/// A driver for `ONE` that the hub has certainly registered (it answered an inbound).
async fn driver(hub: &HubProcess) -> RawPeer {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    driver.inbound(ONE, "sync", "alice", "c1", "sync").await;
    expect_deliver(driver.frame().await);
    driver
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|err| panic!("{err}: stdout {} stderr {}", stdout(out), stderr(out)))
}

/// The SDK's answer to an `outbound` while it shuts down: refused, nothing posted.
async fn refuse_draining(driver: &RawPeer, request_id: &channeld_protocol::Id) {
    let draining = "driver is shutting down".to_owned();
    driver.send(Frame::error(Some(request_id.clone()), "draining", draining, true)).await;
}

/// Closes `leaving` and connects the next driver, once the hub has seen the first go (else
/// `already_connected`).
async fn next_driver(hub: &HubProcess, leaving: RawPeer) -> RawPeer {
    drop(leaving);
    let gone = |status: &Value| status["connected"] == false;
    hub.wait_status(ONE, "the leaving driver gone", Duration::from_secs(10), gone, String::new)
        .await;
    let next = RawPeer::connect(&hub.socket(ONE)).await;
    next.hello(ONE, caps(&["receive", "send"]), &[]).await;
    next
}

/// The next `outbound` a newly connected driver gets (a queued send), past its hello's
/// answer and health probes.
async fn queued_outbound(driver: &mut RawPeer) -> channeld_protocol::frame::Delivery {
    loop {
        match driver.frame_within(Duration::from_secs(20)).await.expect("a queued send") {
            Frame::Outbound(delivery) => return delivery,
            Frame::HelloAck(_) | Frame::Health(_) => {}
            other => panic!("expected a queued outbound, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_retry_resends_an_unknown_send_through_channelctl() {
    let hub = hub("");
    let mut driver = driver(&hub).await;
    // The driver takes the send and never answers: its outcome is unknown.
    let send = hub.ctl_async(&["send", ONE, "--conversation", "c1", "--timeout", "1", "retry me"]);
    let first = expect_outbound(driver.frame().await);
    let out = send.await.unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));

    let listed = hub.ctl(&["outbox", "--state", "unknown", "--json"]);
    assert_eq!(listed.status.code(), Some(0), "{}", stderr(&listed));
    let id = json_of(&listed)["records"][0]["id"].as_i64().expect("the unknown record");

    let retry = hub.ctl_async(&["outbox", "retry", &id.to_string()]);
    let again = expect_outbound(driver.frame().await);
    assert_eq!(again.message.body.text_str(), "retry me");
    assert_eq!(again.request_id, first.request_id, "a retry is the same request");
    driver.send(receipt_for(ONE, &again.request_id, "c1", "posted-on-retry")).await;
    let out = retry.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "stdout {} stderr {}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("receipted"), "{}", stdout(&out));

    let listed = json_of(&hub.ctl(&["outbox", "--state", "receipted", "--json"]));
    let shown = &listed["records"][0];
    assert_eq!(shown["id"], id);
    assert_eq!(shown["receipt"]["message_id"], "posted-on-retry");
    assert_eq!(shown["attempts"], 2);
}

/// A send handed straight to its driver has its ledger row written with its outcome (the
/// send journal holds it until then): a hub killed after the driver took it, before any
/// outcome, lists it as unknown once restarted, and a retry hands the same request over.
///
/// Which path wrote the row depends on timing: any ledger batch that starts while the send
/// is held writes its row early (here the courier's record of the `sync` reply as posted,
/// made after its `deliver` was written, and the driver's connect-time claim, which can
/// land in the few milliseconds before the kill). Every attempt checks the outcome; the
/// journal's path must be taken in at least one of them (measured while every answer was
/// still followed by a claim: an attempt missed it about one time in fifteen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_taken_before_the_hub_was_killed_is_unknown_after_the_restart() {
    const ATTEMPTS: usize = 6;
    for attempt in 1..=ATTEMPTS {
        if send_taken_then_killed().await == RowFrom::Journal {
            return;
        }
        eprintln!("attempt {attempt}: the row was written before the kill; again");
    }
    panic!("in {ATTEMPTS} attempts the send's row never came from the journal");
}

/// Where the row of a send the hub was killed with came from, by the restarted hub's log.
#[derive(Debug, PartialEq, Eq)]
enum RowFrom {
    /// Held in the send journal at the kill, written by the restart.
    Journal,
    /// Written by a ledger batch before the kill.
    Ledger,
}

/// One hub, killed after its driver took a send; checks the send is unknown after the
/// restart and that a retry hands the same request over.
async fn send_taken_then_killed() -> RowFrom {
    let mut hub = hub("");
    let mut first_driver = driver(&hub).await;
    let text = "taken before the crash";
    let send = hub.ctl_async(&["send", ONE, "--conversation", "c1", "--timeout", "60", text]);
    let first = expect_outbound(first_driver.frame().await);
    hub.kill();
    let out = send.await.unwrap();
    assert_ne!(out.status.code(), Some(0), "the caller saw no outcome: {}", stdout(&out));
    drop(first_driver);

    hub.restart();
    let log = hub.log();
    let from = if log.contains("recorded sends a crash left in the send journal") {
        RowFrom::Journal
    } else {
        assert!(log.contains("sends were in flight when the hub stopped"), "{log}");
        RowFrom::Ledger
    };
    let listed = json_of(&hub.ctl(&["outbox", "--state", "unknown", "--json"]));
    let records = listed["records"].as_array().unwrap();
    assert_eq!(records.len(), 1, "{listed}");
    assert_eq!(records[0]["text"], text);
    let id = records[0]["id"].as_i64().unwrap();

    let mut driver = driver(&hub).await;
    let retry = hub.ctl_async(&["outbox", "retry", &id.to_string()]);
    let again = expect_outbound(driver.frame().await);
    assert_eq!(again.request_id, first.request_id, "a retry is the same request");
    assert_eq!(again.message.body.text_str(), text);
    driver.send(receipt_for(ONE, &again.request_id, "c1", "posted-after-restart")).await;
    let out = retry.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "stdout {} stderr {}", stdout(&out), stderr(&out));
    // One record in all: the retry reused it.
    let all = json_of(&hub.ctl(&["outbox", "--json"]));
    assert_eq!(all["records"].as_array().unwrap().len(), 1, "{all}");
    assert_eq!(all["records"][0]["state"], "receipted");
    from
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_too_large_for_a_frame_is_refused_before_it_is_queued() {
    let hub = hub("");
    let control = ControlClient::connect(&hub.control_socket()).await.unwrap();
    let big = "x".repeat(300_000);
    let answer = control
        .call(json!({"op": "send", "instance": ONE, "conversation": "c1", "text": big}))
        .await
        .unwrap();
    assert_eq!(answer["ok"], false, "{answer}");
    assert_eq!(answer["error"]["code"], "too_large", "{answer}");

    // Nothing was queued for it, and the sends behind it go out in order on connect.
    for text in ["first", "second"] {
        let out = hub.ctl(&["send", ONE, "--conversation", "c1", text]);
        assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    }
    let listed = json_of(&hub.ctl(&["outbox", "--json"]));
    assert_eq!(listed["records"].as_array().unwrap().len(), 2, "{listed}");
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    for text in ["first", "second"] {
        let outbound = expect_outbound(driver.frame().await);
        assert_eq!(outbound.message.body.text_str(), text);
        driver.send(receipt_for(ONE, &outbound.request_id, "c1", text)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_to_an_offline_driver_is_answered_queued_at_once() {
    let hub = hub("");
    let started = Instant::now();
    let out = hub.ctl(&["send", ONE, "--conversation", "c1", "--timeout", "60", "later"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("queued"), "{}", stdout(&out));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the answer waited {:?}, as long as the receipt timeout",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_reused_for_other_content_is_a_conflict() {
    let hub = hub("");
    let send = |conversation: &str, text: &str| {
        hub.ctl(&["send", ONE, "--conversation", conversation, "--key", "K1", text])
    };
    let first = send("c1", "deploy 881 finished");
    assert_eq!(first.status.code(), Some(7), "{}", stderr(&first));
    let repeat = send("c1", "deploy 881 finished");
    assert_eq!(repeat.status.code(), Some(7), "{}", stderr(&repeat));
    assert_eq!(stdout(&repeat), stdout(&first), "a repeat answers with the first record");
    assert!(stderr(&repeat).contains("same send as before"), "{}", stderr(&repeat));

    for (conversation, text) in [("c1", "deploy 882 finished"), ("c2", "deploy 881 finished")] {
        let other = send(conversation, text);
        assert_eq!(other.status.code(), Some(8), "{conversation} {text}: {}", stdout(&other));
        assert!(stderr(&other).contains("conflict"), "{}", stderr(&other));
    }
    let listed = json_of(&hub.ctl(&["outbox", "--json"]));
    assert_eq!(listed["records"].as_array().unwrap().len(), 1, "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_listing_leaves_out_bodies_pages_and_shows_one_record_in_full() {
    let hub = hub("");
    let control = ControlClient::connect(&hub.control_socket()).await.unwrap();
    let mut ids = Vec::new();
    for n in 0..8 {
        let text = format!("{n}{}", "y".repeat(199_999));
        let answer = control
            .call(json!({"op": "send", "instance": ONE, "conversation": "c1", "text": text}))
            .await
            .unwrap();
        assert_eq!(answer["result"]["state"], "queued", "{answer}");
        ids.push(answer["result"]["outbox_id"].as_i64().unwrap());
    }

    let out = hub.ctl(&["outbox"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 1 + 8, "{}", stdout(&out));

    let page = json_of(&hub.ctl(&["outbox", "--json", "--limit", "3"]));
    let first: Vec<i64> =
        page["records"].as_array().unwrap().iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(first, vec![ids[7], ids[6], ids[5]], "newest first");
    for record in page["records"].as_array().unwrap() {
        assert!(record["text"].as_str().unwrap().len() < 1000, "a preview, not the body");
        assert_eq!(record["text_bytes"], 200_000);
    }
    let before = page["next_before"].as_i64().expect("a cursor to the next page");
    let next =
        json_of(&hub.ctl(&["outbox", "--json", "--limit", "3", "--before", &before.to_string()]));
    let second: Vec<i64> =
        next["records"].as_array().unwrap().iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(second, vec![ids[4], ids[3], ids[2]]);

    let full = json_of(&hub.ctl(&["outbox", "--full", &ids[3].to_string(), "--json"]));
    assert_eq!(full["text"].as_str().unwrap().len(), 200_000);
    assert!(full["text"].as_str().unwrap().starts_with('3'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_refused_by_a_draining_driver_goes_to_the_next_driver_once() {
    let hub = hub("");
    let mut leaving = driver(&hub).await;
    let send = hub.ctl_async(&[
        "send",
        ONE,
        "--conversation",
        "c1",
        "--key",
        "k-drain",
        "--timeout",
        "20",
        "after restart",
    ]);
    let refused = expect_outbound(leaving.frame().await);
    refuse_draining(&leaving, &refused.request_id).await;

    // The next driver gets the same send, once, and its receipt answers the waiting caller.
    let mut next = next_driver(&hub, leaving).await;
    let again = queued_outbound(&mut next).await;
    assert_eq!(again.request_id, refused.request_id, "the same request");
    assert_eq!(again.message.body.text_str(), "after restart");
    next.send(receipt_for(ONE, &again.request_id, "c1", "posted-after-drain")).await;
    let out = send.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "stdout {} stderr {}", stdout(&out), stderr(&out));
    let listed = json_of(&hub.ctl(&["outbox", "--state", "receipted", "--json"]));
    assert_eq!(listed["records"][0]["receipt"]["message_id"], "posted-after-drain");
    assert_eq!(listed["records"][0]["attempts"], 2, "{listed}");
    assert!(next.frame_within(Duration::from_millis(300)).await.is_none(), "sent only once more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_made_while_a_driver_drains_wait_behind_the_refused_one_for_the_next_driver() {
    let hub = hub("");
    let mut leaving = driver(&hub).await;
    let first = hub.ctl(&["send", ONE, "--conversation", "c1", "--no-wait", "first"]);
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let refused = expect_outbound(leaving.frame().await);
    refuse_draining(&leaving, &refused.request_id).await;
    // The refused send is queued again; wait until the hub has recorded it so.
    let queued = || json_of(&hub.ctl(&["outbox", "--state", "queued", "--json"]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while queued()["records"].as_array().is_none_or(Vec::is_empty) {
        assert!(Instant::now() < deadline, "the refused send was never queued again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The driver said it is shutting down: a newer send is not handed to it (nor are the
    // queued ones again), it is queued behind the refused one and answered so at once.
    let started = Instant::now();
    let second = hub.ctl(&["send", ONE, "--conversation", "c1", "--timeout", "20", "second"]);
    assert_eq!(
        second.status.code(),
        Some(7),
        "stdout {} stderr {}",
        stdout(&second),
        stderr(&second)
    );
    assert!(started.elapsed() < Duration::from_secs(10), "answered after {:?}", started.elapsed());
    assert!(leaving.frame_within(Duration::from_millis(300)).await.is_none(), "nothing more to it");

    // The next driver gets both, in order, once each.
    let mut next = next_driver(&hub, leaving).await;
    for text in ["first", "second"] {
        let outbound = queued_outbound(&mut next).await;
        assert_eq!(outbound.message.body.text_str(), text);
        next.send(receipt_for(ONE, &outbound.request_id, "c1", text)).await;
    }
    assert!(next.frame_within(Duration::from_millis(300)).await.is_none(), "each sent once more");
    let listed = json_of(&hub.ctl(&["outbox", "--state", "receipted", "--json"]));
    let records = listed["records"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{listed}");
    let mut attempts: Vec<i64> = records.iter().filter_map(|r| r["attempts"].as_i64()).collect();
    attempts.sort_unstable();
    assert_eq!(attempts, [1, 2], "the refused send twice, the newer once: {listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_key_unconfirmed_within_its_wait_exits_unknown_not_success() {
    let hub = hub("");
    let mut driver = driver(&hub).await;
    let args = |timeout: &'static str| {
        ["send", ONE, "--conversation", "c1", "--key", "K9", "--timeout", timeout, "once"]
    };
    // The first caller gives the driver 30 s; the driver takes the send and does not answer.
    let first = hub.ctl_async(&args("30"));
    expect_outbound(driver.frame().await);
    // A repeat that waits one second has no receipt by then: the record is still `sent`
    // (`handed`), which is unknown to this caller (exit 5, not success), and nothing is sent
    // again.
    let repeat = hub.ctl(&args("1"));
    assert_eq!(
        repeat.status.code(),
        Some(5),
        "stdout {} stderr {}",
        stdout(&repeat),
        stderr(&repeat)
    );
    assert!(stderr(&repeat).contains("still waiting"), "{}", stderr(&repeat));
    assert!(driver.frame_within(Duration::from_millis(300)).await.is_none(), "sent only once");
    drop(first);
}
