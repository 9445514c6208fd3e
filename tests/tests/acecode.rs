//! ACECode channel platform plugins both ways, through the real binaries.
//!
//! Hosted: `channeld-acecode` runs the test plugin (`drivers/acecode/tests/plugin/
//! fake_plugin.py`, written from ACECode's protocol document alone) behind a real hub: a
//! round trip with typing, `held`/`failed` outcomes, a timed-out send that ends unknown and
//! is not resent, a malformed line restarting the plugin, `login_required` stopping restarts
//! until `channelctl resume`, `channelctl action … login`, and invalid manifests rejected one
//! rule at a time. Served: `channeld-mqtt --acecode` against mosquitto, driven by a test host
//! that plays ACECode.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::mosquitto::{Mosquitto, MqttTestClient, provision_session};
use channeld_tests::{DriverProcess, HubProcess, workspace_bin, write_file, write_script};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const INSTANCE: &str = "acecode.test";
const WITHIN: Duration = Duration::from_secs(15);

fn fake_plugin_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../drivers/acecode/tests/plugin/fake_plugin.py")
}

/// A connector directory with the fake plugin (relative command, `${manifest_dir}` in
/// its args) and its manifest; returns the manifest's path.
fn connector(dir: &Path, features: Value) -> PathBuf {
    let connector = dir.join("connectors/fake");
    std::fs::create_dir_all(&connector).unwrap();
    let script = std::fs::read_to_string(fake_plugin_source()).expect("the fake plugin");
    let plugin = write_file(&connector, "fake-plugin", &script);
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let manifest = json!({
        "schema": "acecode.channel-platform.v1",
        "name": "fake",
        "label": "Fake IM",
        "command": "fake-plugin",
        "args": ["--cwd", "${manifest_dir}"],
        "account": "self",
        "features": features,
    });
    write_file(&connector, "channel-platform.json", &manifest.to_string())
}

/// The plugin's record: every line it received and each start.
fn plugin_log(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("plugin.log"))
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).expect("plugin log line"))
        .collect()
}

fn starts(dir: &Path) -> Vec<Value> {
    plugin_log(dir).into_iter().filter(|e| e["start"] == true).collect()
}

fn received(dir: &Path, method: &str) -> Vec<Value> {
    plugin_log(dir)
        .into_iter()
        .filter_map(|e| (e["received"]["method"] == method).then(|| e["received"].clone()))
        .collect()
}

/// Waits until `check` holds, failing with `what` and the driver's log.
async fn wait_for<T>(
    what: &str,
    driver: &DriverProcess,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(Instant::now() < deadline, "{what} not seen within {WITHIN:?}\n{}", driver.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

struct Hosted {
    dir: tempfile::TempDir,
    hub: HubProcess,
    driver: DriverProcess,
}

impl Hosted {
    fn start(agent: Option<&str>, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let manifest =
            connector(dir.path(), json!(["watched_groups", "a_feature_from_the_future"]));
        std::fs::create_dir_all(dir.path().join("inbox")).unwrap();
        let mut config = String::new();
        if let Some(body) = agent {
            let agent = write_script(dir.path(), "agent.sh", body);
            config.push_str(&format!(
                "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n",
                agent.display()
            ));
        }
        config.push_str(&format!("[instance.\"{INSTANCE}\"]\nallow = [\"me\", \"bob\"]\n"));
        if agent.is_some() {
            config.push_str("runtime = \"agent\"\n");
        }
        let hub = HubProcess::start(&config);
        let mut vars = vec![
            ("CHANNELD_ACECODE_MANIFEST".to_owned(), manifest.display().to_string()),
            ("CHANNELD_ACECODE_WATCHED_GROUPS".to_owned(), "grp-1, grp-2".to_owned()),
            ("FAKE_PLUGIN_LOG".to_owned(), dir.path().join("plugin.log").display().to_string()),
            ("FAKE_PLUGIN_INBOX".to_owned(), dir.path().join("inbox").display().to_string()),
        ];
        vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let driver = DriverProcess::spawn("channeld-acecode", &hub, INSTANCE, &vars);
        Self { dir, hub, driver }
    }

    async fn wait_health(&self, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        wait_for(what, &self.driver, || {
            Some(self.hub.instance_status(INSTANCE)).filter(|s| check(s))
        })
        .await
    }

    /// Waits until the plugin said `connected` (the hub alone shows a new driver Ready).
    async fn wait_ready(&self) {
        self.wait_health("the plugin connected", |s| {
            s["health"]["state"] == "Ready"
                && s["health"]["detail"].as_str().is_some_and(|d| d.starts_with("signed in as"))
        })
        .await;
    }

    /// Makes the plugin emit an `inbound` event with these params.
    fn push_inbound(&self, name: &str, params: Value) {
        let tmp = self.dir.path().join("inbox").join(format!("{name}.tmp"));
        std::fs::write(&tmp, params.to_string()).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("inbox").join(format!("{name}.json"))).unwrap();
    }

    fn ctl(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = self.hub.ctl(args);
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosted_plugin_round_trips_with_typing_and_each_send_outcome() {
    let agent = "cat >/dev/null\nprintf '%s\\n' '{\"type\":\"typing\",\"active\":true}'\nsleep 0.2\necho 'on it'\n";
    let hosted = Hosted::start(
        Some(agent),
        &[("CHANNELD_ACECODE_SEND_TIMEOUT_SECONDS", "1"), ("FAKE_PLUGIN_SLOW_SECONDS", "3")],
    );
    hosted.wait_ready().await;

    // Started in its directory with ${manifest_dir} substituted, reason auto, the settings.
    let start = &starts(hosted.dir.path())[0];
    let connector = std::fs::canonicalize(hosted.dir.path().join("connectors/fake")).unwrap();
    assert_eq!(start["cwd"], connector.display().to_string());
    assert_eq!(start["argv"], json!(["--cwd", connector.display().to_string()]));
    assert_eq!(
        (start["reason"].as_str(), start["platform"].as_str()),
        (Some("auto"), Some("fake"))
    );
    assert_eq!(start["settings"], json!({"watched_groups": ["grp-1", "grp-2"]}));

    hosted.push_inbound(
        "1",
        json!({
            "address": {"kind": "group", "chat": "grp-1", "sender": "bob"},
            "message_id": "m-1", "text": "can we ship?", "mentioned": true, "sender_name": "Bob",
        }),
    );
    let send = wait_for("the reply's send_text", &hosted.driver, || {
        received(hosted.dir.path(), "send_text").pop()
    })
    .await;
    assert_eq!(send["params"]["text"], "on it");
    assert_eq!(send["params"]["address"]["kind"], "group");
    assert_eq!(send["params"]["address"]["chat"], "grp-1");
    assert_eq!(send["params"]["reply_context"]["message_id"], "m-1");
    let typing = received(hosted.dir.path(), "set_typing");
    assert_eq!(typing.len(), 1, "{typing:?}");
    assert_eq!(
        typing[0]["params"],
        json!({"address": {"kind": "group", "chat": "grp-1"}, "on": true})
    );
    assert!(typing[0].get("id").is_none(), "set_typing is a notification");

    // Proactive sends: sent, held (a receipt flagged held), failed, and one that times out.
    let (code, out, _) = hosted.ctl(&["send", INSTANCE, "--conversation", "p:me", "hello me"]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("receipted sent:"), "{out}");
    let (code, out, _) =
        hosted.ctl(&["send", INSTANCE, "--conversation", "g:grp-2", "hold until online"]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("receipted held:"), "{out}");
    let (code, _, err) =
        hosted.ctl(&["send", INSTANCE, "--conversation", "g:grp-2", "fail please"]);
    assert_eq!(code, Some(6), "send_failed: {err}");
    assert!(err.contains("the fake platform refused it"), "{err}");
    let (code, _, err) = hosted.ctl(&["send", INSTANCE, "--conversation", "g:grp-2", "slow news"]);
    assert_eq!(code, Some(5), "outcome unknown: {err}");
    assert!(err.contains("did not answer send_text within 1 s"), "{err}");
    let (code, _, err) = hosted.ctl(&["send", INSTANCE, "--conversation", "not-an-address", "x"]);
    assert_eq!(code, Some(6), "{err}");

    let texts: Vec<String> = received(hosted.dir.path(), "send_text")
        .iter()
        .map(|s| s["params"]["text"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(texts, ["on it", "hello me", "hold until online", "fail please", "slow news"]);
    let private = &received(hosted.dir.path(), "send_text")[1];
    assert_eq!(
        private["params"]["address"],
        json!({"kind": "private", "chat": "me", "sender": "me"})
    );
    // The timed-out send was never resent, even after the plugin answered it late.
    let (code, _, _) =
        hosted.ctl(&["send", INSTANCE, "--conversation", "p:me", "after the slow one"]);
    assert_eq!(code, Some(0));
    let slow = received(hosted.dir.path(), "send_text")
        .iter()
        .filter(|s| s["params"]["text"] == "slow news")
        .count();
    assert_eq!(slow, 1);
    assert_eq!(hosted.hub.instance_status(INSTANCE)["counters"]["inbound"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_text_is_split_to_the_plugins_units_counted_in_utf16() {
    let hosted = Hosted::start(
        None,
        &[
            ("FAKE_PLUGIN_MAX_TEXT_UNITS", "64"),
            ("FAKE_PLUGIN_COUNT_UTF16", "1"),
            ("FAKE_PLUGIN_TYPING", "0"),
        ],
    );
    hosted.wait_ready().await;
    // 100 emoji: 100 characters, 200 UTF-16 units: four pieces of at most 64 units.
    let text = "😀".repeat(100);
    let (code, _, err) = hosted.ctl(&["send", INSTANCE, "--conversation", "p:me", &text]);
    assert_eq!(code, Some(0), "{err}");
    let pieces: Vec<String> = received(hosted.dir.path(), "send_text")
        .iter()
        .map(|s| s["params"]["text"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(pieces.len(), 4, "{pieces:?}");
    assert!(pieces.iter().all(|p| p.encode_utf16().count() <= 64));
    assert_eq!(pieces.concat(), text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_line_restarts_the_plugin_after_one_second() {
    let hosted = Hosted::start(None, &[("FAKE_PLUGIN_MALFORMED", "1")]);
    hosted.wait_ready().await;
    let starts = wait_for("the restart", &hosted.driver, || {
        let all = starts(hosted.dir.path());
        (all.len() >= 2).then_some(all)
    })
    .await;
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[1]["reason"], "auto", "a restart after a failure is automatic");
    assert!(hosted.driver.log().contains("protocol violation"), "{}", hosted.driver.log());
    // Served again after the restart.
    hosted.push_inbound(
        "1",
        json!({
            "address": {"kind": "private", "chat": "me", "sender": "me"},
            "message_id": "m-9", "text": "still there?",
        }),
    );
    let send =
        wait_for("the echo", &hosted.driver, || received(hosted.dir.path(), "send_text").pop())
            .await;
    assert_eq!(send["params"]["text"], "still there?");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_required_stops_restarts_until_resume_and_login_reaches_the_plugin() {
    let hosted = Hosted::start(None, &[("FAKE_PLUGIN_LOGIN_REQUIRED", "1")]);
    // (Before the driver connects the hub shows Unavailable too: wait for the reason.)
    let status = hosted
        .wait_health("Unavailable for a sign-in", |s| {
            s["connected"] == true && s["health"]["status"]["reason"] == "auth_expired"
        })
        .await;
    assert_eq!(status["health"]["state"], "Unavailable", "{status}");
    let (_, text, _) = hosted.ctl(&["status"]);
    assert!(text.contains("Unavailable"), "{text}");
    // The plugin exited after saying login_required. A restart would come 1 s later (the
    // backoff's first step); after 1.5 s there is still only the first start.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(starts(hosted.dir.path()).len(), 1, "restarted by itself");

    // The hub refuses what the driver did not declare, without contacting it.
    let (code, _, err) = hosted.ctl(&["action", INSTANCE, "wipe"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(
        err.contains("did not declare the operator action wipe") && err.contains("not_declared"),
        "{err}"
    );
    // `login` needs a running plugin; the driver says so.
    let (code, _, err) = hosted.ctl(&["action", INSTANCE, "login"]);
    assert_eq!(code, Some(6), "{err}");
    assert!(err.contains("run channelctl resume first"), "{err}");

    let (code, out, err) = hosted.ctl(&["resume", INSTANCE]);
    assert_eq!(code, Some(0), "{out}{err}");
    hosted.wait_ready().await;
    let all = starts(hosted.dir.path());
    assert_eq!(all.len(), 2);
    assert_eq!(all[1]["reason"], "user", "the first start after resume is the user's");

    let (code, out, err) = hosted.ctl(&["action", INSTANCE, "login", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(answer["data"], json!({"login": "started"}));
    let action = received(hosted.dir.path(), "action");
    assert_eq!(action.len(), 1);
    assert_eq!(action[0]["params"], json!({"name": "login", "args": {}}));
}

#[test]
fn operator_actions_need_a_connected_driver() {
    let hub = HubProcess::start(&format!("[instance.\"{INSTANCE}\"]\nallow = [\"me\"]\n"));
    let out = hub.ctl(&["resume", INSTANCE]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("no driver connected") && err.contains("driver_offline"), "{err}");
    let out = hub.ctl(&["action", "nope.x", "resume"]);
    assert_eq!(out.status.code(), Some(4));
}

/// Runs `channeld-acecode` on `manifest` and returns its exit code and log.
fn run_with_manifest(dir: &Path, manifest: &Value) -> (Option<i32>, String) {
    let path =
        write_file(&dir.join("connectors/fake"), "channel-platform.json", &manifest.to_string());
    let out = Command::new(workspace_bin("channeld-acecode"))
        .env_clear()
        .env("CHANNELD_CHANNEL_ID", INSTANCE)
        .env("CHANNELD_SOCKET", dir.join("absent.sock"))
        .env("CHANNELD_ACECODE_MANIFEST", &path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn invalid_manifests_are_rejected_one_rule_at_a_time_with_exit_78() {
    let dir = tempfile::tempdir().unwrap();
    connector(dir.path(), json!([]));
    let valid = json!({
        "schema": "acecode.channel-platform.v1", "name": "fake", "label": "Fake IM",
        "command": "fake-plugin", "args": ["${manifest_dir}"], "account": "self",
    });
    let with = |key: &str, value: Value| {
        let mut m = valid.clone();
        m[key] = value;
        m
    };
    let cases = [
        (with("schema", json!("acecode.channel-platform.v0")), "schema must be"),
        (with("name", json!("Fake")), "name must match"),
        (with("label", json!("x".repeat(65))), "label must be 1-64 bytes"),
        (with("command", json!("missing-binary")), "is not an existing regular file"),
        (with("command", json!(".")), "is not an existing regular file"),
        (with("args", json!(vec!["a"; 33])), "args must be an array of at most 32"),
        (with("account", json!("bot")), "account must be \"self\""),
    ];
    for (manifest, rule) in cases {
        let (code, log) = run_with_manifest(dir.path(), &manifest);
        assert_eq!(code, Some(78), "{manifest}: {log}");
        assert!(log.contains("CHANNELD_ACECODE_MANIFEST") && log.contains(rule), "{rule}: {log}");
    }
}

#[test]
fn channelctl_writes_a_manifest_that_validates() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(workspace_bin("channelctl"))
        .args(["acecode-manifest", "mqtt"])
        .arg(dir.path().join("connectors/channeld-mqtt"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let path = dir.path().join("connectors/channeld-mqtt/channel-platform.json");
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(manifest["schema"], "acecode.channel-platform.v1");
    assert_eq!(manifest["name"], "mqtt");
    assert_eq!(manifest["account"], "self");
    assert_eq!(manifest["args"], json!(["--acecode"]));
    assert_eq!(
        manifest["command"],
        workspace_bin("channeld-mqtt").canonicalize().unwrap().display().to_string()
    );
    let out = Command::new(workspace_bin("channelctl"))
        .args(["acecode-manifest", "Not_A_Name"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
}

/// A test host playing ACECode for a driver run with `--acecode`.
struct Host {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    next: u64,
}

impl Host {
    async fn request(&mut self, method: &str, params: Value) -> u64 {
        self.next += 1;
        let line = json!({"id": self.next, "method": method, "params": params});
        self.stdin.write_all(format!("{line}\n").as_bytes()).await.unwrap();
        self.next
    }

    /// The next line that `matches`, skipping others (status events meanwhile).
    async fn next_where(&mut self, what: &str, matches: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WITHIN;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("{what} not seen within {WITHIN:?}"))
                .unwrap()
                .unwrap_or_else(|| panic!("the plugin closed stdout before {what}"));
            let value: Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
            assert!(value.is_object(), "{line}");
            if matches(&value) {
                return value;
            }
        }
    }

    async fn response(&mut self, id: u64) -> Value {
        self.next_where(&format!("response {id}"), |v| v["id"] == id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mqtt_driver_serves_acecode_as_a_plugin() {
    let broker = Mosquitto::start();
    let instance = "mqtt.acecode";
    let filter = format!("channeld/{instance}/in/+/+");
    provision_session(broker.port(), &format!("channeld-{instance}"), None, &[&filter]).await;
    let mut observer = MqttTestClient::connect(
        broker.port(),
        "observer",
        &[&format!("channeld/{instance}/out/+")],
    )
    .await;
    let mut me = MqttTestClient::connect(broker.port(), "me-phone", &[]).await;
    let mut child = tokio::process::Command::new(workspace_bin("channeld-mqtt"))
        .arg("--acecode")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CHANNELD_LOG", "debug")
        .env("CHANNELD_CHANNEL_ID", instance)
        .env("CHANNELD_MQTT_URL", broker.url())
        .env("CHANNELD_ACECODE_ACCOUNT", "me")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut host = Host { child, stdin, lines, next: 0 };

    let params = json!({"protocol_version": 1, "platform": "mqtt", "reason": "user", "settings": {"watched_groups": []}});
    let id = host.request("initialize", params).await;
    let init = host.response(id).await;
    assert_eq!(init["ok"], true, "{init}");
    assert_eq!(init["result"]["protocol_version"], 1);
    assert_eq!(init["result"]["capabilities"]["max_text_units"], 4000);
    assert_eq!(init["result"]["capabilities"]["supports_typing"], false);
    let connected = host
        .next_where("status connected", |v| {
            v["event"] == "status" && v["params"]["state"] == "connected"
        })
        .await;
    assert_eq!(connected["params"]["account"], "me");

    let ping = json!({"text": "ping from me", "id": "1"}).to_string();
    me.publish_confirmed(&format!("channeld/{instance}/in/me/me"), ping).await;
    let inbound = host.next_where("inbound", |v| v["event"] == "inbound").await;
    assert_eq!(inbound["params"]["text"], "ping from me");
    assert_eq!(
        inbound["params"]["address"],
        json!({"kind": "private", "chat": "me", "sender": "me"})
    );

    let reply_context = inbound["params"]["reply_context"].clone();
    let send = json!({"address": {"kind": "private", "chat": "me", "sender": "me"}, "text": "pong", "reply_context": reply_context});
    let id = host.request("send_text", send).await;
    let sent = host.response(id).await;
    assert_eq!(sent, json!({"id": id, "ok": true, "result": {"outcome": "sent"}}));
    let published = observer.next_message(WITHIN).await;
    assert_eq!(published.topic, format!("channeld/{instance}/out/me"));
    let payload: Value = serde_json::from_slice(&published.payload).unwrap();
    assert_eq!(payload["text"], "pong");

    let id = host.request("action", json!({"name": "login", "args": {}})).await;
    let refused = host.response(id).await;
    assert_eq!(refused["ok"], false, "{refused}");
    let id = host
        .request(
            "send_file",
            json!({"address": {"kind": "private", "chat": "me"}, "path": "/etc/hostname"}),
        )
        .await;
    assert_eq!(host.response(id).await["result"]["outcome"], "failed");

    let id = host.request("shutdown", json!({})).await;
    assert_eq!(host.response(id).await["ok"], true);
    drop(host.stdin);
    let status = tokio::time::timeout(WITHIN, host.child.wait())
        .await
        .expect("exit after shutdown")
        .unwrap();
    assert!(status.success(), "{status}");
}
