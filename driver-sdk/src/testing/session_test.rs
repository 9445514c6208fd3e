//! The session when its connection to the hub breaks: frames the hub wrote before it went
//! away still reach the driver after the driver's write failed, so an inbound the hub
//! accepted is not reported again after the reconnect; the runs' environment a driver set
//! is stated again on each new connection, before the resent inbound.

use std::time::Duration;

use channeld_protocol::types::{Capabilities, DeliveryReceipt};
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
