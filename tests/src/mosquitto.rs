//! A real mosquitto broker for tests, and a small MQTT client to talk to it.
//!
//! [`Mosquitto`] writes a config into a temp dir (a listener on a free 127.0.0.1 port,
//! persistence, optionally users and an ACL), starts `mosquitto -c`, waits until it accepts
//! connections, can restart it on the same port with its persisted sessions, and stops it by
//! PID on drop. A missing mosquitto binary fails the test with the fix; it never skips.
//!
//! [`MqttTestClient`] publishes with confirmation (each publish waits for its PUBACK and is
//! sent again across broker outages, so nothing the test publishes is lost) and collects what
//! its subscriptions receive.

use std::fs::{File, OpenOptions};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, Publish, QoS, SubscribeFilter};
use tempfile::TempDir;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// How long the broker may take to accept connections after being started.
const READY_WITHIN: Duration = Duration::from_secs(10);
/// How long a stopped broker may take to save its state and exit.
const EXIT_WITHIN: Duration = Duration::from_secs(10);
/// Messages a test client buffers before its event loop waits for the test to read them.
const RECEIVED_BUFFER: usize = 16 * 1024;
/// How long a confirmed publish waits for its PUBACK before sending it again.
const PUBACK_WAIT: Duration = Duration::from_secs(5);

/// Where the mosquitto binary is: `$PATH` first, then Debian's `/usr/sbin`.
pub fn mosquitto_binary() -> PathBuf {
    find_binary("mosquitto").unwrap_or_else(|| {
        panic!(
            "the mosquitto binary is missing (looked in $PATH and /usr/sbin): install it with \
             `apt-get install -y mosquitto` (scripts/test does this)"
        )
    })
}

fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into(), "/sbin".into()])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// What the broker's config allows.
#[derive(Debug, Clone)]
pub struct MosquittoOptions {
    /// Keep sessions and queued messages across restarts.
    pub persistence: bool,
    /// Users and passwords; when not empty, anonymous clients are refused.
    pub users: Vec<(String, String)>,
    /// ACL file contents (mosquitto's `acl_file` syntax), if any.
    pub acl: Option<String>,
    /// QoS 1 messages the broker queues per client beyond those in flight.
    pub queue: BrokerQueue,
}

/// `max_queued_messages` in the broker's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerQueue {
    /// `0`: no limit (the tests' usual broker loses nothing to its queue).
    Unlimited,
    /// Not set: mosquitto's default (1,000), beyond which it drops messages for the client.
    BrokerDefault,
    /// This many.
    Messages(u32),
}

impl Default for MosquittoOptions {
    fn default() -> Self {
        Self { persistence: true, users: Vec::new(), acl: None, queue: BrokerQueue::Unlimited }
    }
}

/// A running mosquitto on a loopback port. Killed on drop.
#[derive(Debug)]
pub struct Mosquitto {
    dir: TempDir,
    port: u16,
    child: Option<Child>,
}

impl Mosquitto {
    /// Anonymous access, persistence on.
    pub fn start() -> Self {
        Self::start_with(MosquittoOptions::default())
    }

    pub fn start_with(options: MosquittoOptions) -> Self {
        let binary = mosquitto_binary();
        let dir = tempfile::Builder::new().prefix("mosquitto-").tempdir().expect("temp dir");
        let mut extra = String::new();
        if !options.users.is_empty() {
            let passwords = dir.path().join("passwords");
            File::create(&passwords).expect("create password file");
            let passwd = find_binary("mosquitto_passwd")
                .expect("mosquitto_passwd is missing (it comes with the mosquitto package)");
            for (user, password) in &options.users {
                let status = Command::new(&passwd)
                    .arg("-b")
                    .arg(&passwords)
                    .arg(user)
                    .arg(password)
                    .stdout(Stdio::null())
                    .status()
                    .expect("run mosquitto_passwd");
                assert!(status.success(), "mosquitto_passwd failed for {user}");
            }
            extra.push_str(&format!("password_file {}\n", passwords.display()));
        }
        if let Some(acl) = &options.acl {
            let path = dir.path().join("acl");
            std::fs::write(&path, acl).expect("write acl file");
            extra.push_str(&format!("acl_file {}\n", path.display()));
        }
        match options.queue {
            BrokerQueue::Unlimited => extra.push_str("max_queued_messages 0\n"),
            BrokerQueue::BrokerDefault => {}
            BrokerQueue::Messages(limit) => {
                extra.push_str(&format!("max_queued_messages {limit}\n"));
            }
        }
        let anonymous = options.users.is_empty();
        let mut dir = dir;
        // The port is picked free, then bound by mosquitto: another process may take it in
        // between, so a failed start tries another port.
        for _ in 0..5 {
            let port = free_port();
            let config = format!(
                "listener {port} 127.0.0.1\n\
                 allow_anonymous {anonymous}\n\
                 persistence {persistence}\n\
                 persistence_location {dir}/\n\
                 set_tcp_nodelay true\n\
                 user root\n\
                 log_dest stderr\n\
                 log_type error\nlog_type warning\nlog_type notice\nlog_type information\n\
                 {extra}",
                persistence = options.persistence,
                dir = dir.path().display(),
            );
            std::fs::write(dir.path().join("mosquitto.conf"), config).expect("write config");
            let mut broker = Self { dir, port, child: None };
            match broker.spawn(&binary) {
                Ok(()) => return broker,
                Err(reason) => {
                    eprintln!("mosquitto did not start on port {port} ({reason}); trying another");
                    dir = broker.take_dir();
                }
            }
        }
        panic!("mosquitto did not start on any of 5 ports");
    }

    fn take_dir(mut self) -> TempDir {
        self.kill();
        let placeholder = tempfile::tempdir().expect("temp dir");
        std::mem::replace(&mut self.dir, placeholder)
    }

    fn spawn(&mut self, binary: &Path) -> Result<(), String> {
        let logged_before = self.log().len();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open broker log");
        let child = Command::new(binary)
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", binary.display()));
        self.child = Some(child);
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Err(format!("exited with {status}; log:\n{}", self.log()));
            }
            // This run logged its listener and is alive: it is our broker that answers, not
            // another process on the port.
            let listening = self
                .log()
                .get(logged_before..)
                .is_some_and(|new| new.contains(&format!("listen socket on port {}", self.port)));
            if listening && TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("not accepting within {READY_WITHIN:?}; log:\n{}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `mqtt://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("mosquitto.log")
    }

    /// Everything the broker logged, across restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// SIGTERM (mosquitto saves its persistent state) and waits for the exit.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: a plain syscall on our own child's PID.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + EXIT_WITHIN;
        while child.try_wait().expect("wait mosquitto").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("mosquitto did not exit within {EXIT_WITHIN:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL: a crash, nothing saved since the last autosave.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the broker again on the same port with the same config and state.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "mosquitto is still running");
        let binary = mosquitto_binary();
        if let Err(reason) = self.spawn(&binary) {
            panic!("mosquitto did not restart on port {}: {reason}", self.port);
        }
    }

    /// Graceful stop, then start on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            eprintln!("---- mosquitto log (last 40 lines) ----\n{tail}");
        }
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// Creates the persistent session of `client_id` with its subscriptions (QoS 1), as an
/// operator provisioning a driver would: the broker then queues matching messages until the
/// driver connects with that client id, so a test can publish before the driver is up.
pub async fn provision_session(
    port: u16,
    client_id: &str,
    login: Option<(&str, &str)>,
    filters: &[&str],
) {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options.set_clean_session(false);
    if let Some((user, password)) = login {
        options.set_credentials(user, password);
    }
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    let subscriptions: Vec<SubscribeFilter> =
        filters.iter().map(|f| SubscribeFilter::new((*f).to_owned(), QoS::AtLeastOnce)).collect();
    let provision = async {
        loop {
            match eventloop.poll().await.expect("provisioning connection") {
                Event::Incoming(Packet::ConnAck(_)) => {
                    client.subscribe_many(subscriptions.clone()).await.expect("subscribe");
                }
                Event::Incoming(Packet::SubAck(ack)) => {
                    assert!(
                        ack.return_codes
                            .iter()
                            .all(|code| !matches!(code, rumqttc::SubscribeReasonCode::Failure)),
                        "the broker refused a provisioned subscription"
                    );
                    client.disconnect().await.expect("disconnect");
                }
                Event::Outgoing(Outgoing::Disconnect) => return,
                _ => {}
            }
        }
    };
    tokio::time::timeout(READY_WITHIN, provision).await.expect("provisioning timed out");
}

/// What a test client's event loop tells the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Notice {
    Sent(u16),
    Acked(u16),
    Disconnected,
}

/// A test MQTT client (clean session, auto acks) with a background event loop.
#[derive(Debug)]
pub struct MqttTestClient {
    client: AsyncClient,
    connected: watch::Receiver<bool>,
    notices: mpsc::UnboundedReceiver<Notice>,
    received: mpsc::Receiver<Publish>,
    task: JoinHandle<()>,
}

impl MqttTestClient {
    /// Connects anonymously to the broker at `port`, subscribing (again after every reconnect)
    /// to `filters` at QoS 1.
    pub async fn connect(port: u16, client_id: &str, filters: &[&str]) -> Self {
        Self::connect_as(port, client_id, None, filters).await
    }

    /// Like [`connect`](Self::connect) with a user and password.
    pub async fn connect_as(
        port: u16,
        client_id: &str,
        login: Option<(&str, &str)>,
        filters: &[&str],
    ) -> Self {
        let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        options.set_max_packet_size(1 << 20, 1 << 20);
        if let Some((user, password)) = login {
            options.set_credentials(user, password);
        }
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (connected_tx, connected) = watch::channel(false);
        let (notice_tx, notices) = mpsc::unbounded_channel();
        let (received_tx, received) = mpsc::channel(RECEIVED_BUFFER);
        let filters: Vec<String> = filters.iter().map(|f| (*f).to_owned()).collect();
        let subscriber = client.clone();
        let task = tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        if !filters.is_empty() {
                            let subscription = filters
                                .iter()
                                .map(|f| SubscribeFilter::new(f.clone(), QoS::AtLeastOnce));
                            let _ = subscriber.try_subscribe_many(subscription);
                        }
                        connected_tx.send_replace(true);
                    }
                    Ok(Event::Incoming(Packet::Publish(publish))) => {
                        if received_tx.send(publish).await.is_err() {
                            return;
                        }
                    }
                    Ok(Event::Incoming(Packet::PubAck(ack))) => {
                        let _ = notice_tx.send(Notice::Acked(ack.pkid));
                    }
                    Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                        let _ = notice_tx.send(Notice::Sent(pkid));
                    }
                    Ok(_) => {}
                    Err(_) => {
                        connected_tx.send_replace(false);
                        let _ = notice_tx.send(Notice::Disconnected);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        let mut test_client = Self { client, connected, notices, received, task };
        test_client.wait_connected().await;
        test_client
    }

    async fn wait_connected(&mut self) {
        tokio::time::timeout(READY_WITHIN, self.connected.wait_for(|up| *up))
            .await
            .expect("test MQTT client did not connect")
            .expect("test MQTT client event loop ended");
    }

    /// Publishes at QoS 1 and waits for the broker's PUBACK, publishing again after a
    /// disconnect or a lost ack (the broker may then hold the message twice).
    pub async fn publish_confirmed(&mut self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.publish_confirmed_with(topic, payload.into(), false).await;
    }

    /// Like [`publish_confirmed`](Self::publish_confirmed), as the topic's retained message.
    pub async fn publish_retained(&mut self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.publish_confirmed_with(topic, payload.into(), true).await;
    }

    async fn publish_confirmed_with(&mut self, topic: &str, payload: Vec<u8>, retain: bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < deadline, "could not publish to {topic} within 60 s");
            self.wait_connected().await;
            while self.notices.try_recv().is_ok() {}
            self.client
                .publish(topic, QoS::AtLeastOnce, retain, payload.clone())
                .await
                .expect("test client publish");
            if self.await_puback().await {
                return;
            }
        }
    }

    async fn await_puback(&mut self) -> bool {
        let mut sent = None;
        let wait = async {
            while let Some(notice) = self.notices.recv().await {
                match notice {
                    Notice::Sent(pkid) if sent.is_none() => sent = Some(pkid),
                    Notice::Acked(pkid) if Some(pkid) == sent => return true,
                    Notice::Disconnected => return false,
                    _ => {}
                }
            }
            false
        };
        tokio::time::timeout(PUBACK_WAIT, wait).await.unwrap_or(false)
    }

    /// Publishes `messages` (topic, payload) at QoS 1 as fast as the client's window allows
    /// (pipelined, not one at a time), and waits until the broker acknowledged every one.
    /// Nothing is published again: the connection must stay up.
    pub async fn publish_burst(&mut self, messages: Vec<(String, Vec<u8>)>) {
        self.wait_connected().await;
        while self.notices.try_recv().is_ok() {}
        let total = messages.len();
        let client = self.client.clone();
        let publisher = tokio::spawn(async move {
            for (topic, payload) in messages {
                client.publish(topic, QoS::AtLeastOnce, false, payload).await.expect("publish");
            }
        });
        let mut acked = 0;
        let deadline = Duration::from_secs(60);
        while acked < total {
            match tokio::time::timeout(deadline, self.notices.recv()).await {
                Ok(Some(Notice::Acked(_))) => acked += 1,
                Ok(Some(Notice::Disconnected)) => panic!("disconnected after {acked} PUBACKs"),
                Ok(Some(Notice::Sent(_))) => {}
                Ok(None) | Err(_) => panic!("only {acked} of {total} PUBACKs"),
            }
        }
        publisher.await.expect("burst publisher");
    }

    /// Publishes at QoS 0 without waiting.
    pub async fn publish_unconfirmed(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.client
            .publish(topic, QoS::AtMostOnce, false, payload.into())
            .await
            .expect("test client publish");
    }

    /// The next message received on a subscription, or `None` after `limit`.
    pub async fn next_within(&mut self, limit: Duration) -> Option<Publish> {
        tokio::time::timeout(limit, self.received.recv()).await.ok().flatten()
    }

    /// The next message received on a subscription; panics after `limit`.
    pub async fn next_message(&mut self, limit: Duration) -> Publish {
        self.next_within(limit).await.unwrap_or_else(|| panic!("no MQTT message within {limit:?}"))
    }

    /// Messages already received, without waiting.
    pub fn drain(&mut self) -> Vec<Publish> {
        let mut messages = Vec::new();
        while let Ok(message) = self.received.try_recv() {
            messages.push(message);
        }
        messages
    }
}

impl Drop for MqttTestClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}
