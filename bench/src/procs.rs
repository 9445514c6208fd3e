//! Child processes the bench starts (always stopped by PID), and what `/proc` says about them:
//! resident size and CPU time.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A started child process, stopped (SIGTERM, then SIGKILL after a grace period) on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// Where its stderr goes, quoted when it fails.
    pub log: Option<PathBuf>,
}

impl Proc {
    pub fn new(name: impl Into<String>, child: Child, log: Option<PathBuf>) -> Self {
        Self { name: name.into(), child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Fails with the log's tail when the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited early ({status}){}", self.name, self.log_tail());
        }
        Ok(())
    }

    pub fn log_tail(&self) -> String {
        let Some(path) = &self.log else { return String::new() };
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        if tail.is_empty() { String::new() } else { format!("; log {}:\n{tail}", path.display()) }
    }

    /// Waits up to `limit` for the process to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status.
    pub fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        signal(self.pid(), libc::SIGTERM);
        if let Some(status) = self.wait_exit(grace)? {
            return Ok(status);
        }
        self.child.kill()?;
        Ok(self.child.wait()?)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(5));
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: a plain syscall on a child this process started and has not reaped.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// A loopback TCP port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("bind a loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// Polls until `ready` holds, checking that `proc` is still alive; fails after `limit`.
///
/// Used where the child offers no readiness signal of its own (a listening socket appears).
pub fn wait_until(
    proc: &mut Proc,
    limit: Duration,
    what: &str,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(1);
    loop {
        if ready() {
            return Ok(());
        }
        proc.check_alive()?;
        if Instant::now() >= deadline {
            bail!("{} did not {what} within {limit:?}{}", proc.name, proc.log_tail());
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Resident set size in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: i32) -> Result<u64> {
    status_field(pid, "VmRSS:")
}

/// The first number after `field` in `/proc/<pid>/status`.
fn status_field(pid: i32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// The anonymous part of the resident size in KiB (`RssAnon`).
pub fn rss_anon_kib(pid: i32) -> Result<u64> {
    status_field(pid, "RssAnon:")
}

/// Number of threads (`Threads` of `/proc/<pid>/status`).
pub fn threads(pid: i32) -> Result<u64> {
    status_field(pid, "Threads:")
}

/// User plus system CPU time of a process (all its threads), from `/proc/<pid>/stat`.
pub fn cpu_time(pid: i32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("read /proc/{pid}/stat"))?;
    let ticks = parse_cpu_ticks(&stat).with_context(|| format!("unreadable /proc/{pid}/stat"))?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock ticks.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// `name` in `dir`, or an error that says how to build it.
pub fn binary(dir: &Path, name: &str, hint: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    if !path.is_file() {
        bail!("{} is missing: {hint}", path.display());
    }
    Ok(path)
}

/// The first of `candidates` that exists as a file, else the name looked up on `PATH`.
pub fn find_program(name: &str, candidates: &[&str]) -> Option<PathBuf> {
    for candidate in candidates {
        let path = Path::new(candidate);
        if path.is_file() {
            return Some(path.to_owned());
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_come_after_the_command_name() {
        let stat = "1234 (tokio-rt (worker)) S 1 2 3 4 5 6 7 8 9 10 250 31 0 0 20 0 3 0";
        assert_eq!(parse_cpu_ticks(stat), Some(281));
    }

    #[test]
    fn own_process_has_rss_and_cpu() {
        let pid = std::process::id() as i32;
        assert!(rss_kib(pid).unwrap() > 0);
        assert!(cpu_time(pid).is_ok());
    }
}
