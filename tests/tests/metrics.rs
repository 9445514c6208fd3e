//! Metrics as operators see them: a real Prometheus scrapes a real `channeld` (every second)
//! while a driver sends messages, denied messages, a redelivery and a proactive send; the test
//! reads the series back through Prometheus's HTTP API and finds the counts it caused.
//! `promtool check metrics` accepts the exposition, and the example alerting rules pass
//! `promtool check rules` and their own `promtool test rules` unit tests. The ledger's batch
//! metrics, read from the hub's metrics socket, show a driver's frames of one read sharing
//! a commit.

use std::path::PathBuf;
use std::time::Duration;

use channeld_protocol::Frame;
use channeld_protocol::frame::Inbound;
use channeld_tests::peer::{caps, expect_deliver, expect_outbound, id, message, receipt_for};
use channeld_tests::prometheus::{Prometheus, free_port, promtool};
use channeld_tests::{HubProcess, RawPeer};

const LAB: &str = "test.lab";
/// Scrapes come every second; this is how long a value may take to show.
const SCRAPED_WITHIN: Duration = Duration::from_secs(30);

fn contrib(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../contrib/prometheus").join(name)
}

/// The next frame that is not a health probe.
async fn next(driver: &mut RawPeer) -> Frame {
    loop {
        match driver.frame().await {
            Frame::HealthRequest(_) => continue,
            frame => return frame,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_counts_of_real_traffic() {
    let port = free_port();
    let hub = HubProcess::start(&format!(
        "[hub]\nmetrics_listen = \"127.0.0.1:{port}\"\n[instance.\"{LAB}\"]\nallow = [\"alice\"]\n"
    ));
    let prometheus = Prometheus::start(&[format!("127.0.0.1:{port}")]).await;
    let series = |name: &str, labels: &str| format!("{name}{{channel=\"{LAB}\"{labels}}}");

    let mut driver = RawPeer::connect(&hub.socket(LAB)).await;
    driver.hello(LAB, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(next(&mut driver).await, Frame::HelloAck(_)));
    prometheus.wait_value(&series("channeld_driver_connected", ""), 1.0, SCRAPED_WITHIN).await;
    prometheus.wait_value("channeld_connections{kind=\"driver\"}", 1.0, SCRAPED_WITHIN).await;

    const SENT: usize = 25;
    for n in 0..SENT {
        driver.inbound(LAB, &format!("e-{n}"), "alice", "c1", &format!("hello {n}")).await;
        assert!(matches!(next(&mut driver).await, Frame::Accepted(a) if !a.duplicate));
        assert_eq!(
            expect_deliver(next(&mut driver).await).message.body.text_str(),
            format!("hello {n}")
        );
    }
    for n in 0..3 {
        driver.inbound(LAB, &format!("m-{n}"), "mallory", "c1", "let me in").await;
        match next(&mut driver).await {
            Frame::Error(err) => assert_eq!(err.code, "sender_denied"),
            other => panic!("expected sender_denied, got {other:?}"),
        }
    }
    // A redelivery is answered from the ledger, not run again.
    driver.inbound(LAB, "e-0", "alice", "c1", "hello 0").await;
    assert!(matches!(next(&mut driver).await, Frame::Accepted(a) if a.duplicate));
    assert_eq!(expect_deliver(next(&mut driver).await).message.body.text_str(), "hello 0");
    // A proactive send, receipted.
    let send = hub.ctl_async(&["send", LAB, "--conversation", "c1", "deploy finished"]);
    let outbound = expect_outbound(next(&mut driver).await);
    driver.send(receipt_for(LAB, &outbound.request_id, "c1", "posted-1")).await;
    let sent = send.await.unwrap();
    assert!(sent.status.success(), "{}", String::from_utf8_lossy(&sent.stderr));

    let inbound =
        |outcome: &str| series("channeld_inbound_total", &format!(",outcome=\"{outcome}\""));
    prometheus.wait_value(&inbound("accepted"), SENT as f64, SCRAPED_WITHIN).await;
    prometheus.wait_value(&inbound("denied"), 3.0, SCRAPED_WITHIN).await;
    prometheus.wait_value(&inbound("duplicate"), 1.0, SCRAPED_WITHIN).await;
    assert_eq!(prometheus.value(&inbound("busy")).await, Some(0.0));
    assert_eq!(
        prometheus.value(&series("channeld_runs_started_total", "")).await,
        Some(SENT as f64)
    );
    let finished = series("channeld_runs_finished_total", ",outcome=\"replied\"");
    assert_eq!(prometheus.value(&finished).await, Some(SENT as f64));
    let runs = series("channeld_run_duration_seconds_count", "");
    assert_eq!(prometheus.value(&runs).await, Some(SENT as f64));
    let delivered = series("channeld_reply_delivery_seconds_count", "");
    assert_eq!(prometheus.value(&delivered).await, Some(SENT as f64));
    let receipted = series("channeld_sends_total", ",outcome=\"receipted\"");
    prometheus.wait_value(&receipted, 1.0, SCRAPED_WITHIN).await;
    let outbox = series("channeld_outbox_records", ",state=\"receipted\"");
    prometheus.wait_value(&outbox, 1.0, SCRAPED_WITHIN).await;
    prometheus.wait_value("up{job=\"channeld\"}", 1.0, SCRAPED_WITHIN).await;
    assert_eq!(
        prometheus.value(&format!("sum(channeld_health_state{{channel=\"{LAB}\"}})")).await,
        Some(1.0)
    );

    // Hub-wide: every accepted message took at least three ledger calls (record, outcome,
    // delivered), each committed in some batch.
    let jobs = prometheus.value("channeld_ledger_batch_jobs_sum").await.expect("batch jobs");
    assert!(jobs >= (3 * SENT) as f64, "ledger jobs committed: {jobs}");
    let commits = prometheus.value("channeld_ledger_commit_duration_seconds_count").await;
    assert!(commits.is_some_and(|c| c >= 1.0), "ledger commits: {commits:?}");
    let rss = prometheus.value("process_resident_memory_bytes").await.expect("rss");
    assert!(rss > 1_000_000.0, "rss {rss}");
    let fds = prometheus.value("process_open_fds").await.expect("open fds");
    assert!(fds >= 4.0, "open fds {fds}");
    assert!(prometheus.value("process_cpu_seconds_total").await.is_some_and(|cpu| cpu > 0.0));

    // The exposition itself passes promtool's checks, in the Prometheus text format...
    let client = reqwest::Client::new();
    let text = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("exposition");
    assert!(
        text.contains(&format!(
            "channeld_inbound_total{{channel=\"{LAB}\",outcome=\"accepted\"}} {SENT}"
        )),
        "{text}"
    );
    let checked = promtool(&["check", "metrics"], text.as_bytes());
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // ...and in OpenMetrics when asked for it.
    let open = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .await
        .expect("scrape");
    let content_type = open.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    assert!(open.text().await.unwrap().ends_with("# EOF\n"));

    // The driver leaves: the gauges follow.
    driver.close().await;
    prometheus.wait_value(&series("channeld_driver_connected", ""), 0.0, SCRAPED_WITHIN).await;
    prometheus.wait_value("channeld_connections{kind=\"driver\"}", 0.0, SCRAPED_WITHIN).await;
}

/// The ledger's commits and the calls they carried so far (`channeld_ledger_batch_jobs`
/// count and sum), scraped from the hub's metrics socket.
async fn ledger_batches(client: &reqwest::Client) -> (u64, u64) {
    let text = client.get("http://localhost/metrics").send().await.unwrap().text().await.unwrap();
    let value = |name: &str| {
        let line = text
            .lines()
            .find(|line| line.starts_with(name) && line.as_bytes().get(name.len()) == Some(&b' '))
            .unwrap_or_else(|| panic!("no {name} in {text}"));
        line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
    };
    (value("channeld_ledger_batch_jobs_count"), value("channeld_ledger_batch_jobs_sum"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_and_the_message_behind_it_in_one_read_share_a_commit() {
    // A driver that posts a reply and has the next message already: the receipt and the
    // inbound reach the hub in one read. The reader's ledger calls for both (the reply's
    // settle, the message's record) go into one commit, so every round saves one commit
    // (the run's start and end commit on their own). Committed call by call, the calls of
    // a round only share a commit when the ledger thread happens to be busy.
    const ROUNDS: u64 = 40;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("metrics.sock");
    let hub = HubProcess::start(&format!(
        "[hub]\nmetrics_listen = \"{}\"\n[instance.\"{LAB}\"]\nallow = [\"alice\"]\n",
        socket.display()
    ));
    channeld_driver_sdk::install_crypto_provider();
    let client = reqwest::Client::builder().unix_socket(socket.clone()).build().unwrap();
    let mut driver = RawPeer::connect(&hub.socket(LAB)).await;
    driver.hello(LAB, caps(&["receive"]), &["accepted", "reply_receipt"]).await;
    assert!(matches!(next(&mut driver).await, Frame::HelloAck(_)));
    driver.inbound(LAB, "m0", "alice", "room", "q0").await;
    assert!(matches!(next(&mut driver).await, Frame::Accepted(_)));
    let mut delivery = expect_deliver(next(&mut driver).await);
    let (commits_before, calls_before) = ledger_batches(&client).await;
    for n in 1..=ROUNDS {
        let event = format!("m{n}");
        let receipt = receipt_for(LAB, &delivery.request_id, "room", &format!("p-{}", n - 1));
        let inbound = Frame::Inbound(Inbound {
            event_id: id(&event),
            message: message(LAB, &event, "alice", "room", &format!("q{n}")),
        });
        driver.send_together(&[receipt, inbound]).await;
        assert!(matches!(next(&mut driver).await, Frame::Accepted(_)));
        delivery = expect_deliver(next(&mut driver).await);
    }
    let (commits, calls) = ledger_batches(&client).await;
    let (commits, calls) = (commits - commits_before, calls - calls_before);
    assert!(
        calls - commits >= ROUNDS,
        "{calls} ledger calls in {commits} commits over {ROUNDS} rounds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_can_be_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("metrics.sock");
    let mut hub = HubProcess::start(&format!(
        "[hub]\nmetrics_listen = \"{}\"\n[instance.\"{LAB}\"]\nallow = [\"alice\"]\n",
        socket.display()
    ));
    channeld_driver_sdk::install_crypto_provider();
    let client = reqwest::Client::builder().unix_socket(socket.clone()).build().unwrap();
    let answer = client.get("http://localhost/metrics").send().await.expect("scrape the socket");
    assert!(answer.status().is_success());
    let text = answer.text().await.unwrap();
    assert!(text.contains(&format!("channeld_driver_connected{{channel=\"{LAB}\"}} 0")), "{text}");
    assert!(hub.terminate().success());
    assert!(!socket.exists(), "the hub removes its metrics socket when it stops");
}

#[test]
fn the_example_alerting_rules_are_valid_and_fire_as_tested() {
    let rules = contrib("channeld.rules.yml");
    let checked = promtool(&["check", "rules", rules.to_str().unwrap()], b"");
    assert!(
        checked.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let tests = contrib("channeld.rules.test.yml");
    let tested = promtool(&["test", "rules", tests.to_str().unwrap()], b"");
    assert!(
        tested.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&tested.stdout),
        String::from_utf8_lossy(&tested.stderr)
    );
}
