//! The session when its connection to the hub breaks: frames the hub wrote before it went
//! away still reach the driver after the driver's write failed, so an inbound the hub
//! accepted is not reported again after the reconnect; the runs' environment a driver set
//! is stated again on each new connection, before the resent inbound; a hub that never
//! stops writing does not keep the session from stopping.

use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::ext::{Extensions, StreamFrame};
use channeld_protocol::types::{Capabilities, DeliveryReceipt};
use channeld_protocol::{Frame, Id, encode};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{AckMode, DriverTask, FakeConnection, FakeHub};
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::{Hub, InboundTicket};
use crate::inbound::Inbound;
use crate::pending::Acceptance;

/// Reports an inbound with each event id the test sends it, and hands its ticket to the test.
struct Reporter {
    texts: tokio::sync::Mutex<mpsc::Receiver<&'static str>>,
    tickets: mpsc::UnboundedSender<InboundTicket>,
}

impl Driver for Reporter {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let mut texts = self.texts.lock().await;
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                event = texts.recv() => match event {
                    Some(event) => event,
                    None => return Ok(()),
                },
            };
            let inbound = Inbound::text("alice", "alice", event).id(event);
            let ticket = hub.inbound(inbound).await.expect("reported");
            let _ = self.tickets.send(ticket);
        }
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::Failed { reason: "no platform".into(), retryable: false })
    }
}

/// The hub reads `m-1`, stops reading and only then — after the driver's write of `m-2` has
/// failed — writes `accepted` for `m-1` and closes. The session reads what the hub wrote
/// after the failure: `m-1` is accepted and only `m-2` is reported again after the
/// reconnect. Ending the session at the failed write instead reports both again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_written_after_the_driver_s_write_failed_is_still_read() {
    let fake = FakeHub::bind().await;
    let (texts, rx) = mpsc::channel(4);
    let (tickets, mut ticket) = mpsc::unbounded_channel();
    let driver = Reporter { texts: tokio::sync::Mutex::new(rx), tickets };
    let task = DriverTask::spawn(driver, fake.launch_config("test.session"));
    let mut conn = fake.accept().await;
    conn.handshake(AckMode::Extensions).await;

    texts.send("m-1").await.unwrap();
    assert_eq!(conn.expect_inbound().await.event_id.as_str(), "m-1");
    let first = ticket.recv().await.unwrap();
    conn.stop_reading();
    texts.send("m-2").await.unwrap();
    // The write of m-2 fails at once; the hub's answer to m-1 comes well inside the time
    // the session keeps reading after it (250 ms).
    tokio::time::sleep(Duration::from_millis(20)).await;
    // A session that ended at the failed write has closed its socket: this panics with
    // "Broken pipe".
    conn.accept_inbound("m-1").await;
    conn.disconnect();

    assert_eq!(first.outcome().await, Acceptance::Accepted { duplicate: false });
    let second = ticket.recv().await.unwrap();
    assert_eq!(second.event_id().as_str(), "m-2");
    let mut again = fake.accept().await;
    again.handshake(AckMode::Extensions).await;
    assert_eq!(again.expect_inbound().await.event_id.as_str(), "m-2", "m-1 was reported again");
    again.accept_inbound("m-2").await;
    assert_eq!(second.outcome().await, Acceptance::Accepted { duplicate: false });
    let (stopped, _) = tokio::join!(task.stop(), again.expect_stop());
    assert!(stopped.is_ok(), "{stopped:?}");
}

/// Sets the runs' environment, then reports `m-1`.
struct EnvSetter {
    tickets: mpsc::UnboundedSender<InboundTicket>,
}

impl Driver for EnvSetter {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let env = [("TEST_TOKEN".to_owned(), "tok-1".to_owned())].into();
        hub.agent_env(env).expect("kept for the hub");
        let ticket = hub.inbound(Inbound::text("alice", "alice", "m-1").id("m-1")).await;
        let _ = self.tickets.send(ticket.expect("reported"));
        shutdown.cancelled().await;
        Ok(())
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::Failed { reason: "no platform".into(), retryable: false })
    }
}

/// The environment a driver set reaches every hub connection once, before the inbound the
/// session sends again after a reconnect (so the run of a resent inbound has it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_env_is_sent_again_after_a_reconnect_before_the_resent_inbound() {
    let fake = FakeHub::bind().await;
    let (tickets, mut ticket) = mpsc::unbounded_channel();
    let task = DriverTask::spawn(EnvSetter { tickets }, fake.launch_config("test.env"));
    // The fake hub records `agent_env` frames as it reads past them: one recorded by the
    // time the inbound is read came before it.
    let sent_env = |conn: &FakeConnection| {
        let envs: Vec<_> = conn.agent_envs().iter().map(|e| e.env["TEST_TOKEN"].clone()).collect();
        assert_eq!(envs, ["tok-1"]);
    };
    let mut conn = fake.accept().await;
    conn.handshake(AckMode::Extensions).await;
    assert!(conn.negotiated().agent_env);
    assert_eq!(conn.expect_inbound().await.event_id.as_str(), "m-1");
    sent_env(&conn);
    let first = ticket.recv().await.unwrap();
    conn.disconnect();

    let mut again = fake.accept().await;
    again.handshake(AckMode::Extensions).await;
    assert_eq!(again.expect_inbound().await.event_id.as_str(), "m-1");
    sent_env(&again);
    again.accept_inbound("m-1").await;
    assert_eq!(first.outcome().await, Acceptance::Accepted { duplicate: false });
    let (stopped, _) = tokio::join!(task.stop(), again.expect_stop());
    assert!(stopped.is_ok(), "{stopped:?}");
}

/// Takes a millisecond over each streamed step, so a hub can write steps faster than the
/// driver takes them.
struct SlowReader;

impl Driver for SlowReader {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, _hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        shutdown.cancelled().await;
        Ok(())
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::Failed { reason: "no platform".into(), retryable: false })
    }

    async fn stream(&self, _frame: StreamFrame) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    fn extensions(&self) -> Extensions {
        Extensions::all()
    }
}

/// The hub writes `stream` steps faster than the driver takes them, so the driver's socket
/// always has the next one: the session still sees its stop (within
/// `channeld_link::FRAMES_BETWEEN_CHECKS` frames), closes, and the hub's writes fail. A
/// session that looked at its stop only when the socket had nothing would read on until
/// the hub gave up writing (`FLOOD_FOR`) and it had taken every step written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_that_never_stops_writing_does_not_keep_the_session_from_stopping() {
    const FLOOD_FOR: Duration = Duration::from_secs(10);
    let fake = FakeHub::bind().await;
    let task = DriverTask::spawn(SlowReader, fake.launch_config("test.flood"));
    let mut conn = fake.accept().await;
    conn.handshake(AckMode::Extensions).await;
    assert!(conn.negotiated().stream);

    let step = StreamFrame {
        event_id: Id::new("e-1").expect("a valid id"),
        seq: 1,
        text: Some("x".into()),
        tool: None,
        end: None,
        code: None,
        message: None,
    };
    let line = encode(&Frame::Stream(step)).expect("a step encodes");
    let chunk = line.repeat(64 * 1024 / line.len());
    let conn = Arc::new(conn);
    let flood = tokio::spawn({
        let conn = conn.clone();
        async move {
            let until = tokio::time::Instant::now() + FLOOD_FOR;
            while tokio::time::Instant::now() < until {
                if conn.try_send_raw(&chunk).await.is_err() {
                    return true;
                }
            }
            false
        }
    });
    // Well into the flood: the driver's socket is full.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!flood.is_finished(), "the driver closed the socket before it was asked to stop");
    let stopped = task.stop().await;
    assert!(stopped.is_ok(), "{stopped:?}");
    let closed_while_flooded = flood.await.expect("the flood task ran");
    assert!(
        closed_while_flooded,
        "the session read on for as long as the hub wrote ({FLOOD_FOR:?}) instead of stopping"
    );
}
