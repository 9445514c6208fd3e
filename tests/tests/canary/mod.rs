//! The canary harness shared by the secrets tests: a driver process with its log, everything
//! an operator or a peer could see collected in one place, and two exercises — through a real
//! hub (`channelctl` in text and `--json`, probes, sends that fail, shutdown) and on a bare
//! socket that records every line the driver writes.

use std::fs::OpenOptions;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use channeld_protocol::frame::{Delivery, HealthRequest, HelloAck};
use channeld_protocol::types::{HealthState, MessageBody, OutboundMessage};
use channeld_protocol::{Frame, frame};
use channeld_tests::peer::{id, target};
use channeld_tests::{HubProcess, workspace_bin, write_file};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

/// How long a driver may take to reach the expected health.
const SETTLE_WITHIN: Duration = Duration::from_secs(45);

/// A fresh secret that nothing else could print by chance.
pub fn canary(tag: &str) -> String {
    format!("canary-{tag}-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// A TCP port on loopback that nothing listens on.
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// A `LoadCredential=` directory holding one credential, as systemd lays it out.
pub fn credentials(name: &str, value: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("credentials-").tempdir().expect("temp dir");
    write_file(dir.path(), name, &format!("{value}\n"));
    dir
}

/// A driver process whose stderr goes to a file. Killed on drop.
struct Driver {
    child: Child,
    log: PathBuf,
}

impl Driver {
    fn spawn(
        binary: &str,
        socket: &Path,
        channel: &str,
        env: &[(&str, String)],
        dir: &Path,
    ) -> Self {
        let log = dir.join(format!("{channel}.driver.log"));
        let stderr = OpenOptions::new().create(true).append(true).open(&log).expect("driver log");
        let mut command = Command::new(workspace_bin(binary));
        command
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", channel)
            .env("CHANNELD_SOCKET", socket)
            // Everything the driver can log, including its libraries.
            .env("CHANNELD_LOG", "trace")
            .env("RUST_LOG", "trace")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.spawn().unwrap_or_else(|err| panic!("spawn {binary}: {err}"));
        Self { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM (the drain path logs too) and waits for the exit.
    fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: a plain syscall on our own child's PID.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait driver") {
                return status;
            }
            assert!(Instant::now() < deadline, "driver ignored SIGTERM:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}

/// Everything an operator or a peer could see, labelled, to search for a canary.
#[derive(Default)]
struct Exposed(Vec<(String, String)>);

impl Exposed {
    fn add(&mut self, what: impl Into<String>, text: impl Into<String>) {
        self.0.push((what.into(), text.into()));
    }

    fn add_output(&mut self, what: &str, output: &std::process::Output) {
        self.add(format!("{what} stdout"), String::from_utf8_lossy(&output.stdout));
        self.add(format!("{what} stderr"), String::from_utf8_lossy(&output.stderr));
    }

    fn assert_free_of(&self, canaries: &[&str]) {
        for canary in canaries {
            for (what, text) in &self.0 {
                assert!(!text.contains(canary), "the secret {canary} leaked into {what}:\n{text}");
            }
        }
        assert!(self.0.iter().any(|(_, text)| !text.is_empty()), "nothing was captured");
    }
}

/// What the driver should end up reporting, by the SDK's one health rule: transient
/// trouble is Degraded, a condition only an operator can fix is Unavailable with a reason.
// Each secrets test includes this module and uses the cases its platform has.
#[allow(dead_code)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// Nothing listens: Degraded, transport `disconnected`, no reason; a send fails (exit 6).
    Unreachable,
    /// The login is refused: Unavailable, reason `auth_rejected`, auth `rejected`; a send
    /// fails (exit 6).
    Rejecting,
    /// The login works: Ready, transport `connected`, auth `ok`; a send is receipted (exit 0).
    Accepting,
    /// The session token is refused as expired (platforms with login sessions, e.g. WeChat's
    /// `-14`): Unavailable, reason `auth_expired`, auth `expired`; a send fails (exit 6).
    Expiring,
}

impl Broker {
    /// `(state, transport, auth, reason)` the health must show (`null` for absent fields).
    fn expected_health(self) -> (&'static str, &'static str, Value, Value) {
        match self {
            Broker::Unreachable => ("Degraded", "disconnected", Value::Null, Value::Null),
            Broker::Rejecting => {
                ("Unavailable", "disconnected", "rejected".into(), "auth_rejected".into())
            }
            Broker::Accepting => ("Ready", "connected", "ok".into(), Value::Null),
            Broker::Expiring => {
                ("Unavailable", "disconnected", "expired".into(), "auth_expired".into())
            }
        }
    }

    /// The `channelctl send` exit status: 0 receipted, 6 the driver said the send failed (it
    /// has no broker connection to post on).
    fn send_exit(self) -> i32 {
        match self {
            Broker::Accepting => 0,
            Broker::Unreachable | Broker::Rejecting | Broker::Expiring => 6,
        }
    }
}

/// Runs `binary` for `channel` against a real hub with `env`, waits for the health the
/// broker implies, exercises probes, a send and shutdown, and asserts no canary is exposed.
pub async fn through_the_hub(
    binary: &str,
    channel: &str,
    broker: Broker,
    env: &[(&str, String)],
    canaries: &[&str],
) {
    through_the_hub_to(binary, channel, broker, env, canaries, "room").await;
}

/// [`through_the_hub`] with the sends addressed to `conversation` (a platform whose
/// conversations are addresses, such as a Nostr npub).
pub async fn through_the_hub_to(
    binary: &str,
    channel: &str,
    broker: Broker,
    env: &[(&str, String)],
    canaries: &[&str],
    conversation: &str,
) {
    let hub = HubProcess::start(&format!(
        "[hub]\nhealth_probe_interval_secs = 1\n[instance.\"{channel}\"]\nallow_all = true\n"
    ));
    let mut driver = Driver::spawn(binary, &hub.socket(channel), channel, env, hub.dir.path());
    let (state, transport, auth, reason) = broker.expected_health();
    let deadline = Instant::now() + SETTLE_WITHIN;
    let settled = loop {
        let status = hub.instance_status(channel);
        let health = &status["health"];
        if status["connected"] == true
            && health["state"] == state
            && health["status"]["transport"] == transport
        {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "{channel} not {state} ({transport}) within {SETTLE_WITHIN:?}: {status}\n{}",
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let health = &settled["health"];
    assert_eq!(health["status"]["auth"], auth, "{settled}");
    assert_eq!(health["status"]["reason"], reason, "{settled}");
    if broker != Broker::Accepting {
        let detail = health["detail"].as_str().unwrap_or_default();
        assert!(!detail.is_empty(), "trouble without an explanation: {settled}");
    }

    let mut exposed = Exposed::default();
    exposed.add("status while settled", settled.to_string());
    for args in [
        vec!["health", channel],
        vec!["health", channel, "--json"],
        vec!["status"],
        vec!["status", "--json"],
    ] {
        let out = hub.ctl(&args);
        // `health` exits 9 when it finds the instance Unavailable (refused credentials may).
        let unavailable =
            args[0] == "health" && String::from_utf8_lossy(&out.stdout).contains("Unavailable");
        let expected = if unavailable { 9 } else { 0 };
        assert_eq!(out.status.code(), Some(expected), "channelctl {args:?}: {out:?}");
        exposed.add_output(&format!("channelctl {}", args.join(" ")), &out);
    }
    let send = ["send", channel, "--conversation", conversation, "--timeout", "10", "hello"];
    for json in [false, true] {
        let mut args = send.to_vec();
        if json {
            args.push("--json");
        }
        let out = hub.ctl(&args);
        assert_eq!(out.status.code(), Some(broker.send_exit()), "send: {out:?}\n{}", driver.log());
        exposed.add_output(&format!("channelctl {}", args.join(" ")), &out);
    }
    exposed.add("status after the sends", hub.instance_status(channel).to_string());
    let exit = driver.terminate();
    assert_eq!(
        exit.code(),
        Some(0),
        "the driver did not drain cleanly on SIGTERM: {exit:?}\n{}",
        driver.log()
    );
    exposed.add(format!("{binary} log"), driver.log());
    exposed.add("hub log", hub.log());
    exposed.assert_free_of(canaries);
    if broker != Broker::Accepting {
        // The failure was exercised, so the error paths' output is part of what was checked.
        let status = hub.instance_status(channel);
        assert!(status["last_error"].is_string() || status["counters"]["errors"] != 0, "{status}");
    }
}

/// Plays the hub on a bare socket, recording every line the driver writes: answers `hello`,
/// waits for a health report that is not Ready, then sends a probe and an outbound that cannot be
/// posted, and stops the driver. Asserts no line carries a canary.
pub async fn every_frame_on_the_wire(
    binary: &str,
    channel: &str,
    env: &[(&str, String)],
    canaries: &[&str],
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("hub.sock");
    let listener = UnixListener::bind(&socket).expect("bind fake hub");
    let mut driver = Driver::spawn(binary, &socket, channel, env, dir.path());
    let (stream, _) = tokio::time::timeout(SETTLE_WITHIN, listener.accept())
        .await
        .expect("the driver did not connect")
        .expect("accept");
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut wire: Vec<String> = Vec::new();
    let mut next = async |wire: &mut Vec<String>| -> Option<Frame> {
        let line = tokio::time::timeout(SETTLE_WITHIN, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no frame within {SETTLE_WITHIN:?}; wire: {wire:#?}"))
            .expect("read from driver")?;
        let decoded = frame::decode(line.as_bytes());
        wire.push(line);
        Some(decoded.unwrap_or_else(|err| panic!("undecodable line from the driver: {err}")))
    };

    let hello = match next(&mut wire).await {
        Some(Frame::Hello(hello)) => hello,
        other => panic!("expected hello, got {other:?}"),
    };
    let ack = Frame::HelloAck(HelloAck {
        request_id: hello.request_id.clone(),
        extensions: hello.extensions.clone(),
        hub: "secrets-test".into(),
    });
    write.write_all(&frame::encode(&ack).expect("encode")).await.expect("send hello_ack");
    loop {
        match next(&mut wire).await {
            Some(Frame::Health(report)) if report.health.state != HealthState::Ready => break,
            Some(_) => {}
            None => panic!("the driver left before reporting its trouble; wire: {wire:#?}"),
        }
    }
    let probe = Frame::HealthRequest(HealthRequest { request_id: id("probe-1") });
    let outbound = Frame::Outbound(Delivery {
        request_id: id("send-1"),
        message: OutboundMessage {
            target: target(channel, "room"),
            body: MessageBody::text("hello").expect("body"),
            metadata: Default::default(),
        },
    });
    for frame in [&probe, &outbound] {
        write.write_all(&frame::encode(frame).expect("encode")).await.expect("send frame");
    }
    let (mut probed, mut answered) = (false, false);
    while !(probed && answered) {
        match next(&mut wire).await {
            Some(Frame::HealthResponse(response)) if response.request_id.as_str() == "probe-1" => {
                assert_ne!(response.health.state, HealthState::Ready);
                probed = true;
            }
            Some(Frame::Error(err))
                if err.request_id.as_ref().is_some_and(|r| r.as_str() == "send-1") =>
            {
                answered = true;
            }
            Some(Frame::Receipt(receipt)) => panic!("posted without a broker: {receipt:?}"),
            Some(_) => {}
            None => panic!("the driver left before answering; wire: {wire:#?}"),
        }
    }
    let exit = driver.terminate();
    assert_eq!(exit.code(), Some(0), "the driver did not drain cleanly on SIGTERM: {exit:?}");
    while next(&mut wire).await.is_some() {}
    let mut exposed = Exposed::default();
    exposed.add("frames the driver wrote", wire.join("\n"));
    exposed.add(format!("{binary} log"), driver.log());
    exposed.assert_free_of(canaries);
}
