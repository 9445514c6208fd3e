//! How the session runs the driver's handlers: a post that completes at once runs on the
//! session's own task, one that waits continues as a task of its own, a panicking post ends
//! its request and not the session, requests wait for a handler in the order they came while
//! every handler is busy, and a copy of a request that came while it was posted gets its answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use channeld_protocol::types::{Capabilities, DeliveryReceipt, MessageTarget};
use channeld_protocol::{ChannelId, Id};
use tokio::sync::{Semaphore, mpsc};
use tokio::task;
use tokio_util::sync::CancellationToken;

use super::{AckMode, DriverTask, FakeConnection, FakeHub};
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::Hub;
use crate::session::MAX_CONCURRENT_HANDLERS;

/// Where one post ran: the task before and after its one pause (both the same when it did
/// not pause).
#[derive(Debug, Clone, Copy)]
struct Ran {
    first: Option<task::Id>,
    last: Option<task::Id>,
}

/// Posts by the message's text: `now` at once, `pause` after one yield, `hold` once the test
/// opens the gate (reporting that it started), `panic` never.
struct Poster {
    ran: Mutex<Vec<(String, Ran)>>,
    gate: Semaphore,
    gate_open: AtomicBool,
    holding: mpsc::UnboundedSender<()>,
    /// Whether the gate was open when each `now` post ran.
    now_saw_gate: Mutex<Vec<bool>>,
}

impl Poster {
    fn new(holding: mpsc::UnboundedSender<()>) -> Self {
        Self {
            ran: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
            gate_open: AtomicBool::new(false),
            holding,
            now_saw_gate: Mutex::new(Vec::new()),
        }
    }
}

impl Driver for Arc<Poster> {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { send: true, ..Default::default() })
    }

    async fn run(&self, _hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        shutdown.cancelled().await;
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let text = post.message.body.text_str().to_owned();
        let first = task::try_id();
        match text.as_str() {
            "now" => self.now_saw_gate.lock().unwrap().push(self.gate_open.load(Ordering::SeqCst)),
            "pause" => task::yield_now().await,
            "hold" => {
                let _ = self.holding.send(());
                self.gate.acquire().await.expect("the gate stays").forget();
            }
            "panic" => panic!("a driver's post panicked (on purpose, in a test)"),
            other => panic!("unexpected post {other:?}"),
        }
        let last = task::try_id();
        let request = post.message.target.conversation.to_string();
        self.ran.lock().unwrap().push((request, Ran { first, last }));
        Ok(DeliveryReceipt {
            channel: post.message.target.channel.clone(),
            message_id: Id::new("posted").unwrap(),
            target: post.message.target,
            timestamp_ms: None,
        })
    }
}

/// The target of request `request`: its conversation is the request's id, so a post can say
/// which request it was.
fn target(request: &str) -> MessageTarget {
    MessageTarget::new(ChannelId::new("test.handlers").unwrap(), Id::new(request).unwrap())
}

fn ran(poster: &Poster, request: &str) -> Ran {
    let ran = poster.ran.lock().unwrap();
    ran.iter().find(|(id, _)| id == request).map(|(_, ran)| *ran).expect("the post ran")
}

/// A [`Poster`] connected to a fake hub that completed the handshake, and the receiver of
/// its `hold` posts' starts.
async fn connected()
-> (FakeHub, FakeConnection, DriverTask, Arc<Poster>, mpsc::UnboundedReceiver<()>) {
    let fake = FakeHub::bind().await;
    let (holding, held) = mpsc::unbounded_channel();
    let poster = Arc::new(Poster::new(holding));
    let task = DriverTask::spawn(poster.clone(), fake.launch_config("test.handlers"));
    let mut conn = fake.accept().await;
    conn.handshake(AckMode::Extensions).await;
    (fake, conn, task, poster, held)
}

#[tokio::test]
async fn a_post_that_completes_at_once_runs_on_the_session_s_task_and_one_that_pauses_on_its_own() {
    let (_fake, mut conn, task, poster, _held) = connected().await;

    for (request, text) in [("o-1", "now"), ("o-2", "now"), ("o-3", "pause")] {
        conn.outbound(request, target(request), text).await;
        conn.expect_receipt(request).await;
    }
    let (one, two, three) = (ran(&poster, "o-1"), ran(&poster, "o-2"), ran(&poster, "o-3"));
    assert!(one.first.is_some(), "a post runs on a task");
    // Both ran on the task that reads the hub's frames: no task was made for them.
    assert_eq!(one.first, two.first, "posts that complete at once share the session's task");
    // The pausing post began there too, and went on in a task of its own.
    assert_eq!(three.first, one.first, "a post is first polled on the session's task");
    assert_ne!(three.last, three.first, "a post that paused continues in its own task");
    task.stop().await.expect("stops cleanly");
}

#[tokio::test]
async fn a_post_that_panics_ends_its_request_and_not_the_session() {
    let (_fake, mut conn, task, _poster, _held) = connected().await;

    conn.outbound("p-1", target("p-1"), "panic").await;
    conn.outbound("o-1", target("o-1"), "now").await;
    // The next frame on the same connection is the second post's receipt: the session lives
    // on (a session that ended would have closed it), and the panicked request has no answer.
    conn.expect_receipt("o-1").await;
    conn.outbound("o-2", target("o-2"), "pause").await;
    conn.expect_receipt("o-2").await;
    task.stop().await.expect("stops cleanly");
}

#[tokio::test]
async fn requests_wait_for_a_handler_in_order_while_every_handler_is_busy() {
    let (_fake, mut conn, task, poster, mut held) = connected().await;

    for n in 0..MAX_CONCURRENT_HANDLERS {
        let request = format!("h-{n}");
        conn.outbound(&request, target(&request), "hold").await;
    }
    for _ in 0..MAX_CONCURRENT_HANDLERS {
        held.recv().await.expect("a hold started");
    }
    conn.outbound("o-1", target("o-1"), "now").await;
    conn.outbound("o-2", target("o-2"), "now").await;
    // Time for the driver to read them: a post that ran now would find the gate shut.
    tokio::time::sleep(Duration::from_millis(50)).await;
    poster.gate_open.store(true, Ordering::SeqCst);
    poster.gate.add_permits(MAX_CONCURRENT_HANDLERS);
    let mut answered = 0;
    while answered < MAX_CONCURRENT_HANDLERS + 2 {
        match conn.next_frame().await {
            channeld_protocol::Frame::Receipt(_) => answered += 1,
            other => panic!("expected receipts, got {other:?}"),
        }
    }
    let saw = poster.now_saw_gate.lock().unwrap().clone();
    assert_eq!(saw, [true, true], "they ran once a handler was free");
    let order: Vec<String> = {
        let ran = poster.ran.lock().unwrap();
        ran.iter().map(|(id, _)| id.clone()).filter(|id| id.starts_with("o-")).collect()
    };
    assert_eq!(order, ["o-1", "o-2"], "in the order they came");
    task.stop().await.expect("stops cleanly");
}

#[tokio::test]
async fn a_copy_that_came_while_its_post_waited_gets_the_same_answer() {
    let (_fake, mut conn, task, poster, mut held) = connected().await;

    conn.outbound("r-1", target("r-1"), "hold").await;
    held.recv().await.expect("the post started");
    // The same request again while it is posted: it waits for that post's answer.
    conn.outbound("r-1", target("r-1"), "hold").await;
    conn.outbound("o-1", target("o-1"), "now").await;
    conn.expect_receipt("o-1").await;
    poster.gate.add_permits(1);
    let first = conn.expect_receipt("r-1").await;
    let second = conn.expect_receipt("r-1").await;
    assert_eq!(first, second, "one post, one answer for both copies");
    assert_eq!(poster.ran.lock().unwrap().iter().filter(|(id, _)| id == "r-1").count(), 1);
    task.stop().await.expect("stops cleanly");
}
