//! The platform side's lifecycle against a fake hub: `run` starts only once the hub accepted
//! the driver, stops while the hub refuses it and starts again when it accepts; a `run` that
//! ignores its token is aborted; operator actions are dispatched; unusable sockets and
//! refused channels end the driver with a configuration error.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use channeld_protocol::types::{Capabilities, DeliveryReceipt};
use channeld_protocol::{ChannelId, Id};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{AckMode, DriverTask, FakeHub, IO_TIMEOUT};
use crate::driver::{
    Declaration, Driver, DriverError, OperatorAction, OperatorActionError, Post, PostError,
};
use crate::hub::Hub;
use crate::inbound::Inbound;
use crate::pending::Acceptance;
use crate::runtime::RunError;

const CHANNEL: &str = "lifecycle.test";

/// What happened, in order, on both sides of the test.
type Log = Arc<Mutex<Vec<String>>>;

fn note(log: &Log, entry: impl Into<String>) {
    log.lock().unwrap().push(entry.into());
}

/// Records each `run` start and stop; the first run reports one message and hands its
/// outcome to the test.
struct Recorder {
    log: Log,
    runs: std::sync::atomic::AtomicUsize,
    outcomes: mpsc::UnboundedSender<Acceptance>,
    obey_shutdown: bool,
}

impl Driver for Recorder {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, send: true, ..Default::default() })
            .with_operator_actions(["resume", "explode"])
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        note(&self.log, format!("run {n} started"));
        if !self.obey_shutdown {
            return std::future::pending().await;
        }
        if n == 1 {
            let ticket = hub.inbound(Inbound::text("room", "alice", "hello").id("m-1")).await?;
            let outcomes = self.outcomes.clone();
            tokio::spawn(async move {
                let _ = outcomes.send(ticket.outcome().await);
            });
        }
        shutdown.cancelled().await;
        note(&self.log, format!("run {n} stopped"));
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        Ok(DeliveryReceipt {
            channel: post.message.target.channel.clone(),
            message_id: Id::new("posted").unwrap(),
            target: post.message.target,
            timestamp_ms: None,
        })
    }

    async fn operator_action(
        &self,
        request: OperatorAction,
    ) -> Result<serde_json::Value, OperatorActionError> {
        match request.name.as_str() {
            "resume" => Ok(serde_json::json!({ "resumed": true, "args": request.args })),
            _ => Err(OperatorActionError::Failed("it blew up".into())),
        }
    }
}

fn recorder(log: &Log, obey_shutdown: bool) -> (Recorder, mpsc::UnboundedReceiver<Acceptance>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let driver =
        Recorder { log: log.clone(), runs: Default::default(), outcomes: tx, obey_shutdown };
    (driver, rx)
}

/// Waits (bounded) until the log has `entry`.
async fn logged(log: &Log, entry: &str) {
    let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
    while !log.lock().unwrap().iter().any(|e| e == entry) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {entry:?} within {IO_TIMEOUT:?}; log: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_platform_side_starts_only_after_the_hub_accepted_the_hello() {
    let hub = FakeHub::bind().await;
    let log = Log::default();
    let (driver, _outcomes) = recorder(&log, true);
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));

    let mut refused = hub.accept().await;
    refused.refuse_hello("already_connected", true).await;
    note(&log, "hub refused");
    refused.disconnect();
    let mut conn = hub.accept_within(Duration::from_secs(5)).await;
    note(&log, "hub accepting");
    conn.handshake(AckMode::Extensions).await;
    logged(&log, "run 1 started").await;
    assert_eq!(*log.lock().unwrap(), ["hub refused", "hub accepting", "run 1 started"]);

    let (stopped, ()) = tokio::join!(task.stop(), async {
        conn.expect_inbound().await;
        conn.expect_stop().await;
    });
    stopped.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_stops_the_platform_side_and_the_next_acceptance_starts_it_again() {
    let hub = FakeHub::bind().await;
    let log = Log::default();
    let (driver, mut outcomes) = recorder(&log, true);
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));

    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;
    let inbound = conn.expect_inbound().await;
    assert_eq!(inbound.event_id, "m-1");
    // Unanswered, the connection drops, and on its return another driver holds the instance.
    conn.disconnect();
    let mut refused = hub.accept_within(Duration::from_secs(5)).await;
    refused.refuse_hello("already_connected", true).await;
    logged(&log, "run 1 stopped").await;
    let outcome = tokio::time::timeout(IO_TIMEOUT, outcomes.recv()).await.unwrap().unwrap();
    assert_eq!(outcome, Acceptance::Unresolved, "what the refused driver held is given back");
    refused.disconnect();

    let mut conn = hub.accept_within(Duration::from_secs(5)).await;
    conn.handshake(AckMode::Extensions).await;
    logged(&log, "run 2 started").await;
    let (stopped, ()) = tokio::join!(task.stop(), async {
        conn.expect_stop().await;
    });
    stopped.unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        ["run 1 started", "run 1 stopped", "run 2 started", "run 2 stopped"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_channel_never_reaches_the_platform_and_is_a_configuration_error() {
    let hub = FakeHub::bind().await;
    let log = Log::default();
    let (driver, _outcomes) = recorder(&log, true);
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));
    let mut conn = hub.accept().await;
    conn.refuse_hello("channel_mismatch", false).await;
    let err = task.join().await.unwrap_err();
    assert!(matches!(&err, RunError::Refused { code, .. } if code == "channel_mismatch"), "{err}");
    assert_eq!(err.exit_code(), 78);
    assert!(log.lock().unwrap().is_empty(), "run was called: {:?}", log.lock().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_ignores_shutdown_is_aborted_and_the_driver_exits_non_zero() {
    let hub = FakeHub::bind().await;
    let log = Log::default();
    let (driver, _outcomes) = recorder(&log, false);
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;
    logged(&log, "run 1 started").await;
    let (stopped, ()) = tokio::join!(task.stop(), async {
        conn.expect_stop().await;
    });
    let err = stopped.unwrap_err();
    assert!(matches!(err, RunError::Aborted(_)), "{err}");
    assert_eq!(err.exit_code(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_are_declared_in_hello_and_dispatched_by_name() {
    let hub = FakeHub::bind().await;
    let log = Log::default();
    let (driver, _outcomes) = recorder(&log, true);
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));
    let mut conn = hub.accept().await;
    let hello = conn.handshake(AckMode::Extensions).await;
    assert_eq!(hello.operator_actions, ["resume", "explode"]);
    assert!(conn.negotiated().operator_action);
    conn.expect_inbound().await;

    conn.operator_action("op-1", "resume", serde_json::json!({"force": true})).await;
    let done = conn.expect_operator_action_result("op-1").await;
    assert!(done.ok && done.code.is_none(), "{done:?}");
    assert_eq!(done.data, Some(serde_json::json!({"resumed": true, "args": {"force": true}})));
    conn.operator_action("op-2", "explode", serde_json::json!({})).await;
    let failed = conn.expect_operator_action_result("op-2").await;
    assert!(!failed.ok);
    assert_eq!(failed.code.as_deref(), Some("failed"));
    assert_eq!(failed.message.as_deref(), Some("it blew up"));
    conn.operator_action("op-3", "relogin", serde_json::json!({})).await;
    let unknown = conn.expect_operator_action_result("op-3").await;
    assert_eq!((unknown.ok, unknown.code.as_deref()), (false, Some("unsupported")));

    let (stopped, ()) = tokio::join!(task.stop(), async {
        conn.expect_stop().await;
    });
    stopped.unwrap();
}

#[tokio::test]
async fn a_socket_path_that_is_a_directory_ends_the_driver_with_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let (driver, _outcomes) = recorder(&log, true);
    let launch =
        crate::launch::DriverLaunchConfig::for_socket(ChannelId::new(CHANNEL).unwrap(), dir.path());
    let ended = tokio::time::timeout(IO_TIMEOUT, DriverTask::spawn(driver, launch).join())
        .await
        .expect("the driver kept retrying a directory");
    let err = ended.unwrap_err();
    assert_eq!(err.exit_code(), 78, "{err}");
    assert!(err.to_string().contains("CHANNELD_SOCKET"), "{err}");
}

/// Reports the stop deadline it sees as it starts, then the one it sees `asks_after` it was
/// asked to stop (with when it was asked); then takes all but `spare` of that deadline
/// before it returns.
struct Lingerer {
    seen: mpsc::UnboundedSender<(Option<Instant>, Instant)>,
    asks_after: Duration,
    spare: Duration,
}

impl Driver for Lingerer {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let _ = self.seen.send((hub.stop_deadline(), Instant::now()));
        shutdown.cancelled().await;
        let asked = Instant::now();
        tokio::time::sleep(self.asks_after).await;
        let deadline = hub.stop_deadline();
        let _ = self.seen.send((deadline, asked));
        if let Some(deadline) = deadline {
            tokio::time::sleep_until(tokio::time::Instant::from_std(deadline - self.spare)).await;
        }
        Ok(())
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::failed("this driver posts nothing", false))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_run_learns_its_deadline_and_is_not_aborted_before_it() {
    lingers_until_its_deadline(Duration::ZERO).await;
}

/// A `run` that asks late gets the deadline the SDK fixed when it began to wait, not one
/// counted from its own question (which the SDK would not honour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_asks_late_gets_the_deadline_the_sdk_waits_for() {
    lingers_until_its_deadline(Duration::from_millis(700)).await;
}

async fn lingers_until_its_deadline(asks_after: Duration) {
    let hub = FakeHub::bind().await;
    let (seen, mut saw) = mpsc::unbounded_channel();
    let driver = Lingerer { seen, asks_after, spare: Duration::from_millis(300) };
    let task = DriverTask::spawn(driver, hub.launch_config(CHANNEL));
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;
    let (before, _) = saw.recv().await.expect("run started");
    assert_eq!(before, None, "no deadline before the stop");
    let (stopped, ()) = tokio::join!(task.stop(), async {
        conn.expect_stop().await;
    });
    // It used all but 0.3 s of its deadline and was not aborted.
    stopped.unwrap();
    let (after, asked) = saw.recv().await.expect("run stopped");
    let deadline = after.expect("a deadline once asked to stop");
    // The drain time, counted from about when the run was asked to stop. "About": stopping
    // the task cancels the run's token (a child of the process's) a moment before the SDK
    // fixes the deadline as it starts waiting, so a run woken on another thread may read
    // the clock first (by 2.6 µs in a CI run). A deadline counted from the run's late
    // question would be `asks_after` (0.7 s) later still.
    let left = deadline.saturating_duration_since(asked);
    let slack = Duration::from_millis(100);
    assert!(
        left <= super::DRAIN + slack && left >= super::DRAIN - Duration::from_secs(1),
        "{left:?}"
    );
}
