//! A real Prometheus server for tests, and `promtool`.
//!
//! [`Prometheus`] writes a scrape config into a temp dir (the given targets, a short scrape
//! interval), starts `prometheus` on a free loopback port with its storage there, waits until
//! it is ready, answers instant queries through its HTTP API, and stops it by PID on drop. A
//! missing binary fails the test with the fix; it never skips.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

/// How long Prometheus may take to be ready after being started.
const READY_WITHIN: Duration = Duration::from_secs(30);

fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn binary(name: &str) -> PathBuf {
    find_binary(name).unwrap_or_else(|| {
        panic!(
            "the {name} binary is missing (looked in $PATH and /usr/bin): install it with \
             `apt-get install -y prometheus` (scripts/test does this)"
        )
    })
}

/// `promtool` with `args`, `stdin` fed to it; its output.
pub fn promtool(args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(binary("promtool"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn promtool");
    child.stdin.take().expect("stdin").write_all(stdin).expect("feed promtool");
    child.wait_with_output().expect("promtool output")
}

/// A TCP port on loopback that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// A running Prometheus scraping the given targets every second. Killed on drop.
#[derive(Debug)]
pub struct Prometheus {
    dir: TempDir,
    port: u16,
    child: Option<Child>,
    http: reqwest::Client,
}

impl Prometheus {
    /// Scrapes `targets` (`host:port`) as job `channeld` every second.
    pub async fn start(targets: &[String]) -> Self {
        channeld_driver_sdk::install_crypto_provider();
        let binary = binary("prometheus");
        let dir = tempfile::Builder::new().prefix("prometheus-").tempdir().expect("temp dir");
        let quoted: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: channeld\n    static_configs:\n      - targets: [{}]\n",
            quoted.join(", ")
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).expect("write config");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("http client");
        let mut server = Self { dir, port: 0, child: None, http };
        // The port is picked free, then bound by Prometheus: another process may take it in
        // between, so a failed start tries another port.
        for _ in 0..5 {
            server.port = free_port();
            match server.spawn(&binary).await {
                Ok(()) => return server,
                Err(reason) => {
                    eprintln!("prometheus did not start on port {} ({reason})", server.port);
                    server.kill();
                }
            }
        }
        panic!("prometheus did not start on any of 5 ports");
    }

    async fn spawn(&mut self, binary: &Path) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join("prometheus.log")).expect("log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", self.dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", self.dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
            .arg("--log.level=warn")
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
            let ready = self.http.get(self.url("/-/ready")).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("not ready within {READY_WITHIN:?}; log:\n{}", self.log()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// An instant query through `/api/v1/query`: each series' labels and value.
    pub async fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let response = self
            .http
            .get(self.url("/api/v1/query"))
            .query(&[("query", promql)])
            .send()
            .await
            .unwrap_or_else(|err| panic!("query {promql}: {err}"));
        let body: Value = response.json().await.expect("query answer is JSON");
        assert_eq!(body["status"], "success", "query {promql}: {body}");
        body["data"]["result"]
            .as_array()
            .expect("a vector result")
            .iter()
            .map(|series| {
                let value = series["value"][1].as_str().expect("a sample value");
                (series["metric"].clone(), value.parse().expect("a number"))
            })
            .collect()
    }

    /// The one value of `promql`, once Prometheus has scraped it; `None` while it has none.
    pub async fn value(&self, promql: &str) -> Option<f64> {
        let result = self.query(promql).await;
        assert!(result.len() <= 1, "{promql} matched several series: {result:?}");
        result.first().map(|(_, value)| *value)
    }

    /// Waits until `promql` has the value `wanted` (scrapes come every second); panics with
    /// the last value seen after `limit`.
    pub async fn wait_value(&self, promql: &str, wanted: f64, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.value(promql).await;
            if value == Some(wanted) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{promql} is {value:?}, not {wanted}, after {limit:?}; prometheus log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: plain syscall on our own child, by its PID.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.kill();
    }
}
