//! Harness for cross-process tests: locate the workspace binaries, run a real `channeld` on a
//! config in a temp dir, talk to it as a raw driver or through `channelctl`.

pub mod control;
pub mod fakes;
pub mod fuzz;
pub mod mosquitto;
pub mod nostr_relay;
pub mod peer;
pub mod process;
pub mod prometheus;
pub mod rabbitmq;

use std::path::{Path, PathBuf};

pub use peer::RawPeer;
pub use process::{DriverProcess, HubProcess, alive, channelctl, rss_kib};

/// The directory holding the workspace's built binaries (`target/<profile>`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// A workspace binary; panics with the fix when it has not been built.
pub fn workspace_bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the workspace binaries first (`cargo build --workspace --bins`, which scripts/test does)",
        path.display()
    );
    path
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write test file");
    path
}

/// The files under `dir` (recursively) whose bytes contain `needle`: where a secret that
/// must stay in memory was written to disk (a ledger's database, its log).
pub fn files_holding(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a test directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if std::fs::read(&path)
                .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle.as_bytes()))
            {
                found.push(path);
            }
        }
    }
    found
}

/// Writes an executable shell script.
pub fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = write_file(dir, name, &format!("#!/bin/sh\n{body}"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod script");
    path
}

/// An exec agent that appends its run's event id to `log`, pauses `pause` seconds (so a
/// test's disruption finds runs in flight), then answers `done <event id>`.
pub fn counting_agent(dir: &Path, log: &Path, pause: &str) -> PathBuf {
    write_script(
        dir,
        "counting-agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo \"$id\" >> '{}'\n\
             sleep {pause}\n\
             echo \"done $id\"\n",
            log.display()
        ),
    )
}
