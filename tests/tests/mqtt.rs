//! The MQTT driver as a real process between a real mosquitto and a real `channeld`: round
//! trips, two instances on one broker, identity from the topic (hub allowlist and broker ACL),
//! proactive sends, a second driver the hub refuses staying off the broker, 1,000
//! messages across a broker restart and a driver SIGKILL with nothing lost and nothing run
//! twice, and a 10,000-message burst.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use channeld_tests::mosquitto::{
    BrokerQueue, Mosquitto, MosquittoOptions, MqttTestClient, provision_session,
};
use channeld_tests::{DriverProcess, HubProcess, counting_agent, workspace_bin};
use serde_json::{Value, json};

const ONE: &str = "mqtt.one";
const TWO: &str = "mqtt.two";
/// How long a test waits for one MQTT message.
const MESSAGE_WITHIN: Duration = Duration::from_secs(15);

fn inbound_topic(instance: &str, sender: &str, conversation: &str) -> String {
    format!("channeld/{instance}/in/{sender}/{conversation}")
}

fn outbound_filter(instance: &str) -> String {
    format!("channeld/{instance}/out/+")
}

/// `channeld-mqtt` for `instance` of `hub` on `broker`, with `env` on top.
fn mqtt_driver(
    hub: &HubProcess,
    instance: &str,
    broker: &Mosquitto,
    env: &[(&str, &str)],
) -> DriverProcess {
    let mut vars = vec![("CHANNELD_MQTT_URL".to_owned(), broker.url())];
    vars.extend(env.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())));
    DriverProcess::spawn("channeld-mqtt", hub, instance, &vars)
}

/// Waits until the driver is connected to the hub and reports Ready (broker connected).
async fn wait_ready(hub: &HubProcess, instance: &str, driver: &DriverProcess) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = hub.instance_status(instance);
        if status["connected"] == true && status["health"]["state"] == "Ready" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{instance} not Ready within 20 s: {status}\n{}",
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Creates the driver's persistent session (default client id, default inbound filter), so
/// messages published before it first connects are queued for it.
async fn provision(broker: &Mosquitto, instance: &str, login: Option<(&str, &str)>) {
    let filter = inbound_topic(instance, "+", "+");
    provision_session(broker.port(), &format!("channeld-{instance}"), login, &[&filter]).await;
}

fn payload(message: &rumqttc::Publish) -> Value {
    serde_json::from_slice(&message.payload).expect("outbound payload is JSON")
}

fn echo_hub(allow: &[&str], instances: &[&str]) -> HubProcess {
    let allow: Vec<String> = allow.iter().map(|sender| format!("\"{sender}\"")).collect();
    let config: String = instances
        .iter()
        .map(|instance| format!("[instance.\"{instance}\"]\nallow = [{}]\n", allow.join(", ")))
        .collect();
    HubProcess::start(&config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_round_trips_through_the_echo_runtime() {
    let broker = Mosquitto::start();
    let hub = echo_hub(&["alice"], &[ONE]);
    provision(&broker, ONE, None).await;
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &[&outbound_filter(ONE)]).await;
    let mut alice = MqttTestClient::connect(broker.port(), "alice-phone", &[]).await;
    let driver = mqtt_driver(&hub, ONE, &broker, &[]);
    wait_ready(&hub, ONE, &driver).await;

    let ping = json!({"text": "ping", "id": "1", "thread": "t-1"}).to_string();
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), ping).await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(reply.topic, "channeld/mqtt.one/out/c1");
    assert_eq!(
        payload(&reply),
        json!({
            "id": "reply-alice/1",
            "text": "ping",
            "conversation": "c1",
            "thread": "t-1",
            "reply_to": "alice/1",
        })
    );

    // Junk is acknowledged away and does not hold up what follows; raw text is a message.
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c2"), vec![0xff, 0xfe, 0x00]).await;
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c2"), "{\"id\":\"no text\"}").await;
    let oversize = json!({"text": "x".repeat(300 * 1024), "id": "big"}).to_string();
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c2"), oversize).await;
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c2"), "hello raw\n").await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(reply.topic, "channeld/mqtt.one/out/c2");
    assert_eq!(payload(&reply)["text"], "hello raw");

    let out = hub.ctl(&["health", ONE]);
    let health = String::from_utf8_lossy(&out.stdout);
    assert!(health.starts_with("mqtt.one Ready"), "{health}");
    assert_eq!(hub.instance_status(ONE)["counters"]["inbound"], 2, "junk never reached the hub");
    assert!(observer.next_within(Duration::from_millis(200)).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_a_broker_with_their_own_client_ids_and_topics() {
    let broker = Mosquitto::start();
    let hub = echo_hub(&["alice"], &[ONE, TWO]);
    provision(&broker, ONE, None).await;
    provision(&broker, TWO, None).await;
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &["channeld/+/out/+"]).await;
    let mut alice = MqttTestClient::connect(broker.port(), "alice-phone", &[]).await;
    let one = mqtt_driver(&hub, ONE, &broker, &[]);
    let two = mqtt_driver(&hub, TWO, &broker, &[]);
    wait_ready(&hub, ONE, &one).await;
    wait_ready(&hub, TWO, &two).await;

    for (instance, text) in [(ONE, "for one"), (TWO, "for two"), (ONE, "one again")] {
        let body = json!({"text": text, "id": text}).to_string();
        alice.publish_confirmed(&inbound_topic(instance, "alice", "c"), body).await;
        let reply = observer.next_message(MESSAGE_WITHIN).await;
        assert_eq!(reply.topic, format!("channeld/{instance}/out/c"), "reply to {text:?}");
        assert_eq!(payload(&reply)["text"], text);
    }
    assert!(observer.next_within(Duration::from_millis(200)).await.is_none(), "cross-talk");
    assert_eq!(hub.instance_status(ONE)["counters"]["inbound"], 2);
    assert_eq!(hub.instance_status(TWO)["counters"]["inbound"], 1);

    let log = broker.log();
    assert!(log.contains("as channeld-mqtt.one") && log.contains("as channeld-mqtt.two"), "{log}");
    assert!(!log.contains("already connected"), "a client id was shared:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_claiming_an_allowed_sender_is_denied_by_the_topic_identity() {
    let broker = Mosquitto::start();
    let hub = echo_hub(&["alice"], &[ONE]);
    provision(&broker, ONE, None).await;
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &[&outbound_filter(ONE)]).await;
    let mut clients = MqttTestClient::connect(broker.port(), "clients", &[]).await;
    let mut driver = mqtt_driver(&hub, ONE, &broker, &[]);
    wait_ready(&hub, ONE, &driver).await;

    let spoof = json!({"text": "wire the money", "sender": "alice", "id": "s-1"}).to_string();
    clients.publish_confirmed(&inbound_topic(ONE, "mallory", "c1"), spoof).await;
    let genuine = json!({"text": "hi", "id": "a-1"}).to_string();
    clients.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), genuine).await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(payload(&reply)["reply_to"], "alice/a-1", "only alice's own message is answered");
    let status = hub.instance_status(ONE);
    assert_eq!(status["counters"]["denied"], 1, "{status}");

    // A retained message is a message when it is published...
    clients.publish_retained(&inbound_topic(ONE, "alice", "c1"), "kept on the broker").await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(payload(&reply)["text"], "kept on the broker");

    // The refused message was acknowledged: a restarted driver does not get it again. Nor
    // does the retained message run again when the resubscription replays it.
    assert!(driver.terminate().success(), "clean exit after SIGTERM:\n{}", driver.log());
    let driver = mqtt_driver(&hub, ONE, &broker, &[]);
    wait_ready(&hub, ONE, &driver).await;
    let later = json!({"text": "still there?", "id": "a-2"}).to_string();
    clients.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), later).await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(payload(&reply)["reply_to"], "alice/a-2");
    let status = hub.instance_status(ONE);
    assert_eq!(status["counters"]["denied"], 1, "the spoof came back");
    // The spoof, a-1, the retained message when published, a-2: not its replay.
    assert_eq!(status["counters"]["inbound"], 4, "{status}");
    assert!(driver.log().contains("retained message replayed"), "{}", driver.log());
    assert!(observer.next_within(Duration::from_millis(200)).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_acl_decides_who_may_publish_as_whom() {
    let acl = "pattern write channeld/mqtt.one/in/%u/#\n\
               pattern read channeld/mqtt.one/out/#\n\
               user bridge\n\
               topic read channeld/mqtt.one/in/#\n\
               topic write channeld/mqtt.one/out/#\n";
    let users = [("bridge", "bridge-pw"), ("alice", "alice-pw"), ("mallory", "mallory-pw")];
    let broker = Mosquitto::start_with(MosquittoOptions {
        users: users.iter().map(|(u, p)| ((*u).to_owned(), (*p).to_owned())).collect(),
        acl: Some(acl.into()),
        ..MosquittoOptions::default()
    });
    // Both are allowed by the hub: only the broker stands between mallory and alice's name.
    let hub = echo_hub(&["alice", "mallory"], &[ONE]);
    provision(&broker, ONE, Some(("bridge", "bridge-pw"))).await;
    let port = broker.port();
    let mut observer = MqttTestClient::connect_as(
        port,
        "observer",
        Some(("alice", "alice-pw")),
        &[&outbound_filter(ONE)],
    )
    .await;
    let mut alice =
        MqttTestClient::connect_as(port, "alice-phone", Some(("alice", "alice-pw")), &[]).await;
    let mut mallory =
        MqttTestClient::connect_as(port, "mallory-phone", Some(("mallory", "mallory-pw")), &[])
            .await;
    let credentials = tempfile::tempdir().unwrap();
    std::fs::write(credentials.path().join("mqtt-password"), "bridge-pw\n").unwrap();
    let credentials_dir = credentials.path().display().to_string();
    let driver = mqtt_driver(
        &hub,
        ONE,
        &broker,
        &[("CHANNELD_MQTT_USERNAME", "bridge"), ("CREDENTIALS_DIRECTORY", &credentials_dir)],
    );
    wait_ready(&hub, ONE, &driver).await;

    let spoof = json!({"text": "spoofed", "id": "x"}).to_string();
    mallory.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), spoof).await;
    let own = json!({"text": "mallory here", "id": "m"}).to_string();
    mallory.publish_confirmed(&inbound_topic(ONE, "mallory", "c1"), own).await;
    let genuine = json!({"text": "alice here", "id": "a"}).to_string();
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), genuine).await;
    let mut replied = vec![
        payload(&observer.next_message(MESSAGE_WITHIN).await)["reply_to"].clone(),
        payload(&observer.next_message(MESSAGE_WITHIN).await)["reply_to"].clone(),
    ];
    replied.sort_by_key(|v| v.to_string());
    assert_eq!(replied, vec![json!("alice/a"), json!("mallory/m")]);
    // Had the broker let the spoof through, the driver would have handed it over first.
    assert_eq!(hub.instance_status(ONE)["counters"]["inbound"], 2);
    assert!(!driver.log().contains("bridge-pw"), "the password reached the driver's log");
    let status = hub.ctl(&["status", "--json"]);
    assert!(!String::from_utf8_lossy(&status.stdout).contains("bridge-pw"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_makes_the_instance_unavailable_without_revealing_it() {
    let broker = Mosquitto::start_with(MosquittoOptions {
        users: vec![("bridge".into(), "right-pw".into())],
        ..MosquittoOptions::default()
    });
    let hub = echo_hub(&["alice"], &[ONE]);
    let driver = mqtt_driver(
        &hub,
        ONE,
        &broker,
        &[("CHANNELD_MQTT_USERNAME", "bridge"), ("CHANNELD_MQTT_PASSWORD", "wrong-pw")],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let status = hub.instance_status(ONE);
        // Refused credentials need an operator: Unavailable, with a machine-readable reason.
        if status["connected"] == true && status["health"]["state"] == "Unavailable" {
            let detail = status["health"]["detail"].as_str().unwrap_or_default().to_owned();
            if detail.contains("BadUserNamePassword") || detail.contains("NotAuthorized") {
                break status;
            }
        }
        assert!(Instant::now() < deadline, "no auth failure in health: {status}\n{}", driver.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(status["health"]["status"]["reason"], "auth_rejected", "{status}");
    assert_eq!(status["health"]["status"]["auth"], "rejected", "{status}");
    assert!(!status.to_string().contains("wrong-pw"), "{status}");
    let health = hub.ctl(&["health", ONE]);
    let text = String::from_utf8_lossy(&health.stdout);
    assert!(text.starts_with("mqtt.one Unavailable: broker mqtt://127.0.0.1:"), "{text}");
    assert!(!text.contains("wrong-pw") && !driver.log().contains("wrong-pw"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proactive_send_is_receipted_after_the_broker_took_it() {
    let broker = Mosquitto::start();
    let mut broker = broker;
    let hub = echo_hub(&["alice"], &[ONE]);
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &[&outbound_filter(ONE)]).await;
    let driver = mqtt_driver(&hub, ONE, &broker, &[("CHANNELD_MQTT_PUBLISH_TIMEOUT_SECONDS", "1")]);
    wait_ready(&hub, ONE, &driver).await;

    let out = hub.ctl(&["send", ONE, "--conversation", "ops", "deploy finished"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let message_id = stdout
        .strip_prefix("receipted ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no receipt in {stdout:?}"))
        .to_owned();
    assert!(message_id.starts_with("send-"), "{message_id}");
    let sent = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(sent.topic, "channeld/mqtt.one/out/ops");
    let sent = payload(&sent);
    assert_eq!(sent["text"], "deploy finished");
    assert_eq!(sent["id"], message_id.as_str());
    assert_eq!(sent["reply_to"], Value::Null);

    // A conversation that is not one topic level is refused, not published elsewhere.
    let out = hub.ctl(&["send", ONE, "--conversation", "ops/#", "escape"]);
    assert_eq!(out.status.code(), Some(6), "{}", String::from_utf8_lossy(&out.stderr));

    // With the broker down the send fails (nothing was published) once the publish timeout
    // has passed, and works again after the broker is back.
    tokio::task::block_in_place(|| broker.stop());
    let out = hub.ctl(&["send", ONE, "--conversation", "ops", "while down"]);
    assert_eq!(out.status.code(), Some(6), "{}", String::from_utf8_lossy(&out.stderr));
    tokio::task::block_in_place(|| broker.start_again());
    wait_ready(&hub, ONE, &driver).await;
    let out = hub.ctl(&["send", ONE, "--conversation", "ops", "back again"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let back = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(payload(&back)["text"], "back again");
    assert!(observer.next_within(Duration::from_millis(200)).await.is_none(), "nothing else");
}

fn runs(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log).unwrap_or_default().lines().map(str::to_owned).collect()
}

/// What interrupts the stream of messages.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    /// mosquitto stopped and started again on the same port (sessions persisted).
    BrokerRestart,
    /// The driver killed with SIGKILL and started again.
    DriverKill,
}

/// Publishes `TOTAL` messages with ids while `disruption` happens in the middle, then checks
/// that every message ran exactly once.
///
/// The publisher stays at most `AHEAD` messages ahead of the completed runs, so the
/// disruption finds messages in every stage: being published, queued in the broker, in flight
/// to the driver, waiting for the hub, running.
async fn thousand_messages_across(disruption: Disruption) {
    const TOTAL: usize = 1000;
    const AHEAD: usize = 150;
    const DISRUPT_AFTER_RUNS: usize = 400;
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("runs.log");
    let agent = counting_agent(dir.path(), &log, "0");
    let mut broker = Mosquitto::start();
    // The broker hands the driver up to 20 unacknowledged messages; with the hub's default of
    // 4 runs in flight the others bounce as `busy` and back off for up to 5 s each, which is
    // correct but slow. Room for the broker's whole window keeps the test fast.
    let hub = HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\nmax_inflight = 32\n",
        agent.display()
    ));
    provision(&broker, ONE, None).await;
    let mut driver = mqtt_driver(&hub, ONE, &broker, &[]);
    wait_ready(&hub, ONE, &driver).await;

    let published = Arc::new(AtomicUsize::new(0));
    let port = broker.port();
    let publisher = tokio::spawn({
        let published = published.clone();
        let log = log.clone();
        async move {
            let mut alice = MqttTestClient::connect(port, "alice-phone", &[]).await;
            for n in 0..TOTAL {
                while runs(&log).len() + AHEAD < n {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let body = json!({"text": format!("message {n}"), "id": n.to_string()});
                let topic = inbound_topic(ONE, "alice", &format!("c{}", n % 5));
                alice.publish_confirmed(&topic, body.to_string()).await;
                published.store(n + 1, Ordering::SeqCst);
            }
            alice
        }
    });

    let deadline = Instant::now() + Duration::from_secs(180);
    while runs(&log).len() < DISRUPT_AFTER_RUNS {
        assert!(Instant::now() < deadline, "runs stalled:\n{}", driver.log());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let runs_before = runs(&log).len();
    match disruption {
        Disruption::BrokerRestart => tokio::task::block_in_place(|| broker.restart()),
        Disruption::DriverKill => {
            driver.kill();
            driver = mqtt_driver(&hub, ONE, &broker, &[]);
        }
    }
    eprintln!(
        "{disruption:?} after {} published, {runs_before} runs",
        published.load(Ordering::SeqCst)
    );
    let mut alice = publisher.await.expect("publisher task");

    // A last message: once it has run and nothing is in flight, every earlier one has been
    // handed over (the driver forwards in order) and finished.
    let sentinel = json!({"text": "the end", "id": "sentinel"}).to_string();
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c0"), sentinel).await;
    loop {
        let done = runs(&log);
        if done.len() > TOTAL && done.iter().any(|id| id == "alice/sentinel") {
            let status = hub.instance_status(ONE);
            if status["in_flight"] == 0 && status["queued"] == 0 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} runs after {:?}; driver log:\n{}",
            done.len(),
            TOTAL + 1,
            started.elapsed(),
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let done = runs(&log);
    let distinct: HashSet<&str> = done.iter().map(String::as_str).collect();
    let expected: HashSet<String> =
        (0..TOTAL).map(|n| format!("alice/{n}")).chain(["alice/sentinel".to_owned()]).collect();
    let missing: Vec<&String> =
        expected.iter().filter(|id| !distinct.contains(id.as_str())).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let repeated = done.len() - distinct.len();
    assert_eq!(repeated, 0, "{repeated} runs repeated an event id after {disruption:?}");
    assert_eq!(distinct.len(), TOTAL + 1);
    let duplicates = driver.log().matches("duplicate=true").count();
    eprintln!(
        "{disruption:?}: {} runs, none lost or repeated ({duplicates} redeliveries the hub \
         recognised), in {:?}",
        done.len(),
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_amid_1000_messages_loses_none_and_repeats_no_run() {
    thousand_messages_across(Disruption::BrokerRestart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_sigkill_amid_1000_messages_loses_none_and_repeats_no_run() {
    thousand_messages_across(Disruption::DriverKill).await;
}

/// What a burst of messages came to.
#[derive(Debug)]
struct Burst {
    /// Distinct replies that came back.
    replied: usize,
    /// From the first publish to the last reply.
    took: Duration,
    /// How often the broker logged that it dropped messages for a client.
    broker_drops: usize,
    busy: u64,
}

/// Publishes `total` QoS 1 messages in 16 conversations as fast as the broker takes them,
/// with the driver connected, on a broker queueing `queue` per client. Waits for every reply,
/// or, when `all` is false, until replies stop coming for 3 s (those left out are lost).
async fn burst(total: usize, queue: BrokerQueue, all: bool) -> Burst {
    let broker = Mosquitto::start_with(MosquittoOptions { queue, ..MosquittoOptions::default() });
    // The hub takes the burst into its run queue (`max_queued`) rather than answering `busy`,
    // so the driver acknowledges each message as soon as the hub has it. The ledger is off:
    // what is measured is the broker's queue and the driver's intake, not fsyncs (the
    // durable path is covered by the 1,000-message tests above).
    let hub = HubProcess::start_without_ledger(
        tempfile::tempdir().unwrap(),
        &format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\nmax_queued = {total}\n"),
    );
    provision(&broker, ONE, None).await;
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &[&outbound_filter(ONE)]).await;
    let mut alice = MqttTestClient::connect(broker.port(), "alice-phone", &[]).await;
    let driver = mqtt_driver(&hub, ONE, &broker, &[("CHANNELD_LOG", "warn")]);
    wait_ready(&hub, ONE, &driver).await;

    let messages: Vec<(String, Vec<u8>)> = (0..total)
        .map(|n| {
            let topic = inbound_topic(ONE, "alice", &format!("c{}", n % 16));
            (topic, json!({"text": format!("burst {n}"), "id": n.to_string()}).to_string().into())
        })
        .collect();
    let started = Instant::now();
    alice.publish_burst(messages).await;
    let published = started.elapsed();

    let mut replied = HashSet::new();
    let mut last = started.elapsed();
    let quiet = Duration::from_secs(3);
    let deadline = Instant::now() + Duration::from_secs(45);
    while replied.len() < total {
        let wait = if all { deadline.saturating_duration_since(Instant::now()) } else { quiet };
        let Some(reply) = observer.next_within(wait).await else {
            assert!(!all, "{} of {total} replies within 45 s:\n{}", replied.len(), driver.log());
            break;
        };
        let id = payload(&reply)["reply_to"].as_str().unwrap_or_default().to_owned();
        replied.insert(id);
        last = started.elapsed();
    }
    eprintln!("published {total} in {published:?}");
    let busy = hub.instance_status(ONE)["counters"]["busy"].as_u64().unwrap_or_default();
    let broker_drops = broker.log().matches("Outgoing messages are being dropped").count();
    Burst { replied: replied.len(), took: last, broker_drops, busy }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10000_message_burst_loses_nothing_with_room_in_the_broker_queue() {
    const TOTAL: usize = 10_000;
    let roomy = burst(TOTAL, BrokerQueue::Messages(20_000), true).await;
    eprintln!(
        "burst of {TOTAL}, broker max_queued_messages 20000: {} replied, {} lost, {:.0} msg/s, \
         {} busy answers, {} broker drop warnings",
        roomy.replied,
        TOTAL - roomy.replied,
        TOTAL as f64 / roomy.took.as_secs_f64(),
        roomy.busy,
        roomy.broker_drops
    );
    assert_eq!(roomy.replied, TOTAL, "messages lost");
    assert_eq!(roomy.broker_drops, 0);
    assert_eq!(roomy.busy, 0, "the hub bounced messages instead of queueing them");

    // The broker's default queue (1,000 per client): what it drops is only measured.
    let default = burst(TOTAL, BrokerQueue::BrokerDefault, false).await;
    eprintln!(
        "burst of {TOTAL}, broker default queue: {} replied, {} lost, {:.0} msg/s, {} busy \
         answers, {} broker drop warnings",
        default.replied,
        TOTAL - default.replied,
        default.replied as f64 / default.took.as_secs_f64(),
        default.busy,
        default.broker_drops
    );
}

/// How often mosquitto has logged a connection for the client id of `instance`.
fn broker_connections(broker: &Mosquitto, instance: &str) -> usize {
    broker.log().matches(&format!(" as channeld-{instance} ")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_driver_the_hub_refuses_never_takes_over_the_broker_session() {
    let broker = Mosquitto::start();
    let hub = echo_hub(&["alice"], &[ONE]);
    provision(&broker, ONE, None).await;
    let first = mqtt_driver(&hub, ONE, &broker, &[]);
    wait_ready(&hub, ONE, &first).await;
    // Mosquitto writes its log after the CONNACK: wait until it shows the provisioning client
    // and the first driver, so the count below is not taken before its line lands.
    let deadline = Instant::now() + Duration::from_secs(10);
    while broker_connections(&broker, ONE) < 2 {
        assert!(Instant::now() < deadline, "first driver never logged:\n{}", broker.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let connections = broker_connections(&broker, ONE);

    // The same instance again: same socket, same MQTT client id.
    let second = mqtt_driver(&hub, ONE, &broker, &[]);
    // Refused `already_connected`, it retries; after its second refusal it has had every
    // chance to reach the broker (before the fix it connected at once and knocked the first
    // driver off).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !second.log().contains("the hub still refuses this driver") {
        assert!(Instant::now() < deadline, "no second refusal:\n{}", second.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Both processes log to the one file of the instance: only the first ever connected.
    assert_eq!(second.log().matches("connected to the broker").count(), 1, "{}", second.log());
    assert_eq!(broker_connections(&broker, ONE), connections, "{}", broker.log());
    assert!(
        !broker.log().contains("already connected, closing old connection"),
        "{}",
        broker.log()
    );

    // The first driver still serves, undisturbed.
    let mut observer =
        MqttTestClient::connect(broker.port(), "observer", &[&outbound_filter(ONE)]).await;
    let mut alice = MqttTestClient::connect(broker.port(), "alice-phone", &[]).await;
    let ping = json!({"text": "still me", "id": "1"}).to_string();
    alice.publish_confirmed(&inbound_topic(ONE, "alice", "c1"), ping).await;
    let reply = observer.next_message(MESSAGE_WITHIN).await;
    assert_eq!(payload(&reply)["text"], "still me");
    assert_eq!(hub.instance_status(ONE)["health"]["state"], "Ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_for_the_wrong_channel_exits_78_without_touching_the_broker() {
    let broker = Mosquitto::start();
    let hub = echo_hub(&["alice"], &[ONE]);
    let before = broker_connections(&broker, TWO);
    // Channel `mqtt.two` on the socket that serves `mqtt.one`.
    let mut driver = mqtt_driver(&hub, ONE, &broker, &[("CHANNELD_CHANNEL_ID", TWO)]);
    let status = driver.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(78), "{}", driver.log());
    assert!(driver.log().contains("channel_mismatch"), "{}", driver.log());
    assert_eq!(broker_connections(&broker, TWO), before, "{}", broker.log());
}

#[test]
fn conflicting_launch_settings_and_an_unusable_socket_exit_78_with_the_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("mqtt.one.sock");
    let socket = socket.to_str().expect("utf-8 path");
    let directory = dir.path().to_str().expect("utf-8 path");
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[
                ("CHANNELD_CHANNEL_ID", ONE),
                ("CORTEXFS_CHANNEL_ID", TWO),
                ("CHANNELD_SOCKET", socket),
            ],
            "CHANNELD_CHANNEL_ID and CORTEXFS_CHANNEL_ID disagree",
        ),
        (
            &[
                ("CHANNELD_CHANNEL_ID", ONE),
                ("CHANNELD_SOCKET", socket),
                ("CORTEXFS_CHANNEL_SOCKET", "/tmp/other.sock"),
            ],
            "CHANNELD_SOCKET and CORTEXFS_CHANNEL_SOCKET disagree",
        ),
        (
            &[("CHANNELD_CHANNEL_ID", ONE), ("CHANNELD_SOCKET", "")],
            "CHANNELD_SOCKET is invalid: is empty",
        ),
        (&[("CHANNELD_CHANNEL_ID", ONE), ("CHANNELD_SOCKET", directory)], "is a directory"),
    ];
    for (env, reason) in cases {
        let out = Command::new(workspace_bin("channeld-mqtt"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_MQTT_URL", "mqtt://127.0.0.1:1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run channeld-mqtt");
        let log = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{env:?}: {log}");
        assert!(log.contains(reason), "{env:?}: {log}");
    }
}
