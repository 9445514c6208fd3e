//! A mosquitto broker on a free loopback port, no inflight limit, no persistence, with Nagle
//! off (`set_tcp_nodelay true`) or as installed (Nagle on): which is faster depends on the
//! row, so the bench measures both and compares against the better one.

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
