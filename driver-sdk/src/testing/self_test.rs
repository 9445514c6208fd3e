//! The SDK runs its own conformance suite against a minimal in-process driver, once with
//! `send` and once without, so the runtime and the checks are tested together.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use channeld_protocol::types::{
    Actions, Capabilities, DeliveryReceipt, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_protocol::{ChannelId, Id};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ConformanceHarness;
use crate::driver::{Declaration, Driver, DriverError, Post, PostError};
use crate::hub::Hub;
use crate::launch::DriverLaunchConfig;
use crate::runtime::{RunError, run_driver};

/// Reports each string from a channel as an inbound and counts its posts.
struct ChannelDriver {
    declaration: Declaration,
    input: Mutex<Option<mpsc::Receiver<String>>>,
    posts: Arc<AtomicUsize>,
    next_id: AtomicU64,
}

impl Driver for ChannelDriver {
    fn declaration(&self) -> Declaration {
        self.declaration
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let Some(mut input) = self.input.lock().await.take() else {
            return Err(DriverError::Platform("input already taken".into()));
        };
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

struct InProcess {
    declaration: Declaration,
    input: Option<mpsc::Sender<String>>,
    posts: Arc<AtomicUsize>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), RunError>>>,
}

impl InProcess {
    fn new(capabilities: Capabilities, actions: Actions) -> Self {
        Self {
            declaration: Declaration { capabilities, actions },
            input: None,
            posts: Arc::default(),
            shutdown: CancellationToken::new(),
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
            declaration: self.declaration,
            input: Mutex::new(Some(rx)),
            posts: self.posts.clone(),
            next_id: AtomicU64::new(1),
        };
        self.input = Some(tx);
        self.task = Some(tokio::spawn(run_driver(driver, launch, self.shutdown.clone())));
    }

    async fn inject_inbound(&mut self, text: &str) {
        let input = self.input.as_ref().expect("driver started");
        input.send(text.to_owned()).await.expect("driver is reading its input");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), id("room"))
    }

    async fn stop(&mut self) -> bool {
        self.shutdown.cancel();
        let task = self.task.take().expect("driver started");
        matches!(task.await, Ok(Ok(())))
    }

    fn platform_posts(&self) -> Option<usize> {
        Some(self.posts.load(Ordering::SeqCst))
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
