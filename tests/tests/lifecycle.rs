//! The hub's life as a process: one hub per state directory, and SIGHUP re-reading the
//! configuration — applied live where it can be, refused (the hub running on) when the file
//! is invalid.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_tests::peer::{caps, expect_deliver};
use channeld_tests::{HubProcess, RawPeer, alive, workspace_bin, write_script};

const ONE: &str = "test.one";
const TWO: &str = "test.two";
const RELOADED: &str = "configuration reloaded";
const NOT_RELOADED: &str = "configuration not reloaded";
const WAIT: Duration = Duration::from_secs(15);

/// Rewrites the hub's config file and sends SIGHUP; waits until the hub logged the `n`th
/// answer `outcome`.
fn reload(hub: &HubProcess, config: &str, outcome: &str, n: usize) {
    std::fs::write(&hub.config, config).unwrap();
    hub.signal(libc::SIGHUP);
    tokio::task::block_in_place(|| hub.wait_log(outcome, n, WAIT));
}

fn error_code(frame: Frame) -> String {
    match frame {
        Frame::Error(err) => err.code,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

/// Polls `done` every 20 ms until it holds; panics with `what` after [`WAIT`].
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hub_on_the_same_state_directory_refuses_to_start_and_names_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let gate = dir.path().join("gate");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!(
            "cat > /dev/null\necho start >> '{}'\nwhile [ ! -e '{}' ]; do sleep 0.02; done\necho done\n",
            starts.display(),
            gate.display()
        ),
    );
    let hub = HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "m-1", "alice", "c1", "work").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    eventually("the run started", || starts.exists()).await;

    // The same configuration and state, another runtime directory.
    let mut second = Command::new(workspace_bin("channeld"))
        .arg("--config")
        .arg(&hub.config)
        .arg("--runtime-dir")
        .arg(hub.dir.path().join("run-2"))
        .arg("--state-dir")
        .arg(hub.dir.path().join("state"))
        .env_remove("STATE_DIRECTORY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while second.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = second.kill();
            panic!("a second hub kept running on the first one's state directory");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = second.wait_with_output().unwrap();
    assert_eq!(second.status.code(), Some(75), "{}", String::from_utf8_lossy(&second.stderr));
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains(&format!("pid {}", hub.pid())), "{said}");
    assert!(!hub.dir.path().join("run-2").join(format!("{ONE}.sock")).exists());

    // The first hub's run was not started a second time, and it finishes as usual.
    std::fs::write(&gate, "").unwrap();
    assert_eq!(expect_deliver(driver.frame().await).message.body.text_str(), "done");
    assert_eq!(std::fs::read_to_string(&starts).unwrap().lines().count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_allowlists_deny_notices_runtimes_and_new_instances_live() {
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(dir.path(), "agent.sh", "cat > /dev/null\necho 'from the agent'\n");
    let hub = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"));
    let pid = hub.pid();
    let mut one = RawPeer::connect(&hub.socket(ONE)).await;
    one.hello(ONE, caps(&["receive"]), &[]).await;
    one.inbound(ONE, "m-1", "bob", "c1", "hi").await;
    assert_eq!(error_code(one.frame().await), "sender_denied");

    reload(
        &hub,
        &format!(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
             [instance.\"{ONE}\"]\nallow = [\"bob\"]\nruntime = \"agent\"\ndeny_notice = \"Private.\"\n\
             [instance.\"{TWO}\"]\nallow = [\"alice\"]\n",
            agent.display()
        ),
        RELOADED,
        1,
    );
    assert_eq!(hub.pid(), pid);
    // The connected driver keeps its connection; the new settings apply to new messages.
    one.inbound(ONE, "m-2", "bob", "c1", "hi").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "from the agent");
    one.inbound(ONE, "m-3", "alice", "c1", "hi").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "Private.");
    assert_eq!(error_code(one.frame().await), "sender_denied");

    let mut two = RawPeer::connect(&hub.socket(TWO)).await;
    two.hello(TWO, caps(&["receive"]), &[]).await;
    two.inbound(TWO, "t-1", "alice", "c1", "new instance").await;
    assert_eq!(expect_deliver(two.frame().await).message.body.text_str(), "new instance");
    assert_eq!(hub.instance_status(TWO)["connected"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_removes_an_instance_stopping_its_driver_and_removing_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("spawned.pid");
    let spawned = write_script(
        dir.path(),
        "driver.sh",
        &format!("echo $$ > '{}'\nexec sleep 60\n", pid_file.display()),
    );
    let both = format!(
        "[instance.\"{ONE}\"]\nallow = [\"alice\"]\n[instance.\"{TWO}\"]\nallow = [\"alice\"]\n\
         [instance.\"test.three\"]\nallow = [\"alice\"]\nspawn = [\"{}\"]\n",
        spawned.display()
    );
    let mut hub = HubProcess::start(&both);
    let mut one = RawPeer::connect(&hub.socket(ONE)).await;
    one.hello(ONE, caps(&["receive", "send"]), &[]).await;
    let mut two = RawPeer::connect(&hub.socket(TWO)).await;
    two.hello(TWO, caps(&["receive"]), &[]).await;
    two.inbound(TWO, "t-1", "alice", "c1", "sync").await;
    expect_deliver(two.frame().await);
    eventually("the spawned driver started", || pid_file.exists()).await;
    let spawned_pid: i32 = {
        let mut text = String::new();
        eventually("the spawned driver wrote its pid", || {
            text = std::fs::read_to_string(&pid_file).unwrap_or_default();
            text.ends_with('\n')
        })
        .await;
        text.trim().parse().unwrap()
    };

    reload(&hub, &format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"), RELOADED, 1);
    assert!(matches!(two.frame().await, Frame::Stop(_)), "the removed driver is told stop");
    assert!(two.closed_within(WAIT).await);
    assert!(!hub.socket(TWO).exists());
    assert!(!hub.socket("test.three").exists());
    eventually("the spawned driver of the removed instance stopped", || !alive(spawned_pid)).await;
    let out = hub.ctl(&["send", TWO, "--conversation", "c1", "hello?"]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let status: serde_json::Value =
        serde_json::from_slice(&hub.ctl(&["status", "--json"]).stdout).unwrap();
    assert_eq!(status["instances"].as_array().unwrap().len(), 1, "{status}");

    // The instance that stayed is untouched.
    one.inbound(ONE, "m-1", "alice", "c1", "still here").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "still here");

    // Added back, it is served again.
    reload(&hub, &both, RELOADED, 2);
    let mut two = RawPeer::connect(&hub.socket(TWO)).await;
    two.hello(TWO, caps(&["receive"]), &[]).await;
    two.inbound(TWO, "t-2", "alice", "c1", "back").await;
    assert_eq!(expect_deliver(two.frame().await).message.body.text_str(), "back");
    assert!(hub.terminate().success());
    assert!(!hub.socket(TWO).exists(), "an added instance's socket is removed at shutdown too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_an_invalid_file_keeps_the_hub_running_and_says_why() {
    let config = format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n");
    let hub = HubProcess::start(&config);
    let mut one = RawPeer::connect(&hub.socket(ONE)).await;
    one.hello(ONE, caps(&["receive"]), &[]).await;

    reload(&hub, "[instance.\"test.one\"\nallow = [", NOT_RELOADED, 1);
    reload(
        &hub,
        &format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"nope\"\n"),
        NOT_RELOADED,
        2,
    );
    assert!(
        hub.log().contains("no runtime named \\\"nope\\\"")
            || hub.log().contains("no runtime named \"nope\""),
        "{}",
        hub.log()
    );
    one.inbound(ONE, "m-1", "alice", "c1", "still served").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "still served");

    // Keys that only a restart applies are named, and the rest is applied.
    reload(
        &hub,
        &format!(
            "[hub]\nreceipt_timeout_secs = 3\n[instance.\"{ONE}\"]\nallow = [\"bob\"]\nmax_inflight = 2\n"
        ),
        RELOADED,
        1,
    );
    let log = hub.log();
    assert!(log.contains("hub.receipt_timeout_secs"), "{log}");
    assert!(
        log.contains("instance.\\\"test.one\\\".max_inflight")
            || log.contains("instance.\"test.one\".max_inflight"),
        "{log}"
    );
    one.inbound(ONE, "m-2", "bob", "c1", "bob now").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "bob now");
}

#[test]
fn systemctl_reload_sends_the_hub_sighup() {
    let unit = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/channeld.service");
    let unit = std::fs::read_to_string(unit).unwrap();
    assert!(unit.lines().any(|l| l == "ExecReload=/bin/kill -HUP $MAINPID"), "{unit}");
}

/// The scheduling policy of every thread of process `pid`.
fn thread_policies(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| task.ok()?.file_name().to_str()?.parse().ok())
        .filter_map(|tid| channeld_link::sched::policy_of(tid).ok())
        .collect()
}

/// A hub (an exec agent that answers with its own policy, a spawned driver that writes its
/// own) with `cpu_scheduling` set as given; returns the hub, the agent's answer and what the
/// driver wrote.
async fn policies_under(cpu_scheduling: &str) -> (HubProcess, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let driver_policy = dir.path().join("driver-policy");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        "cat > /dev/null\necho \"policy $(cut -d' ' -f41 /proc/$$/stat)\"\n",
    );
    let driver = write_script(
        dir.path(),
        "driver.sh",
        &format!(
            "cut -d' ' -f41 /proc/$$/stat > '{0}.tmp' && mv '{0}.tmp' '{0}'\nexec sleep 60\n",
            driver_policy.display()
        ),
    );
    let hub = HubProcess::start(&format!(
        "[hub]\n{cpu_scheduling}\n[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n\
         [instance.\"{TWO}\"]\nallow = [\"alice\"]\nspawn = [\"{}\"]\n",
        agent.display(),
        driver.display()
    ));
    let mut one = RawPeer::connect(&hub.socket(ONE)).await;
    one.hello(ONE, caps(&["receive"]), &[]).await;
    one.inbound(ONE, "m-1", "alice", "c1", "which policy?").await;
    let answer = expect_deliver(one.frame().await).message.body.text_str().trim().to_owned();
    eventually("the spawned driver wrote its policy", || driver_policy.exists()).await;
    let written = std::fs::read_to_string(&driver_policy).unwrap().trim().to_owned();
    (hub, answer, written)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hub_threads_run_batched_and_the_processes_it_starts_under_the_default_policy() {
    const SCHED_OTHER: i32 = 0;
    const SCHED_BATCH: i32 = 3;
    let (hub, agent, driver) = policies_under("").await;
    let policies = thread_policies(hub.pid());
    assert!(policies.len() >= 3, "the hub runs its threads: {policies:?}");
    assert!(policies.iter().all(|&p| p == SCHED_BATCH), "every hub thread batched: {policies:?}");
    assert_eq!(agent, format!("policy {SCHED_OTHER}"), "the exec agent runs as started");
    assert_eq!(driver, SCHED_OTHER.to_string(), "the spawned driver runs as started");

    let (hub, agent, driver) = policies_under("cpu_scheduling = \"inherit\"").await;
    let policies = thread_policies(hub.pid());
    assert!(policies.iter().all(|&p| p == SCHED_OTHER), "inherit leaves them: {policies:?}");
    assert_eq!(agent, format!("policy {SCHED_OTHER}"));
    assert_eq!(driver, SCHED_OTHER.to_string());
}
