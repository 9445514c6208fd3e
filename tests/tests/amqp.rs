//! The AMQP driver end to end: real `channeld`, real `channeld-amqp` processes and a real
//! RabbitMQ node. Round trips with the echo runtime, two instances of the family, senders
//! that claim someone else, proactive and unroutable sends, and 1,000 messages through broker
//! outages and driver crashes with every run counted by an exec agent.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::rabbitmq::{AmqpTestClient, RabbitMq, body_text, property};
use channeld_tests::{HubProcess, workspace_bin, write_script};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation};

/// How long a round trip may take.
const REPLY_WITHIN: Duration = Duration::from_secs(20);
/// How long a driver may take to connect to the broker and the hub.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// Messages in the outage tests.
const LOAD: usize = 1000;

/// A `channeld-amqp` process. Killed on drop; its log is printed when a test fails.
struct DriverProcess {
    child: Child,
    log: PathBuf,
}

impl DriverProcess {
    fn start(
        hub: &HubProcess,
        broker: &RabbitMq,
        channel: &str,
        settings: &[(&str, &str)],
    ) -> Self {
        let log = unique_log(hub.dir.path(), channel);
        let file = std::fs::File::create(&log).expect("driver log");
        let child = Command::new(workspace_bin("channeld-amqp"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", channel)
            .env("CHANNELD_SOCKET", hub.socket(channel))
            .env("CHANNELD_LOG", std::env::var("CHANNELD_LOG").unwrap_or_else(|_| "debug".into()))
            .env("CHANNELD_AMQP_URL", broker.guest_url())
            .envs(settings.iter().map(|(k, v)| (format!("CHANNELD_AMQP_{k}"), *v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn channeld-amqp");
        Self { child, log }
    }

    /// SIGKILL: a crash with nothing flushed or acknowledged.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A log path not used by an earlier process of the same instance.
fn unique_log(dir: &Path, channel: &str) -> PathBuf {
    (0..)
        .map(|n| dir.join(format!("{channel}-driver-{n}.log")))
        .find(|path| !path.exists())
        .expect("a free log name")
}

impl Drop for DriverProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}

/// Runs `channelctl` on a blocking thread.
async fn ctl(hub: &HubProcess, args: &[&str]) -> Output {
    let socket = hub.control_socket();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        channeld_tests::channelctl(&socket, &refs)
    })
    .await
    .expect("channelctl thread")
}

/// Polls `channelctl health <instance>` until its line contains `state`.
async fn wait_health(hub: &HubProcess, instance: &str, state: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        let out = ctl(hub, &["health", instance]).await;
        last = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if last.contains(&format!("{instance} {state}")) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{instance} was not {state} within {limit:?}; last health: {last:?}");
}

fn headers(pairs: &[(&str, &str)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in pairs {
        table.insert((*key).into(), AMQPValue::LongString((*value).into()));
    }
    table
}

fn request(user: Option<&str>, message_id: &str, reply_to: &str) -> BasicProperties {
    let properties = BasicProperties::default()
        .with_message_id(message_id.into())
        .with_reply_to(reply_to.into())
        .with_correlation_id(format!("corr-{message_id}").into());
    match user {
        Some(user) => properties.with_user_id(user.into()),
        None => properties,
    }
}

async fn published(
    client: &AmqpTestClient,
    exchange: &str,
    key: &str,
    props: BasicProperties,
    body: &str,
) {
    let confirmation = client
        .publish_to(exchange, key, props, body.as_bytes())
        .await
        .unwrap_or_else(|err| panic!("publish to {exchange}/{key} refused: {err}"));
    assert_eq!(confirmation, Confirmation::Ack(None), "publish to {exchange}/{key} not routed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_through_two_instances_and_spoofed_senders_are_denied() {
    let broker = tokio::task::block_in_place(|| {
        let broker = RabbitMq::start();
        broker.add_user("alice", "alice-pw");
        broker.add_user("mallory", "mallory-pw");
        broker
    });
    let hub = HubProcess::start(
        "[instance.\"amqp.one\"]\nallow = [\"alice\"]\n[instance.\"amqp.two\"]\nallow = [\"alice\"]\n",
    );
    // One: bound to a direct exchange, strict identity, rejects dead-lettered.
    let _one = DriverProcess::start(
        &hub,
        &broker,
        "amqp.one",
        &[
            ("QUEUE", "one.in"),
            ("EXCHANGE", "chat"),
            ("EXCHANGE_TYPE", "direct"),
            ("BINDINGS", "one"),
            ("DEAD_LETTER_EXCHANGE", "one.dlx"),
            ("DEAD_LETTER_QUEUE", "one.dead"),
        ],
    );
    // Two: the default exchange, and a trusted sender header for messages without user_id.
    let _two = DriverProcess::start(
        &hub,
        &broker,
        "amqp.two",
        &[
            ("QUEUE", "two.in"),
            ("TRUST", "header:x-sender"),
            ("DEAD_LETTER_EXCHANGE", "two.dlx"),
            ("DEAD_LETTER_QUEUE", "two.dead"),
        ],
    );
    let health = wait_health(&hub, "amqp.one", "Ready", READY_WITHIN).await;
    assert!(health.starts_with("amqp.one Ready: consuming queue one.in"), "{health}");
    wait_health(&hub, "amqp.two", "Ready", READY_WITHIN).await;

    let alice = AmqpTestClient::connect(&broker.url("alice", "alice-pw")).await;
    alice.declare_queue("alice.replies").await;
    let mut replies = alice.collect("alice.replies").await;

    // Round trip through the exchange binding of instance one.
    published(&alice, "chat", "one", request(Some("alice"), "a-1", "alice.replies"), "ping one")
        .await;
    let reply = replies.expect_within(REPLY_WITHIN, "echo from amqp.one").await;
    assert_eq!(body_text(&reply), "ping one");
    assert_eq!(property(reply.properties.correlation_id()), "corr-a-1");
    assert_eq!(property(reply.properties.message_id()), "amqp.one/reply/a-1");
    assert_eq!(property(reply.properties.app_id()), "amqp.one");

    // Instance two is independent: its own queue, its own reply.
    published(&alice, "", "two.in", request(Some("alice"), "a-2", "alice.replies"), "ping two")
        .await;
    let reply = replies.expect_within(REPLY_WITHIN, "echo from amqp.two").await;
    assert_eq!(body_text(&reply), "ping two");
    assert_eq!(property(reply.properties.message_id()), "amqp.two/reply/a-2");

    // Mallory names alice in a header: the broker-checked user_id wins, the hub denies mallory,
    // and the message is dead-lettered, on both instances (even the one trusting the header
    // for messages without user_id).
    let mallory = AmqpTestClient::connect(&broker.url("mallory", "mallory-pw")).await;
    mallory.declare_queue("mallory.replies").await;
    let mut mallory_replies = mallory.collect("mallory.replies").await;
    let claims_alice = |id: &str| {
        request(Some("mallory"), id, "mallory.replies")
            .with_headers(headers(&[("x-sender", "alice")]))
    };
    published(&mallory, "chat", "one", claims_alice("s-1"), "i am alice").await;
    published(&mallory, "", "two.in", claims_alice("s-2"), "i am alice too").await;
    // Without a user_id, the strict instance has no sender at all.
    let anonymous =
        request(None, "s-3", "mallory.replies").with_headers(headers(&[("x-sender", "alice")]));
    published(&mallory, "", "one.in", anonymous, "trust me").await;

    let dead_watcher = AmqpTestClient::connect(&broker.guest_url()).await;
    let mut one_dead = dead_watcher.collect("one.dead").await;
    let mut two_dead = dead_watcher.collect("two.dead").await;
    let mut dead_one = HashSet::new();
    for _ in 0..2 {
        let dead = one_dead.expect_within(REPLY_WITHIN, "dead-lettered on amqp.one").await;
        dead_one.insert(property(dead.properties.message_id()));
    }
    assert_eq!(dead_one, HashSet::from(["s-1".to_owned(), "s-3".to_owned()]));
    let dead = two_dead.expect_within(REPLY_WITHIN, "dead-lettered on amqp.two").await;
    assert_eq!(property(dead.properties.message_id()), "s-2");
    assert!(
        mallory_replies.next_within(Duration::from_secs(1)).await.is_none(),
        "a denied sender got a reply"
    );

    // Claiming alice in user_id itself is refused by RabbitMQ before any driver sees it.
    let forger = AmqpTestClient::connect(&broker.url("mallory", "mallory-pw")).await;
    let forged =
        forger.publish("one.in", request(Some("alice"), "s-4", "mallory.replies"), b"forged").await;
    let err = forged.expect_err("the broker must refuse a user_id that is not the connection's");
    assert!(err.to_string().contains("user_id"), "{err}");

    // With the trust mode of instance two, a message without user_id names its sender by header.
    let trusted =
        request(None, "t-1", "alice.replies").with_headers(headers(&[("x-sender", "alice")]));
    published(&alice, "", "two.in", trusted, "via a trusted gateway").await;
    let reply = replies.expect_within(REPLY_WITHIN, "echo for the trusted header").await;
    assert_eq!(body_text(&reply), "via a trusted gateway");

    let status = ctl(&hub, &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status json");
    let denied: u64 = status["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .map(|inst| inst["counters"]["denied"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(denied, 2, "the hub denied mallory on each instance once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proactive_sends_are_receipted_and_unroutable_ones_fail() {
    let broker = tokio::task::block_in_place(RabbitMq::start);
    let hub = HubProcess::start(
        "[instance.\"amqp.one\"]\nallow = [\"guest\"]\n[instance.\"amqp.two\"]\nallow = [\"guest\"]\n",
    );
    let _one = DriverProcess::start(&hub, &broker, "amqp.one", &[("QUEUE", "one.in")]);
    // Two publishes proactive sends to an exchange that does not exist.
    let _two = DriverProcess::start(
        &hub,
        &broker,
        "amqp.two",
        &[("QUEUE", "two.in"), ("OUTBOUND_EXCHANGE", "no.such.exchange")],
    );
    wait_health(&hub, "amqp.one", "Ready", READY_WITHIN).await;
    wait_health(&hub, "amqp.two", "Ready", READY_WITHIN).await;
    let client = AmqpTestClient::connect(&broker.guest_url()).await;
    client.declare_queue("guest.inbox").await;
    let mut inbox = client.collect("guest.inbox").await;

    let out =
        ctl(&hub, &["send", "amqp.one", "--conversation", "guest.inbox", "hello from the agent"])
            .await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("receipted amqp.one/out/"), "{stdout}");
    let message = inbox.expect_within(REPLY_WITHIN, "the proactive send").await;
    assert_eq!(body_text(&message), "hello from the agent");
    let message_id = property(message.properties.message_id());
    assert!(stdout.contains(&message_id), "receipt {stdout:?} names {message_id}");
    let conversation = message
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-conversation").cloned());
    assert_eq!(conversation, Some(AMQPValue::LongString("guest.inbox".into())));

    // Mandatory publish, no queue bound for the key: returned by the broker, a failed receipt.
    let out = ctl(&hub, &["send", "amqp.one", "--conversation", "nobody.listens", "anyone?"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(6), "unroutable must fail: {stderr}");
    assert!(stderr.contains("send_failed") && stderr.contains("unroutable"), "{stderr}");

    // An exchange that does not exist: the broker closes the publishing channel; the send
    // fails and the driver's channel recovers (the echo reply below is published on it).
    let out = ctl(&hub, &["send", "amqp.two", "--conversation", "guest.inbox", "lost"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(6), "missing exchange must fail: {stderr}");
    published(&client, "", "two.in", request(Some("guest"), "g-1", "guest.inbox"), "still there?")
        .await;
    let reply = inbox.expect_within(REPLY_WITHIN, "echo after the failed send").await;
    assert_eq!(body_text(&reply), "still there?");
    assert!(inbox.next_within(Duration::from_millis(500)).await.is_none(), "a failed send arrived");
}

/// A broker, a hub whose exec agent appends each run's event id to a file, and 1,000
/// persistent messages waiting in the driver's queue.
struct LoadRig {
    broker: RabbitMq,
    hub: HubProcess,
    runs: PathBuf,
    _dir: tempfile::TempDir,
}

const LOAD_CHANNEL: &str = "amqp.load";
const LOAD_QUEUE: &str = "load.in";

impl LoadRig {
    async fn start() -> Self {
        let broker = tokio::task::block_in_place(RabbitMq::start);
        let dir = tempfile::tempdir().expect("temp dir");
        let runs = dir.path().join("runs.txt");
        std::fs::write(&runs, "").expect("runs file");
        let agent = write_script(
            dir.path(),
            "agent.sh",
            &format!(
                "IFS= read -r envelope\n\
                 id=$(printf '%s\\n' \"$envelope\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
                 printf '%s\\n' \"$id\" >> '{}'\n",
                runs.display()
            ),
        );
        let hub = HubProcess::start(&format!(
            "[runtime.counter]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
             [instance.\"{LOAD_CHANNEL}\"]\nallow = [\"guest\"]\nruntime = \"counter\"\nmax_inflight = 32\n",
            agent.display()
        ));
        let client = AmqpTestClient::connect(&broker.guest_url()).await;
        client.declare_queue(LOAD_QUEUE).await;
        for n in 0..LOAD {
            let props = BasicProperties::default()
                .with_user_id("guest".into())
                .with_message_id(format!("m-{n:04}").into())
                .with_headers(headers(&[("x-conversation", &format!("c-{}", n % 8))]));
            published(&client, "", LOAD_QUEUE, props, &format!("message {n}")).await;
        }
        Self { broker, hub, runs, _dir: dir }
    }

    fn driver(&self) -> DriverProcess {
        DriverProcess::start(
            &self.hub,
            &self.broker,
            LOAD_CHANNEL,
            &[("QUEUE", LOAD_QUEUE), ("PREFETCH", "32")],
        )
    }

    fn runs(&self) -> Vec<String> {
        std::fs::read_to_string(&self.runs)
            .unwrap_or_default()
            .lines()
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Waits until the agent has run at least `count` times.
    async fn wait_runs(&self, count: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.runs().len() < count {
            assert!(
                Instant::now() < deadline,
                "only {} runs within {limit:?}, expected {count}",
                self.runs().len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every message has run and the queue is empty with nothing unacknowledged,
    /// then checks that each message ran exactly once.
    async fn assert_exactly_once(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let distinct: HashSet<String> = self.runs().into_iter().collect();
            if distinct.len() >= LOAD {
                let counts = tokio::task::block_in_place(|| self.broker.queue_counts(LOAD_QUEUE));
                if counts == Some((0, 0)) {
                    break;
                }
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = (0..LOAD)
                    .map(|n| format!("m-{n:04}"))
                    .filter(|id| !distinct.contains(id))
                    .collect();
                let counts = tokio::task::block_in_place(|| self.broker.queue_counts(LOAD_QUEUE));
                panic!(
                    "{} of {LOAD} messages ran within {limit:?} (queue ready/unacked: {counts:?}); missing: {missing:?}",
                    distinct.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // A late duplicate could only come from a message still queued or unacknowledged at
        // the broker (both zero above) or a run still in flight at the hub: once none is,
        // no further run can start and the counts below are final.
        loop {
            let status = self.hub.instance_status(LOAD_CHANNEL);
            let counts = tokio::task::block_in_place(|| self.broker.queue_counts(LOAD_QUEUE));
            if status["in_flight"] == 0 && status["queued"] == 0 && counts == Some((0, 0)) {
                break;
            }
            assert!(Instant::now() < deadline, "runs still in flight: {status}, queue {counts:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let runs = self.runs();
        let mut per_event: BTreeMap<&str, usize> = BTreeMap::new();
        for id in &runs {
            *per_event.entry(id.as_str()).or_default() += 1;
        }
        let lost: Vec<String> = (0..LOAD)
            .map(|n| format!("m-{n:04}"))
            .filter(|id| !per_event.contains_key(id.as_str()))
            .collect();
        let duplicated: Vec<(&str, usize)> =
            per_event.iter().filter(|(_, n)| **n > 1).map(|(id, n)| (*id, *n)).collect();
        assert!(lost.is_empty(), "lost messages: {lost:?}");
        assert!(duplicated.is_empty(), "duplicate runs: {duplicated:?}");
        assert_eq!(runs.len(), LOAD);
        // How many messages the broker delivered again after the hub had taken them: the
        // copies the ledger answered without a second run.
        let replays = self.hub.log().matches("redelivered event; replaying").count();
        eprintln!(
            "{LOAD} messages ran once each; {replays} redeliveries were answered from the ledger"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outages_mid_stream_lose_nothing_and_run_nothing_twice() {
    let mut rig = LoadRig::start().await;
    let _driver = rig.driver();

    rig.wait_runs(250, Duration::from_secs(60)).await;
    tokio::task::block_in_place(|| rig.broker.close_all_connections());

    rig.wait_runs(600, Duration::from_secs(90)).await;
    tokio::task::block_in_place(|| rig.broker.stop_node());
    let health = wait_health(&rig.hub, LOAD_CHANNEL, "Degraded", Duration::from_secs(20)).await;
    assert!(health.contains("recovering") || health.contains("unreachable"), "{health}");
    tokio::task::block_in_place(|| rig.broker.start_node());
    wait_health(&rig.hub, LOAD_CHANNEL, "Ready", READY_WITHIN).await;

    rig.assert_exactly_once(Duration::from_secs(180)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_killed_mid_stream_loses_nothing_and_runs_nothing_twice() {
    let rig = LoadRig::start().await;
    let mut driver = rig.driver();

    rig.wait_runs(300, Duration::from_secs(60)).await;
    driver.kill9();
    driver = rig.driver();

    rig.wait_runs(700, Duration::from_secs(90)).await;
    driver.kill9();
    let _driver = rig.driver();

    rig.assert_exactly_once(Duration::from_secs(180)).await;
}
