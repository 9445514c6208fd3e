//! `channeld-conformance` run as a process against real drivers: two Python drivers from
//! `tests/drivers/` (one correct, one with four known faults that must fail exactly their
//! checks), the console driver, the MQTT driver against mosquitto and the WeCom driver against
//! its fake. Platform messages for `--inject` go through a FIFO this test reads: the inject
//! command writes a line, the test hands it to the platform (stdin, broker, fake server).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use channeld_tests::fakes::wecom::{FakeConfig, FakeWeCom, payloads};
use channeld_tests::mosquitto::{Mosquitto, MqttTestClient, provision_session};
use channeld_tests::workspace_bin;
use serde_json::Value;
use tokio::sync::mpsc;

const KIT: &str = env!("CARGO_BIN_EXE_channeld-conformance");
/// Every check the kit reports, in order.
const ALL: [&str; 17] = [
    "hello",
    "health",
    "outbound",
    "outbound_repeat",
    "undeclared_effect",
    "undeclared_command",
    "error_frame",
    "invalid_line",
    "oversize_line",
    "inject_inbound",
    "deliver_once",
    "reference_hub",
    "inject_redelivery",
    "reconnect",
    "sigterm",
    "secret",
    "frames",
];

fn drivers_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/drivers")
}

/// Runs the kit with `--json`, `args` before `--` and `command` after it.
async fn kit(args: &[&str], env: &[(&str, String)], command: &[&str]) -> (Output, Value) {
    let output = tokio::process::Command::new(KIT)
        .arg("--json")
        .args(args)
        .arg("--")
        .args(command)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .kill_on_drop(true)
        .output()
        .await
        .expect("run channeld-conformance");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let doc: Value = serde_json::from_str(&stdout).unwrap_or_else(|err| {
        panic!(
            "not one JSON document ({err}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output, doc)
}

/// Check name → status, and the reasons for a failure message.
fn statuses(doc: &Value) -> BTreeMap<String, String> {
    let checks = doc["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ALL, "every check, in order");
    checks
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_owned(), c["status"].as_str().unwrap().to_owned()))
        .collect()
}

/// Asserts each check's status: those named in `failed` / `skipped` have that status, every
/// other one passed.
fn assert_statuses(doc: &Value, failed: &[&str], skipped: &[&str]) {
    let statuses = statuses(doc);
    let shown = serde_json::to_string_pretty(doc).unwrap();
    for name in ALL {
        let expected = if failed.contains(&name) {
            "FAIL"
        } else if skipped.contains(&name) {
            "SKIP"
        } else {
            "PASS"
        };
        assert_eq!(statuses[name], expected, "{name} in:\n{shown}");
    }
}

/// A FIFO the `--inject` command writes lines to; each line is sent on the returned channel.
/// Opened read-write, so it never reports end of file between writers.
fn inject_fifo(dir: &Path) -> (PathBuf, mpsc::Receiver<String>) {
    let fifo = dir.join("inject.fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(status.success(), "mkfifo {}", fifo.display());
    let (tx, rx) = mpsc::channel(16);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).expect("open fifo");
    std::thread::spawn(move || {
        for line in BufReader::new(file).lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    (fifo, rx)
}

fn inject_command(fifo: &Path) -> String {
    format!("printf '%s\\n' {{text}} > '{}'", fifo.display())
}

fn python_env(dir: &Path) -> Vec<(&'static str, String)> {
    let inbox = dir.join("inbox");
    std::fs::create_dir(&inbox).expect("inbox");
    vec![
        ("CHANNELD_PYDROP_INBOX", inbox.display().to_string()),
        ("CHANNELD_PYDROP_OUTBOX", dir.join("outbox").display().to_string()),
    ]
}

/// Drops a message file in the Python driver's inbox, written whole before it is named *.txt.
fn python_inject(dir: &Path) -> String {
    let inbox = dir.join("inbox");
    format!(
        "f='{}'/m$(date +%s%N); printf '%s' {{text}} > \"$f.tmp\" && mv \"$f.tmp\" \"$f.txt\"",
        inbox.display()
    )
}

#[tokio::test]
async fn the_python_driver_passes_every_check() {
    let dir = tempfile::tempdir().unwrap();
    let env = python_env(dir.path());
    let driver = drivers_dir().join("good_driver.py");
    let inject = python_inject(dir.path());
    let (output, doc) =
        kit(&["--timeout", "5", "--inject", &inject], &env, &["python3", driver.to_str().unwrap()])
            .await;
    assert_statuses(&doc, &[], &[]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(doc["passed"], true);
    // Posted once each: the outbound, the reply, the reference hub's outbound and reply.
    let posts = std::fs::read_to_string(dir.path().join("outbox")).unwrap();
    assert_eq!(posts.lines().count(), 4, "{posts}");
}

#[tokio::test]
async fn the_faulty_python_driver_fails_exactly_its_faults() {
    let dir = tempfile::tempdir().unwrap();
    let env = python_env(dir.path());
    let driver = drivers_dir().join("faulty_driver.py");
    let inject = python_inject(dir.path());
    let (output, doc) =
        kit(&["--timeout", "2", "--inject", &inject], &env, &["python3", driver.to_str().unwrap()])
            .await;
    // No receipt: outbound (and the reference hub's outbound); its repeat cannot be tried.
    // A crash on an error frame; reconnects without backoff; the environment in its log.
    assert_statuses(
        &doc,
        &["outbound", "reference_hub", "error_frame", "reconnect", "secret"],
        &["outbound_repeat"],
    );
    assert_eq!(output.status.code(), Some(1));
    let reason = |name: &str| {
        let checks = doc["checks"].as_array().unwrap();
        let check = checks.iter().find(|c| c["name"] == name).unwrap();
        check["reason"].as_str().unwrap().to_owned()
    };
    assert!(reason("secret").contains("CHANNELD_CONFORMANCE_SECRET appeared on stderr"));
    assert!(reason("error_frame").contains("exited"), "{}", reason("error_frame"));
    assert!(reason("reconnect").contains("do not grow"), "{}", reason("reconnect"));
    let report = serde_json::to_string(&doc).unwrap();
    assert!(!report.contains("canary-"), "a canary value in the report: {report}");
}

#[tokio::test]
async fn the_console_driver_passes_every_check() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("stdin.fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(status.success());
    let console = workspace_bin("channeld-console");
    // `<>` opens the FIFO read-write: no end of input between the inject commands' writes.
    let run = format!("exec '{}' <> '{}'", console.display(), fifo.display());
    let (output, doc) =
        kit(&["--inject", &inject_command(&fifo)], &[], &["/bin/sh", "-c", &run]).await;
    assert_statuses(&doc, &[], &[]);
    assert_eq!(output.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mqtt_driver_passes_every_check_against_mosquitto() {
    let broker = Mosquitto::start();
    let port = broker.port();
    // The driver's session exists first, so nothing published before it subscribed is lost.
    let filter = "conformance/in/+/+";
    provision_session(port, "channeld-mqtt.conformance", None, &[filter]).await;
    let dir = tempfile::tempdir().unwrap();
    let (fifo, mut lines) = inject_fifo(dir.path());
    let mut publisher = MqttTestClient::connect(port, "conformance-publisher", &[]).await;
    let publish = tokio::spawn(async move {
        while let Some(text) = lines.recv().await {
            let payload = serde_json::json!({ "text": text }).to_string();
            publisher.publish_confirmed("conformance/in/alice/c1", payload).await;
        }
    });
    let env = [
        ("CHANNELD_MQTT_URL", broker.url()),
        ("CHANNELD_MQTT_INBOUND_TOPIC", "conformance/in/{sender}/{conversation}".to_owned()),
        ("CHANNELD_MQTT_OUTBOUND_TOPIC", "conformance/out/{conversation}".to_owned()),
    ];
    let mqtt = workspace_bin("channeld-mqtt");
    let (output, doc) = kit(
        &[
            "--channel",
            "mqtt.conformance",
            "--conversation",
            "c1",
            "--inject",
            &inject_command(&fifo),
        ],
        &env,
        &[mqtt.to_str().unwrap()],
    )
    .await;
    publish.abort();
    assert_statuses(&doc, &[], &[]);
    assert_eq!(output.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wecom_driver_passes_every_check_against_its_fake() {
    const SECRET: &str = "s3cret-conformance";
    let fake = FakeWeCom::start(FakeConfig::new("aib-conformance", SECRET)).await;
    // A conversation the bot may message first (WeCom refuses strangers).
    fake.know_chat("alice");
    let dir = tempfile::tempdir().unwrap();
    let (fifo, mut lines) = inject_fifo(dir.path());
    let env = [
        ("CHANNELD_WECOM_WS_URL", fake.url()),
        ("CHANNELD_WECOM_BOT_ID", "aib-conformance".to_owned()),
        ("CHANNELD_WECOM_SECRET", SECRET.to_owned()),
    ];
    let wecom = workspace_bin("channeld-wecom");
    let inject = inject_command(&fifo);
    let args = [
        "--channel",
        "wecom.conformance",
        "--conversation",
        "alice",
        "--secret",
        "CHANNELD_WECOM_SECRET",
        "--inject",
        &inject,
    ];
    let command = [wecom.to_str().unwrap()];
    let run = kit(&args, &env, &command);
    let (output, doc) = tokio::select! {
        done = run => done,
        () = push_to_wecom(&fake, &mut lines) => panic!("the inject FIFO closed"),
    };
    assert_statuses(&doc, &[], &[]);
    assert_eq!(output.status.code(), Some(0));
    let secret = doc["checks"][15]["reason"].as_str().unwrap();
    assert!(secret.contains("CHANNELD_WECOM_SECRET"), "{secret}");
}

/// Each injected line as a text message from alice on the fake WeCom.
async fn push_to_wecom(fake: &FakeWeCom, lines: &mut mpsc::Receiver<String>) {
    let mut n = 0;
    while let Some(text) = lines.recv().await {
        n += 1;
        let body = payloads::text(&format!("m-{n}"), "alice", &text);
        // The driver may still be connecting to the fake: retry until it is there.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fake.push_message(body.clone()).is_err() {
            assert!(Instant::now() < deadline, "the driver never reached the fake WeCom");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn a_driver_that_never_connects_fails_hello_and_skips_the_rest_in_text_mode() {
    let output = tokio::process::Command::new(KIT)
        .args(["--", "/bin/sh", "-c", "echo 'no hub for me' >&2; exit 3"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), ALL.len(), "one line per check:\n{stdout}");
    assert!(
        lines[0].starts_with("FAIL hello: no connection: the driver exited (exit status: 3)")
            && lines[0].ends_with("last stderr line: no hub for me"),
        "{}",
        lines[0]
    );
    for (line, name) in lines.iter().zip(ALL).skip(1).take(ALL.len() - 3) {
        assert!(line.starts_with(&format!("SKIP {name}: ")), "{line}");
    }
    assert!(lines[ALL.len() - 2].starts_with("PASS secret: "), "{stdout}");
}

#[tokio::test]
async fn usage_errors_exit_2_and_an_unstartable_command_exits_3() {
    for args in
        [&["--timeout", "0", "--", "x"][..], &[][..], &["--inject", "no placeholder", "--", "x"]]
    {
        let output = tokio::process::Command::new(KIT).args(args).output().await.unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    let output = tokio::process::Command::new(KIT)
        .args(["--", "/nonexistent/driver"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot start /nonexistent/driver"), "{stderr}");
}
