//! A raw peer on a channel socket: sends and reads frames exactly as written, so tests can
//! play a reference driver, a controller or a hostile client.

use std::path::Path;
use std::time::Duration;

use channeld_link::{FrameReader, FrameSink, QuietRead, Writer, split_unix};
use channeld_protocol::frame::{ErrorFrame, Hello, Inbound, Lifecycle};
use channeld_protocol::types::{
    Capabilities, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_protocol::{ChannelId, DecodeError, Frame, Id};
use tokio::net::UnixStream;

/// How long a test waits for one frame.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// One raw connection.
#[derive(Debug)]
pub struct RawPeer {
    pub reader: FrameReader<QuietRead>,
    pub sink: FrameSink,
    writer: Option<Writer>,
}

impl RawPeer {
    pub async fn connect(socket: &Path) -> Self {
        let stream = UnixStream::connect(socket)
            .await
            .unwrap_or_else(|err| panic!("connect {}: {err}", socket.display()));
        Self::from_stream(stream)
    }

    pub fn from_stream(stream: UnixStream) -> Self {
        let (reader, sink, writer) = split_unix(stream, 1024).expect("watch the connection");
        Self { reader, sink, writer: Some(writer) }
    }

    pub async fn send(&self, frame: Frame) {
        self.sink.send(&frame).await.expect("send frame");
    }

    /// Sends `frames` in one write, as a driver does that had them ready together: the hub
    /// reads them in one read.
    pub async fn send_together(&self, frames: &[Frame]) {
        let mut lines = Vec::new();
        for frame in frames {
            lines.extend(channeld_protocol::encode(frame).expect("encode frame"));
        }
        self.sink.send_encoded(lines).await.expect("send frames");
    }

    /// The next frame or decode error; panics on timeout or EOF.
    pub async fn next(&mut self) -> Result<Frame, DecodeError> {
        match tokio::time::timeout(FRAME_TIMEOUT, self.reader.next()).await {
            Ok(Ok(Some(item))) => item,
            Ok(Ok(None)) => panic!("peer closed the connection while a frame was expected"),
            Ok(Err(err)) => panic!("read failed: {err}"),
            Err(_) => panic!("no frame within {FRAME_TIMEOUT:?}"),
        }
    }

    /// The next decodable frame, skipping heartbeats and unsolicited health.
    pub async fn frame(&mut self) -> Frame {
        loop {
            match self.next().await.expect("a valid frame") {
                Frame::Event(_) | Frame::Health(_) => continue,
                frame => return frame,
            }
        }
    }

    /// Waits for a frame, or `None` if none arrives within `limit`.
    pub async fn frame_within(&mut self, limit: Duration) -> Option<Frame> {
        tokio::time::timeout(limit, self.frame()).await.ok()
    }

    /// Expects an `error` frame.
    pub async fn error(&mut self) -> ErrorFrame {
        match self.frame().await {
            Frame::Error(err) => err,
            other => panic!("expected an error frame, got {other:?}"),
        }
    }

    /// True when the peer closes within `limit` (EOF).
    pub async fn closed_within(&mut self, limit: Duration) -> bool {
        let wait = async {
            loop {
                match self.reader.next().await {
                    Ok(None) | Err(_) => return,
                    Ok(Some(_)) => continue,
                }
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    /// Says `hello` (with `extensions`) and `start`, as a driver for `channel`.
    pub async fn hello(&self, channel: &str, capabilities: Capabilities, extensions: &[&str]) {
        self.hello_with(channel, capabilities, Default::default(), extensions).await;
    }

    pub async fn hello_with(
        &self,
        channel: &str,
        capabilities: Capabilities,
        actions: channeld_protocol::types::Actions,
        extensions: &[&str],
    ) {
        self.send(Frame::Hello(Hello {
            request_id: id(&format!("{channel}-hello")),
            channel: ChannelId::new(channel).expect("channel id"),
            capabilities,
            actions,
            extensions: extensions.iter().map(|e| (*e).to_owned()).collect(),
            operator_actions: Vec::new(),
        }))
        .await;
        self.send(Frame::Start(Lifecycle { request_id: id(&format!("{channel}-start")) })).await;
    }

    /// Sends an inbound text message from `sender` in `conversation`.
    pub async fn inbound(
        &self,
        channel: &str,
        event_id: &str,
        sender: &str,
        conversation: &str,
        text: &str,
    ) {
        self.send(Frame::Inbound(Inbound {
            event_id: id(event_id),
            message: message(channel, event_id, sender, conversation, text),
        }))
        .await;
    }

    /// Closes the write side and drops the connection.
    pub async fn close(mut self) {
        if let Some(writer) = self.writer.take() {
            let _ = writer.close().await;
        }
    }
}

pub fn id(value: &str) -> Id {
    Id::new(value).expect("valid id")
}

pub fn target(channel: &str, conversation: &str) -> MessageTarget {
    MessageTarget::new(ChannelId::new(channel).expect("channel id"), id(conversation))
}

pub fn message(
    channel: &str,
    message_id: &str,
    sender: &str,
    conversation: &str,
    text: &str,
) -> InboundMessage {
    InboundMessage {
        id: id(message_id),
        target: target(channel, conversation),
        sender: Participant::new(id(sender)),
        body: MessageBody::text(text).expect("valid body"),
        timestamp_ms: None,
        metadata: Default::default(),
    }
}

/// Capabilities with the named flags set.
pub fn caps(names: &[&str]) -> Capabilities {
    let mut caps = Capabilities::default();
    for name in names {
        assert!(caps.set(name, true), "unknown capability {name}");
    }
    caps
}

/// The `deliver` in `frame`; panics on anything else.
pub fn expect_deliver(frame: Frame) -> channeld_protocol::frame::Delivery {
    match frame {
        Frame::Deliver(delivery) => delivery,
        other => panic!("expected deliver, got {other:?}"),
    }
}

/// The `outbound` in `frame`; panics on anything else.
pub fn expect_outbound(frame: Frame) -> channeld_protocol::frame::Delivery {
    match frame {
        Frame::Outbound(delivery) => delivery,
        other => panic!("expected outbound, got {other:?}"),
    }
}

/// A driver's `receipt` for `request_id`: posted as `message_id` in `conversation`.
pub fn receipt_for(channel: &str, request_id: &Id, conversation: &str, message_id: &str) -> Frame {
    Frame::Receipt(channeld_protocol::frame::Receipt {
        request_id: request_id.clone(),
        receipt: channeld_protocol::types::DeliveryReceipt {
            channel: ChannelId::new(channel).expect("channel id"),
            message_id: id(message_id),
            target: target(channel, conversation),
            timestamp_ms: Some(1),
        },
    })
}
