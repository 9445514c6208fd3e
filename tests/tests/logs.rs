//! Logs for shippers: with `CHANNELD_LOG_FORMAT=json` the hub and a real driver
//! (`channeld-mqtt` against a real mosquitto that wants a canary password) write one JSON
//! object a line; the lines about a message carry its ids — the hub's `instance`, `event_id`
//! and `run_id`, the driver's `instance` and `event_id` — so one event id finds its story in
//! both processes; and the canary password appears in neither log, even at trace level.

use std::time::{Duration, Instant};

use channeld_tests::mosquitto::{Mosquitto, MosquittoOptions, MqttTestClient, provision_session};
use channeld_tests::{DriverProcess, HubProcess};
use serde_json::{Value, json};

const LAB: &str = "mqtt.lab";

/// A fresh secret that nothing else could print by chance.
fn canary() -> String {
    format!("canary-log-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// Every line of `log` as JSON; panics naming the first line that is not.
fn json_lines(who: &str, log: &str) -> Vec<Value> {
    log.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("{who} wrote a line that is not JSON ({err}): {line}"))
        })
        .collect()
}

/// A field of a JSON log line: the event's own, else the nearest enclosing span's.
fn field<'a>(line: &'a Value, name: &str) -> Option<&'a str> {
    line.get(name).and_then(Value::as_str).or_else(|| {
        line.get("spans")?.as_array()?.iter().rev().find_map(|span| span.get(name)?.as_str())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_carry_the_message_ids_and_never_the_password() {
    let password = canary();
    let broker = Mosquitto::start_with(MosquittoOptions {
        users: vec![("bot".into(), password.clone())],
        ..MosquittoOptions::default()
    });
    let json_format = [("CHANNELD_LOG_FORMAT", "json")];
    let hub = HubProcess::start_with_env(
        &format!("[instance.\"{LAB}\"]\nallow = [\"alice\"]\n"),
        &json_format,
    );
    let filter = format!("channeld/{LAB}/in/+/+");
    let login = Some(("bot", password.as_str()));
    provision_session(broker.port(), &format!("channeld-{LAB}"), login, &[&filter]).await;
    let mut observer = MqttTestClient::connect_as(
        broker.port(),
        "observer",
        login,
        &[&format!("channeld/{LAB}/out/+")],
    )
    .await;
    let mut alice = MqttTestClient::connect_as(broker.port(), "alice-phone", login, &[]).await;
    let env = [
        ("CHANNELD_MQTT_URL".to_owned(), broker.url()),
        ("CHANNELD_MQTT_USERNAME".to_owned(), "bot".to_owned()),
        ("CHANNELD_MQTT_PASSWORD".to_owned(), password.clone()),
        ("CHANNELD_LOG_FORMAT".to_owned(), "json".to_owned()),
        ("CHANNELD_LOG".to_owned(), "trace".to_owned()),
    ];
    let mut driver = DriverProcess::spawn("channeld-mqtt", &hub, LAB, &env);
    let deadline = Instant::now() + Duration::from_secs(20);
    while hub.instance_status(LAB)["health"]["state"] != "Ready" {
        assert!(Instant::now() < deadline, "{LAB} not Ready: {}", driver.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    let ping = json!({"text": "ping", "id": "1"}).to_string();
    alice.publish_confirmed(&format!("channeld/{LAB}/in/alice/c1"), ping).await;
    let reply = observer.next_message(Duration::from_secs(15)).await;
    assert_eq!(reply.topic, format!("channeld/{LAB}/out/c1"));
    // The driver settles the message once the hub answered: wait for it to say so.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !driver.log().contains("acknowledging it") {
        assert!(
            Instant::now() < deadline,
            "the driver did not settle the message: {}",
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(driver.terminate().success());

    let hub_lines = json_lines("the hub", &hub.log());
    let driver_lines = json_lines("the driver", &driver.log());
    for line in hub_lines.iter().chain(&driver_lines) {
        assert!(line["timestamp"].is_string() && line["level"].is_string(), "{line}");
        assert!(line["fields"].is_null(), "event fields are at the top level: {line}");
    }

    // The hub's run: started and finished, each line with instance, event id and run id.
    let runs: Vec<&Value> =
        hub_lines.iter().filter(|line| line["message"] == "run finished").collect();
    assert_eq!(runs.len(), 1, "one run: {}", hub.log());
    let event_id = field(runs[0], "event_id").expect("the run's event id").to_owned();
    let run_id = field(runs[0], "run_id").expect("the run's id").to_owned();
    assert_eq!(field(runs[0], "instance"), Some(LAB));
    assert!(run_id.starts_with("run-"), "{run_id}");
    let started =
        hub_lines.iter().find(|line| line["message"] == "run started").expect("run started");
    assert_eq!(field(started, "run_id"), Some(run_id.as_str()));

    // The driver's side of the same event carries its instance and the same event id.
    let story: Vec<&Value> = driver_lines
        .iter()
        .filter(|line| field(line, "event_id") == Some(event_id.as_str()))
        .collect();
    assert!(!story.is_empty(), "no driver line names {event_id}: {}", driver.log());
    for line in story {
        assert_eq!(field(line, "instance"), Some(LAB), "{line}");
    }
    // Every driver line carries the instance (the SDK's process span).
    for line in &driver_lines {
        assert_eq!(field(line, "instance"), Some(LAB), "{line}");
    }

    for (who, log) in [("hub", hub.log()), ("driver", driver.log())] {
        assert!(!log.contains(&password), "the {who}'s log holds the broker password");
    }
}
