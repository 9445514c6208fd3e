//! Real processes: a `channeld` hub on a temp config, a driver binary serving one of its
//! instances, `channelctl`, resident memory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{workspace_bin, write_file};

/// A running `channeld` with its own runtime directory. Killed on drop.
#[derive(Debug)]
pub struct HubProcess {
    pub dir: TempDir,
    pub child: Child,
    pub config: PathBuf,
    ledger: bool,
    /// Environment variables set for the hub on top of the test's.
    env: Vec<(String, String)>,
}

impl HubProcess {
    /// Starts `channeld` on `config` (TOML without a `[hub]` runtime_dir: the harness adds
    /// it) and waits until its control socket answers.
    pub fn start(config: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        Self::start_in(dir, config)
    }

    /// Like [`start`](Self::start) in a given directory (kept across restarts: the ledger in
    /// `dir/state` survives).
    pub fn start_in(dir: TempDir, config: &str) -> Self {
        Self::spawn(dir, config, true)
    }

    /// A hub without a state directory: the ledger is off.
    pub fn start_without_ledger(dir: TempDir, config: &str) -> Self {
        Self::spawn(dir, config, false)
    }

    /// Like [`start`](Self::start) with `env` set for the hub (e.g. `CHANNELD_LOG_FORMAT`).
    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Self::spawn_with(dir, config, true, env)
    }

    fn spawn(dir: TempDir, config: &str, ledger: bool) -> Self {
        Self::spawn_with(dir, config, ledger, Vec::new())
    }

    fn spawn_with(dir: TempDir, config: &str, ledger: bool, env: Vec<(String, String)>) -> Self {
        let config_path = write_file(dir.path(), "channeld.toml", config);
        let child = Self::launch(dir.path(), &config_path, ledger, &env);
        let hub = Self { dir, child, config: config_path, ledger, env };
        hub.wait_ready();
        hub
    }

    /// Starts the hub again on the same config, sockets and state after it exited or was
    /// killed.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::launch(self.dir.path(), &self.config, self.ledger, &self.env);
        self.wait_ready();
    }

    fn launch(dir: &Path, config_path: &Path, ledger: bool, env: &[(String, String)]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("channeld.log"))
            .expect("log file");
        let mut command = Command::new(workspace_bin("channeld"));
        command.arg("--config").arg(config_path).arg("--runtime-dir").arg(dir.join("run"));
        if ledger {
            command.arg("--state-dir").arg(dir.join("state"));
        }
        command
            .env_remove("STATE_DIRECTORY")
            .env("CHANNELD_LOG", std::env::var("CHANNELD_LOG").unwrap_or_else(|_| "debug".into()))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn channeld")
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let control = self.control_socket();
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&control).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("channeld did not open {} within 20 s; log:\n{}", control.display(), self.log());
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn runtime_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    pub fn control_socket(&self) -> PathBuf {
        self.runtime_dir().join("control.sock")
    }

    pub fn socket(&self, instance: &str) -> PathBuf {
        self.runtime_dir().join(format!("{instance}.sock"))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("channeld.log")).unwrap_or_default()
    }

    /// The event ids whose reply the hub's log reports with an unknown outcome (a driver's
    /// `send_unknown`, or no answer in time): the hub never hands those over again.
    pub fn replies_reported_unknown(&self) -> std::collections::HashSet<String> {
        self.log()
            .lines()
            .filter(|line| line.contains("reply outcome unknown"))
            .filter_map(|line| line.split_whitespace().find_map(|f| f.strip_prefix("event_id=")))
            .map(str::to_owned)
            .collect()
    }

    /// Waits until the hub's log holds `needle` at least `times` times; panics with the log
    /// after `limit`.
    pub fn wait_log(&self, needle: &str, times: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.log().matches(needle).count() < times {
            assert!(
                Instant::now() < deadline,
                "{needle:?} not logged {times} time(s) within {limit:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the hub.
    pub fn signal(&self, signal: i32) {
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(self.pid(), signal);
        }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        self.wait_exit(Duration::from_secs(30))
    }

    /// Kills the hub with SIGKILL (a crash) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait channeld") {
                return status;
            }
            assert!(Instant::now() < deadline, "channeld did not exit; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The hub's view of one instance (`channelctl status INSTANCE --json`).
    pub fn instance_status(&self, instance: &str) -> serde_json::Value {
        let out = self.ctl(&["status", instance, "--json"]);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
        status["instances"]
            .as_array()
            .and_then(|all| all.iter().find(|i| i["instance"] == instance).cloned())
            .unwrap_or_else(|| panic!("{instance} missing from status: {status}"))
    }

    /// Polls `channelctl status` until `check` holds for `instance`; panics after `within`
    /// naming `what`, with the last status and `context()` (a driver's log, say).
    pub async fn wait_status(
        &self,
        instance: &str,
        what: &str,
        within: Duration,
        check: impl Fn(&serde_json::Value) -> bool,
        context: impl Fn() -> String,
    ) -> serde_json::Value {
        let deadline = Instant::now() + within;
        loop {
            let status = tokio::task::block_in_place(|| self.instance_status(instance));
            if check(&status) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{instance}: {what} not seen within {within:?}: {status}\n{}",
                context()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `channelctl` against this hub.
    pub fn ctl(&self, args: &[&str]) -> Output {
        channelctl(&self.control_socket(), args)
    }

    /// Runs `channelctl` on a blocking thread, so the test can play the driver meanwhile.
    pub fn ctl_async(&self, args: &[&str]) -> tokio::task::JoinHandle<Output> {
        let socket = self.control_socket();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            channelctl(&socket, &refs)
        })
    }
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- channeld log ----\n{}", self.log());
        }
    }
}

/// Runs `channelctl --socket <socket> <args>`.
pub fn channelctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(workspace_bin("channelctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("run channelctl")
}

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// Resident set size of a process, in KiB.
pub fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in /proc status")
}

/// A driver binary serving one instance of a hub, with a clean environment plus `env`; its
/// stderr is appended to `<hub dir>/<instance>.driver.log`. Killed on drop; the log is
/// printed when the test fails.
#[derive(Debug)]
pub struct DriverProcess {
    child: Child,
    log: PathBuf,
}

impl DriverProcess {
    pub fn spawn(binary: &str, hub: &HubProcess, instance: &str, env: &[(String, String)]) -> Self {
        let log = hub.dir.path().join(format!("{instance}.driver.log"));
        let stderr =
            std::fs::OpenOptions::new().create(true).append(true).open(&log).expect("driver log");
        let child = Command::new(workspace_bin(binary))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", instance)
            .env("CHANNELD_SOCKET", hub.socket(instance))
            .env("CHANNELD_LOG", std::env::var("CHANNELD_LOG").unwrap_or_else(|_| "debug".into()))
            .envs(env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {binary}: {err}"));
        Self { child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: a crash with nothing flushed or acknowledged.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: a plain syscall on our own child's PID.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        self.wait_exit(Duration::from_secs(20))
    }

    /// Waits (bounded) for the process to exit by itself and returns its status.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait driver") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "driver did not exit within {limit:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for DriverProcess {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}
