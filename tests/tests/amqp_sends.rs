//! Sends from other machines (`[hub.amqp_sends]`, `channelctl --amqp … send`) through a real
//! RabbitMQ: a remote send reaches the driver and its outcome comes back as the control socket
//! gives it; a repeated idempotency key posts once and says so; a key reused for another
//! message is a conflict (exit 8, as on the socket); a message that is no send is answered
//! with an error, dead-lettered, and the consumer goes on; after a broker restart the
//! consumer is back and sends work again. `channelctl status` shows the consumer.

use std::process::{Command, Output};
use std::time::Duration;

use channeld_protocol::Frame;
use channeld_tests::peer::{caps, expect_outbound, receipt_for};
use channeld_tests::rabbitmq::{AmqpTestClient, RabbitMq, body_text, property};
use channeld_tests::{HubProcess, RawPeer, workspace_bin};
use lapin::BasicProperties;

const ONE: &str = "test.one";
const URL_VARIABLE: &str = "SENDS_TEST_AMQP_URL";
const READY: &str = "send queue consumer ready";
/// Covers a broker restart and the consumer's reconnect.
const LIMIT: Duration = Duration::from_secs(60);

fn hub(url: &str, queue: &str) -> HubProcess {
    let hub = HubProcess::start_with_env(
        &format!(
            "[hub.amqp_sends]\nurl = \"env:{URL_VARIABLE}\"\nqueue = \"{queue}\"\nprefetch = 4\n\
             [instance.\"{ONE}\"]\nallow_all = true\n"
        ),
        &[(URL_VARIABLE, url)],
    );
    hub.wait_log(READY, 1, LIMIT);
    hub
}

async fn driver(hub: &HubProcess) -> RawPeer {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver
}

/// `channelctl --amqp env:… --amqp-queue <queue> <args>` (never the socket), on a blocking
/// thread so the test can play the driver meanwhile.
fn remote_ctl(url: &str, queue: &str, args: &[&str]) -> tokio::task::JoinHandle<Output> {
    let (url, queue) = (url.to_owned(), queue.to_owned());
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(workspace_bin("channelctl"))
            .args(["--socket", "/nonexistent/control.sock"])
            .args(["--amqp", &format!("env:{URL_VARIABLE}"), "--amqp-queue", &queue])
            .args(&args)
            .env(URL_VARIABLE, url)
            .output()
            .expect("run channelctl")
    })
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The driver takes one `outbound` for `conversation` and posts it as `posted`.
async fn post_one(driver: &mut RawPeer, conversation: &str, expected: &str, posted: &str) {
    let outbound = expect_outbound(driver.frame().await);
    assert_eq!(outbound.message.target.conversation.as_str(), conversation);
    assert_eq!(outbound.message.body.text_str(), expected);
    driver.send(receipt_for(ONE, &outbound.request_id, conversation, posted)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_sends_post_once_per_key_and_bad_messages_are_answered_and_dead_lettered() {
    let rabbit = RabbitMq::start();
    rabbit.add_user("sender", "s3nd-pw-91");
    let url = rabbit.url("sender", "s3nd-pw-91");
    let queue = "sends.basic";
    let hub = hub(&url, queue);
    let mut driver = driver(&hub).await;

    // A remote send reaches the driver; its receipt comes back through the broker.
    let args = ["send", ONE, "--conversation", "ops", "--key", "deploy-881", "deploy 881 finished"];
    let sent = remote_ctl(&url, queue, &args);
    post_one(&mut driver, "ops", "deploy 881 finished", "p-1").await;
    let out = sent.await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("receipted p-1 (request "), "{stdout}");

    // The same key again: the first send's record, nothing posted.
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(&args);
    let out = remote_ctl(&url, queue, &json_args).await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let repeated: serde_json::Value = serde_json::from_str(&stdout).expect("json result");
    assert_eq!(repeated["repeated"], true, "{repeated}");
    assert_eq!(repeated["state"], "receipted", "{repeated}");
    assert_eq!(repeated["receipt"]["message_id"], "p-1", "{repeated}");

    // The key for another message: a conflict, exit 8 as on the socket.
    let other =
        ["send", ONE, "--conversation", "ops", "--key", "deploy-881", "deploy 882 finished"];
    let out = remote_ctl(&url, queue, &other).await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(8), "{stdout}{stderr}");
    assert!(stderr.contains("(conflict)"), "{stderr}");
    let socket = hub.ctl(&other);
    assert_eq!(socket.status.code(), Some(8), "the socket path exits alike");

    // Not a send: an error outcome to reply_to, the message dead-lettered.
    let client = AmqpTestClient::connect(&url).await;
    client.declare_queue("sends.test.answers").await;
    let mut answers = client.collect("sends.test.answers").await;
    let properties = BasicProperties::default()
        .with_correlation_id("bad-1".into())
        .with_reply_to("sends.test.answers".into());
    client.publish(queue, properties, b"{\"instance\": 7}").await.expect("published");
    let answer = answers.expect_within(LIMIT, "the malformed message's outcome").await;
    assert_eq!(property(answer.properties.correlation_id()), "bad-1");
    let outcome: serde_json::Value = serde_json::from_str(&body_text(&answer)).unwrap();
    assert_eq!(outcome["ok"], false, "{outcome}");
    assert_eq!(outcome["error"]["code"], "invalid_request", "{outcome}");
    assert!(outcome["error"]["message"].as_str().unwrap().contains("not a send message"));
    // Valid JSON without a key: refused too (a redelivery would post twice).
    let properties = BasicProperties::default()
        .with_correlation_id("bad-2".into())
        .with_reply_to("sends.test.answers".into());
    let keyless = br#"{"instance":"test.one","conversation":"ops","text":"x"}"#;
    client.publish(queue, properties, keyless).await.expect("published");
    let answer = answers.expect_within(LIMIT, "the keyless message's outcome").await;
    assert!(body_text(&answer).contains("idempotency_key is required"), "{}", body_text(&answer));
    let dead = format!("{queue}.dead");
    let deadline = std::time::Instant::now() + LIMIT;
    while rabbit.queue_counts(&dead).map(|(ready, _)| ready) != Some(2) {
        assert!(
            std::time::Instant::now() < deadline,
            "not dead-lettered: {:?}",
            rabbit.queue_counts(&dead)
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The consumer goes on; a URL with a password in argv works and warns, never printing it.
    let argv_url = url.clone();
    let sent = tokio::task::spawn_blocking(move || {
        Command::new(workspace_bin("channelctl"))
            .args(["--amqp", &argv_url, "--amqp-queue", "sends.basic"])
            .args(["send", ONE, "--conversation", "ops", "after the bad ones"])
            .output()
            .expect("run channelctl")
    });
    post_one(&mut driver, "ops", "after the bad ones", "p-2").await;
    let out = sent.await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("process list") && stderr.contains("env:NAME"), "{stderr}");
    assert!(!stderr.contains("s3nd-pw-91") && !stdout.contains("s3nd-pw-91"));

    // A wrong queue name is an error naming it, not a message nobody reads.
    let out =
        remote_ctl(&url, "sends.typo", &["send", ONE, "--conversation", "ops", "x"]).await.unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out).1.contains("sends.typo does not exist"), "{}", text(&out).1);
    // --amqp carries sends only.
    let out = remote_ctl(&url, queue, &["status"]).await.unwrap();
    assert_eq!(out.status.code(), Some(2));

    let status = hub.ctl(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let sends = &status["amqp_sends"];
    assert_eq!(sends["queue"], queue, "{status}");
    assert_eq!(sends["connected"], true);
    assert_eq!((sends["received"].as_u64(), sends["sent"].as_u64()), (Some(6), Some(3)), "{sends}");
    assert_eq!(
        (sends["failed"].as_u64(), sends["malformed"].as_u64()),
        (Some(1), Some(2)),
        "{sends}"
    );
    let human = text(&hub.ctl(&["status"])).0;
    assert!(human.contains("amqp sends: queue sends.basic consumed"), "{human}");
    assert!(!hub.log().contains("s3nd-pw-91"), "the hub logged the broker password");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_send_consumer_comes_back_after_a_broker_restart() {
    let mut rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let queue = "sends.restart";
    let hub = hub(&url, queue);
    let mut driver = driver(&hub).await;

    let sent = remote_ctl(&url, queue, &["send", ONE, "--conversation", "c1", "before"]);
    post_one(&mut driver, "c1", "before", "p-1").await;
    assert_eq!(sent.await.unwrap().status.code(), Some(0));

    rabbit.restart();
    hub.wait_log(READY, 2, LIMIT);
    let sent = remote_ctl(&url, queue, &["send", ONE, "--conversation", "c1", "after"]);
    post_one(&mut driver, "c1", "after", "p-2").await;
    let out = sent.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{:?}", text(&out));
    let status = hub.ctl(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["amqp_sends"]["connected"], true, "{status}");
    assert_eq!(status["amqp_sends"]["reconnects"], 1, "{status}");
    assert!(status["amqp_sends"]["last_error"].is_string(), "{status}");
}
