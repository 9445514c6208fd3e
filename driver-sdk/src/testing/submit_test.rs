//! What `Hub::inbound` and `Hub::inbound_event` write: the line the hub reads is the frame
//! the driver reported; a message too large for a frame is refused before it is queued or
//! written; an event is accepted once written when the hub did not negotiate `accepted`, and
//! only by the hub's answer when it did.

use std::time::Duration;

use channeld_protocol::types::{
    Capabilities, DeliveryReceipt, EventContext, IncomingEvent, MessageTarget,
};
use channeld_protocol::{ChannelId, Id, MAX_LINE_BYTES};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{AckMode, DriverTask, FakeHub};
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::{Hub, HubError, InboundTicket};
use crate::inbound::Inbound;
use crate::pending::Acceptance;

const CHANNEL: &str = "test.submit";

/// What the test asks the driver to report.
enum Report {
    Text { id: &'static str, text: String },
    Event { id: &'static str },
}

/// Reports what the test sends it and hands back what `Hub` answered.
struct Reporter {
    reports: tokio::sync::Mutex<mpsc::Receiver<Report>>,
    answers: mpsc::UnboundedSender<Result<InboundTicket, HubError>>,
}

impl Driver for Reporter {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let mut reports = self.reports.lock().await;
        loop {
            let report = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                report = reports.recv() => match report {
                    Some(report) => report,
                    None => return Ok(()),
                },
            };
            let answer = match report {
                Report::Text { id, text } => {
                    hub.inbound(Inbound::text("room-1", "alice", text).id(id)).await
                }
                Report::Event { id } => {
                    let channel = ChannelId::new(CHANNEL).expect("valid channel");
                    let context = EventContext {
                        target: MessageTarget::new(channel, Id::new("room-1").expect("id")),
                        participant: None,
                        timestamp_ms: None,
                        metadata: Default::default(),
                    };
                    let event = IncomingEvent::Typing { context, active: true };
                    hub.inbound_event(Id::new(id).expect("id"), event).await
                }
            };
            let _ = self.answers.send(answer);
        }
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::Failed { reason: "no platform".into(), retryable: false })
    }
}

type Answers = mpsc::UnboundedReceiver<Result<InboundTicket, HubError>>;

fn reporter() -> (Reporter, mpsc::Sender<Report>, Answers) {
    let (reports, rx) = mpsc::channel(4);
    let (answers, answered) = mpsc::unbounded_channel();
    (Reporter { reports: tokio::sync::Mutex::new(rx), answers }, reports, answered)
}

/// A message whose frame would pass the line limit is refused `TooLarge` and never reaches
/// the socket: the next line the hub reads is the next message, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_for_a_line_is_refused_and_the_next_one_arrives_whole() {
    let fake = FakeHub::bind().await;
    let (driver, reports, mut answers) = reporter();
    let task = DriverTask::spawn(driver, fake.launch_config(CHANNEL));
    let mut conn = fake.accept().await;
    conn.handshake(AckMode::Extensions).await;

    let huge = "x".repeat(MAX_LINE_BYTES);
    reports.send(Report::Text { id: "m-1", text: huge }).await.unwrap();
    let refused = answers.recv().await.unwrap();
    assert!(matches!(refused, Err(HubError::TooLarge(_))), "{refused:?}");

    let text = "fits \"quoted\" and \\ escaped, ünïcode".to_owned();
    reports.send(Report::Text { id: "m-2", text: text.clone() }).await.unwrap();
    let ticket = answers.recv().await.unwrap().expect("a message that fits is reported");
    let inbound = conn.expect_inbound().await;
    assert_eq!(inbound.event_id.as_str(), "m-2");
    assert_eq!(inbound.message.body.text_str(), text);
    assert_eq!(inbound.message.target.conversation.as_str(), "room-1");
    conn.accept_inbound("m-2").await;
    assert_eq!(ticket.outcome().await, Acceptance::Accepted { duplicate: false });
    task.stop().await.expect("the driver stops cleanly");
}

/// Without `accepted` (a hub like the reference one) an event's write is its acceptance;
/// with it, the event waits for the hub's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_is_accepted_by_its_write_only_when_the_hub_answers_nothing() {
    for mode in [AckMode::Reference, AckMode::Extensions] {
        let fake = FakeHub::bind().await;
        let (driver, reports, mut answers) = reporter();
        let task = DriverTask::spawn(driver, fake.launch_config(CHANNEL));
        let mut conn = fake.accept().await;
        conn.handshake(mode).await;

        reports.send(Report::Event { id: "ev-1" }).await.unwrap();
        let ticket = answers.recv().await.unwrap().expect("an event is reported");
        match conn.next_frame().await {
            channeld_protocol::Frame::InboundEvent(event) => {
                assert_eq!(event.event_id.as_str(), "ev-1");
            }
            other => panic!("expected the inbound_event, got {other:?}"),
        }
        let outcome = tokio::time::timeout(Duration::from_millis(300), ticket.outcome()).await;
        match mode {
            AckMode::Reference => {
                assert_eq!(outcome.ok(), Some(Acceptance::Accepted { duplicate: false }));
            }
            AckMode::Extensions => {
                assert!(outcome.is_err(), "accepted before the hub answered: {outcome:?}");
            }
        }
        task.stop().await.expect("the driver stops cleanly");
    }
}
