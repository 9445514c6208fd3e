//! A driver binary run as a child process of a test, for one instance of a hub: a cleared
//! environment plus the test's settings, stderr in a log file printed when the test fails,
//! killed when dropped.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::{HubProcess, workspace_bin};

/// A running driver process.
#[derive(Debug)]
pub struct DriverProcess {
    child: Child,
    log: PathBuf,
}

impl DriverProcess {
    /// Starts the workspace binary `binary` as `instance` of `hub` with `env` on top of
    /// `PATH`, the launch variables and `CHANNELD_LOG` (the test's, else `debug`).
    pub fn for_hub(binary: &str, hub: &HubProcess, instance: &str, env: &[(&str, String)]) -> Self {
        Self::spawn(binary, instance, &hub.socket(instance), hub.dir.path(), env)
    }

    /// Starts `binary` as `instance` on `socket`, logging to a fresh file in `dir`.
    pub fn spawn(
        binary: &str,
        instance: &str,
        socket: &Path,
        dir: &Path,
        env: &[(&str, String)],
    ) -> Self {
        let log = (0..)
            .map(|n| dir.join(format!("{instance}.driver-{n}.log")))
            .find(|path| !path.exists())
            .expect("a free log name");
        let stderr = OpenOptions::new().create(true).append(true).open(&log).expect("driver log");
        let mut command = Command::new(workspace_bin(binary));
        command
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", instance)
            .env("CHANNELD_SOCKET", socket)
            .env("CHANNELD_LOG", std::env::var("CHANNELD_LOG").unwrap_or_else(|_| "debug".into()))
            .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let child = command.spawn().unwrap_or_else(|err| panic!("spawn {binary}: {err}"));
        Self { child, log }
    }

    /// Everything the driver logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (up to 30 s) for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: a plain syscall on our own child's PID.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the driver") {
                return status;
            }
            assert!(Instant::now() < deadline, "the driver ignored SIGTERM:\n{}", self.log());
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
