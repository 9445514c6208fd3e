//! A real `channeld` hub on its own config in a temp dir, ledger off or on, plus the few
//! synchronous control requests the setup needs (`status`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::procs::{Proc, binary, wait_until};
use crate::report::StatusListing;

/// The instance every throughput row uses.
pub const MAIN_INSTANCE: &str = "bench.main";

/// Inbound runs one driver connection may have in flight. The hub's default is 4; the
/// pipelined rows keep up to 256 in flight, so the bench raises it.
pub const BENCH_MAX_INFLIGHT: usize = 512;

/// What the hub is started with.
#[derive(Debug, Clone)]
pub struct HubSpec {
    /// Keep a durable ledger (`--state-dir`).
    pub ledger: bool,
    /// Instances besides [`MAIN_INSTANCE`], each allowing every sender.
    pub extra_instances: Vec<String>,
    /// `hub.durability = "normal"`: commits skip the fsync (the default is `full`).
    pub durability_normal: bool,
    /// `hub.metrics_listen` on a Unix socket in the hub's directory: metrics counted.
    pub metrics: bool,
}

/// A running hub, stopped by PID on drop.
#[derive(Debug)]
pub struct HubProc {
    pub proc: Proc,
    pub runtime_dir: PathBuf,
}

impl HubProc {
    /// Writes the config into `dir`, starts `bin_dir/channeld` and waits for its control socket.
    pub fn start(bin_dir: &Path, dir: &Path, spec: &HubSpec) -> Result<Self> {
        Self::start_wrapped(bin_dir, dir, spec, None)
    }

    /// Like [`start`](Self::start), with the hub under a wrapper command (a profiler).
    pub fn start_wrapped(
        bin_dir: &Path,
        dir: &Path,
        spec: &HubSpec,
        wrap: Option<&str>,
    ) -> Result<Self> {
        Self::launch(bin_dir, dir, &config_text(spec, dir), spec.ledger, wrap, &[])
    }

    /// Starts the hub on the config `text` (written into `dir`), with `env` added to its
    /// environment (where `env:NAME` settings find their secrets).
    pub fn start_config(
        bin_dir: &Path,
        dir: &Path,
        text: &str,
        ledger: bool,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::launch(bin_dir, dir, text, ledger, None, env)
    }

    fn launch(
        bin_dir: &Path,
        dir: &Path,
        text: &str,
        ledger: bool,
        wrap: Option<&str>,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let channeld = binary(
            bin_dir,
            "channeld",
            "build it with `cargo build --release -p channeld-hub` (scripts/bench does)",
        )?;
        let runtime_dir = dir.join("run");
        let config = dir.join("channeld.toml");
        std::fs::write(&config, text).with_context(|| format!("write {}", config.display()))?;
        let log = dir.join("channeld.log");
        let mut words = wrap.map(str::split_whitespace).into_iter().flatten();
        let mut command = match words.next() {
            Some(wrapper) => {
                let mut command = Command::new(wrapper);
                command.args(words).arg(&channeld);
                command
            }
            None => Command::new(&channeld),
        };
        command.arg("--config").arg(&config).arg("--runtime-dir").arg(&runtime_dir);
        if ledger {
            command.arg("--state-dir").arg(dir.join("state"));
        }
        command.envs(env.iter().copied());
        let child = command
            .env_remove("STATE_DIRECTORY")
            .env("CHANNELD_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("start {}", channeld.display()))?;
        let mut proc = Proc::new("channeld", child, Some(log));
        let control = runtime_dir.join("control.sock");
        // Answered, not only bound: the hub binds its control socket with the instances'
        // before it starts serving them, and answers on it once every instance's accept loop
        // is started — what a resident size "with 0 connected" must include.
        let ready = "{\"id\":1,\"op\":\"status\",\"limit\":1}\n";
        wait_until(&mut proc, Duration::from_secs(120), "answer on its control socket", || {
            request_at(&control, ready).is_ok()
        })?;
        Ok(Self { proc, runtime_dir })
    }

    pub fn pid(&self) -> i32 {
        self.proc.pid()
    }

    pub fn control_socket(&self) -> PathBuf {
        self.runtime_dir.join("control.sock")
    }

    pub fn socket(&self, instance: &str) -> PathBuf {
        self.runtime_dir.join(format!("{instance}.sock"))
    }

    /// Waits until every instance in `instances` has a connected driver whose health passes
    /// `healthy` (the hub's own view: what a send would see).
    pub fn wait_connected(
        &mut self,
        instances: &[&str],
        limit: Duration,
        healthy: impl Fn(&Value) -> bool,
    ) -> Result<()> {
        self.wait_status(limit, "see the drivers connect", |rows| {
            instances.iter().all(|name| {
                rows.iter().any(|row| {
                    row["instance"] == *name
                        && row["connected"] == Value::Bool(true)
                        && healthy(&row["health"])
                })
            })
        })
        .with_context(|| format!("waiting for {instances:?}"))
    }

    /// Waits until `instance` has a driver that answers a health probe (the `health` request:
    /// one instance, where `status` lists every instance and outgrows a control line at
    /// thousands of them).
    pub fn wait_driver(&mut self, instance: &str, limit: Duration) -> Result<()> {
        let control = self.control_socket();
        let mut last = None;
        let request = format!("{{\"id\":1,\"op\":\"health\",\"instance\":\"{instance}\"}}\n");
        let waited =
            wait_until(&mut self.proc, limit, "see the driver connect", || {
                match request_at(&control, &request) {
                    Ok(result) => {
                        let ready = result["health"]["state"] != "Unavailable";
                        last = Some(result["health"].to_string());
                        ready
                    }
                    Err(err) => {
                        last = Some(err.to_string());
                        false
                    }
                }
            });
        waited.with_context(|| format!("waiting for {instance}; last answer: {last:?}"))
    }

    /// Open file descriptors of the hub (`/proc/<pid>/fd`): each connected driver holds one.
    pub fn open_fds(&self) -> Result<usize> {
        let dir = format!("/proc/{}/fd", self.pid());
        Ok(std::fs::read_dir(&dir).with_context(|| format!("read {dir}"))?.count())
    }

    /// Waits until the hub holds at most `fds` descriptors (the drivers that left are gone).
    pub fn wait_fds_at_most(&mut self, fds: usize, limit: Duration) -> Result<()> {
        let dir = format!("/proc/{}/fd", self.pid());
        wait_until(&mut self.proc, limit, "close the connections of the drivers that left", || {
            std::fs::read_dir(&dir).is_ok_and(|entries| entries.count() <= fds)
        })
    }

    /// Every instance's `status`, a page at a time as `channelctl status` fetches it; an error
    /// unless the pages hold exactly `expected` distinct instances in id order.
    pub fn list_status(&self, expected: usize) -> Result<StatusListing> {
        let control = self.control_socket();
        let started = Instant::now();
        let (mut instances, mut connected, mut pages) = (Vec::new(), 0, 0);
        let mut after: Option<String> = None;
        loop {
            let request = match &after {
                Some(after) => serde_json::json!({"id": 1, "op": "status", "after": after}),
                None => serde_json::json!({"id": 1, "op": "status"}),
            };
            let page = request_at(&control, &format!("{request}\n"))?;
            pages += 1;
            for row in page["instances"].as_array().map_or(&[][..], Vec::as_slice) {
                instances.push(row["instance"].as_str().unwrap_or_default().to_owned());
                connected += usize::from(row["connected"] == Value::Bool(true));
            }
            match page["next_after"].as_str() {
                Some(next) => after = Some(next.to_owned()),
                None => break,
            }
            if pages > expected {
                bail!("status paging did not end after {pages} pages");
            }
        }
        let millis = started.elapsed().as_secs_f64() * 1e3;
        let sorted = instances.windows(2).all(|pair| pair[0] < pair[1]);
        if instances.len() != expected || !sorted {
            bail!(
                "status listed {} instances (in order: {sorted}), not the {expected} configured",
                instances.len()
            );
        }
        Ok(StatusListing { instances: instances.len(), connected, pages, millis })
    }

    /// Polls `status` until `ready` holds for its instance rows.
    fn wait_status(
        &mut self,
        limit: Duration,
        what: &str,
        ready: impl Fn(&[Value]) -> bool,
    ) -> Result<()> {
        let control = self.control_socket();
        let mut last_error = None;
        let waited = wait_until(&mut self.proc, limit, what, || match status_at(&control) {
            Ok(status) => ready(status["instances"].as_array().map_or(&[], Vec::as_slice)),
            Err(err) => {
                last_error = Some(err.to_string());
                false
            }
        });
        waited.with_context(|| format!("last status error: {last_error:?}"))
    }
}

/// One `status` request on the control socket at `control`.
pub fn status_at(control: &Path) -> Result<Value> {
    request_at(control, "{\"id\":1,\"op\":\"status\"}\n")
}

/// One control request line on the control socket at `control`; its `result`.
fn request_at(control: &Path, request: &str) -> Result<Value> {
    let mut stream =
        UnixStream::connect(control).with_context(|| format!("connect {}", control.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(request.as_bytes())?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let answer: Value = serde_json::from_str(&line).context("control answer is not JSON")?;
    if answer["ok"] != Value::Bool(true) {
        bail!("request failed: {line}");
    }
    Ok(answer["result"].clone())
}

fn config_text(spec: &HubSpec, dir: &Path) -> String {
    let durability = if spec.durability_normal { "durability = \"normal\"\n" } else { "" };
    let metrics = if spec.metrics {
        format!("metrics_listen = \"{}\"\n", dir.join("metrics.sock").display())
    } else {
        String::new()
    };
    let mut text = format!(
        "[hub]\nmax_inflight = {BENCH_MAX_INFLIGHT}\n{durability}{metrics}\n[instance.\"{MAIN_INSTANCE}\"]\nallow_all = true\n"
    );
    for name in &spec.extra_instances {
        text.push_str(&format!("\n[instance.\"{name}\"]\nallow_all = true\n"));
    }
    text
}

/// Health that is simply "a driver is connected".
pub fn any_health(_: &Value) -> bool {
    true
}

/// Health of a broker driver that reached its broker.
pub fn transport_connected(health: &Value) -> bool {
    health["status"]["transport"] == "connected"
}
