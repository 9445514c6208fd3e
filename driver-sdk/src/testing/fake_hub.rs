//! A fake hub for driver tests: one Unix listener in a fresh temp dir, and a connection type
//! that asserts the driver's frames one by one.
//!
//! Every wait is bounded by [`IO_TIMEOUT`] and panics with a message naming what the fake hub
//! waited for, so a hung driver fails its test instead of hanging it. The only frames skipped
//! while waiting are unsolicited ones (`event` notices such as heartbeats, and `health`
//! reports); they are recorded and can be inspected.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_link::FrameReader;
use channeld_protocol::ext::{
    AgentEnv, CancelRequest, CancelResult, Extensions, HistoryEntry, HistoryRequest, HistoryResult,
};
use channeld_protocol::frame::{
    Accepted, CommandResultFrame, Delivery, ErrorFrame, Hello, HelloAck, Inbound, Lifecycle,
    OperatorActionFrame, OperatorActionResult,
};
use channeld_protocol::types::{
    DeliveryReceipt, Health, LifecycleEvent, MessageBody, MessageTarget, OutboundMessage,
};
use channeld_protocol::{ChannelId, Frame, Id, encode};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::launch::DriverLaunchConfig;

/// How long the fake hub waits for a connection, a frame or a write before failing the test.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The drain deadline of [`FakeHub::launch_config`]: a driver's `run` must return within it
/// once asked to stop.
pub const DRAIN: Duration = Duration::from_secs(3);

/// The `hub` name the fake sends in `hello_ack`.
pub const FAKE_HUB_NAME: &str = "fake-hub";

/// How the fake hub answers a `hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckMode {
    /// Like channeld: a `hello` that lists extensions gets a `hello_ack` naming the ones both
    /// sides support.
    Extensions,
    /// Like the reference hub: nothing is sent back, so no extension is in use.
    Reference,
}

/// A listening fake hub. Drop it to remove its socket and temp dir.
#[derive(Debug)]
pub struct FakeHub {
    listener: UnixListener,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl FakeHub {
    /// Binds a fresh socket in a new temp dir. Panics if that fails.
    pub async fn bind() -> FakeHub {
        let dir = tempfile::Builder::new()
            .prefix("channeld-fake-hub-")
            .tempdir()
            .unwrap_or_else(|err| panic!("fake hub: cannot create a temp dir: {err}"));
        let socket = dir.path().join("hub.sock");
        let listener = UnixListener::bind(&socket).unwrap_or_else(|err| {
            panic!("fake hub: cannot bind {}: {err}", socket.display());
        });
        FakeHub { listener, socket, _dir: dir }
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Launch settings that point a driver for `channel` at this fake hub, with a drain
    /// deadline of [`DRAIN`] (shorter than [`IO_TIMEOUT`], so a driver that has to be
    /// aborted is told apart from a slow one).
    pub fn launch_config(&self, channel: &str) -> DriverLaunchConfig {
        let channel = ChannelId::new(channel)
            .unwrap_or_else(|err| panic!("fake hub: {channel:?} is not a channel id: {err}"));
        let mut launch = DriverLaunchConfig::for_socket(channel, &self.socket);
        launch.drain_timeout = DRAIN;
        launch
    }

    /// Waits up to [`IO_TIMEOUT`] for the driver to connect.
    pub async fn accept(&self) -> FakeConnection {
        self.accept_within(IO_TIMEOUT).await
    }

    /// Waits up to `limit` for the driver to connect; panics when it does not.
    pub async fn accept_within(&self, limit: Duration) -> FakeConnection {
        match tokio::time::timeout(limit, self.listener.accept()).await {
            Ok(Ok((stream, _))) => {
                let (read, write) = stream.into_split();
                FakeConnection {
                    reader: FrameReader::new(read),
                    writer: Mutex::new(write),
                    hello: None,
                    negotiated: Extensions::default(),
                    events: Vec::new(),
                    health_reports: Vec::new(),
                    agent_envs: Vec::new(),
                    probes: 0,
                }
            }
            Ok(Err(err)) => panic!("fake hub: accept on {} failed: {err}", self.socket.display()),
            Err(_) => panic!(
                "fake hub: no driver connected to {} within {limit:?}",
                self.socket.display()
            ),
        }
    }
}

/// One driver connection as the fake hub sees it.
///
/// Reads are exact: each `expect_*` helper takes the next frame (skipping only unsolicited
/// `event`, `health` and `agent_env` frames, which it records) and panics if it is not the
/// one expected. Writes go straight
/// to the socket, so a frame sent before dropping the connection reaches the driver before
/// its end of file.
#[derive(Debug)]
pub struct FakeConnection {
    reader: FrameReader<OwnedReadHalf>,
    writer: Mutex<OwnedWriteHalf>,
    hello: Option<Hello>,
    negotiated: Extensions,
    events: Vec<LifecycleEvent>,
    health_reports: Vec<Health>,
    agent_envs: Vec<AgentEnv>,
    /// Health probes [`wait_health`](FakeConnection::wait_health) sent (their ids).
    probes: u64,
}

impl FakeConnection {
    /// Reads the driver's `hello` and `start`. With [`AckMode::Extensions`] a `hello` that
    /// lists extensions is answered with `hello_ack` (sent as soon as the `hello` is read);
    /// with [`AckMode::Reference`] nothing is sent.
    pub async fn handshake(&mut self, ack: AckMode) -> Hello {
        let hello = match self.recv("the driver's hello").await {
            Frame::Hello(hello) => hello,
            other => unexpected("hello as the first frame", &other),
        };
        self.negotiated = Extensions::default();
        if ack == AckMode::Extensions && !hello.extensions.is_empty() {
            let agreed = Extensions::all().intersect(Extensions::from_names(&hello.extensions));
            self.send(&Frame::HelloAck(HelloAck {
                request_id: hello.request_id.clone(),
                extensions: agreed.names(),
                hub: FAKE_HUB_NAME.to_owned(),
            }))
            .await;
            self.negotiated = agreed;
        }
        match self.recv("the driver's start after its hello").await {
            Frame::Start(_) => {}
            other => unexpected("start after hello", &other),
        }
        self.hello = Some(hello.clone());
        hello
    }

    /// Reads the driver's `hello` and refuses it with an `error` frame carrying its request
    /// id, as channeld does for `already_connected` (retryable) or `channel_mismatch` (not
    /// retryable). Drop the connection afterwards, as the hub does.
    pub async fn refuse_hello(&mut self, code: &str, retryable: bool) -> Hello {
        let hello = match self.recv("the driver's hello").await {
            Frame::Hello(hello) => hello,
            other => unexpected("hello as the first frame", &other),
        };
        let message = format!("fake hub refuses this driver: {code}");
        self.send(&Frame::error(Some(hello.request_id.clone()), code, message, retryable)).await;
        hello
    }

    /// The `hello` read by [`handshake`](Self::handshake).
    pub fn hello(&self) -> Option<&Hello> {
        self.hello.as_ref()
    }

    /// The extensions agreed in the handshake (none with [`AckMode::Reference`]).
    pub fn negotiated(&self) -> Extensions {
        self.negotiated
    }

    /// `event` frames received so far (heartbeats and other lifecycle notices).
    pub fn events(&self) -> &[LifecycleEvent] {
        &self.events
    }

    /// Unsolicited `health` reports received so far.
    pub fn health_reports(&self) -> &[Health] {
        &self.health_reports
    }

    /// `agent_env` frames received so far (extension `agent_env`), in order.
    pub fn agent_envs(&self) -> &[AgentEnv] {
        &self.agent_envs
    }

    /// Sends one frame; panics if the driver is gone.
    pub async fn send(&self, frame: &Frame) {
        let line = encode(frame).unwrap_or_else(|err| {
            panic!("fake hub: cannot encode a {} frame: {err}", frame.type_name())
        });
        self.write(&line, frame.type_name()).await;
    }

    /// Sends raw bytes, e.g. a line that is not JSON. Include the trailing newline.
    pub async fn send_raw(&self, bytes: &[u8]) {
        self.write(bytes, "raw line").await;
    }

    /// Writes `bytes` and reports a failure instead of panicking (for tests that expect the
    /// driver to go away while the hub is still writing).
    #[cfg(test)]
    pub(crate) async fn try_send_raw(&self, bytes: &[u8]) -> std::io::Result<()> {
        let mut writer = self.writer.lock().await;
        writer.write_all(bytes).await?;
        writer.flush().await
    }

    async fn write(&self, bytes: &[u8], what: &str) {
        let mut writer = self.writer.lock().await;
        let written = tokio::time::timeout(IO_TIMEOUT, async {
            writer.write_all(bytes).await?;
            writer.flush().await
        })
        .await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(err)) => panic!("fake hub: cannot send {what} to the driver: {err}"),
            Err(_) => panic!("fake hub: the driver did not read {what} within {IO_TIMEOUT:?}"),
        }
    }

    /// Shuts the socket's read side down, as a hub that went away after writing would look
    /// to the driver: the driver's next write fails (`EPIPE`), while what this connection
    /// still writes reaches it. Panics if the socket refuses.
    pub fn stop_reading(&self) {
        use std::os::fd::AsFd;
        let fd = self
            .reader
            .get_ref()
            .as_ref()
            .as_fd()
            .try_clone_to_owned()
            .unwrap_or_else(|err| panic!("fake hub: cannot duplicate the socket: {err}"));
        std::os::unix::net::UnixStream::from(fd)
            .shutdown(std::net::Shutdown::Read)
            .unwrap_or_else(|err| panic!("fake hub: cannot shut the read side down: {err}"));
    }

    /// Sends `accepted` for an inbound (the `accepted` extension).
    pub async fn accept_inbound(&self, event_id: impl AsRef<str>) {
        let event_id = id(event_id.as_ref());
        self.send(&Frame::Accepted(Accepted { event_id, duplicate: false })).await;
    }

    /// Sends a `deliver`: the reply to the inbound with this event id.
    pub async fn deliver(&self, event_id: impl AsRef<str>, target: MessageTarget, text: &str) {
        let delivery =
            Delivery { request_id: id(event_id.as_ref()), message: message(target, text) };
        self.send(&Frame::Deliver(delivery)).await;
    }

    /// Sends an `outbound`: a proactive send.
    pub async fn outbound(&self, request_id: impl AsRef<str>, target: MessageTarget, text: &str) {
        let delivery =
            Delivery { request_id: id(request_id.as_ref()), message: message(target, text) };
        self.send(&Frame::Outbound(delivery)).await;
    }

    /// Sends an `operator_action` (extension `operator_action`).
    pub async fn operator_action(
        &self,
        request_id: impl AsRef<str>,
        name: &str,
        args: serde_json::Value,
    ) {
        let frame = OperatorActionFrame {
            request_id: id(request_id.as_ref()),
            name: name.to_owned(),
            args,
        };
        self.send(&Frame::OperatorAction(frame)).await;
    }

    /// Expects the `operator_action_result` for `request_id`.
    pub async fn expect_operator_action_result(
        &mut self,
        request_id: impl AsRef<str>,
    ) -> OperatorActionResult {
        let request_id = request_id.as_ref();
        let what = format!("an operator_action_result for {request_id}");
        match self.recv(&what).await {
            Frame::OperatorActionResult(result) if result.request_id == request_id => result,
            other => unexpected(&what, &other),
        }
    }

    /// Expects a `history_request` (extension `history`) and answers it with `entries`
    /// (oldest first); returns the request.
    pub async fn answer_history(&mut self, entries: Vec<HistoryEntry>) -> HistoryRequest {
        let request = match self.recv("a history_request").await {
            Frame::HistoryRequest(request) => request,
            other => unexpected("a history_request", &other),
        };
        let result =
            HistoryResult { request_id: request.request_id.clone(), entries, truncated: false };
        self.send(&Frame::HistoryResult(result)).await;
        request
    }

    /// Expects a `cancel` (extension `cancel`) and answers it: the event named cancelled
    /// (`state` `aborted`) when `cancelled`, else nothing cancelled with `state`
    /// `replied`. Returns the request.
    pub async fn answer_cancel(&mut self, cancelled: bool) -> CancelRequest {
        let request = match self.recv("a cancel").await {
            Frame::Cancel(request) => request,
            other => unexpected("a cancel", &other),
        };
        let result = CancelResult {
            request_id: request.request_id.clone(),
            event_id: request.event_id.clone(),
            cancelled: if cancelled { vec![request.event_id.clone()] } else { Vec::new() },
            state: if cancelled { "aborted" } else { "replied" }.to_owned(),
        };
        self.send(&Frame::CancelResult(result)).await;
        request
    }

    /// Sends a `health_request`.
    pub async fn health_request(&self, request_id: impl AsRef<str>) {
        let request = Lifecycle { request_id: id(request_id.as_ref()) };
        self.send(&Frame::HealthRequest(request)).await;
    }

    /// The next frame from the driver, skipping (and recording) unsolicited `event` and
    /// `health` frames. Panics after [`IO_TIMEOUT`], at end of file or on an undecodable line.
    pub async fn next_frame(&mut self) -> Frame {
        self.recv("the next frame from the driver").await
    }

    /// Expects an `inbound`.
    pub async fn expect_inbound(&mut self) -> Inbound {
        match self.recv("an inbound").await {
            Frame::Inbound(inbound) => inbound,
            other => unexpected("an inbound", &other),
        }
    }

    /// Expects a `receipt` for `request_id`.
    pub async fn expect_receipt(&mut self, request_id: impl AsRef<str>) -> DeliveryReceipt {
        let request_id = request_id.as_ref();
        let what = format!("a receipt for {request_id}");
        match self.recv(&what).await {
            Frame::Receipt(receipt) if receipt.request_id == request_id => receipt.receipt,
            other => unexpected(&what, &other),
        }
    }

    /// Expects an `error` frame carrying `request_id`.
    pub async fn expect_error(&mut self, request_id: impl AsRef<str>) -> ErrorFrame {
        let request_id = request_id.as_ref();
        let what = format!("an error for {request_id}");
        match self.recv(&what).await {
            Frame::Error(err) if err.request_id.as_ref().is_some_and(|id| id == request_id) => err,
            other => unexpected(&what, &other),
        }
    }

    /// Expects an `error` frame whose `request_id` is null (e.g. the answer to a bad line).
    pub async fn expect_uncorrelated_error(&mut self) -> ErrorFrame {
        let what = "an error with a null request_id";
        match self.recv(what).await {
            Frame::Error(err) if err.request_id.is_none() => err,
            other => unexpected(what, &other),
        }
    }

    /// Probes the driver's health every 20 ms until an answer satisfies `wanted`, and
    /// returns that answer; panics naming `what`, with the last answer, after `within`.
    pub async fn wait_health(
        &mut self,
        within: Duration,
        what: &str,
        wanted: impl Fn(&Health) -> bool,
    ) -> Health {
        let deadline = Instant::now() + within;
        loop {
            self.probes += 1;
            let request_id = format!("fake-hub-probe-{}", self.probes);
            self.health_request(&request_id).await;
            let health = self.expect_health_response(&request_id).await;
            if wanted(&health) {
                return health;
            }
            assert!(
                Instant::now() < deadline,
                "fake hub: the driver's health was not {what} within {within:?}: last {health:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Expects a `command_result` for `request_id`.
    pub async fn expect_command_result(
        &mut self,
        request_id: impl AsRef<str>,
    ) -> CommandResultFrame {
        let request_id = request_id.as_ref();
        let what = format!("a command_result for {request_id}");
        match self.recv(&what).await {
            Frame::CommandResult(result) if result.request_id == request_id => result,
            other => unexpected(&what, &other),
        }
    }

    /// Expects a `health_response` for `request_id`.
    pub async fn expect_health_response(&mut self, request_id: impl AsRef<str>) -> Health {
        let request_id = request_id.as_ref();
        let what = format!("a health_response for {request_id}");
        match self.recv(&what).await {
            Frame::HealthResponse(response) if response.request_id == request_id => response.health,
            other => unexpected(&what, &other),
        }
    }

    /// Expects the driver's `stop`.
    pub async fn expect_stop(&mut self) -> Lifecycle {
        match self.recv("the driver's stop").await {
            Frame::Stop(stop) => stop,
            other => unexpected("stop", &other),
        }
    }

    /// Asserts that the driver closes the connection within [`IO_TIMEOUT`] without sending
    /// anything but unsolicited frames first.
    pub async fn closed(&mut self) {
        let what = "the driver to close the connection";
        if let Some(frame) = self.read_until(Instant::now() + IO_TIMEOUT, what).await {
            unexpected(what, &frame);
        }
    }

    /// Closes the connection from the hub's side.
    pub fn disconnect(self) {
        drop(self);
    }

    async fn recv(&mut self, what: &str) -> Frame {
        let deadline = Instant::now() + IO_TIMEOUT;
        match self.read_until(deadline, what).await {
            Some(frame) => frame,
            None => panic!("fake hub: the driver closed the connection while waiting for {what}"),
        }
    }

    /// The next solicited frame, or `None` at end of file.
    async fn read_until(&mut self, deadline: Instant, what: &str) -> Option<Frame> {
        loop {
            let next = tokio::time::timeout_at(deadline, self.reader.next()).await;
            let frame = match next {
                Err(_) => panic!("fake hub: waited {IO_TIMEOUT:?} for {what}, got nothing"),
                // A driver that closes with hub frames unread resets the connection.
                Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Ok(Err(err)) => panic!("fake hub: read failed while waiting for {what}: {err}"),
                Ok(Ok(None)) => return None,
                Ok(Ok(Some(Err(err)))) => panic!(
                    "fake hub: the driver sent an undecodable line ({}: {err}) while waiting for {what}",
                    err.code()
                ),
                Ok(Ok(Some(Ok(frame)))) => frame,
            };
            match frame {
                Frame::Event(event) => self.events.push(event.event),
                Frame::Health(report) => self.health_reports.push(report.health),
                Frame::AgentEnv(env) => self.agent_envs.push(env),
                frame => return Some(frame),
            }
        }
    }
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap_or_else(|err| panic!("fake hub: {value:?} is not a valid id: {err}"))
}

fn message(target: MessageTarget, text: &str) -> OutboundMessage {
    let body = MessageBody::text(text)
        .unwrap_or_else(|err| panic!("fake hub: {text:?} is not a valid body: {err}"));
    OutboundMessage { target, body, metadata: Default::default() }
}

fn unexpected(expected: &str, got: &Frame) -> ! {
    panic!("fake hub: expected {expected}, got {}", Shown(got))
}

/// A frame as its wire line, shortened for panic messages.
struct Shown<'a>(&'a Frame);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MAX: usize = 2000;
        if let Frame::AgentEnv(env) = self.0 {
            // Its values are secrets: the names only.
            return write!(f, "{env:?}");
        }
        match encode(self.0) {
            Ok(line) => {
                let line = String::from_utf8_lossy(&line);
                let line = line.trim_end();
                match line.char_indices().nth(MAX) {
                    Some((end, _)) => write!(f, "{}…", &line[..end]),
                    None => f.write_str(line),
                }
            }
            Err(_) => write!(f, "an unencodable {} frame", self.0.type_name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_protocol::frame::{EventFrame, HealthReport};
    use channeld_protocol::types::Capabilities;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;

    fn hello(extensions: &[&str]) -> Frame {
        Frame::Hello(Hello {
            request_id: id("d-hello"),
            channel: ChannelId::new("test.fake").unwrap(),
            capabilities: Capabilities { receive: true, ..Default::default() },
            actions: Default::default(),
            extensions: extensions.iter().map(|&name| name.to_owned()).collect(),
            operator_actions: Vec::new(),
        })
    }

    fn start() -> Frame {
        Frame::Start(Lifecycle { request_id: id("d-start") })
    }

    async fn write_frames(stream: &mut UnixStream, frames: &[Frame]) {
        for frame in frames {
            stream.write_all(&encode(frame).unwrap()).await.unwrap();
        }
    }

    async fn read_frame(stream: &mut UnixStream) -> Frame {
        let mut reader = FrameReader::new(stream);
        reader.next().await.unwrap().unwrap().unwrap()
    }

    #[tokio::test]
    async fn extensions_mode_acks_the_intersection_of_declared_extensions() {
        let hub = FakeHub::bind().await;
        let mut driver = UnixStream::connect(hub.socket_path()).await.unwrap();
        let mut conn = hub.accept().await;
        write_frames(&mut driver, &[hello(&["accepted", "not_a_real_extension"]), start()]).await;

        let hello = conn.handshake(AckMode::Extensions).await;
        assert_eq!(hello.channel.as_str(), "test.fake");
        assert_eq!(conn.negotiated().names(), vec!["accepted".to_owned()]);
        let expected = Frame::HelloAck(HelloAck {
            request_id: id("d-hello"),
            extensions: vec!["accepted".to_owned()],
            hub: FAKE_HUB_NAME.to_owned(),
        });
        assert_eq!(read_frame(&mut driver).await, expected);
    }

    #[tokio::test]
    async fn reference_mode_sends_nothing_after_the_hello() {
        let hub = FakeHub::bind().await;
        let mut driver = UnixStream::connect(hub.socket_path()).await.unwrap();
        let mut conn = hub.accept().await;
        write_frames(&mut driver, &[hello(&["accepted"]), start()]).await;

        conn.handshake(AckMode::Reference).await;
        assert!(conn.negotiated().is_empty());
        conn.disconnect();
        let mut rest = Vec::new();
        driver.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "reference mode sent {:?}", String::from_utf8_lossy(&rest));
    }

    #[tokio::test]
    async fn unsolicited_frames_are_recorded_not_returned() {
        let hub = FakeHub::bind().await;
        let mut driver = UnixStream::connect(hub.socket_path()).await.unwrap();
        let mut conn = hub.accept().await;
        let heartbeat = Frame::Event(EventFrame { event: LifecycleEvent::Heartbeat });
        let health = Frame::Health(HealthReport { health: Health::ready() });
        let stop = Frame::Stop(Lifecycle { request_id: id("d-stop") });
        write_frames(&mut driver, &[heartbeat, health, stop]).await;
        drop(driver);

        assert_eq!(conn.expect_stop().await.request_id, "d-stop");
        assert_eq!(conn.events(), &[LifecycleEvent::Heartbeat]);
        assert_eq!(conn.health_reports(), &[Health::ready()]);
        conn.closed().await;
    }

    #[tokio::test]
    #[should_panic(expected = "expected a receipt for r-1, got")]
    async fn a_mismatched_frame_fails_with_both_frames_named() {
        let hub = FakeHub::bind().await;
        let mut driver = UnixStream::connect(hub.socket_path()).await.unwrap();
        let mut conn = hub.accept().await;
        write_frames(&mut driver, &[Frame::error(Some(id("r-1")), "nope", "no", false)]).await;
        conn.expect_receipt("r-1").await;
    }

    #[tokio::test]
    async fn helpers_write_wire_frames() {
        let hub = FakeHub::bind().await;
        let mut driver = UnixStream::connect(hub.socket_path()).await.unwrap();
        let conn = hub.accept().await;
        let target = MessageTarget::new(ChannelId::new("test.fake").unwrap(), id("room"));
        conn.accept_inbound("e-1").await;
        conn.outbound("o-1", target.clone(), "hi").await;
        conn.send_raw(b"not json\n").await;
        conn.disconnect();

        let mut reader = FrameReader::new(&mut driver);
        let accepted = Frame::Accepted(Accepted { event_id: id("e-1"), duplicate: false });
        assert_eq!(reader.next().await.unwrap().unwrap().unwrap(), accepted);
        let outbound =
            Frame::Outbound(Delivery { request_id: id("o-1"), message: message(target, "hi") });
        assert_eq!(reader.next().await.unwrap().unwrap().unwrap(), outbound);
        assert_eq!(reader.next().await.unwrap().unwrap().unwrap_err().code(), "invalid_json");
        assert!(reader.next().await.unwrap().is_none());
    }
}
