//! Past one machine: the hub's `amqp` runtime and `channeld-worker`s on a real RabbitMQ.
//! 1,000 runs over two workers with one SIGKILLed mid-stream, and runs across a broker
//! restart: every inbound is answered once, none is lost, and a run repeats only as a
//! flagged redelivery. Deltas, tool reports, reply metadata, the metadata environment and
//! `CHANNELD_LOCATOR` reach a worker's agent and come back as they do with the exec runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use channeld_protocol::Frame;
use channeld_protocol::frame::Inbound;
use channeld_tests::peer::{caps, id, message, receipt_for};
use channeld_tests::rabbitmq::RabbitMq;
use channeld_tests::{HubProcess, RawPeer, workspace_bin, write_script};

const ONE: &str = "test.one";
/// Longest wait for one frame: covers a broker restart and the clients' reconnects.
const QUIET_LIMIT: Duration = Duration::from_secs(60);

/// A slow agent: logs `run_id redelivered`, sleeps 20 ms, answers `done <event id>`.
fn agent(dir: &Path, log: &Path) -> PathBuf {
    write_script(
        dir,
        "agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo \"$CHANNELD_RUN_ID $CHANNELD_REDELIVERED\" >> '{}'\n\
             sleep 0.02\n\
             echo \"done $id\"\n",
            log.display()
        ),
    )
}

fn hub(url: &str, queue: &str) -> HubProcess {
    HubProcess::start_with_env(
        &format!(
            "[runtime.remote]\nkind = \"amqp\"\nurl = \"env:SCALE_TEST_AMQP_URL\"\n\
             queue = \"{queue}\"\nreply_queue = \"{queue}.replies\"\ntimeout_secs = 120\n\
             [instance.\"{ONE}\"]\nallow_all = true\nruntime = \"remote\"\n\
             max_inflight = 32\nmax_queued = 2000\n"
        ),
        &[("SCALE_TEST_AMQP_URL", url)],
    )
}

struct Worker {
    child: Child,
}

impl Worker {
    fn start(url: &str, queue: &str, agent: &Path, log: &Path) -> Self {
        let out = std::fs::File::create(log).expect("worker log");
        let child = Command::new(workspace_bin("channeld-worker"))
            .args(["--queue", queue, "--concurrency", "8", "--timeout-secs", "30", "--"])
            .arg(agent)
            .env("CHANNELD_AMQP_URL", url)
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .expect("start channeld-worker");
        Self { child }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `count` inbound messages (one conversation each) and reads until every one was
/// answered, acknowledging each reply with a receipt; calls `midway` once after `at` replies.
/// Returns the replies' texts by event id (all of them, duplicates included).
async fn drive(
    hub: &HubProcess,
    count: usize,
    at: usize,
    midway: impl FnOnce(),
) -> BTreeMap<String, Vec<String>> {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    let sink = driver.sink.clone();
    let sender = tokio::spawn(async move {
        for n in 0..count {
            let event = format!("e-{n}");
            let frame = Frame::Inbound(Inbound {
                event_id: id(&event),
                message: message(ONE, &event, "alice", &format!("c{n}"), "work"),
            });
            sink.send(&frame).await.expect("send inbound");
        }
    });
    let mut replies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut midway = Some(midway);
    let mut answered = 0;
    while answered < count {
        let frame = match tokio::time::timeout(QUIET_LIMIT, driver.reader.next()).await {
            Ok(Ok(Some(Ok(frame)))) => frame,
            other => panic!(
                "after {answered} of {count} replies: no frame ({other:?})\n--- hub log ---\n{}",
                hub.log()
            ),
        };
        match frame {
            Frame::Deliver(delivery) => {
                let conversation = delivery.message.target.conversation.to_string();
                let event = delivery.request_id.to_string();
                let receipt =
                    receipt_for(ONE, &delivery.request_id, &conversation, &format!("p-{event}"));
                driver.send(receipt).await;
                let entry = replies.entry(event).or_default();
                entry.push(delivery.message.body.text_str().to_owned());
                if entry.len() == 1 {
                    answered += 1;
                    if answered == at {
                        (midway.take().expect("once"))();
                    }
                }
            }
            Frame::Error(err) => panic!("a run failed: {err:?}\n--- hub log ---\n{}", hub.log()),
            Frame::Accepted(_) | Frame::Event(_) | Frame::Health(_) => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
    sender.await.expect("sender");
    // Anything owed arrives now: a second reply to an event would be a repeat.
    while let Ok(Ok(Some(Ok(frame)))) =
        tokio::time::timeout(Duration::from_millis(500), driver.reader.next()).await
    {
        if let Frame::Deliver(delivery) = frame {
            replies
                .entry(delivery.request_id.to_string())
                .or_default()
                .push(delivery.message.body.text_str().to_owned());
        }
    }
    replies
}

/// Every event answered exactly once with its own reply.
fn assert_all_answered_once(replies: &BTreeMap<String, Vec<String>>, count: usize) {
    assert_eq!(replies.len(), count, "every inbound is answered");
    for n in 0..count {
        let event = format!("e-{n}");
        assert_eq!(replies[&event], vec![format!("done {event}")], "{event}");
    }
}

/// The agents' log: each run id's starts; a second start must be a flagged redelivery.
fn assert_repeats_are_flagged(agent_log: &Path, count: usize) -> usize {
    let text = std::fs::read_to_string(agent_log).expect("agent log");
    let mut starts: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in text.lines() {
        let (run, flag) = line.split_once(' ').expect("run_id flag");
        starts.entry(run).or_default().push(flag);
    }
    assert_eq!(starts.len(), count, "one run id per inbound");
    let mut repeated = 0;
    for (run, flags) in &starts {
        for flag in &flags[1..] {
            assert_eq!(*flag, "1", "{run} ran again without being flagged redelivered: {flags:?}");
        }
        repeated += flags.len() - 1;
    }
    let flagged: BTreeSet<&str> =
        starts.iter().filter(|(_, f)| f.contains(&"1")).map(|(r, _)| *r).collect();
    eprintln!(
        "{} runs, {repeated} repeated starts, {} runs flagged redelivered",
        starts.len(),
        flagged.len()
    );
    repeated
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_runs_over_two_workers_survive_one_worker_killed_mid_stream() {
    let rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let dir = tempfile::tempdir().unwrap();
    let agent_log = dir.path().join("runs.log");
    let agent = agent(dir.path(), &agent_log);
    let hub = hub(&url, "scale.kill");
    let mut first = Worker::start(&url, "scale.kill", &agent, &dir.path().join("w1.log"));
    let _second = Worker::start(&url, "scale.kill", &agent, &dir.path().join("w2.log"));
    let replies = drive(&hub, 1000, 300, || {
        // SIGKILL: its unacknowledged runs go back to the queue and to the other worker.
        first.kill();
    })
    .await;
    assert_all_answered_once(&replies, 1000);
    let repeated = assert_repeats_are_flagged(&agent_log, 1000);
    assert!(repeated <= 8, "at most the killed worker's prefetch runs again: {repeated}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_survive_a_broker_restart_mid_stream() {
    let mut rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let dir = tempfile::tempdir().unwrap();
    let agent_log = dir.path().join("runs.log");
    let agent = agent(dir.path(), &agent_log);
    let hub = hub(&url, "scale.restart");
    let _first = Worker::start(&url, "scale.restart", &agent, &dir.path().join("w1.log"));
    let _second = Worker::start(&url, "scale.restart", &agent, &dir.path().join("w2.log"));
    let replies = drive(&hub, 300, 100, || rabbit.restart()).await;
    assert_all_answered_once(&replies, 300);
    assert_repeats_are_flagged(&agent_log, 300);
}

/// Deltas `Hel`, a tool report, `lo`, then a reply whose metadata carries what the agent
/// saw: `$TEST_BOT` (from the inbound's `env.TEST_BOT` metadata), `$PATH_SET` (a driver
/// cannot set it) and whether `$CHANNELD_LOCATOR` was set.
fn streaming_agent(dir: &Path) -> PathBuf {
    write_script(
        dir,
        "stream-agent.sh",
        "IFS= read -r line\n\
         echo '{\"type\":\"delta\",\"text\":\"Hel\"}'\n\
         echo '{\"type\":\"tool\",\"name\":\"search\",\"status\":\"done\",\"hits\":2}'\n\
         echo '{\"type\":\"delta\",\"text\":\"lo\"}'\n\
         case \"$CHANNELD_LOCATOR\" in test:v1:*) loc=yes;; *) loc=no;; esac\n\
         echo \"{\\\"type\\\":\\\"reply\\\",\\\"text\\\":\\\"Hello\\\",\\\"metadata\\\":{\\\"bot\\\":\\\"$TEST_BOT\\\",\\\"evil\\\":\\\"$EVIL\\\",\\\"locator\\\":\\\"$loc\\\"}}\"\n",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_streams_deltas_and_tools_and_returns_the_reply_metadata() {
    let rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let dir = tempfile::tempdir().unwrap();
    let agent = streaming_agent(dir.path());
    let hub = hub(&url, "scale.stream");
    let _worker = Worker::start(&url, "scale.stream", &agent, &dir.path().join("w.log"));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "stream"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    let mut inbound = message(ONE, "m-1", "alice", "room", "hi");
    inbound.metadata.insert("env.TEST_BOT".into(), "bot-1".into());
    inbound.metadata.insert("env.EVIL".into(), "set".into());
    driver.send(Frame::Inbound(Inbound { event_id: id("m-1"), message: inbound })).await;
    let mut steps = Vec::new();
    let reply = loop {
        let frame = match tokio::time::timeout(QUIET_LIMIT, driver.reader.next()).await {
            Ok(Ok(Some(Ok(frame)))) => frame,
            other => panic!("no frame ({other:?})\n--- hub log ---\n{}", hub.log()),
        };
        match frame {
            Frame::Stream(step) => steps.push(step),
            Frame::Deliver(delivery) => break delivery,
            Frame::Accepted(_) | Frame::Health(_) => {}
            other => panic!("unexpected frame {other:?}\n--- hub log ---\n{}", hub.log()),
        }
    };
    assert_eq!(steps.iter().map(|s| s.seq).collect::<Vec<_>>(), [0, 1, 2]);
    let texts: Vec<Option<&str>> = steps.iter().map(|s| s.text.as_deref()).collect();
    assert_eq!(texts, [Some("Hel"), None, Some("lo")]);
    let tool = steps[1].tool.as_ref().expect("a tool report");
    assert_eq!((tool.name.as_str(), tool.status.as_str()), ("search", "done"));
    assert_eq!(tool.rest.get("hits"), Some(&serde_json::json!(2)));
    assert_eq!(reply.message.body.text_str(), "Hello");
    let metadata = &reply.message.metadata;
    assert_eq!(metadata.get("stream_seq").map(String::as_str), Some("3"));
    assert_eq!(metadata.get("bot").map(String::as_str), Some("bot-1"), "{metadata:?}");
    assert_eq!(metadata.get("evil").map(String::as_str), Some(""), "{metadata:?}");
    assert_eq!(metadata.get("locator").map(String::as_str), Some("yes"), "{metadata:?}");
}
