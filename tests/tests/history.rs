//! Conversation history (extension `history`) through the real `channeld` and a raw driver:
//! the admitted inbound texts and posted replies of a conversation in the order the driver
//! sent them, newest `limit` oldest first, kept across a hub restart, capped by
//! `history_max`, off with `history = false`, and the same through `channelctl history`. A
//! driver that did not negotiate the extension cannot ask.

use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_protocol::ext::{HistoryEntry, HistoryRequest, HistoryRole};
use channeld_tests::peer::{caps, expect_deliver, id, receipt_for};
use channeld_tests::{HubProcess, RawPeer};

const ONE: &str = "hist.one";
const CAPPED: &str = "hist.cap";
const OFF: &str = "hist.off";

fn config() -> String {
    format!(
        "[instance.\"{ONE}\"]\nallow = [\"alice\"]\n\
         [instance.\"{CAPPED}\"]\nallow = [\"alice\"]\nhistory_max = 8\n\
         [instance.\"{OFF}\"]\nallow = [\"alice\"]\nhistory = false\n"
    )
}

async fn connect(hub: &HubProcess, instance: &str, extensions: &[&str]) -> RawPeer {
    let mut driver = RawPeer::connect(&hub.socket(instance)).await;
    driver.hello(instance, caps(&["receive"]), extensions).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver
}

/// One exchange: `text` from alice in `conversation`, the echo reply posted as `p-<event>`.
async fn exchange(
    driver: &mut RawPeer,
    instance: &str,
    event: &str,
    conversation: &str,
    text: &str,
) {
    driver.inbound(instance, event, "alice", conversation, text).await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let delivery = expect_deliver(driver.frame().await);
    assert_eq!(delivery.message.body.text_str(), text);
    let posted = format!("p-{event}");
    driver.send(receipt_for(instance, &delivery.request_id, conversation, &posted)).await;
}

async fn ask(
    driver: &mut RawPeer,
    request_id: &str,
    conversation: &str,
    limit: Option<u32>,
) -> Result<Vec<HistoryEntry>, String> {
    let request = HistoryRequest {
        request_id: id(request_id),
        conversation: id(conversation),
        thread: None,
        limit,
    };
    driver.send(Frame::HistoryRequest(request)).await;
    match driver.frame().await {
        Frame::HistoryResult(result) => {
            assert_eq!(result.request_id.as_str(), request_id);
            Ok(result.entries)
        }
        Frame::Error(err) => {
            assert_eq!(err.request_id.as_ref().map(|i| i.as_str()), Some(request_id));
            Err(err.code)
        }
        other => panic!("expected history_result, got {other:?}"),
    }
}

/// Asks until the reply to `event` is in the conversation's history: a posted reply is
/// written once its receipt was read, after the receipt frame itself. Returns the history.
async fn posted(driver: &mut RawPeer, conversation: &str, event: &str) -> Vec<HistoryEntry> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        n += 1;
        let entries = ask(driver, &format!("wait-{n}"), conversation, Some(100)).await.unwrap();
        let found = entries
            .iter()
            .any(|e| e.role == HistoryRole::Assistant && e.event_id.as_deref() == Some(event));
        if found {
            return entries;
        }
        assert!(Instant::now() < deadline, "the reply to {event} never reached the history");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn summary(entries: &[HistoryEntry]) -> Vec<(HistoryRole, String)> {
    entries.iter().map(|e| (e.role, e.text.clone())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_holds_each_exchange_in_order_and_survives_a_restart() {
    let mut hub = HubProcess::start(&config());
    let extensions = ["accepted", "reply_receipt", "history"];
    let mut driver = connect(&hub, ONE, &extensions).await;
    for n in 1..=3 {
        exchange(&mut driver, ONE, &format!("e{n}"), "room", &format!("q{n}")).await;
        posted(&mut driver, "room", &format!("e{n}")).await;
    }
    exchange(&mut driver, ONE, "x1", "elsewhere", "other").await;
    posted(&mut driver, "elsewhere", "x1").await;
    let entries = ask(&mut driver, "h-1", "room", None).await.unwrap();
    let expected: Vec<(HistoryRole, String)> = (1..=3)
        .flat_map(|n| {
            [(HistoryRole::User, format!("q{n}")), (HistoryRole::Assistant, format!("q{n}"))]
        })
        .collect();
    assert_eq!(summary(&entries), expected);
    assert_eq!(entries[0].sender.as_deref(), Some("alice"));
    assert_eq!(entries[0].message_id.as_deref(), Some("e1"));
    assert_eq!(entries[1].message_id.as_deref(), Some("p-e1"), "the receipt's message id");
    assert_eq!(entries[1].event_id.as_deref(), Some("e1"));
    assert!(entries.windows(2).all(|w| w[0].id < w[1].id && w[0].at_ms <= w[1].at_ms));
    let last_two = ask(&mut driver, "h-2", "room", Some(2)).await.unwrap();
    assert_eq!(last_two, entries[4..]);
    assert!(ask(&mut driver, "h-none", "nobody-here", None).await.unwrap().is_empty());
    assert_eq!(ask(&mut driver, "h-0", "room", Some(0)).await, Err("invalid_request".into()));

    driver.close().await;
    hub.restart();
    let mut driver = connect(&hub, ONE, &extensions).await;
    assert_eq!(ask(&mut driver, "h-after", "room", None).await.unwrap(), entries);

    let out = hub.ctl(&["history", ONE, "room", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed: Vec<HistoryEntry> = serde_json::from_value(view["entries"].clone()).unwrap();
    assert_eq!(listed, entries);
    let out = hub.ctl(&["history", ONE, "room", "--limit", "1"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("assistant: q3"), "{text}");
}

/// The hub writes history behind the messages it comes from and holds the newest entries in
/// memory for a moment: killed (SIGKILL) while it holds them, it rebuilds them from its
/// records on the next start, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_the_hub_held_when_it_was_killed_is_rebuilt_in_order() {
    let mut hub = HubProcess::start(&config());
    let mut driver = connect(&hub, ONE, &["accepted", "reply_receipt", "history"]).await;
    for n in 1..=3 {
        exchange(&mut driver, ONE, &format!("k{n}"), "crash", &format!("q{n}")).await;
    }
    // Its `accepted` comes after its record's commit, and the receipts before it were
    // recorded before it: every entry is committed, and the newest are still held.
    driver.inbound(ONE, "k4", "alice", "crash", "q4").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    hub.restart();
    let out = hub.ctl(&["history", ONE, "crash", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entries: Vec<HistoryEntry> = serde_json::from_value(view["entries"].clone()).unwrap();
    let mut expected: Vec<(HistoryRole, String)> = (1..=3)
        .flat_map(|n| {
            [(HistoryRole::User, format!("q{n}")), (HistoryRole::Assistant, format!("q{n}"))]
        })
        .collect();
    expected.push((HistoryRole::User, "q4".into()));
    assert_eq!(summary(&entries), expected);
    assert_eq!(entries[5].message_id.as_deref(), Some("p-k3"), "the receipt's message id");
    assert!(entries.windows(2).all(|w| w[0].id < w[1].id && w[0].at_ms <= w[1].at_ms));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_and_the_next_message_sent_back_to_back_keep_their_order() {
    // The platform showed the reply before the person wrote again: the driver writes the
    // receipt and then the next message, with no pause between them. The hub records them
    // in that order, however its ledger groups them.
    let hub = HubProcess::start(&config());
    let mut driver = connect(&hub, ONE, &["accepted", "reply_receipt", "history"]).await;
    let rounds = 40;
    for n in 1..=rounds {
        exchange(&mut driver, ONE, &format!("b{n}"), "busy", &format!("q{n}")).await;
    }
    let entries = posted(&mut driver, "busy", &format!("b{rounds}")).await;
    let expected: Vec<(HistoryRole, String)> = (1..=rounds)
        .flat_map(|n| {
            [(HistoryRole::User, format!("q{n}")), (HistoryRole::Assistant, format!("q{n}"))]
        })
        .collect();
    assert_eq!(summary(&entries), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_max_keeps_the_newest_entries_and_history_false_keeps_none() {
    let hub = HubProcess::start(&config());
    let extensions = ["accepted", "reply_receipt", "history"];
    let mut capped = connect(&hub, CAPPED, &extensions).await;
    for n in 1..=5 {
        exchange(&mut capped, CAPPED, &format!("c{n}"), "room", &format!("q{n}")).await;
        posted(&mut capped, "room", &format!("c{n}")).await;
    }
    // Ten entries, within the cap's slack (a quarter of 8): the ledger trims in steps and
    // still holds them all, but no reader sees more than the newest 8.
    let entries = ask(&mut capped, "cap", "room", Some(100)).await.unwrap();
    let newest: Vec<_> = (2..=5)
        .flat_map(|n| {
            [(HistoryRole::User, format!("q{n}")), (HistoryRole::Assistant, format!("q{n}"))]
        })
        .collect();
    assert_eq!(summary(&entries), newest);

    let mut off = connect(&hub, OFF, &extensions).await;
    exchange(&mut off, OFF, "o1", "room", "secret-ish").await;
    assert_eq!(ask(&mut off, "off", "room", None).await, Err("history_off".into()));
    let out = hub.ctl(&["history", OFF, "room"]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("history_off"));
    let out = hub.ctl(&["history", "nope.x", "room"]);
    assert_eq!(out.status.code(), Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_without_the_extension_cannot_ask_and_sees_no_history_frames() {
    let hub = HubProcess::start(&config());
    let mut driver = connect(&hub, ONE, &["accepted"]).await;
    driver.inbound(ONE, "r1", "alice", "room", "hello").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    expect_deliver(driver.frame().await);
    let request = HistoryRequest {
        request_id: id("h-1"),
        conversation: id("room"),
        thread: None,
        limit: None,
    };
    driver.send(Frame::HistoryRequest(request)).await;
    let err = driver.error().await;
    assert_eq!(err.code, "unexpected_frame");
}
