//! A mosquitto broker on a free loopback port, no inflight limit, no persistence, with Nagle
//! off (`set_tcp_nodelay true`) or as installed (Nagle on): which is faster depends on the
//! row, so the bench measures both and compares against the better one. And a RabbitMQ node
//! with its own epmd, for the AMQP rows.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::procs::{Proc, find_program, free_port, wait_until};

/// Where Debian puts the broker; `PATH` is searched too.
const MOSQUITTO_CANDIDATES: &[&str] = &["/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"];

/// The mosquitto binary, or an error saying how to get one.
pub fn mosquitto_binary() -> Result<PathBuf> {
    find_program("mosquitto", MOSQUITTO_CANDIDATES).context(
        "mosquitto is not installed (looked in /usr/sbin, /usr/local/sbin and PATH): apt-get install mosquitto",
    )
}

/// A running mosquitto, stopped by PID on drop.
#[derive(Debug)]
pub struct Mosquitto {
    pub port: u16,
    pub proc: Proc,
}

impl Mosquitto {
    /// Starts mosquitto with its config in `dir` and waits until it accepts connections.
    pub fn start(dir: &Path, nagle: bool) -> Result<Self> {
        let binary = mosquitto_binary()?;
        let port = free_port()?;
        let config = dir.join("mosquitto.conf");
        std::fs::write(&config, config_text(port, nagle))
            .with_context(|| format!("write {}", config.display()))?;
        let log = dir.join("mosquitto.log");
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let mut proc = Proc::new("mosquitto", child, Some(log));
        wait_until(&mut proc, Duration::from_secs(10), "listen", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        })?;
        Ok(Self { port, proc })
    }
}

fn config_text(port: u16, nagle: bool) -> String {
    format!(
        "listener {port} 127.0.0.1\n\
         allow_anonymous true\n\
         set_tcp_nodelay {}\n\
         max_inflight_messages 0\n\
         max_queued_messages 0\n\
         persistence false\n\
         log_dest stderr\n\
         log_type error\n\
         log_type warning\n",
        !nagle
    )
}

/// The broker's version line (`mosquitto version 2.0.11`), for the report.
pub fn mosquitto_version() -> Option<String> {
    let binary = mosquitto_binary().ok()?;
    let out = Command::new(binary).arg("-h").stdin(Stdio::null()).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find(|l| l.contains("version")).map(|l| l.trim().to_owned())
}

/// A RabbitMQ node with its own epmd (so nothing outlives the bench), both stopped by PID.
pub struct RabbitMq {
    pub port: u16,
    node: Proc,
    epmd: Proc,
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        // The start script stops the Erlang node on SIGTERM; that takes a few seconds, and
        // killing the script early would orphan the node.
        let _ = self.node.stop(Duration::from_secs(60));
        let _ = self.epmd.stop(Duration::from_secs(5));
    }
}

impl RabbitMq {
    /// Starts a fresh node with its config and data in `dir` and waits until it serves AMQP
    /// (the default `guest` user, loopback only).
    pub fn start(dir: &Path) -> Result<Self> {
        let server = find_program(
            "rabbitmq-server",
            &["/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server"],
        )
        .context("rabbitmq-server is not installed: apt-get install rabbitmq-server")?;
        let epmd_bin = find_epmd().context("epmd (Erlang) is not installed")?;
        let epmd_port = free_port()?;
        let epmd_child = Command::new(&epmd_bin)
            .arg("-port")
            .arg(epmd_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start epmd")?;
        let mut epmd = Proc::new("epmd", epmd_child, None);
        wait_until(&mut epmd, Duration::from_secs(10), "listen", || {
            TcpStream::connect(("127.0.0.1", epmd_port)).is_ok()
        })?;
        let port = free_port()?;
        let dist_port = free_port()?;
        std::fs::write(
            dir.join("rabbit.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\n"),
        )?;
        std::fs::write(dir.join("plugins"), "[].\n")?;
        let log = dir.join("rabbitmq.log");
        let node = format!("channeld-bench-{}@localhost", std::process::id());
        let child = Command::new(&server)
            .env("ERL_EPMD_PORT", epmd_port.to_string())
            .env("RABBITMQ_NODENAME", node)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbit"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("plugins"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .env("HOME", dir)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(Stdio::null())
            .spawn()
            .context("start rabbitmq-server")?;
        let mut node = Proc::new("rabbitmq-server", child, Some(log));
        wait_until(&mut node, Duration::from_secs(60), "accept AMQP connections", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        })?;
        Ok(Self { port, node, epmd })
    }

    /// The default `guest` user's URL.
    pub fn guest_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

fn find_epmd() -> Option<PathBuf> {
    if let Some(path) = find_program("epmd", &[]) {
        return Some(path);
    }
    let erts = std::fs::read_dir("/usr/lib/erlang").ok()?;
    erts.filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join("bin/epmd"))
        .find(|path| path.is_file())
}
