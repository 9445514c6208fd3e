//! Extension `agent_env` through the real `channeld`: a driver hands its runs an environment
//! once (BCN's `bot.connect` `env`, with the bot token), the exec agent sees it — over the
//! inbound's metadata environment — every run after it, it is replaced by the next frame,
//! a name outside the driver family's namespace is refused whole with `invalid_agent_env`,
//! and the value is neither in the ledger's files nor in the hub's log. A run a hub crash
//! interrupted waits, after the restart, for the environment the driver sends again.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_protocol::ext::AgentEnv;
use channeld_protocol::frame::Inbound;
use channeld_tests::peer::{caps, expect_deliver, id, message};
use channeld_tests::{HubProcess, RawPeer, files_holding, write_script};

const ONE: &str = "envtest.one";
const SECRET: &str = "tok-5f1c0ffee-secret";

/// Answers `token=<$ENVTEST_TOKEN reversed> other=<$ENVTEST_OTHER>`: reversed, so the reply
/// (which the ledger keeps) does not hold the secret itself.
fn agent(dir: &Path) -> PathBuf {
    write_script(
        dir,
        "agent.sh",
        "IFS= read -r line\n\
         token=$(printf '%s\\n' \"${ENVTEST_TOKEN:-none}\" | rev)\n\
         echo \"token=$token other=${ENVTEST_OTHER:-none}\"\n",
    )
}

fn reversed(text: &str) -> String {
    text.chars().rev().collect()
}

fn env(entries: &[(&str, &str)]) -> Frame {
    Frame::AgentEnv(AgentEnv {
        env: entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
    })
}

/// Sends an inbound whose metadata sets `env.ENVTEST_TOKEN` and `env.ENVTEST_OTHER`, and
/// returns the reply's text.
async fn ask(driver: &mut RawPeer, event_id: &str) -> String {
    let mut msg = message(ONE, event_id, "alice", "room", "hi");
    msg.metadata.insert("env.ENVTEST_TOKEN".into(), "from-metadata".into());
    msg.metadata.insert("env.ENVTEST_OTHER".into(), "meta-other".into());
    driver.send(Frame::Inbound(Inbound { event_id: id(event_id), message: msg })).await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), event_id);
    reply.message.body.text_str().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drivers_agent_env_reaches_its_runs_and_stays_out_of_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path());
    let mut hub = HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 30\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "agent_env"]).await;
    let Frame::HelloAck(ack) = driver.frame().await else { panic!("no hello_ack") };
    assert!(ack.extensions.iter().any(|e| e == "agent_env"), "{:?}", ack.extensions);

    // Before any agent_env: the metadata environment only.
    assert_eq!(
        ask(&mut driver, "e-1").await,
        format!("token={} other=meta-other", reversed("from-metadata"))
    );

    driver.send(env(&[("ENVTEST_TOKEN", SECRET)])).await;
    assert_eq!(
        ask(&mut driver, "e-2").await,
        format!("token={} other=meta-other", reversed(SECRET))
    );

    // `channelctl status` names the entries, never their values.
    let out = hub.ctl(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
    assert_eq!(status["instances"][0]["agent_env"], serde_json::json!(["ENVTEST_TOKEN"]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains(SECRET));

    // Refused whole, naming the entry: the set before stays.
    driver.send(env(&[("ENVTEST_TOKEN", "other"), ("PATH", "/tmp/evil")])).await;
    let err = driver.error().await;
    assert_eq!(err.code, "invalid_agent_env");
    assert!(err.message.contains("PATH"), "{}", err.message);
    assert!(!err.message.contains("/tmp/evil"), "{}", err.message);
    assert_eq!(
        ask(&mut driver, "e-3").await,
        format!("token={} other=meta-other", reversed(SECRET))
    );

    // Replaced by the next frame; an empty one clears it.
    driver.send(env(&[("ENVTEST_TOKEN", "rotated")])).await;
    assert_eq!(
        ask(&mut driver, "e-4").await,
        format!("token={} other=meta-other", reversed("rotated"))
    );
    driver.send(env(&[])).await;
    assert_eq!(
        ask(&mut driver, "e-5").await,
        format!("token={} other=meta-other", reversed("from-metadata"))
    );

    // The value never reached a file: not the ledger's database or its log, not the hub's
    // log (which runs at debug level in these tests).
    let state = hub.dir.path().join("state");
    assert!(state.join("ledger.sqlite3").exists(), "no ledger under {}", state.display());
    assert_eq!(files_holding(&state, SECRET), Vec::<PathBuf>::new(), "the secret is on disk");
    assert!(hub.log().contains("agent environment set"), "{}", hub.log());
    assert!(!hub.log().contains(SECRET), "the secret is in the hub's log");

    // The set was cleared last, so a restart makes no run wait for it.
    drop(driver);
    hub.restart();
    tokio::task::block_in_place(|| hub.wait_log("hub ready", 2, Duration::from_secs(10)));
    assert!(!hub.log().contains(WAITS), "{}", hub.log());
}

/// What the hub logs when the ledger says runs must wait for a driver's environment (before
/// it logs `hub ready`).
const WAITS: &str = "runs wait for the driver's agent environment";

/// Logs each start to `starts.log` with its token, then answers at once when `go` exists and
/// otherwise sleeps (a run the test interrupts by killing the hub).
fn slow_agent(dir: &Path) -> PathBuf {
    let starts = dir.join("starts.log");
    let go = dir.join("go");
    write_script(
        dir,
        "slow.sh",
        &format!(
            "IFS= read -r line\n\
             token=$(printf '%s\\n' \"${{ENVTEST_TOKEN:-none}}\" | rev)\n\
             echo \"start token=$token\" >> '{}'\n\
             [ -e '{}' ] || exec sleep 30\n\
             echo \"token=$token\"\n",
            starts.display(),
            go.display()
        ),
    )
}

fn starts(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("starts.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A hub running [`slow_agent`] for `instance`; runs wait at most 2 s for a silent driver.
fn slow_config(work: &Path, instance: &str) -> String {
    format!(
        "[hub]\nagent_env_wait_secs = 2\n\
         [runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 60\n\
         [instance.\"{instance}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        slow_agent(work).display()
    )
}

/// A hub whose driver gave its runs `ENVTEST_TOKEN` and whose run of `e-1` was interrupted by
/// a crash, restarted without the driver: the recovered run waits (checked for 1.5 s).
async fn crashed_mid_run(work: &Path) -> HubProcess {
    let dir = tempfile::tempdir().unwrap();
    let mut hub = HubProcess::start_in(dir, &slow_config(work, ONE));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "agent_env"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.send(env(&[("ENVTEST_TOKEN", SECRET)])).await;
    let msg = message(ONE, "e-1", "alice", "room", "hi");
    driver.send(Frame::Inbound(Inbound { event_id: id("e-1"), message: msg })).await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let deadline = Instant::now() + Duration::from_secs(20);
    while starts(work).is_empty() {
        assert!(Instant::now() < deadline, "the run did not start; log:\n{}", hub.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(starts(work), vec![format!("start token={}", reversed(SECRET))]);

    // A crash in the middle of the run; the next start recovers it.
    hub.kill();
    drop(driver);
    std::fs::write(work.join("go"), "").unwrap();
    hub.restart();
    // No driver yet: the recovered run has no environment, so it waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(starts(work).len(), 1, "the recovered run started without its environment");
    assert!(hub.log().contains(WAITS), "{}", hub.log());
    hub
}

/// The driver back after the restart with `extensions`, sending `env_first` first if given.
/// Returns the text of the recovered run's reply.
async fn back(hub: &HubProcess, extensions: &[&str], env_first: Option<Frame>) -> String {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), extensions).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    if let Some(frame) = env_first {
        driver.send(frame).await;
    }
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), "e-1");
    reply.message.body.text_str().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_recovered_after_a_crash_waits_for_the_drivers_agent_env() {
    let work = tempfile::tempdir().unwrap();
    let hub = crashed_mid_run(work.path()).await;
    // The driver is back with its environment (a new token), sent after its `start`: the
    // run starts with it.
    let rotated = env(&[("ENVTEST_TOKEN", "rotated")]);
    let text = back(&hub, &["accepted", "agent_env"], Some(rotated)).await;
    assert_eq!(text, format!("token={}", reversed("rotated")));
    assert_eq!(starts(work.path()).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_run_waits_no_longer_for_a_driver_that_sends_no_agent_env() {
    let work = tempfile::tempdir().unwrap();
    let hub = crashed_mid_run(work.path()).await;
    // Back without the extension: it has no environment to send, so the run starts at once.
    let text = back(&hub, &["accepted"], None).await;
    assert_eq!(text, format!("token={}", reversed("none")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_run_waits_at_most_the_grace_for_a_silent_driver() {
    let work = tempfile::tempdir().unwrap();
    let hub = crashed_mid_run(work.path()).await;
    // Back with the extension, but it sends neither its environment nor an inbound: the run
    // starts after `agent_env_wait_secs` (2 s here), without the environment.
    let text = back(&hub, &["accepted", "agent_env"], None).await;
    assert_eq!(text, format!("token={}", reversed("none")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_run_cancelled_while_it_waits_never_starts() {
    let work = tempfile::tempdir().unwrap();
    let hub = crashed_mid_run(work.path()).await;
    // Cancelled while it waits for the driver: answered at once (not after the cancel's
    // 30-s wait for a run to stop), as cancelled.
    let out = hub.ctl_async(&["cancel", ONE, "e-1"]).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("e-1: cancelled"), "{out:?}");
    // The driver is back with its environment: the run does not start after all.
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "agent_env"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.send(env(&[("ENVTEST_TOKEN", "rotated")])).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(starts(work.path()).len(), 1, "the cancelled run started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_run_of_an_instance_a_reload_removes_waits_no_longer() {
    let work = tempfile::tempdir().unwrap();
    let hub = crashed_mid_run(work.path()).await;
    // Its driver cannot come back: the run goes on, as the removed instance's other runs do.
    std::fs::write(&hub.config, slow_config(work.path(), "envtest.two")).unwrap();
    hub.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(15);
    while starts(work.path()).len() < 2 {
        assert!(Instant::now() < deadline, "the run still waits; log:\n{}", hub.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(starts(work.path())[1], format!("start token={}", reversed("none")));
}
