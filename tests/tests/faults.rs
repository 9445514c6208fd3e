//! Faults a real `channeld` meets in operation: a full disk under the ledger (a small tmpfs
//! mounted for the test: as root, or — run by another user — in a user and mount namespace of
//! the test's own, `unshare --user --map-root-user --mount`; without either they fail naming
//! what is missing), a
//! state directory or database the hub cannot use (refused at start with exit status 74,
//! naming the file and what to do), and the operator's `channeld ledger` tools.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_tests::peer::caps;
use channeld_tests::{HubProcess, RawPeer, alive, workspace_bin};

const ONE: &str = "test.one";
const ECHO: &str = "[instance.\"test.one\"]\nallow = [\"alice\"]\n";

/// Set in the test process [`as_root`] starts inside its own namespaces.
const IN_NAMESPACE: &str = "CHANNELD_TEST_IN_USERNS";

/// Whether this process may mount (it runs as root, in the machine's namespaces or in a user
/// namespace of its own). Otherwise runs the test `name` again in a user and mount namespace
/// where this user is root (`unshare --user --map-root-user --mount`), checks that it
/// passed, and returns false: the caller returns at once. A tmpfs mounted there is seen by
/// that test process and the hub it starts, and is gone with them.
fn as_root(name: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    assert!(
        std::env::var_os(IN_NAMESPACE).is_none(),
        "not root inside the user namespace that should map this user to root"
    );
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "--propagation", "private"])
        .arg(&exe)
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(IN_NAMESPACE, "1")
        .output()
        .unwrap_or_else(|err| {
            panic!("not root, and `unshare` (util-linux) cannot be run to get a namespace: {err}")
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} in a user and mount namespace of its own (not root: this test mounts a tmpfs, \
         which needs root or unprivileged user namespaces, `sysctl user.max_user_namespaces`) \
         ended with {}:\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("1 passed"), "{name} did not run in the namespace:\n{stdout}");
    false
}

/// A tmpfs of `size` mounted on a fresh directory; unmounted (lazily, so a process still
/// holding a file cannot keep it) on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// `options` besides the mode, e.g. `size=4m` or `size=1m,ro` (read-only from the
    /// start: a remount is refused in a user namespace).
    fn mount(dir: &Path, options: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("{options},mode=0700"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "these tests mount a small tmpfs and need root (CAP_SYS_ADMIN) for it, or a user \
             namespace of their own (see `as_root`): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir: dir.to_owned() }
    }

    /// Fills what is left with a file; returns its path (remove it to give the space back).
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.dir.join("filler");
        let mut file = std::fs::File::create(&path).unwrap();
        let block = vec![0u8; 64 * 1024];
        loop {
            match file.write(&block) {
                Ok(0) => break,
                Ok(_) => {}
                Err(err) if err.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(err) => panic!("filling the tmpfs: {err}"),
            }
        }
        // Whatever a partial page left: write single bytes until none fits.
        while file.write(&[0]).is_ok_and(|n| n == 1) {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn status_json(hub: &HubProcess) -> serde_json::Value {
    let out = hub.ctl(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("status json")
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_new_work_keeps_what_was_accepted_and_recovers_by_itself() {
    if !as_root("a_full_disk_refuses_new_work_keeps_what_was_accepted_and_recovers_by_itself") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tmpfs = Tmpfs::mount(&dir.path().join("state"), "size=4m");
    let hub = HubProcess::start_in(dir, ECHO);
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "before", "alice", "c0", "stored before the disk filled").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert!(matches!(driver.frame().await, Frame::Deliver(_)));

    let filler = tmpfs.fill();
    // The write-ahead log may still have room from earlier commits: messages are accepted
    // until it runs out, then refused. Every accepted one must be answered in the end.
    let text = "x".repeat(8 * 1024);
    let mut accepted = BTreeSet::new();
    let mut answered: HashMap<String, usize> = HashMap::new();
    let mut refused = None;
    for n in 0..400 {
        let event = format!("full-{n}");
        driver.inbound(ONE, &event, "alice", &format!("c{}", n % 3), &text).await;
        match driver.frame().await {
            Frame::Accepted(_) => {
                accepted.insert(event);
            }
            Frame::Error(error) => {
                assert_eq!(error.code, "storage_full", "{error:?}");
                assert!(error.retryable, "a full disk is retryable: {error:?}");
                refused = Some(event);
                break;
            }
            Frame::Deliver(delivery) => {
                // A reply to an earlier accepted message, handed over meanwhile.
                assert!(accepted.contains(delivery.request_id.as_str()), "{delivery:?}");
                *answered.entry(delivery.request_id.to_string()).or_default() += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let refused = refused.expect("a 4 MiB tmpfs filled up within 400 messages of 8 KiB");
    wait_for("status shows storage_full", Duration::from_secs(5), || {
        status_json(&hub)["storage"] == "storage_full"
    });
    let health = hub.ctl_async(&["health", ONE]);
    loop {
        match driver.frame().await {
            Frame::HealthRequest(request) => {
                let ready = channeld_protocol::types::Health::ready();
                let response = channeld_protocol::frame::HealthResponse {
                    request_id: request.request_id,
                    health: ready,
                };
                driver.send(Frame::HealthResponse(response)).await;
                break;
            }
            Frame::Deliver(delivery) => {
                *answered.entry(delivery.request_id.to_string()).or_default() += 1;
            }
            other => panic!("expected health_request, got {other:?}"),
        }
    }
    let health = health.await.unwrap();
    assert!(String::from_utf8_lossy(&health.stdout).contains("storage_full"), "{health:?}");
    let send = hub.ctl(&["send", ONE, "--conversation", "c0", "proactive"]);
    assert_eq!(send.status.code(), Some(10), "storage full: {send:?}");
    assert!(String::from_utf8_lossy(&send.stderr).contains("storage_full"), "{send:?}");
    assert!(alive(hub.pid()), "the hub stays up on a full disk");

    std::fs::remove_file(&filler).unwrap();
    wait_for("the hub notices space returned", Duration::from_secs(10), || {
        status_json(&hub)["storage"].is_null()
    });
    // The driver retries what was refused; it is accepted now and answered.
    driver.inbound(ONE, &refused, "alice", "c9", "again").await;
    accepted.insert(refused.clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    while accepted.iter().any(|event| !answered.contains_key(event)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match driver.frame_within(left).await {
            Some(Frame::Deliver(delivery)) => {
                *answered.entry(delivery.request_id.to_string()).or_default() += 1;
            }
            Some(Frame::Accepted(_)) => {}
            Some(other) => panic!("unexpected {other:?}"),
            None => panic!(
                "answered {} of {} accepted messages; missing {:?}",
                answered.len(),
                accepted.len(),
                accepted.iter().filter(|e| !answered.contains_key(*e)).collect::<Vec<_>>()
            ),
        }
    }
    // Each once: nothing accepted was run twice or lost.
    for event in &accepted {
        assert_eq!(answered.get(event), Some(&1), "{event}: {answered:?}");
    }
    drop(hub);
}

/// Starts `channeld` on `dir` and waits for it to exit (it must refuse to start).
fn refused_start(dir: &Path, state: &Path) -> (Option<i32>, String) {
    let config = channeld_tests::write_file(dir, "channeld.toml", ECHO);
    let mut child = Command::new(workspace_bin("channeld"))
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(dir.join("run"))
        .arg("--state-dir")
        .arg(state)
        .env_remove("STATE_DIRECTORY")
        .env("CHANNELD_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn channeld");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut log = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
            return (status.code(), log);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("channeld started on an unusable state directory");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A state directory with a ledger written by a hub that ran and stopped.
fn used_state(dir: &Path) -> PathBuf {
    let state = dir.join("state");
    let mut hub = HubProcess::start_in(tempfile::tempdir_in(dir).unwrap(), ECHO);
    let status = hub.terminate();
    assert!(status.success());
    let ledger = hub.dir.path().join("state").join("ledger.sqlite3");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::copy(&ledger, state.join("ledger.sqlite3")).unwrap();
    state
}

#[test]
fn a_read_only_state_directory_is_refused_naming_it() {
    if !as_root("a_read_only_state_directory_is_refused_naming_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let _tmpfs = Tmpfs::mount(&state, "size=1m,ro");
    let (code, log) = refused_start(dir.path(), &state);
    assert_eq!(code, Some(74), "{log}");
    assert!(log.contains(&state.display().to_string()), "{log}");
    assert!(log.contains("not writable") && log.contains("writable by the hub's user"), "{log}");
}

#[test]
fn a_corrupted_database_is_refused_naming_it_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let state = used_state(dir.path());
    let ledger = state.join("ledger.sqlite3");
    // Damage every page after the header's first 100 bytes.
    let mut bytes = std::fs::read(&ledger).unwrap();
    for byte in bytes.iter_mut().skip(100) {
        *byte ^= 0x5a;
    }
    std::fs::write(&ledger, &bytes).unwrap();
    let (code, log) = refused_start(dir.path(), &state);
    assert_eq!(code, Some(74), "{log}");
    assert!(log.contains(&ledger.display().to_string()), "{log}");
    assert!(log.contains("corrupted") && log.contains("channeld ledger backup"), "{log}");
    // Not a database at all.
    std::fs::write(&ledger, b"definitely not sqlite, just text that is long enough").unwrap();
    let (code, log) = refused_start(dir.path(), &state);
    assert_eq!(code, Some(74), "{log}");
    assert!(log.contains("corrupted"), "{log}");
}

#[test]
fn a_database_from_a_newer_channeld_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = used_state(dir.path());
    let ledger = state.join("ledger.sqlite3");
    let out = Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('PRAGMA user_version = 999'); c.commit()"])
        .arg(&ledger)
        .output()
        .expect("python3 (with its sqlite3 module) sets the schema version");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (code, log) = refused_start(dir.path(), &state);
    assert_eq!(code, Some(74), "{log}");
    assert!(log.contains("newer than this hub understands") && log.contains("999"), "{log}");
    assert!(log.contains(&ledger.display().to_string()), "{log}");
}

fn ledger_cmd(state: &Path, args: &[&str]) -> Output {
    Command::new(workspace_bin("channeld"))
        .arg("--state-dir")
        .arg(state)
        .arg("ledger")
        .args(args)
        .env_remove("STATE_DIRECTORY")
        .output()
        .expect("run channeld ledger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_check_backup_and_vacuum_for_operators() {
    let dir = tempfile::tempdir().unwrap();
    let mut hub = HubProcess::start_in(dir, ECHO);
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    for n in 0..20 {
        driver.inbound(ONE, &format!("m-{n}"), "alice", "c1", "keep me").await;
        assert!(matches!(driver.frame().await, Frame::Deliver(_)));
    }
    let state = hub.dir.path().join("state");

    // While the hub runs: check and backup work, vacuum is refused (exit 75).
    let check = ledger_cmd(&state, &["check"]);
    assert_eq!(check.status.code(), Some(0), "{check:?}");
    assert!(String::from_utf8_lossy(&check.stdout).contains("integrity check: ok"), "{check:?}");
    let backup = hub.dir.path().join("backup.sqlite3");
    let out = ledger_cmd(&state, &["backup", backup.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(backup.is_file());
    let again = ledger_cmd(&state, &["backup", backup.to_str().unwrap()]);
    assert_ne!(again.status.code(), Some(0), "an existing backup is never overwritten");
    let vacuum = ledger_cmd(&state, &["vacuum"]);
    assert_eq!(vacuum.status.code(), Some(75), "{vacuum:?}");
    assert!(
        String::from_utf8_lossy(&vacuum.stderr).contains("in use by another hub"),
        "{vacuum:?}"
    );

    driver.close().await;
    assert!(hub.terminate().success());
    let vacuum = ledger_cmd(&state, &["vacuum"]);
    assert_eq!(vacuum.status.code(), Some(0), "{vacuum:?}");

    // The backup restores: a hub on it knows the 20 messages (a redelivery is not run again).
    std::fs::copy(&backup, state.join("ledger.sqlite3")).unwrap();
    for side in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(state.join(format!("ledger.sqlite3{side}")));
    }
    hub.restart();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "m-3", "alice", "c1", "keep me").await;
    // A reply the backup still owed (the last ones may have been handed over after the backup
    // was taken) is delivered again first; then m-3 is known.
    loop {
        match driver.frame().await {
            Frame::Deliver(delivery) if delivery.request_id.as_str() != "m-3" => continue,
            Frame::Accepted(accepted) => {
                assert!(accepted.duplicate, "{accepted:?}");
                break;
            }
            other => panic!("expected accepted (duplicate), got {other:?}"),
        }
    }

    // A missing ledger is an error naming it, never created by `check`.
    let empty = tempfile::tempdir().unwrap();
    let check = ledger_cmd(empty.path(), &["check"]);
    assert_eq!(check.status.code(), Some(74), "{check:?}");
    assert!(!empty.path().join("ledger.sqlite3").exists());
}

const TWO: &str = "test.two";

/// Two echo instances and a short stall timeout.
fn stall_hub() -> HubProcess {
    HubProcess::start(&format!(
        "[hub]\nstall_timeout_secs = 3\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\n[instance.\"{TWO}\"]\nallow = [\"alice\"]\n"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_stops_reading_is_degraded_then_closed_and_its_replies_wait() {
    let hub = stall_hub();
    let mut other = RawPeer::connect(&hub.socket(TWO)).await;
    other.hello(TWO, caps(&["receive", "send"]), &[]).await;

    // This driver writes but never reads: the echo replies (100 KiB each, one conversation
    // each, so they are handed over side by side) fill its socket and then the hub's queue.
    let stuck = RawPeer::connect(&hub.socket(ONE)).await;
    stuck.hello(ONE, caps(&["receive", "send"]), &["accepted", "reply_receipt"]).await;
    let text = "y".repeat(100 * 1024);
    let events: Vec<String> = (0..30).map(|n| format!("stall-{n}")).collect();
    for (n, event) in events.iter().enumerate() {
        stuck.inbound(ONE, event, "alice", &format!("c{n}"), &text).await;
    }
    wait_for("the stuck instance shows Degraded", Duration::from_secs(10), || {
        let row = hub.instance_status(ONE);
        row["health"]["state"] == "Degraded"
            && row["health"]["detail"].as_str().unwrap_or("").contains("has not read its socket")
    });
    // The other instance is served meanwhile.
    other.inbound(TWO, "other-1", "alice", "c1", "still here").await;
    assert_eq!(channeld_tests::peer::expect_deliver(other.frame().await).request_id, "other-1");

    wait_for("the stuck connection is closed", Duration::from_secs(10), || {
        hub.instance_status(ONE)["connected"] == false
    });
    assert!(hub.log().contains("did not read its socket within stall_timeout_secs"));
    drop(stuck);

    // A new connection, which (as the SDK does) sends again what was never answered: the
    // replies never confirmed are handed to it, the messages the hub had not read yet are
    // run now; each message gets one reply.
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted", "reply_receipt"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    for (n, event) in events.iter().enumerate() {
        driver.inbound(ONE, event, "alice", &format!("c{n}"), &text).await;
    }
    let mut delivered: HashMap<String, usize> = HashMap::new();
    while delivered.len() < events.len() {
        match driver.frame().await {
            Frame::Accepted(_) => {}
            Frame::Deliver(delivery) => {
                *delivered.entry(delivery.request_id.to_string()).or_default() += 1;
                let receipt = channeld_tests::peer::receipt_for(
                    ONE,
                    &delivery.request_id,
                    delivery.message.target.conversation.as_str(),
                    &format!("posted-{}", delivery.request_id),
                );
                driver.send(receipt).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // A message sent again after its reply was posted gets the reply replayed (the driver
    // answers it from memory, PROTOCOL.md); any other second copy would be a second post.
    // Replays still on their way when this stops waiting are not counted.
    while let Some(frame) = driver.frame_within(Duration::from_millis(500)).await {
        match frame {
            Frame::Deliver(delivery) => {
                *delivered.entry(delivery.request_id.to_string()).or_default() += 1;
            }
            Frame::Accepted(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let log = hub.log();
    for event in &events {
        let copies = delivered.get(event).copied().unwrap_or(0);
        let replays = log
            .lines()
            .filter(|line| {
                line.contains("replaying") && line.contains(&format!("event_id={event} "))
            })
            .count();
        assert!(
            (1..=1 + replays).contains(&copies),
            "{event}: {copies} copies, {replays} replays of a posted reply"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_bounded_and_the_driver_keeps_being_served() {
    let hub = HubProcess::start(ECHO);
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;

    // Hundreds of connections that say nothing, on the instance socket and the control socket.
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(tokio::net::UnixStream::connect(hub.socket(ONE)).await.unwrap());
        silent.push(tokio::net::UnixStream::connect(hub.control_socket()).await.unwrap());
    }
    // Beyond 64 unidentified connections on an instance socket: refused, retryable.
    let mut crowd = RawPeer::connect(&hub.socket(ONE)).await;
    let refusal = crowd.error().await;
    assert_eq!(refusal.code, "too_many_connections", "{refusal:?}");
    assert!(refusal.retryable);
    // The connected driver is served all along.
    for n in 0..5 {
        let event = format!("served-{n}");
        driver.inbound(ONE, &event, "alice", "c1", "ping").await;
        assert_eq!(
            channeld_tests::peer::expect_deliver(driver.frame().await).request_id,
            event.as_str()
        );
    }
    // Silent control connections are closed after the first-request timeout (10 s), so
    // channelctl gets a slot again.
    wait_for("channelctl is served again", Duration::from_secs(20), || {
        hub.ctl(&["status"]).status.code() == Some(0)
    });
    let rss_before = channeld_tests::rss_kib(hub.pid());
    drop(silent);
    assert!(alive(hub.pid()));
    eprintln!("hub RSS with 400 silent connections: {rss_before} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_floods_output_ignores_sigterm_and_forks_is_killed_whole_and_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("child.pid");
    // The agent and its child ignore SIGTERM; once the child wrote its pid down (so the
    // test knows whom to watch even when the hub ends the group at once), the agent prints
    // without end.
    let agent = channeld_tests::write_script(
        dir.path(),
        "flood.sh",
        &format!(
            "trap '' TERM\ncat > /dev/null\npid_file='{}'\n\
             sh -c \"trap '' TERM; echo \\$\\$ > '$pid_file.tmp'; mv '$pid_file.tmp' '$pid_file'; exec sleep 60\" &\n\
             while [ ! -s \"$pid_file\" ]; do sleep 0.01; done\n\
             exec yes 'gigabytes of output, gigabytes of output'\n",
            pid_file.display()
        ),
    );
    let config = format!(
        "[runtime.flood]\nkind = \"exec\"\ncommand = [\"{}\"]\nmax_output_bytes = 65536\ntimeout_secs = 20\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"flood\"\n",
        agent.display()
    );
    let hub = HubProcess::start_in(tempfile::tempdir().unwrap(), &config);
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    let rss_before = channeld_tests::rss_kib(hub.pid());
    for n in 0..5 {
        driver.inbound(ONE, &format!("flood-{n}"), "alice", "c1", "talk a lot").await;
        let error = driver.error().await;
        assert_eq!(error.code, "agent_output_too_large", "{error:?}");
        wait_for("the agent's child is written down", Duration::from_secs(5), || {
            std::fs::read_to_string(&pid_file).is_ok_and(|pid| pid.ends_with('\n'))
        });
        let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        wait_for("the child that ignores SIGTERM is killed", Duration::from_secs(5), || {
            !alive(pid)
        });
        std::fs::remove_file(&pid_file).unwrap();
    }
    let rss_after = channeld_tests::rss_kib(hub.pid());
    eprintln!("hub RSS: {rss_before} KiB before five flooding agents, {rss_after} KiB after");
    assert!(rss_after < rss_before + 32 * 1024, "{rss_before} KiB -> {rss_after} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_flooding_faster_than_agents_run_gets_busy_and_nothing_accepted_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let agent = channeld_tests::write_script(
        dir.path(),
        "slow.sh",
        "cat > /dev/null\nsleep 0.2\necho done\n",
    );
    let config = format!(
        "[runtime.slow]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"slow\"\nmax_inflight = 2\nmax_queued = 8\n",
        agent.display()
    );
    let hub = HubProcess::start_in(tempfile::tempdir().unwrap(), &config);
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    let rss_before = channeld_tests::rss_kib(hub.pid());
    let text = "z".repeat(16 * 1024);
    let total = 2000;
    let sender = {
        let sink = driver.sink.clone();
        let text = text.clone();
        tokio::spawn(async move {
            for n in 0..total {
                let event = format!("flood-{n}");
                let frame = Frame::Inbound(channeld_protocol::frame::Inbound {
                    event_id: channeld_tests::peer::id(&event),
                    message: channeld_tests::peer::message(
                        ONE,
                        &event,
                        "alice",
                        &format!("c{}", n % 50),
                        &text,
                    ),
                });
                sink.send(&frame).await.expect("send");
            }
        })
    };
    let (mut accepted, mut busy) = (BTreeSet::new(), 0usize);
    let mut delivered = BTreeSet::new();
    while accepted.len() + busy < total || delivered.len() < accepted.len() {
        match driver.frame().await {
            Frame::Accepted(a) => {
                accepted.insert(a.event_id.to_string());
            }
            Frame::Error(error) => {
                assert_eq!(error.code, "busy", "{error:?}");
                assert!(error.retryable);
                busy += 1;
            }
            Frame::Deliver(delivery) => {
                assert!(delivered.insert(delivery.request_id.to_string()), "delivered twice");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    sender.await.unwrap();
    let rss_after = channeld_tests::rss_kib(hub.pid());
    eprintln!(
        "flood: {total} inbound of 16 KiB, {} accepted, {busy} busy; hub RSS {rss_before} KiB -> {rss_after} KiB",
        accepted.len()
    );
    assert!(busy > 0, "a flood this fast must meet the queue bound");
    assert_eq!(delivered, accepted, "every accepted message is answered");
    assert!(rss_after < rss_before + 64 * 1024, "{rss_before} KiB -> {rss_after} KiB");
}
