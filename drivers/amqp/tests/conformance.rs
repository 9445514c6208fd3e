//! The SDK's conformance suite against the real `channeld-amqp` binary and a real RabbitMQ.
//!
//! Each check gets its own broker node (the harness owns it and stops it when the check ends)
//! and runs the driver as a child process, so SIGTERM handling and the exit status are the
//! real ones. Injected messages are published by a test client as `guest` with a fresh
//! `message_id`; replies and proactive sends land in queues the harness declared, and
//! `platform_posts` counts what the broker holds in the outbound queue.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::ConformanceHarness;
use channeld_tests::rabbitmq::{AmqpTestClient, RabbitMq};
use lapin::{BasicProperties, Confirmation};
use tempfile::TempDir;
use tokio::process::{Child, Command};

const INBOX: &str = "conformance.in";
const REPLIES: &str = "conformance.replies";
const OUTBOUND: &str = "conformance.outbound";
/// How long the driver may take to drain and exit after SIGTERM.
const EXIT_WITHIN: Duration = Duration::from_secs(30);

struct AmqpHarness {
    broker: RabbitMq,
    client: Option<AmqpTestClient>,
    driver: Option<Child>,
    logs: TempDir,
    injected: AtomicUsize,
}

impl AmqpHarness {
    fn new() -> Self {
        let broker = tokio::task::block_in_place(RabbitMq::start);
        let logs =
            tempfile::Builder::new().prefix("channeld-amqp-log-").tempdir().expect("temp dir");
        Self { broker, client: None, driver: None, logs, injected: AtomicUsize::new(0) }
    }

    fn log_path(&self) -> PathBuf {
        self.logs.path().join("driver.log")
    }

    fn client(&self) -> &AmqpTestClient {
        self.client.as_ref().expect("the driver was started")
    }
}

impl ConformanceHarness for AmqpHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let client = AmqpTestClient::connect(&self.broker.guest_url()).await;
        // The driver declares its queue too; declaring it here as well means a message
        // injected before the driver is consuming waits in the queue instead of being unroutable.
        for queue in [INBOX, REPLIES, OUTBOUND] {
            client.declare_queue(queue).await;
        }
        self.client = Some(client);
        let log = std::fs::File::create(self.log_path()).expect("driver log");
        // The launch as the suite gave it (its drain deadline included), plus the broker.
        let child = Command::new(env!("CARGO_BIN_EXE_channeld-amqp"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(launch.to_env())
            .env("CHANNELD_LOG", std::env::var("CHANNELD_LOG").unwrap_or_else(|_| "debug".into()))
            .env("CHANNELD_AMQP_URL", self.broker.guest_url())
            .env("CHANNELD_AMQP_QUEUE", INBOX)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn channeld-amqp");
        self.driver = Some(child);
    }

    async fn inject_inbound(&mut self, text: &str) {
        let n = self.injected.fetch_add(1, Ordering::SeqCst);
        let properties = BasicProperties::default()
            .with_user_id("guest".into())
            .with_message_id(format!("conformance-{}-{n}", std::process::id()).into())
            .with_reply_to(REPLIES.into())
            .with_correlation_id(format!("corr-{n}").into());
        let confirmation = self
            .client()
            .publish(INBOX, properties, text.as_bytes())
            .await
            .expect("the broker takes the injected message");
        assert_eq!(confirmation, Confirmation::Ack(None), "the injected message was not routed");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(OUTBOUND).expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let mut child = self.driver.take().expect("the driver was started");
        let pid = child.id().and_then(|pid| i32::try_from(pid).ok()).expect("driver pid");
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        match tokio::time::timeout(EXIT_WITHIN, child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => false,
        }
    }

    fn platform_posts(&self) -> usize {
        let counts = tokio::task::block_in_place(|| self.broker.queue_counts(OUTBOUND));
        let (ready, unacked) = counts.expect("the broker reports the outbound queue");
        (ready + unacked) as usize
    }
}

impl Drop for AmqpHarness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
            eprintln!("---- channeld-amqp log ----\n{log}");
        }
    }
}

channeld_driver_sdk::conformance_suite!(AmqpHarness::new());
