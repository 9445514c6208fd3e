//! Cancelling a run of the `amqp` runtime reaches the `channeld-worker` running it, through a
//! real RabbitMQ: the agent (which ignores SIGTERM) is gone soon after the cancel and the
//! driver gets the run's one ending, `error` `aborted`, as with the exec runtime; a run
//! cancelled while it waited in the run queue is never started when a worker picks it, even
//! a worker that connected only after the cancel.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_tests::peer::{caps, expect_deliver};
use channeld_tests::rabbitmq::RabbitMq;
use channeld_tests::{HubProcess, RawPeer, workspace_bin, write_script};

const ONE: &str = "cancel.remote";
const LIMIT: Duration = Duration::from_secs(30);

/// Records its pid in `pid-<event id>`; `slow-*` events ignore SIGTERM and sleep, anything
/// else answers `reply <event id>` at once.
fn agent(dir: &Path) -> PathBuf {
    let pids = dir.display();
    write_script(
        dir,
        "agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo $$ > '{pids}/pid-'\"$id\".tmp && mv '{pids}/pid-'\"$id\".tmp '{pids}/pid-'\"$id\"\n\
             case \"$id\" in slow-*) trap '' TERM; exec sleep 60;; esac\n\
             echo \"reply $id\"\n"
        ),
    )
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pid_of(dir: &Path, event: &str) -> i32 {
    let path = dir.join(format!("pid-{event}"));
    wait_for(&format!("the agent of {event} starting"), || path.exists());
    std::fs::read_to_string(&path).unwrap().trim().parse().expect("a pid")
}

fn expect_aborted(frame: Frame, event_id: &str) {
    match frame {
        Frame::Error(err) => {
            assert_eq!(err.request_id.as_ref().map(|i| i.as_str()), Some(event_id));
            assert_eq!(err.code, "aborted");
            assert!(!err.retryable);
        }
        other => panic!("expected the aborted ending of {event_id}, got {other:?}"),
    }
}

/// A hub whose instance [`ONE`] runs on the `amqp` runtime over `<queue>.runs`.
fn hub(url: &str, queue: &str) -> HubProcess {
    HubProcess::start_with_env(
        &format!(
            "[runtime.remote]\nkind = \"amqp\"\nurl = \"env:CANCEL_TEST_AMQP_URL\"\n\
             queue = \"{queue}.runs\"\nreply_queue = \"{queue}.replies\"\ntimeout_secs = 120\n\
             [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"remote\"\n"
        ),
        &[("CANCEL_TEST_AMQP_URL", url)],
    )
}

struct Worker(Child);

impl Worker {
    /// Starts a worker taking one run at a time from `queue`, logging to `log`.
    fn start(url: &str, queue: &str, agent: &Path, log: &Path) -> Self {
        let out = std::fs::File::create(log).unwrap();
        Self(
            Command::new(workspace_bin("channeld-worker"))
                .args(["--queue", queue, "--concurrency", "1", "--"])
                .arg(agent)
                .env("CHANNELD_AMQP_URL", url)
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .stdin(Stdio::null())
                .spawn()
                .expect("start channeld-worker"),
        )
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_the_workers_agent_and_a_queued_cancelled_run_never_starts() {
    let rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path());
    let hub = hub(&url, "cancel");
    let worker_log = dir.path().join("worker.log");
    // One run at a time: a second run waits in the run queue.
    let _worker = Worker::start(&url, "cancel.runs", &agent, &worker_log);
    let log = || std::fs::read_to_string(&worker_log).unwrap_or_default();
    wait_for("the worker being ready", || log().contains("worker ready"));

    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "cancel"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "slow-a", "alice", "room-a", "first").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let pid = pid_of(dir.path(), "slow-a");
    // slow-b is handed to the run queue and waits there: the worker is busy.
    driver.inbound(ONE, "slow-b", "alice", "room-b", "second").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    wait_for("slow-b waiting in the run queue", || {
        rabbit.queue_counts("cancel.runs").is_some_and(|(ready, _)| ready == 1)
    });

    let out = hub.ctl_async(&["cancel", ONE, "slow-b"]);
    expect_aborted(driver.frame().await, "slow-b");
    let out = out.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    let out = hub.ctl_async(&["cancel", ONE, "slow-a"]);
    expect_aborted(driver.frame().await, "slow-a");
    assert_eq!(out.await.unwrap().status.code(), Some(0));
    // SIGTERM is ignored: the SIGKILL after the exec runtime's grace ends it.
    wait_for("the cancelled agent ending", || !Path::new(&format!("/proc/{pid}")).exists());
    // The worker is free, picks slow-b and does not run it.
    wait_for("the worker skipping slow-b", || log().contains("before it started: not run"));
    assert!(!dir.path().join("pid-slow-b").exists(), "the cancelled queued run started");

    // The hub ignored both results; the next run is answered as usual.
    driver.inbound(ONE, "quick-1", "alice", "room-a", "and now?").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), "quick-1");
    assert_eq!(reply.message.body.text_str(), "reply quick-1");
    assert!(log().contains("run cancelled by the hub: stopping its agent"), "{}", log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_before_any_worker_connected_never_starts() {
    let rabbit = RabbitMq::start();
    let url = rabbit.guest_url();
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path());
    let hub = hub(&url, "early");
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted", "cancel"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    // No worker yet: the run waits in the run queue, and is cancelled there.
    driver.inbound(ONE, "slow-early", "alice", "room-a", "first").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    wait_for("slow-early waiting in the run queue", || {
        rabbit.queue_counts("early.runs").is_some_and(|(ready, _)| ready == 1)
    });
    let out = hub.ctl_async(&["cancel", ONE, "slow-early"]);
    expect_aborted(driver.frame().await, "slow-early");
    assert_eq!(out.await.unwrap().status.code(), Some(0));

    // A worker that connects only now reads the cancel before it takes the run.
    let worker_log = dir.path().join("worker.log");
    let _worker = Worker::start(&url, "early.runs", &agent, &worker_log);
    let log = || std::fs::read_to_string(&worker_log).unwrap_or_default();
    wait_for("the worker skipping slow-early", || log().contains("before it started: not run"));
    assert!(!dir.path().join("pid-slow-early").exists(), "the cancelled queued run started");
    assert!(!log().contains("run started"), "{}", log());

    driver.inbound(ONE, "quick-1", "alice", "room-a", "and now?").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id.as_str(), "quick-1");
    assert_eq!(reply.message.body.text_str(), "reply quick-1");
}
