//! The hub handle's requests (`Hub::history`, `Hub::cancel`) against the fake hub: the
//! answer comes back to the caller, a refusal is `Refused` with the hub's code, and a hub
//! that did not negotiate the extension is never asked.

use channeld_protocol::ext::{HistoryEntry, HistoryRole};
use channeld_protocol::types::{Capabilities, DeliveryReceipt};
use channeld_protocol::{Frame, Id};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{AckMode, DriverTask, FakeHub};
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::{Hub, HubError};

/// Hands its hub handle to the test once connected.
struct Handle {
    tx: mpsc::Sender<Hub>,
}

impl Driver for Handle {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let _ = self.tx.send(hub).await;
        shutdown.cancelled().await;
        Ok(())
    }

    async fn post(&self, _post: Post) -> Result<DeliveryReceipt, PostError> {
        Err(PostError::Failed { reason: "no platform".into(), retryable: false })
    }
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap()
}

async fn connected(ack: AckMode) -> (FakeHub, super::FakeConnection, DriverTask, Hub) {
    let fake = FakeHub::bind().await;
    let (tx, mut rx) = mpsc::channel(1);
    let task = DriverTask::spawn(Handle { tx }, fake.launch_config("test.req"));
    let mut conn = fake.accept().await;
    conn.handshake(ack).await;
    let hub = rx.recv().await.expect("the driver runs");
    (fake, conn, task, hub)
}

#[tokio::test]
async fn history_and_cancel_are_answered_to_their_caller() {
    let (_fake, mut conn, task, hub) = connected(AckMode::Extensions).await;
    let entry = HistoryEntry {
        id: 1,
        role: HistoryRole::User,
        text: "hi".into(),
        at_ms: 5,
        sender: Some("alice".into()),
        message_id: None,
        event_id: Some("m-1".into()),
    };
    let (done, answer) = oneshot::channel();
    let asking = hub.clone();
    tokio::spawn(async move {
        let _ = done.send(asking.history(id("room"), None, Some(10)).await);
    });
    let request = conn.answer_history(vec![entry.clone()]).await;
    assert_eq!(request.conversation.as_str(), "room");
    assert_eq!(request.limit, Some(10));
    assert_eq!(answer.await.unwrap().unwrap(), vec![entry]);

    let asking = hub.clone();
    let cancelling = tokio::spawn(async move { asking.cancel(id("m-1")).await });
    let request = conn.answer_cancel(true).await;
    assert_eq!(request.event_id.as_str(), "m-1");
    let result = cancelling.await.unwrap().unwrap();
    assert_eq!(result.cancelled, vec![id("m-1")]);
    assert_eq!(result.state, "aborted");

    let asking = hub.clone();
    let cancelling = tokio::spawn(async move { asking.cancel(id("m-9")).await });
    let request = match conn.next_frame().await {
        Frame::Cancel(request) => request,
        other => panic!("expected cancel, got {other:?}"),
    };
    let refusal = Frame::error(Some(request.request_id), "unknown_event", "no such event", false);
    conn.send(&refusal).await;
    match cancelling.await.unwrap() {
        Err(HubError::Refused { code, retryable, .. }) => {
            assert_eq!(code, "unknown_event");
            assert!(!retryable);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    task.stop().await.unwrap();
}

#[tokio::test]
async fn a_hub_without_the_extensions_is_not_asked() {
    let (_fake, _conn, task, hub) = connected(AckMode::Reference).await;
    assert_eq!(hub.history(id("room"), None, None).await, Err(HubError::NotNegotiated("history")));
    assert_eq!(hub.cancel(id("m-1")).await, Err(HubError::NotNegotiated("cancel")));
    task.stop().await.unwrap();
}
