//! The systemd units in `systemd/`: generated from one template, accepted by
//! `systemd-analyze verify`, driver units hardened to an exposure of at most 2.0 by
//! `systemd-analyze security --offline=true`, the sysusers entry valid, and the hub speaking
//! the notification protocol (`READY=1`, `WATCHDOG=1`, `STOPPING=1`) as a real process.

use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::{bin_dir, write_file};

/// The worst exposure `systemd-analyze security` may give a driver unit.
const MAX_DRIVER_EXPOSURE: f64 = 2.0;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root").to_path_buf()
}

/// A systemd tool; fails the test naming it when it is missing.
fn systemd_tool(name: &str) -> PathBuf {
    ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .map(|dir| dir.join(name)),
        )
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is missing: install the systemd package (`apt-get install -y systemd`; \
                 scripts/test does this)"
            )
        })
}

fn run(command: &mut Command) -> Output {
    command.stdin(Stdio::null()).output().unwrap_or_else(|err| panic!("run {command:?}: {err}"))
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every unit file in `systemd/`, by file name.
fn unit_files() -> Vec<PathBuf> {
    let mut units: Vec<PathBuf> = std::fs::read_dir(repo().join("systemd"))
        .expect("read systemd/")
        .map(|entry| entry.expect("dir entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "service"))
        .collect();
    units.sort();
    units
}

/// A driver's template unit: `channeld-<family>@.service`, except the worker's template
/// (`channeld-worker@.service` runs agents, not a channel).
fn is_driver_unit(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with("@.service") && n != "channeld-worker@.service")
}

/// The binary a unit starts: the first word of its `ExecStart=`.
fn exec_start(unit: &str) -> String {
    unit.lines()
        .find_map(|line| line.strip_prefix("ExecStart="))
        .and_then(|cmd| cmd.split_whitespace().next())
        .expect("an ExecStart= line")
        .to_owned()
}

/// Copies every unit into a temp dir with `/usr/local/bin/` pointing at a directory holding
/// the workspace's binaries, and a stub for each driver family the workspace does not build
/// (yet); the hub and the MQTT driver must be the real ones.
fn staged_units() -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    let mut staged = Vec::new();
    for unit in unit_files() {
        let body = std::fs::read_to_string(&unit).expect("read unit");
        let binary = exec_start(&body);
        let name = binary
            .strip_prefix("/usr/local/bin/")
            .unwrap_or_else(|| panic!("{}: ExecStart= is not in /usr/local/bin", unit.display()));
        let target = bin.join(name);
        let built = bin_dir().join(name);
        if built.is_file() {
            std::os::unix::fs::symlink(&built, &target).expect("link binary");
        } else {
            assert!(
                is_driver_unit(&unit) && name != "channeld-mqtt",
                "{} starts {name}, which the workspace did not build",
                unit.display()
            );
            channeld_tests::write_script(&bin, name, "exit 0\n");
        }
        let staged_body = body.replace("/usr/local/bin/", &format!("{}/", bin.display()));
        let file_name = unit.file_name().expect("file name");
        staged.push(write_file(dir.path(), file_name.to_str().expect("utf-8"), &staged_body));
    }
    (dir, staged)
}

#[test]
fn driver_units_are_exactly_what_the_generator_writes() {
    let out = tempfile::tempdir().expect("temp dir");
    let generated = run(Command::new(repo().join("scripts/gen-units")).arg(out.path()));
    assert!(generated.status.success(), "scripts/gen-units failed: {}", text(&generated));
    let mut names: Vec<String> = std::fs::read_dir(out.path())
        .expect("read generated")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let committed: Vec<String> = unit_files()
        .iter()
        .filter(|p| is_driver_unit(p))
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, committed, "systemd/ holds other driver units than the generator makes");
    for name in &names {
        let fresh = std::fs::read_to_string(out.path().join(name)).expect("read generated");
        let kept = std::fs::read_to_string(repo().join("systemd").join(name)).expect("read unit");
        assert!(fresh == kept, "systemd/{name} is stale: run scripts/gen-units");
    }
    for family in ["mqtt", "amqp", "slack", "wechat", "wecom", "nostr", "acecode", "bcn"] {
        assert!(names.contains(&format!("channeld-{family}@.service")), "no unit for {family}");
    }
}

#[test]
fn every_unit_passes_systemd_analyze_verify() {
    let analyze = systemd_tool("systemd-analyze");
    let (_dir, units) = staged_units();
    assert!(units.len() >= 7, "expected the hub and six driver units, found {units:?}");
    for unit in &units {
        let output = run(Command::new(&analyze).arg("verify").arg(unit));
        // verify exits 0 on unknown keys and other warnings; any output is a finding.
        assert!(
            output.status.success() && output.stdout.is_empty() && output.stderr.is_empty(),
            "systemd-analyze verify {}: {}",
            unit.display(),
            text(&output)
        );
    }
}

fn exposure(analyze: &Path, unit: &Path) -> f64 {
    let output = run(Command::new(analyze).args(["security", "--offline=true"]).arg(unit));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    all.lines()
        .find_map(|line| {
            let rest = line.split("Overall exposure level for ").nth(1)?;
            rest.split(": ").nth(1)?.split_whitespace().next()?.parse::<f64>().ok()
        })
        .unwrap_or_else(|| {
            panic!("no overall exposure level for {}: {}", unit.display(), text(&output))
        })
}

#[test]
fn driver_units_score_at_most_2_0_in_systemd_analyze_security() {
    let analyze = systemd_tool("systemd-analyze");
    let (_dir, units) = staged_units();
    let mut scores = Vec::new();
    for unit in &units {
        let score = exposure(&analyze, unit);
        let name = unit.file_name().expect("name").to_string_lossy().into_owned();
        eprintln!("{name}: exposure {score:.1}");
        // The worker's template is held to the drivers' bar too.
        let held = is_driver_unit(unit) || name == "channeld-worker@.service";
        scores.push((name, score, held));
    }
    let worse: Vec<_> = scores
        .iter()
        .filter(|(_, score, driver)| *driver && *score > MAX_DRIVER_EXPOSURE)
        .collect();
    assert!(worse.is_empty(), "driver units above {MAX_DRIVER_EXPOSURE}: {worse:?}");
    assert!(scores.iter().filter(|(_, _, driver)| *driver).count() >= 7, "{scores:?}");
    assert!(scores.iter().any(|(name, _, _)| name == "channeld-worker@.service"), "{scores:?}");
}

#[test]
fn driver_units_take_secrets_only_through_credentials() {
    for unit in unit_files().iter().filter(|p| is_driver_unit(p)) {
        let body = std::fs::read_to_string(unit).expect("read unit");
        let name = unit.file_name().expect("name").to_string_lossy().into_owned();
        let family = name.strip_prefix("channeld-").and_then(|n| n.strip_suffix("@.service"));
        let family = family.expect("channeld-<family>@.service");
        let lines: Vec<&str> = body.lines().filter(|l| !l.starts_with('#')).collect();
        let has = |line: &str| lines.contains(&line);
        assert!(has(&format!("Environment=CHANNELD_CHANNEL_ID={family}.%i")), "{name}");
        assert!(has(&format!("Environment=CHANNELD_SOCKET=/run/channeld/{family}.%i.sock")));
        assert!(has(&format!("EnvironmentFile=-/etc/channeld/{family}.%i.env")), "{name}");
        for required in [
            "BindsTo=channeld.service",
            "DynamicUser=yes",
            "SupplementaryGroups=channeld",
            "RestartPreventExitStatus=78",
            "CapabilityBoundingSet=",
            "SystemCallFilter=@system-service",
        ] {
            assert!(has(required), "{name} lacks {required}");
        }
        let credentials: Vec<&&str> =
            lines.iter().filter(|l| l.starts_with("LoadCredential=")).collect();
        // The ACECode plugin host holds no secret: its plugin keeps its own login state. A
        // BCN bot's token is issued by BCN and kept in its StateDirectory.
        if family != "acecode" && family != "bcn" {
            assert!(!credentials.is_empty(), "{name} loads no credential");
        }
        for credential in credentials {
            let path = credential.split_once(':').map(|(_, p)| p).unwrap_or_default();
            assert!(
                path.starts_with(&format!("/etc/channeld/credentials/{family}.%i.")),
                "{name}: {credential}"
            );
        }
        for line in &lines {
            let upper = line.to_ascii_uppercase();
            let assignment = line.starts_with("Environment=") || line.starts_with("ExecStart=");
            let secret_like =
                ["PASSWORD", "TOKEN", "SECRET", "_URL"].iter().any(|word| upper.contains(word));
            assert!(!(assignment && secret_like), "{name}: a secret in the unit: {line}");
        }
    }
}

#[test]
fn the_sysusers_entry_creates_the_channeld_user_and_group() {
    let sysusers = systemd_tool("systemd-sysusers");
    let root = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(root.path().join("etc")).expect("etc");
    let output = run(Command::new(sysusers)
        .arg("--dry-run")
        .arg(format!("--root={}", root.path().display()))
        .arg(repo().join("systemd/channeld.sysusers")));
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert!(all.contains("Creating group 'channeld'"), "{all}");
    assert!(all.contains("Creating user 'channeld'"), "{all}");
}

/// A datagram socket playing systemd's notification socket.
struct FakeSystemd {
    socket: UnixDatagram,
    path: PathBuf,
}

impl FakeSystemd {
    fn bind(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        Self { socket, path }
    }

    /// The next notification, waiting up to `limit`, without the newline that may end its
    /// last assignment (systemd reads newline-separated assignments either way).
    fn next(&self, limit: Duration) -> Option<String> {
        self.socket.set_read_timeout(Some(limit)).expect("timeout");
        let mut buf = [0u8; 4096];
        let n = self.socket.recv(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).trim_end_matches('\n').to_owned())
    }
}

#[test]
fn the_hub_notifies_ready_after_binding_pings_the_watchdog_and_says_stopping() {
    let dir = tempfile::tempdir().expect("temp dir");
    let systemd = FakeSystemd::bind(dir.path());
    let config =
        write_file(dir.path(), "channeld.toml", "[instance.\"test.one\"]\nallow_all = true\n");
    let run_dir = dir.path().join("run");
    let log = std::fs::File::create(dir.path().join("channeld.log")).expect("log");
    let mut hub = Command::new(channeld_tests::workspace_bin("channeld"))
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(&run_dir)
        .env_remove("STATE_DIRECTORY")
        .env_remove("WATCHDOG_PID")
        .env("NOTIFY_SOCKET", &systemd.path)
        // 200 ms: pings every 100 ms.
        .env("WATCHDOG_USEC", "200000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn channeld");
    let hub_log = || std::fs::read_to_string(dir.path().join("channeld.log")).unwrap_or_default();

    let ready = systemd.next(Duration::from_secs(20)).unwrap_or_else(|| {
        let _ = hub.kill();
        panic!("no notification within 20 s; log:\n{}", hub_log())
    });
    assert_eq!(ready, "READY=1\nSTATUS=serving 1 instance(s)");
    // Ready means served: both sockets accept connections now.
    UnixStream::connect(run_dir.join("test.one.sock")).expect("instance socket after READY=1");
    UnixStream::connect(run_dir.join("control.sock")).expect("control socket after READY=1");

    let started = Instant::now();
    let mut pings = 0;
    while pings < 3 {
        let note = systemd.next(Duration::from_secs(5)).expect("a watchdog ping within 5 s");
        assert_eq!(note, "WATCHDOG=1");
        pings += 1;
    }
    assert!(started.elapsed() < Duration::from_secs(5), "pings are far too slow");

    // SAFETY: a plain syscall on our own child's PID.
    unsafe {
        libc::kill(hub.id() as i32, libc::SIGTERM);
    }
    let stopping = loop {
        let note = systemd.next(Duration::from_secs(10)).expect("STOPPING=1 after SIGTERM");
        if note != "WATCHDOG=1" {
            break note;
        }
    };
    assert_eq!(stopping, "STOPPING=1\nSTATUS=draining runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = hub.try_wait().expect("wait channeld") {
            break status;
        }
        assert!(Instant::now() < deadline, "channeld did not exit; log:\n{}", hub_log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "channeld exited with {status}; log:\n{}", hub_log());
}

#[test]
fn the_hub_exits_78_on_a_bad_config_so_systemd_does_not_restart_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_file(dir.path(), "channeld.toml", "[instance.\"a.b\"]\nallow_uids = []\n");
    let output = run(Command::new(channeld_tests::workspace_bin("channeld"))
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(dir.path().join("run"))
        .env_remove("STATE_DIRECTORY")
        .env_remove("NOTIFY_SOCKET"));
    assert_eq!(output.status.code(), Some(78), "{}", text(&output));
    let unit = std::fs::read_to_string(repo().join("systemd/channeld.service")).expect("unit");
    let prevented = unit
        .lines()
        .filter_map(|l| l.strip_prefix("RestartPreventExitStatus="))
        .any(|codes| codes.split_whitespace().any(|code| code == "78"));
    assert!(prevented, "hub unit restarts on 78");
}
