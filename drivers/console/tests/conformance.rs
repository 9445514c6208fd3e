//! The SDK's conformance suite against the console driver, run in-process with in-memory
//! pipes for stdin and stdout.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use channeld_console::{ConsoleConfig, ConsoleDriver};
use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask};
use tokio::io::{AsyncWrite, AsyncWriteExt, DuplexStream};

/// The console driver on pipes. Its stdout is counted, not kept: every message the suite
/// sends is one line, so lines printed = messages posted.
#[derive(Default)]
struct ConsoleHarness {
    stdin: Option<DuplexStream>,
    printed_lines: Arc<AtomicUsize>,
    task: Option<DriverTask>,
}

impl ConformanceHarness for ConsoleHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let config = ConsoleConfig::from_launch(&launch, Some("tester")).expect("valid settings");
        let (input, stdin) = tokio::io::duplex(64 * 1024);
        let output = LineCounter { lines: self.printed_lines.clone() };
        let driver = ConsoleDriver::new(config, input, output, false);
        self.stdin = Some(stdin);
        self.task = Some(DriverTask::spawn(driver, launch));
    }

    async fn inject_inbound(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("driver started");
        stdin.write_all(format!("{text}\n").as_bytes()).await.expect("driver reads stdin");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new("console").expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        self.task.take().expect("driver started").stop().await.is_ok()
    }

    fn platform_posts(&self) -> usize {
        self.printed_lines.load(Ordering::SeqCst)
    }
}

/// Discards what is written and counts the newlines, as the write happens: the count is
/// current by the time the driver's receipt reaches the hub.
struct LineCounter {
    lines: Arc<AtomicUsize>,
}

impl AsyncWrite for LineCounter {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let newlines = buf.iter().filter(|&&b| b == b'\n').count();
        self.lines.fetch_add(newlines, Ordering::SeqCst);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

channeld_driver_sdk::conformance_suite!(ConsoleHarness::default());
