//! The SDK runs its own conformance suite against a minimal in-process driver, once with
//! `send` and once without, so the runtime and the checks are tested together; and shows
//! that the suite fails a driver whose `run` ignores its shutdown token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use channeld_protocol::types::{
    Actions, Capabilities, DeliveryReceipt, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_protocol::{ChannelId, Id};
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

use super::{ConformanceHarness, DriverTask};
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::Hub;
use crate::launch::DriverLaunchConfig;

/// Reports each string from a channel as an inbound and counts its posts.
struct ChannelDriver {
    declaration: Declaration,
    input: Mutex<Option<mpsc::Receiver<String>>>,
    posts: Arc<AtomicUsize>,
    next_id: AtomicU64,
}

impl Driver for ChannelDriver {
    fn declaration(&self) -> Declaration {
        self.declaration.clone()
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let Some(mut input) = self.input.lock().await.take() else {
            return Err(DriverError::Platform("input already taken".into()));
        };
        let result = self.report(&hub, &shutdown, &mut input).await;
        // Handed back, so a later run (after the hub refused and accepted again) reads on.
        *self.input.lock().await = Some(input);
        result
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let n = self.posts.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(DeliveryReceipt {
            channel: post.message.target.channel.clone(),
            message_id: id(&format!("posted-{n}")),
            target: post.message.target,
            timestamp_ms: None,
        })
    }
}

impl ChannelDriver {
    async fn report(
        &self,
        hub: &Hub,
        shutdown: &CancellationToken,
        input: &mut mpsc::Receiver<String>,
    ) -> Result<(), DriverError> {
        loop {
            let text = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                text = input.recv() => text,
            };
            let Some(text) = text else {
                shutdown.cancelled().await;
                return Ok(());
            };
            let n = self.next_id.fetch_add(1, Ordering::Relaxed);
            let target = MessageTarget::new(hub.channel().clone(), id("room"));
            let message = InboundMessage {
                id: id(&format!("m-{n}")),
                target,
                sender: Participant::new(id("someone")),
                body: MessageBody::text(text).map_err(|e| DriverError::Platform(e.to_string()))?,
                timestamp_ms: None,
                metadata: Default::default(),
            };
            if hub.inbound(message).await.is_err() {
                return Ok(());
            }
        }
    }
}

struct InProcess {
    declaration: Declaration,
    input: Option<mpsc::Sender<String>>,
    posts: Arc<AtomicUsize>,
    task: Option<DriverTask>,
}

impl InProcess {
    fn new(capabilities: Capabilities, actions: Actions) -> Self {
        Self {
            declaration: Declaration::new(capabilities).with_actions(actions),
            input: None,
            posts: Arc::default(),
            task: None,
        }
    }

    /// `receive` and `send`, with the `typing` action.
    fn full() -> Self {
        let caps = Capabilities { receive: true, send: true, ..Default::default() };
        Self::new(caps, Actions { typing: true, ..Default::default() })
    }

    /// `receive` only, with commands and single choices but no multi_choice or tool_control.
    fn receive_only() -> Self {
        let caps =
            Capabilities { receive: true, commands: true, choices: true, ..Default::default() };
        Self::new(caps, Actions::default())
    }
}

impl ConformanceHarness for InProcess {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let (tx, rx) = mpsc::channel(16);
        let driver = ChannelDriver {
            declaration: self.declaration.clone(),
            input: Mutex::new(Some(rx)),
            posts: self.posts.clone(),
            next_id: AtomicU64::new(1),
        };
        self.input = Some(tx);
        self.task = Some(DriverTask::spawn(driver, launch));
    }

    async fn inject_inbound(&mut self, text: &str) {
        let input = self.input.as_ref().expect("driver started");
        input.send(text.to_owned()).await.expect("driver is reading its input");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), id("room"))
    }

    async fn stop(&mut self) -> bool {
        let task = self.task.take().expect("driver started");
        task.stop().await.is_ok()
    }

    fn platform_posts(&self) -> usize {
        self.posts.load(Ordering::SeqCst)
    }
}

fn id(value: &str) -> Id {
    Id::new(value).expect("test ids are valid")
}

mod full {
    use super::*;
    crate::conformance_suite!(InProcess::full());
}

mod receive_only {
    use super::*;
    crate::conformance_suite!(InProcess::receive_only());
}

/// A driver whose `run` never looks at its shutdown token.
struct Stubborn;

impl Driver for Stubborn {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { send: true, ..Default::default() })
    }

    async fn run(&self, _hub: Hub, _shutdown: CancellationToken) -> Result<(), DriverError> {
        std::future::pending().await
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        Ok(DeliveryReceipt {
            channel: post.message.target.channel.clone(),
            message_id: id("stubborn-1"),
            target: post.message.target,
            timestamp_ms: None,
        })
    }
}

#[derive(Default)]
struct StubbornHarness {
    task: Option<DriverTask>,
}

impl ConformanceHarness for StubbornHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        self.task = Some(DriverTask::spawn(Stubborn, launch));
    }

    async fn inject_inbound(&mut self, _text: &str) {
        panic!("the stubborn driver declares no receive");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), id("room"))
    }

    async fn stop(&mut self) -> bool {
        self.task.take().expect("driver started").stop().await.is_ok()
    }

    fn platform_posts(&self) -> usize {
        0
    }
}

#[test]
#[should_panic(expected = "did not exit cleanly after being stopped")]
fn the_suite_fails_a_driver_whose_run_ignores_shutdown() {
    crate::testing::conformance::run_check("stops_within_the_drain_deadline", async {
        crate::testing::conformance::stops_within_the_drain_deadline(StubbornHarness::default())
            .await;
    });
}
