//! The driver under test as a child process: started with the launch environment, its stdout
//! and stderr read to the end (scanned for secrets, stderr's last lines kept for reasons),
//! stopped with SIGTERM, killed when the kit is done with it.

use std::collections::VecDeque;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use crate::secrets::{Leaks, Place, Scanner, Watched};

/// Lines of stderr kept to explain a crash.
const STDERR_TAIL: usize = 20;

/// How the driver is started (the same for every start in one run).
#[derive(Debug, Clone)]
pub struct Launch {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub watched: Arc<[Watched]>,
    pub leaks: Leaks,
}

/// The driver could not be started at all.
#[derive(Debug, thiserror::Error)]
#[error("cannot start {program}: {source}")]
pub struct SpawnError {
    program: String,
    source: std::io::Error,
}

/// One running driver process.
#[derive(Debug)]
pub struct DriverProcess {
    child: Child,
    status: Option<ExitStatus>,
    pumps: JoinSet<()>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    watched: Arc<[Watched]>,
}

impl DriverProcess {
    pub fn spawn(launch: &Launch) -> Result<Self, SpawnError> {
        let mut command = Command::new(&launch.program);
        command
            .args(&launch.args)
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|source| SpawnError { program: launch.program.clone(), source })?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut pumps = JoinSet::new();
        if let Some(stdout) = child.stdout.take() {
            let scanner = Scanner::new(launch.watched.clone(), Place::Stdout, launch.leaks.clone());
            pumps.spawn(pump(stdout, scanner, None));
        }
        if let Some(stderr) = child.stderr.take() {
            let scanner = Scanner::new(launch.watched.clone(), Place::Stderr, launch.leaks.clone());
            pumps.spawn(pump(stderr, scanner, Some(stderr_tail.clone())));
        }
        Ok(Self { child, status: None, pumps, stderr_tail, watched: launch.watched.clone() })
    }

    /// The exit status if the process has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits up to `limit` for the process to end.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        if self.status.is_none()
            && let Ok(Ok(status)) = tokio::time::timeout(limit, self.child.wait()).await
        {
            self.status = Some(status);
        }
        self.status
    }

    /// Sends SIGTERM; false when the process is already gone.
    pub fn terminate(&mut self) -> bool {
        if self.exited().is_some() {
            return false;
        }
        let Some(pid) = self.child.id().and_then(|pid| libc::pid_t::try_from(pid).ok()) else {
            return false;
        };
        // SAFETY: kill(2) with a pid this process spawned and has not reaped yet.
        unsafe { libc::kill(pid, libc::SIGTERM) == 0 }
    }

    /// Kills the process (if it still runs), reaps it and reads its output to the end (bounded:
    /// a grandchild holding the pipes open is not waited for).
    pub async fn finish(mut self) -> Option<ExitStatus> {
        if self.exited().is_none() {
            let _ = self.child.start_kill();
            self.status = self.child.wait().await.ok();
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while self.pumps.join_next().await.is_some() {}
        })
        .await;
        self.pumps.abort_all();
        self.status
    }

    /// Why the driver is gone or silent, for a reason: its exit status and last stderr line
    /// (secrets redacted).
    pub fn describe_exit(&mut self) -> String {
        let last = {
            let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
            tail.iter().rev().find(|line| !line.trim().is_empty()).cloned()
        };
        let last = last.map(|line| {
            let line = crate::secrets::redact(&line, &self.watched);
            let short: String = line.chars().take(300).collect();
            format!("; last stderr line: {short}")
        });
        match self.exited() {
            Some(status) => format!("the driver exited ({status}){}", last.unwrap_or_default()),
            None => "the driver is still running".to_owned(),
        }
    }
}

/// Reads one output stream to its end, scanning for secrets and keeping stderr's last lines.
async fn pump<R: AsyncRead + Unpin>(
    mut stream: R,
    mut scanner: Scanner,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) {
    let mut chunk = vec![0u8; 8192];
    let mut partial = Vec::new();
    loop {
        let read = match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        scanner.feed(&chunk[..read]);
        let Some(tail) = &tail else { continue };
        partial.extend_from_slice(&chunk[..read]);
        while let Some(end) = partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = partial.drain(..=end).collect();
            push_line(tail, String::from_utf8_lossy(&line).trim_end().to_owned());
        }
        if partial.len() > 4096 {
            let line = String::from_utf8_lossy(&partial).into_owned();
            partial.clear();
            push_line(tail, line);
        }
    }
    if let Some(tail) = &tail
        && !partial.is_empty()
    {
        push_line(tail, String::from_utf8_lossy(&partial).trim_end().to_owned());
    }
}

fn push_line(tail: &Mutex<VecDeque<String>>, line: String) {
    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
    if tail.len() == STDERR_TAIL {
        tail.pop_front();
    }
    tail.push_back(line);
}
