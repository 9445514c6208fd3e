//! Replies that fail to post are retried, not stranded (issue 22), against the real `channeld`
//! and `channelctl` binaries.
//!
//! With real brokers and the real MQTT and AMQP drivers: the broker goes down while runs are
//! in flight, so their replies fail to post and are retried with backoff; after it comes back
//! every reply is posted exactly once and no run is repeated. The drivers' post timeouts are
//! cut to 1 s and the outage to a few seconds (the scenario used 30 s and 60 s), which
//! keeps the suite fast: the retry path is the same whatever the lengths. The MQTT test also
//! kills the hub with SIGKILL during the outage: the retry state is in the ledger and survives.
//!
//! With a raw driver speaking the protocol (`RawPeer`): a final refusal is not retried (until
//! an operator asks with `channelctl replies retry`), an `unknown` outcome (said by the
//! driver, or no answer within the receipt timeout) is not retried, and a retryable failure is;
//! replies owed to a driver that left expire when their TTL passes.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_tests::mosquitto::{Mosquitto, provision_session};
use channeld_tests::peer::{caps, expect_deliver, receipt_for};
use channeld_tests::rabbitmq::{AmqpTestClient, RabbitMq, body_text, property};
use channeld_tests::{DriverProcess, HubProcess, RawPeer, write_script};
use lapin::BasicProperties;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, Publish};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// How long a reply may take once nothing stands in its way.
const WITHIN: Duration = Duration::from_secs(30);
/// How long the broker stays down after the replies failed.
const OUTAGE: Duration = Duration::from_secs(3);
/// Messages per outage test: two conversations of three.
const MESSAGES: usize = 6;

/// A hub whose exec agent logs each run's event id to `dir/runs.txt`, then waits until the
/// file `dir/gate` exists (see [`open_gate`]) and answers `done <event id>`: the test decides
/// when the replies are produced.
fn gated_hub(dir: &Path, instance: &str, allow: &str) -> HubProcess {
    let runs = dir.join("runs.txt");
    std::fs::write(&runs, "").expect("runs file");
    let agent = write_script(
        dir,
        "gated-agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo \"$id\" >> '{}'\n\
             while [ ! -e '{}' ]; do sleep 0.05; done\n\
             echo \"done $id\"\n",
            runs.display(),
            dir.join("gate").display()
        ),
    );
    HubProcess::start(&format!(
        "[hub]\nreceipt_timeout_secs = 20\n\
         [runtime.counter]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
         [instance.\"{instance}\"]\nallow = [\"{allow}\"]\nruntime = \"counter\"\nmax_inflight = 16\n",
        agent.display()
    ))
}

/// Lets the runs of a [`gated_hub`] answer.
fn open_gate(dir: &Path) {
    std::fs::write(dir.join("gate"), "").expect("gate file");
}

fn runs(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("runs.txt"))
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Polls until `check` holds for the instance's status, or panics with the last status.
async fn wait_status(
    hub: &HubProcess,
    instance: &str,
    what: &str,
    limit: Duration,
    check: impl Fn(&Value) -> bool,
) -> Value {
    hub.wait_status(instance, what, limit, check, String::new).await
}

fn replies(status: &Value, state: &str) -> u64 {
    status["replies"][state].as_u64().unwrap_or(0)
}

/// `channelctl replies [args] --json`, parsed.
fn replies_json(hub: &HubProcess, args: &[&str]) -> Value {
    let mut all = vec!["replies", "--json"];
    all.extend_from_slice(args);
    let out = hub.ctl(&all);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("replies json")
}

/// A persistent MQTT session (clean session off, QoS 1) collecting what the broker routes to
/// `filter`, across broker restarts: messages published while it reconnects are queued for
/// it by the broker.
struct Watcher {
    received: mpsc::UnboundedReceiver<Publish>,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    async fn start(broker: &Mosquitto, filter: &str) -> Self {
        provision_session(broker.port(), "reply-watcher", None, &[filter]).await;
        let mut options = MqttOptions::new("reply-watcher", "127.0.0.1", broker.port());
        options.set_clean_session(false);
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (tx, received) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let _client = client;
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(publish))) => {
                        if tx.send(publish).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        Self { received, task }
    }

    /// Everything received until `count` messages arrived (or `limit` passed).
    async fn collect(&mut self, count: usize, limit: Duration) -> Vec<Publish> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut all = Vec::new();
        while all.len() < count {
            match tokio::time::timeout_at(deadline, self.received.recv()).await {
                Ok(Some(publish)) => all.push(publish),
                _ => break,
            }
        }
        all
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Each id appears exactly once in `ids`, and they are `expected`.
fn assert_once(ids: &[String], expected: &HashSet<String>, what: &str) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for id in ids {
        *counts.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{what} more than once: {twice:?}");
    let seen: HashSet<String> = ids.iter().cloned().collect();
    assert_eq!(&seen, expected, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_broker_down_while_replies_are_pending_and_a_hub_kill_lose_and_repeat_nothing() {
    const ONE: &str = "mqtt.one";
    let mut broker = Mosquitto::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut hub = gated_hub(dir.path(), ONE, "alice");
    provision_session(
        broker.port(),
        &format!("channeld-{ONE}"),
        None,
        &["channeld/mqtt.one/in/+/+"],
    )
    .await;
    let mut watcher = Watcher::start(&broker, "channeld/mqtt.one/out/+").await;
    let driver = DriverProcess::spawn(
        "channeld-mqtt",
        &hub,
        ONE,
        &[
            ("CHANNELD_MQTT_URL".into(), broker.url()),
            ("CHANNELD_MQTT_PUBLISH_TIMEOUT_SECONDS".into(), "1".into()),
            ("CHANNELD_MQTT_RECONNECT_MAX_SECONDS".into(), "1".into()),
        ],
    );
    wait_status(&hub, ONE, "driver Ready", WITHIN, |s| {
        s["connected"] == true && s["health"]["state"] == "Ready"
    })
    .await;

    let mut alice =
        channeld_tests::mosquitto::MqttTestClient::connect(broker.port(), "alice", &[]).await;
    let mut expected = HashSet::new();
    for n in 0..MESSAGES {
        let conversation = format!("c{}", n % 2);
        let body = json!({"text": format!("message {n}"), "id": format!("m{n}")}).to_string();
        alice.publish_confirmed(&format!("channeld/{ONE}/in/alice/{conversation}"), body).await;
        expected.insert(format!("alice/m{n}"));
    }
    drop(alice);
    // Runs of one conversation take turns: the first run of each of the two conversations
    // starts now, the others after the reply before them was handed over.
    let deadline = Instant::now() + WITHIN;
    while runs(dir.path()).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "runs started: {:?}\n{}",
            runs(dir.path()),
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The broker goes away while every run is in flight, then the runs answer: each reply
    // fails to post (not connected within 1 s) and is retried with backoff.
    tokio::task::block_in_place(|| broker.stop());
    open_gate(dir.path());
    let status = wait_status(&hub, ONE, "every reply failed retryably", WITHIN, |s| {
        replies(s, "failed_retryable") + replies(s, "handed") + replies(s, "pending")
            == MESSAGES as u64
            && replies(s, "failed_retryable") >= 1
    })
    .await;
    assert_eq!(replies(&status, "posted"), 0, "{status}");
    let listed = replies_json(&hub, &[ONE, "--state", "failed_retryable"]);
    let failed = listed["replies"].as_array().expect("replies").clone();
    assert!(!failed.is_empty(), "{listed}");
    assert!(
        failed.iter().all(|r| r["error"].as_str().unwrap_or_default().starts_with("send_failed")),
        "{listed}"
    );

    // The hub dies mid-outage without a chance to save anything: the retry state is in the
    // ledger. The driver reconnects to the new hub and is handed the replies again.
    tokio::task::block_in_place(|| hub.restart());
    wait_status(&hub, ONE, "driver back on the restarted hub", WITHIN, |s| s["connected"] == true)
        .await;
    let status = tokio::task::block_in_place(|| hub.instance_status(ONE));
    assert_eq!(
        replies(&status, "failed_retryable")
            + replies(&status, "handed")
            + replies(&status, "pending"),
        MESSAGES as u64,
        "the retry state survived the kill: {status}"
    );
    tokio::time::sleep(OUTAGE).await;
    tokio::task::block_in_place(|| broker.start_again());

    let status = wait_status(&hub, ONE, "every reply posted", Duration::from_secs(60), |s| {
        replies(s, "posted") == MESSAGES as u64
    })
    .await;
    for state in ["pending", "handed", "failed_retryable", "failed", "unknown", "expired"] {
        assert_eq!(replies(&status, state), 0, "{state}: {status}");
    }
    let posted = replies_json(&hub, &[ONE]);
    let attempts: Vec<u64> = posted["replies"]
        .as_array()
        .expect("replies")
        .iter()
        .map(|r| r["attempts"].as_u64().unwrap_or(0))
        .collect();
    // The first reply of each conversation failed and was tried again; the ones behind it
    // waited for it (in order) and may have gone out at their first attempt.
    assert!(attempts.iter().filter(|n| **n >= 2).count() >= 2, "retried: {attempts:?}");
    eprintln!("attempts per reply: {attempts:?}");

    let received = watcher.collect(MESSAGES + 1, Duration::from_secs(3)).await;
    let reply_to: Vec<String> = received
        .iter()
        .map(|p| {
            let payload: Value = serde_json::from_slice(&p.payload).expect("reply json");
            payload["reply_to"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    assert_once(&reply_to, &expected, "replies on the broker");
    assert_once(&runs(dir.path()), &(0..MESSAGES).map(|n| format!("alice/m{n}")).collect(), "runs");
    // Each conversation's replies reached the broker in the order the ledger recorded them.
    let mut recorded: Vec<(i64, String, String)> = posted["replies"]
        .as_array()
        .expect("replies")
        .iter()
        .map(|r| {
            let id = r["id"].as_i64().unwrap_or(0);
            let conversation = r["conversation"].as_str().unwrap_or_default().to_owned();
            (id, conversation, r["event_id"].as_str().unwrap_or_default().to_owned())
        })
        .collect();
    recorded.sort();
    for conversation in ["c0", "c1"] {
        let in_ledger: Vec<&str> = recorded
            .iter()
            .filter(|(_, c, _)| c == conversation)
            .map(|(_, _, e)| e.as_str())
            .collect();
        let on_broker: Vec<&str> = received
            .iter()
            .zip(&reply_to)
            .filter(|(p, _)| p.topic.ends_with(&format!("/{conversation}")))
            .map(|(_, e)| e.as_str())
            .collect();
        assert_eq!(on_broker, in_ledger, "order of {conversation}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_broker_down_while_replies_are_pending_loses_and_repeats_nothing() {
    const ONE: &str = "amqp.one";
    const QUEUE: &str = "one.in";
    const INBOX: &str = "guest.inbox";
    let mut broker = tokio::task::block_in_place(RabbitMq::start);
    let dir = tempfile::tempdir().expect("temp dir");
    let hub = gated_hub(dir.path(), ONE, "guest");
    let client = AmqpTestClient::connect(&broker.guest_url()).await;
    client.declare_queue(QUEUE).await;
    client.declare_queue(INBOX).await;
    let driver = DriverProcess::spawn(
        "channeld-amqp",
        &hub,
        ONE,
        &[
            ("CHANNELD_AMQP_URL".into(), broker.guest_url()),
            ("CHANNELD_AMQP_QUEUE".into(), QUEUE.into()),
            ("CHANNELD_AMQP_CONFIRM_TIMEOUT_SECONDS".into(), "1".into()),
        ],
    );
    wait_status(&hub, ONE, "driver Ready", Duration::from_secs(60), |s| {
        s["connected"] == true && s["health"]["state"] == "Ready"
    })
    .await;
    let mut expected = HashSet::new();
    for n in 0..MESSAGES {
        let props = BasicProperties::default()
            .with_user_id("guest".into())
            .with_message_id(format!("m{n}").into())
            .with_reply_to(INBOX.into())
            .with_correlation_id(format!("corr-{n}").into());
        let confirmation =
            client.publish(QUEUE, props, format!("message {n}").as_bytes()).await.expect("publish");
        assert_eq!(confirmation, lapin::Confirmation::Ack(None));
        expected.insert(format!("corr-{n}"));
    }
    drop(client);
    // Every message is in one conversation (the reply queue's), so runs take turns: the first
    // starts now, each next one after the reply before it was handed over.
    let deadline = Instant::now() + WITHIN;
    while runs(dir.path()).is_empty() {
        assert!(
            Instant::now() < deadline,
            "runs started: {:?}\n{}",
            runs(dir.path()),
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    tokio::task::block_in_place(|| broker.stop_node());
    open_gate(dir.path());
    let status = wait_status(&hub, ONE, "a reply failed retryably", WITHIN, |s| {
        replies(s, "failed_retryable") >= 1
    })
    .await;
    assert_eq!(replies(&status, "posted"), 0, "{status}");
    tokio::time::sleep(OUTAGE).await;
    tokio::task::block_in_place(|| broker.start_node());

    let status = wait_status(&hub, ONE, "every reply posted", Duration::from_secs(90), |s| {
        replies(s, "posted") == MESSAGES as u64
    })
    .await;
    for state in ["pending", "handed", "failed_retryable", "failed", "unknown", "expired"] {
        assert_eq!(replies(&status, state), 0, "{state}: {status}");
    }
    let client = AmqpTestClient::connect(&broker.guest_url()).await;
    let mut inbox = client.collect(INBOX).await;
    let mut correlations = Vec::new();
    while let Some(reply) = inbox.next_within(Duration::from_secs(2)).await {
        assert!(body_text(&reply).starts_with("done "), "{}", body_text(&reply));
        correlations.push(property(reply.properties.correlation_id()));
    }
    assert_once(&correlations, &expected, "replies on the broker");
    let ran: HashSet<String> = (0..MESSAGES).map(|n| format!("m{n}")).collect();
    assert_once(&runs(dir.path()), &ran, "runs");
}

/// A raw driver with `reply_receipt` on a hub whose echo runtime answers at once.
async fn raw_driver(hub: &HubProcess, instance: &str) -> RawPeer {
    let mut peer = RawPeer::connect(&hub.socket(instance)).await;
    peer.hello(instance, caps(&["receive", "send"]), &["accepted", "reply_receipt"]).await;
    match peer.frame().await {
        Frame::HelloAck(_) => {}
        other => panic!("expected hello_ack, got {other:?}"),
    }
    peer
}

/// Sends an inbound and returns the `deliver` of its reply (after the `accepted`).
async fn ask(peer: &mut RawPeer, instance: &str, event_id: &str, conversation: &str) -> Frame {
    peer.inbound(instance, event_id, "alice", conversation, &format!("hi {event_id}")).await;
    match peer.frame().await {
        Frame::Accepted(_) => {}
        other => panic!("expected accepted, got {other:?}"),
    }
    peer.frame().await
}

fn error(event_id: &str, code: &str, retryable: bool) -> Frame {
    Frame::error(Some(channeld_tests::peer::id(event_id)), code, format!("{code} here"), retryable)
}

fn reply_id(hub: &HubProcess, event_id: &str) -> String {
    let listed = replies_json(hub, &[]);
    let reply = listed["replies"]
        .as_array()
        .and_then(|all| all.iter().find(|r| r["event_id"] == event_id).cloned())
        .unwrap_or_else(|| panic!("no reply for {event_id}: {listed}"));
    reply["id"].as_i64().expect("reply id").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_refusal_and_an_unknown_outcome_are_not_retried_but_a_retryable_failure_is() {
    const ONE: &str = "raw.one";
    let hub = HubProcess::start(&format!(
        "[hub]\nreceipt_timeout_secs = 1\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"
    ));
    let mut peer = raw_driver(&hub, ONE).await;

    // A final refusal: failed, never handed over again by itself.
    let first = expect_deliver(ask(&mut peer, ONE, "e-refused", "c1").await);
    peer.send(error("e-refused", "send_failed", false)).await;
    // Driver says it cannot tell: unknown, never handed over again by itself.
    let _unknown = expect_deliver(ask(&mut peer, ONE, "e-unknown", "c2").await);
    peer.send(error("e-unknown", "send_unknown", false)).await;
    // No answer at all within the receipt timeout (1 s): unknown too.
    let _silent = expect_deliver(ask(&mut peer, ONE, "e-silent", "c3").await);
    // A retryable failure comes back after its backoff (about 1 s).
    let _retried = expect_deliver(ask(&mut peer, ONE, "e-retry", "c4").await);
    peer.send(error("e-retry", "send_failed", true)).await;
    let again = expect_deliver(peer.frame_within(WITHIN).await.expect("the retry"));
    assert_eq!(again.request_id.as_str(), "e-retry");
    peer.send(receipt_for(ONE, &again.request_id, "c4", "posted-retry")).await;

    let status = wait_status(&hub, ONE, "the outcomes recorded", WITHIN, |s| {
        replies(s, "failed") == 1 && replies(s, "unknown") == 2 && replies(s, "posted") == 1
    })
    .await;
    assert_eq!(replies(&status, "failed_retryable") + replies(&status, "pending"), 0, "{status}");
    let failed = replies_json(&hub, &["--state", "failed"]);
    assert_eq!(failed["replies"][0]["event_id"], "e-refused", "{failed}");
    assert_eq!(failed["replies"][0]["error"], "send_failed: send_failed here", "{failed}");
    let text = String::from_utf8_lossy(&hub.ctl(&["status"]).stdout).into_owned();
    assert!(text.contains("replies: failed 1, unknown 2"), "{text}");
    hub.wait_log("reply outcome unknown", 2, WITHIN);
    let logged = hub.replies_reported_unknown();
    assert!(logged.contains("e-unknown") && logged.contains("e-silent"), "{logged:?}");
    assert_eq!(logged.len(), 2, "{logged:?}");
    // Nothing else is handed over: the next frame is the answer to a new message.
    let next = expect_deliver(ask(&mut peer, ONE, "e-next", "c5").await);
    assert_eq!(next.request_id.as_str(), "e-next");
    peer.send(receipt_for(ONE, &next.request_id, "c5", "posted-next")).await;

    // An operator retries the refused one: it is handed over again, once.
    let out = hub.ctl(&["replies", "retry", &reply_id(&hub, "e-refused")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let retried = expect_deliver(peer.frame_within(WITHIN).await.expect("the operator's retry"));
    assert_eq!(retried.request_id, first.request_id);
    assert_eq!(retried.message, first.message);
    peer.send(receipt_for(ONE, &retried.request_id, "c1", "posted-refused")).await;
    // A posted reply cannot be retried.
    let out = hub.ctl(&["replies", "retry", &reply_id(&hub, "e-next")]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_retryable"));
    wait_status(&hub, ONE, "the retried reply posted", WITHIN, |s| replies(s, "posted") == 3).await;
    // A redelivery of the unknown one is answered with an error, not posted again.
    peer.inbound(ONE, "e-unknown", "alice", "c2", "hi e-unknown").await;
    let mut answer = None;
    for _ in 0..2 {
        match peer.frame().await {
            Frame::Accepted(_) => {}
            other => answer = Some(other),
        }
        if answer.is_some() {
            break;
        }
    }
    match answer {
        Some(Frame::Error(err)) => assert_eq!(err.code, "reply_not_posted"),
        other => panic!("expected reply_not_posted, got {other:?}"),
    }
}

/// Sends `e-2` in `c1` while `e-1`'s reply there is unanswered: its reply is recorded and
/// waits (`pending`) behind the first.
async fn queue_second_reply(hub: &HubProcess, peer: &mut RawPeer, instance: &str) {
    peer.inbound(instance, "e-2", "alice", "c1", "hi e-2").await;
    match peer.frame().await {
        Frame::Accepted(_) => {}
        other => panic!("expected accepted, got {other:?}"),
    }
    wait_status(hub, instance, "the second reply recorded", WITHIN, |s| replies(s, "pending") == 1)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_of_one_conversation_wait_for_the_one_before_them() {
    const ONE: &str = "raw.one";
    let hub = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"));
    let mut peer = raw_driver(&hub, ONE).await;
    let first = expect_deliver(ask(&mut peer, ONE, "e-1", "c1").await);
    // The second reply of c1 is recorded, but not handed over while the first is unanswered.
    queue_second_reply(&hub, &mut peer, ONE).await;
    peer.send(error("e-1", "send_failed", true)).await;
    // The first one comes back first, after its backoff; only its receipt lets the second go.
    let again = expect_deliver(peer.frame_within(WITHIN).await.expect("the retry"));
    assert_eq!(again.request_id, first.request_id);
    peer.send(receipt_for(ONE, &again.request_id, "c1", "p-1")).await;
    let second = expect_deliver(peer.frame_within(WITHIN).await.expect("the second reply"));
    assert_eq!(second.request_id.as_str(), "e-2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_owed_to_a_driver_that_left_expire_when_their_ttl_passes() {
    const ONE: &str = "raw.one";
    let hub = HubProcess::start(&format!(
        "[hub]\nreply_ttl_secs = 2\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"
    ));
    let mut peer = raw_driver(&hub, ONE).await;
    // e-1 is handed over and never answered; e-2 waits behind it in c1.
    let _first = expect_deliver(ask(&mut peer, ONE, "e-1", "c1").await);
    queue_second_reply(&hub, &mut peer, ONE).await;
    // The driver leaves: both wait for the next one, which never comes, and expire after
    // their TTL (2 s) — not at the hub's next idle wake a minute later.
    drop(peer);
    let left = Instant::now();
    wait_status(&hub, ONE, "both replies expired", Duration::from_secs(20), |s| {
        replies(s, "expired") == 2
    })
    .await;
    println!("expired {:?} after the driver left", left.elapsed());
}
