//! A real RabbitMQ broker for tests, and a small AMQP client to talk to it.
//!
//! [`RabbitMq`] runs `rabbitmq-server` as an isolated node: its own node name, AMQP port,
//! distribution port and epmd (started by the harness on its own port, so parallel tests never
//! share one), with config, Erlang cookie, mnesia and logs in a temp dir. It waits with
//! `rabbitmqctl await_startup`, creates users, forces connections closed, restarts the node on
//! the same ports and data (durable queues and persistent messages survive), and on drop stops
//! the node with `rabbitmqctl stop` and kills its epmd by PID. A missing `rabbitmq-server`
//! fails the test with the fix; it never skips.
//!
//! [`AmqpTestClient`] publishes with confirms and `mandatory`, and [`Collector`] gathers what
//! a queue receives.

use std::fs::File;
use std::future::{Future, poll_fn};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer};
use tempfile::TempDir;

/// How long the node may take to boot.
const READY_WITHIN: Duration = Duration::from_secs(90);
/// How long one `rabbitmqctl` call may take.
const CTL_WITHIN: Duration = Duration::from_secs(60);
/// How long a stopped node may take to exit.
const EXIT_WITHIN: Duration = Duration::from_secs(30);
/// The server script itself. Debian's `/usr/sbin/rabbitmq-server` wrapper switches to the
/// `rabbitmq` user and its fixed directories; the script runs the node as the test user.
const SERVER_SCRIPTS: &[&str] = &["/usr/lib/rabbitmq/bin", "/usr/lib/rabbitmq/sbin"];

/// Where `rabbitmq-server`'s own scripts are.
fn script_dir() -> PathBuf {
    SERVER_SCRIPTS
        .iter()
        .map(PathBuf::from)
        .find(|dir| dir.join("rabbitmq-server").is_file() && dir.join("rabbitmqctl").is_file())
        .unwrap_or_else(|| {
            panic!(
                "rabbitmq-server is missing (looked for rabbitmq-server and rabbitmqctl in {}): \
                 install it with `apt-get install -y --no-install-recommends rabbitmq-server` \
                 (scripts/test does this)",
                SERVER_SCRIPTS.join(", ")
            )
        })
}

/// The `epmd` binary that comes with Erlang.
fn epmd_binary() -> PathBuf {
    ["/usr/bin/epmd", "/usr/local/bin/epmd"]
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .or_else(|| {
            let lib = std::fs::read_dir("/usr/lib/erlang").ok()?;
            lib.flatten()
                .map(|entry| entry.path().join("bin/epmd"))
                .find(|path| path.is_file())
        })
        .unwrap_or_else(|| {
            panic!("epmd is missing: it comes with rabbitmq-server's Erlang (apt-get install -y --no-install-recommends rabbitmq-server)")
        })
}

/// A free loopback port (bound and released; the broker binds it next).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("find a free loopback port")
}

fn wait_for_port(
    port: u16,
    limit: Duration,
    mut alive: impl FnMut() -> Result<(), String>,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(());
        }
        alive()?;
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("nothing listened on 127.0.0.1:{port} within {limit:?}"))
}

/// Runs `command` and waits at most `limit` for it, killing it when it overruns.
fn run_bounded(mut command: Command, limit: Duration) -> Result<Output, String> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| format!("cannot run rabbitmqctl: {err}"))?;
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => {
                return child
                    .wait_with_output()
                    .map_err(|err| format!("rabbitmqctl output: {err}"));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let stderr = child
                    .wait_with_output()
                    .map(|out| String::from_utf8_lossy(&out.stderr).into_owned())
                    .unwrap_or_default();
                return Err(format!(
                    "rabbitmqctl did not finish within {limit:?}; stderr:\n{stderr}"
                ));
            }
        }
    }
}

fn signal(pid: u32, signal: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: plain syscall on a process this harness started.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// The direct children of `pid` (from `/proc/<pid>/task/*/children`).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>()
        })
        .collect()
}

fn wait_exit(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return true,
            Ok(None) if Instant::now() >= deadline => return false,
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A running RabbitMQ node on loopback ports. Stopped on drop.
#[derive(Debug)]
pub struct RabbitMq {
    dir: TempDir,
    node: String,
    port: u16,
    dist_port: u16,
    epmd_port: u16,
    epmd: Child,
    server: Option<Child>,
    /// Frozen by [`pause`](RabbitMq::pause) (SIGSTOP) and not resumed yet.
    paused: bool,
}

impl RabbitMq {
    /// Starts a fresh node (only the default `guest` user, which may log in from loopback).
    pub fn start() -> Self {
        static NODES: AtomicUsize = AtomicUsize::new(0);
        script_dir();
        let dir =
            tempfile::Builder::new().prefix("channeld-rabbitmq-").tempdir().expect("temp dir");
        let (port, dist_port, epmd_port) = (free_port(), free_port(), free_port());
        let node = format!(
            "channeld-test-{}-{}-{port}@localhost",
            std::process::id(),
            NODES.fetch_add(1, Ordering::Relaxed)
        );
        for sub in ["mnesia", "log"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("broker dirs");
        }
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").expect("plugins file");
        std::fs::write(dir.path().join("rabbitmq-env.conf"), "").expect("env file");
        write_config(dir.path(), port);

        let epmd_log = File::create(dir.path().join("epmd.log")).expect("epmd log");
        let mut epmd = Command::new(epmd_binary())
            .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(epmd_log.try_clone().expect("epmd log"))
            .stderr(epmd_log)
            .spawn()
            .expect("start epmd");
        let epmd_up = wait_for_port(epmd_port, Duration::from_secs(10), || match epmd.try_wait() {
            Ok(Some(status)) => Err(format!("epmd exited with {status}")),
            _ => Ok(()),
        });
        if let Err(why) = epmd_up {
            let _ = epmd.kill();
            let _ = epmd.wait();
            panic!("{why}");
        }
        let mut broker =
            Self { dir, node, port, dist_port, epmd_port, epmd, server: None, paused: false };
        // Free ports are picked before the node binds them: a test starting beside this one
        // may take one first, and the node then fails at boot. Such a boot is tried again
        // on new ports (a node that fails for another reason fails every time).
        for attempt in 1.. {
            match broker.try_boot() {
                Ok(()) => break,
                Err(why) if attempt < 3 => {
                    eprintln!("rabbitmq boot attempt {attempt} failed, new ports: {why}");
                    broker.kill_server();
                    (broker.port, broker.dist_port) = (free_port(), free_port());
                    // The config's listener wins over RABBITMQ_NODE_PORT.
                    write_config(broker.dir.path(), broker.port);
                    broker.node = format!(
                        "channeld-test-{}-{}-{}@localhost",
                        std::process::id(),
                        NODES.fetch_add(1, Ordering::Relaxed),
                        broker.port
                    );
                }
                Err(why) => panic!("{why}"),
            }
        }
        broker
    }

    /// Kills the node: the script's children (the Erlang VM) first, then the script.
    fn kill_server(&mut self) {
        if let Some(mut server) = self.server.take() {
            for pid in children_of(server.id()) {
                signal(pid, libc::SIGKILL);
            }
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// The node's environment, shared by the server and `rabbitmqctl`.
    fn command(&self, program: &str) -> Command {
        let dir = self.dir.path();
        let mut command = Command::new(script_dir().join(program));
        command
            .env("HOME", dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            .current_dir(dir);
        command
    }

    /// Starts the node and waits until it serves AMQP.
    fn boot(&mut self) {
        if let Err(why) = self.try_boot() {
            panic!("{why}");
        }
    }

    fn try_boot(&mut self) -> Result<(), String> {
        let out = File::create(self.dir.path().join("server.out")).expect("server log");
        let server = self
            .command("rabbitmq-server")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("server log"))
            .stderr(out)
            .spawn()
            .expect("start rabbitmq-server");
        self.server = Some(server);
        let port = self.port;
        let log_dir = self.dir.path().to_path_buf();
        let server = self.server.as_mut().expect("just started");
        let exited = |server: &mut Child| match server.try_wait() {
            Ok(Some(status)) => Err(format!(
                "rabbitmq-server exited with {status} before serving AMQP; output:\n{}",
                read_log(&log_dir.join("server.out"))
            )),
            _ => Ok(()),
        };
        wait_for_port(port, READY_WITHIN, || exited(server))?;
        let ready = self.ctl(&["await_startup", "--timeout", "60"]);
        if !ready.status.success() {
            return Err(format!(
                "rabbitmqctl await_startup failed: {}{}",
                String::from_utf8_lossy(&ready.stderr),
                self.log()
            ));
        }
        Ok(())
    }

    /// The AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The node name (`RABBITMQ_NODENAME`).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// `amqp://user:password@127.0.0.1:port/%2f`.
    pub fn url(&self, user: &str, password: &str) -> String {
        format!("amqp://{user}:{password}@127.0.0.1:{}/%2f", self.port)
    }

    /// The URL of the default `guest` user.
    pub fn guest_url(&self) -> String {
        self.url("guest", "guest")
    }

    /// Runs `rabbitmqctl <args>` against this node; panics if it cannot run or hangs.
    pub fn ctl(&self, args: &[&str]) -> Output {
        self.try_ctl(args).unwrap_or_else(|err| panic!("{err}"))
    }

    fn try_ctl(&self, args: &[&str]) -> Result<Output, String> {
        let mut command = self.command("rabbitmqctl");
        command.args(args);
        run_bounded(command, CTL_WITHIN)
    }

    fn ctl_ok(&self, args: &[&str]) -> String {
        let output = self.ctl(args);
        assert!(
            output.status.success(),
            "rabbitmqctl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Adds a user with full permissions on the default virtual host.
    pub fn add_user(&self, user: &str, password: &str) {
        self.ctl_ok(&["add_user", user, password]);
        self.ctl_ok(&["set_permissions", "-p", "/", user, ".*", ".*", ".*"]);
    }

    /// Closes every client connection, as an operator or a failover would.
    pub fn close_all_connections(&self) {
        self.ctl_ok(&["close_all_connections", "closed by the test"]);
    }

    /// `(ready, unacknowledged)` message counts of a queue, `None` if it does not exist.
    pub fn queue_counts(&self, queue: &str) -> Option<(u64, u64)> {
        let listing = self.ctl_ok(&[
            "-q",
            "list_queues",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ]);
        listing.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            if fields.next()? != queue {
                return None;
            }
            Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
        })
    }

    /// Stops the node (its data stays); [`start_node`](Self::start_node) brings it back.
    pub fn stop_node(&mut self) {
        self.resume();
        if self.server.is_none() {
            return;
        }
        let stopped = self.try_ctl(&["stop"]).is_ok_and(|out| out.status.success());
        if stopped && self.server.as_mut().is_some_and(|server| wait_exit(server, EXIT_WITHIN)) {
            if let Some(mut server) = self.server.take() {
                let _ = server.wait();
            }
        } else {
            self.kill_server();
        }
    }

    /// Starts a stopped node again on the same ports and data.
    pub fn start_node(&mut self) {
        assert!(self.server.is_none(), "the node is already running");
        self.boot();
    }

    /// Freezes the node (SIGSTOP to its processes): its connections stay open and nothing
    /// on them is answered, as with a broker that hangs. [`resume`](Self::resume) (or drop)
    /// thaws it.
    pub fn pause(&mut self) {
        self.signal_tree(libc::SIGSTOP);
        self.paused = true;
    }

    /// Thaws a node frozen by [`pause`](Self::pause).
    pub fn resume(&mut self) {
        if self.paused {
            self.signal_tree(libc::SIGCONT);
            self.paused = false;
        }
    }

    /// Sends `sig` to the server process and every process under it.
    fn signal_tree(&self, sig: i32) {
        let Some(server) = self.server.as_ref() else { return };
        let mut pending = vec![server.id()];
        while let Some(pid) = pending.pop() {
            pending.extend(children_of(pid));
            signal(pid, sig);
        }
    }

    /// Stops and starts the node: every connection breaks and durable queues come back.
    pub fn restart(&mut self) {
        self.stop_node();
        self.start_node();
    }

    /// The node's log (for failure messages).
    pub fn log(&self) -> String {
        let log_dir = self.dir.path().join("log");
        let mut text = read_log(&self.dir.path().join("server.out"));
        if let Ok(entries) = std::fs::read_dir(&log_dir) {
            for entry in entries.flatten() {
                text.push_str(&read_log(&entry.path()));
            }
        }
        text
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The node's config file: its AMQP listener on `port`.
fn write_config(dir: &Path, port: u16) {
    std::fs::write(
        dir.join("rabbitmq.conf"),
        format!(
            "listeners.tcp.default = 127.0.0.1:{port}\n\
             log.console = false\n\
             log.file.level = info\n\
             disk_free_limit.absolute = 1MB\n"
        ),
    )
    .expect("broker config");
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(60)..].join("\n");
            eprintln!("---- rabbitmq {} log (tail) ----\n{tail}", self.node);
        }
        self.stop_node();
        let _ = self.epmd.kill();
        let _ = self.epmd.wait();
    }
}

/// A test-side AMQP connection with one confirming channel.
#[derive(Debug)]
pub struct AmqpTestClient {
    _connection: Connection,
    channel: Channel,
}

impl AmqpTestClient {
    /// Connects (as the URL's user) and enables publisher confirms.
    pub async fn connect(url: &str) -> Self {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|err| panic!("test client cannot connect: {err}"));
        let channel = connection.create_channel().await.expect("test client channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("test client confirm mode");
        Self { _connection: connection, channel }
    }

    /// Declares a durable queue (idempotent).
    pub async fn declare_queue(&self, queue: &str) {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions { durable: true, ..Default::default() },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|err| panic!("declare {queue}: {err}"));
    }

    /// Publishes to the default exchange (routing key = queue); see
    /// [`publish_to`](Self::publish_to).
    pub async fn publish(
        &self,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> lapin::Result<Confirmation> {
        self.publish_to("", routing_key, properties, body).await
    }

    /// Publishes a persistent message with `mandatory` and waits for the broker's confirm
    /// (`Ack(Some(_))` = returned unroutable). An error means the broker refused the message
    /// and closed the channel (e.g. a `user_id` that is not the connection's user).
    pub async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> lapin::Result<Confirmation> {
        self.channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                body,
                properties.with_delivery_mode(2),
            )
            .await?
            .await
    }

    /// Starts collecting what `queue` receives (auto-ack).
    pub async fn collect(&self, queue: &str) -> Collector {
        let consumer = self
            .channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions { no_ack: true, ..Default::default() },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|err| panic!("consume {queue}: {err}"));
        Collector { consumer }
    }
}

/// Messages arriving on one queue.
#[derive(Debug)]
pub struct Collector {
    consumer: Consumer,
}

impl Collector {
    /// The next message, or `None` if none arrives within `limit`.
    pub async fn next_within(&mut self, limit: Duration) -> Option<Delivery> {
        match tokio::time::timeout(limit, next(&mut self.consumer)).await {
            Ok(Some(Ok(delivery))) => Some(delivery),
            Ok(Some(Err(err))) => panic!("collector consumer failed: {err}"),
            Ok(None) => panic!("collector consumer was cancelled"),
            Err(_) => None,
        }
    }

    /// The next message; panics if none arrives within `limit`.
    pub async fn expect_within(&mut self, limit: Duration, what: &str) -> Delivery {
        self.next_within(limit)
            .await
            .unwrap_or_else(|| panic!("no message ({what}) within {limit:?}"))
    }
}

/// The consumer's next delivery; `None` once it is cancelled.
fn next(consumer: &mut Consumer) -> impl Future<Output = Option<lapin::Result<Delivery>>> + '_ {
    poll_fn(move |cx| Pin::new(&mut *consumer).poll_next(cx))
}

/// The text of a delivery's body.
pub fn body_text(delivery: &Delivery) -> String {
    String::from_utf8_lossy(&delivery.data).into_owned()
}

/// A short-string property as text (`""` when absent).
pub fn property(value: &Option<lapin::types::ShortString>) -> String {
    value.as_ref().map(|v| v.as_str().to_owned()).unwrap_or_default()
}
