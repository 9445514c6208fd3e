//! What the console driver does when its input ends: it waits for the replies to every line
//! (bounded by the reply timeout), prints them, and stops cleanly.

use std::time::Duration;

use channeld_console::convert::{MESSAGE_MARKER, PROMPT};
use channeld_console::{ConsoleConfig, ConsoleDriver};
use channeld_driver_sdk::protocol::Frame;
use channeld_driver_sdk::protocol::frame::EffectFrame;
use channeld_driver_sdk::protocol::types::Effect;
use channeld_driver_sdk::testing::{AckMode, FakeConnection, FakeHub};
use channeld_driver_sdk::{CancellationToken, DriverLaunchConfig, RunError, run_driver};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

const CHANNEL: &str = "console.test";
/// Bounds reading what the driver printed once it has exited.
const READ_OUTPUT: Duration = Duration::from_secs(5);

/// A console driver on pipes, connected to a fake hub.
struct Console {
    stdin: DuplexStream,
    stdout: DuplexStream,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RunError>>,
}

impl Console {
    fn start(launch: DriverLaunchConfig, interactive: bool) -> (Self, DuplexStream) {
        let config = ConsoleConfig::from_launch(&launch, Some("tester")).expect("valid settings");
        let (input, stdin) = tokio::io::duplex(64 * 1024);
        let (output, stdout) = tokio::io::duplex(64 * 1024);
        let (status, status_reader) = tokio::io::duplex(64 * 1024);
        let driver = ConsoleDriver::new(config, input, output, interactive).with_status(status);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run_driver(driver, launch, shutdown.clone()));
        (Console { stdin, stdout, shutdown, task }, status_reader)
    }

    /// Waits for the driver to exit and returns everything it printed.
    async fn exit(mut self) -> (Result<(), RunError>, String) {
        let result = self.task.await.expect("driver task did not panic");
        let mut printed = String::new();
        tokio::time::timeout(READ_OUTPUT, self.stdout.read_to_string(&mut printed))
            .await
            .expect("the driver released stdout when it exited")
            .expect("stdout is UTF-8");
        (result, printed)
    }
}

async fn connect(hub: &FakeHub) -> FakeConnection {
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_of_input_waits_for_every_reply_then_stops() {
    let hub = FakeHub::bind().await;
    let (mut console, _status) = Console::start(hub.launch_config(CHANNEL), false);
    let mut conn = connect(&hub).await;

    console.stdin.write_all(b"first\n\nsecond\n").await.unwrap();
    console.stdin.shutdown().await.unwrap();
    let first = conn.expect_inbound().await;
    let second = conn.expect_inbound().await;
    assert_eq!(first.message.body.text_str(), "first");
    assert_eq!(second.message.body.text_str(), "second");
    assert!(first.event_id.as_str().starts_with("console-"), "event id {}", first.event_id);
    assert_ne!(first.event_id, second.event_id);
    assert_eq!(first.message.sender.id, "tester");
    assert_eq!(first.message.target.conversation, "console");
    conn.accept_inbound(&first.event_id).await;
    conn.accept_inbound(&second.event_id).await;

    conn.deliver(&first.event_id, first.message.target.clone(), "reply one").await;
    let receipt = conn.expect_receipt(&first.event_id).await;
    assert!(receipt.message_id.as_str().starts_with("console-out-"));
    conn.health_request("still-waiting").await;
    conn.expect_health_response("still-waiting").await;

    conn.deliver(&second.event_id, second.message.target.clone(), "reply two").await;
    conn.expect_receipt(&second.event_id).await;
    conn.expect_stop().await;
    conn.closed().await;

    let (result, printed) = console.exit().await;
    assert!(result.is_ok(), "driver failed: {result:?}");
    assert_eq!(printed, "reply one\nreply two\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_of_input_gives_up_waiting_after_the_reply_timeout() {
    let hub = FakeHub::bind().await;
    let mut launch = hub.launch_config(CHANNEL);
    launch.reply_timeout = Duration::from_secs(1);
    let (mut console, _status) = Console::start(launch, false);
    let mut conn = connect(&hub).await;

    console.stdin.write_all(b"never answered\n").await.unwrap();
    console.stdin.shutdown().await.unwrap();
    let inbound = conn.expect_inbound().await;
    conn.accept_inbound(&inbound.event_id).await;
    conn.expect_stop().await;
    conn.closed().await;

    let (result, printed) = console.exit().await;
    assert!(result.is_ok(), "driver failed: {result:?}");
    assert_eq!(printed, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_of_input_does_not_wait_for_a_line_the_hub_refused() {
    let hub = FakeHub::bind().await;
    let (mut console, _status) = Console::start(hub.launch_config(CHANNEL), false);
    let mut conn = connect(&hub).await;

    console.stdin.write_all(b"refused\n").await.unwrap();
    console.stdin.shutdown().await.unwrap();
    let inbound = conn.expect_inbound().await;
    let refusal = Frame::error(Some(inbound.event_id), "sender_denied", "not allowed", false);
    conn.send(&refusal).await;
    conn.expect_stop().await;
    conn.closed().await;

    let (result, _) = console.exit().await;
    assert!(result.is_ok(), "driver failed: {result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_mode_marks_messages_and_shows_typing() {
    let hub = FakeHub::bind().await;
    let (mut console, mut status) = Console::start(hub.launch_config(CHANNEL), true);
    let mut conn = connect(&hub).await;

    console.stdin.write_all(b"hello\n").await.unwrap();
    let inbound = conn.expect_inbound().await;
    conn.accept_inbound(&inbound.event_id).await;
    let typing = EffectFrame {
        request_id: "typing-1".try_into().unwrap(),
        target: inbound.message.target.clone(),
        effect: Effect::Typing { active: true },
    };
    conn.send(&Frame::Effect(typing)).await;
    conn.deliver(&inbound.event_id, inbound.message.target.clone(), "hi back").await;
    conn.expect_receipt(&inbound.event_id).await;

    console.shutdown.cancel();
    conn.expect_stop().await;
    conn.closed().await;
    let (result, printed) = console.exit().await;
    assert!(result.is_ok(), "driver failed: {result:?}");
    assert_eq!(printed, format!("{PROMPT}{PROMPT}\r\x1b[2K{MESSAGE_MARKER}hi back\n{PROMPT}"));

    let mut shown = String::new();
    tokio::time::timeout(READ_OUTPUT, status.read_to_string(&mut shown))
        .await
        .expect("the driver released its status writer")
        .unwrap();
    assert_eq!(shown, "\r\x1b[2K\x1b[2m… typing\x1b[0m");
}
