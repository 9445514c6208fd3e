//! Writes frames through a bounded queue drained by one task that batches and flushes.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use channeld_protocol::{EncodeError, Frame, encode};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;

/// Largest batch written in one call.
const BATCH_BYTES: usize = 64 * 1024;

/// Why a frame was not queued.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("connection closed")]
    Closed,
    #[error("outgoing queue is full")]
    Full,
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// The sending side of a connection. Cheap to clone.
#[derive(Debug, Clone)]
pub struct FrameSink {
    tx: mpsc::Sender<Vec<u8>>,
    progress: Arc<Progress>,
}

/// Whether the writer task is inside a write the peer has not taken yet, and since when: a
/// peer that stops reading leaves the task blocked there (the socket buffer full).
#[derive(Debug)]
struct Progress {
    base: Instant,
    /// Milliseconds after `base` (plus one, so 0 means "not writing") when the current
    /// write began.
    writing_since: AtomicU64,
    /// Told when a write could not complete at once (the peer's socket buffer is full):
    /// only then is a stall worth watching for, so an idle connection needs no timer.
    blocked: Notify,
}

impl Progress {
    fn new() -> Self {
        Self { base: Instant::now(), writing_since: AtomicU64::new(0), blocked: Notify::new() }
    }

    fn begin(&self) {
        let at = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.writing_since.store(at + 1, Ordering::Relaxed);
    }

    fn end(&self) {
        self.writing_since.store(0, Ordering::Relaxed);
    }

    fn blocked_for(&self) -> Option<Duration> {
        let since = self.writing_since.load(Ordering::Relaxed).checked_sub(1)?;
        Some(self.base.elapsed().saturating_sub(Duration::from_millis(since)))
    }
}

impl FrameSink {
    /// Encodes and queues a frame, waiting while the queue is full.
    ///
    /// The frame is encoded before the future is returned, and the future does not borrow
    /// it: a caller that makes the frame in a statement of its own before awaiting
    /// (`let sending = sink.send(&frame); drop(frame); sending.await`, or a temporary in a
    /// `let`) does not keep it in its own state while the queue is full.
    pub fn send<'a>(
        &'a self,
        frame: &Frame,
    ) -> impl Future<Output = Result<(), SinkError>> + Send + use<'a> {
        let line = encode(frame);
        async move { self.tx.send(line?).await.map_err(|_| SinkError::Closed) }
    }

    /// Encodes and queues a frame, failing at once when the queue is full.
    pub fn try_send(&self, frame: &Frame) -> Result<(), SinkError> {
        let line = encode(frame)?;
        self.tx.try_send(line).map_err(|err| match err {
            mpsc::error::TrySendError::Full(_) => SinkError::Full,
            mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
        })
    }

    /// Queues an already encoded line (from [`channeld_protocol::encode`]).
    pub async fn send_encoded(&self, line: Vec<u8>) -> Result<(), SinkError> {
        self.tx.send(line).await.map_err(|_| SinkError::Closed)
    }

    /// How long the writer task has been waiting for the peer to take a write, if it is
    /// waiting: a peer that stopped reading shows here (the hub's stall timeout).
    pub fn write_blocked_for(&self) -> Option<Duration> {
        self.progress.blocked_for()
    }

    /// Resolves once a write the writer task began could not complete at once (the peer is
    /// not taking bytes as fast as they come), counting from the last time it resolved: the
    /// moment to start watching [`write_blocked_for`](Self::write_blocked_for). Cancel-safe.
    pub async fn write_blocked(&self) {
        self.progress.blocked.notified().await
    }

    /// Frames queued and not yet taken by the writer task.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// True once the writer task has stopped (closed, peer gone or write failed).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves when the writer task has stopped.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// The writer task of one connection.
#[derive(Debug)]
pub struct Writer {
    close: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl Writer {
    /// Writes what is already queued, shuts the write side down and waits for the task.
    /// Frames queued afterwards are refused with [`SinkError::Closed`].
    pub async fn close(self) -> io::Result<()> {
        let _ = self.close.send(());
        self.task.await.unwrap_or_else(|err| Err(io::Error::other(err)))
    }

    /// [`close`](Self::close), but a peer that does not read within `limit` does not keep
    /// the task alive: it is aborted, and what was queued is lost.
    pub async fn close_within(self, limit: Duration) -> io::Result<()> {
        let _ = self.close.send(());
        let mut task = self.task;
        match tokio::time::timeout(limit, &mut task).await {
            Ok(done) => done.unwrap_or_else(|err| Err(io::Error::other(err))),
            Err(_) => {
                task.abort();
                let _ = task.await;
                Err(io::Error::new(io::ErrorKind::TimedOut, "the peer did not read in time"))
            }
        }
    }
}

/// Spawns the writer task for `writer` with a queue of `capacity` frames.
pub fn spawn_writer<W>(writer: W, capacity: usize) -> (FrameSink, Writer)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let (close, closing) = oneshot::channel();
    let progress = Arc::new(Progress::new());
    let task = tokio::spawn(write_loop(writer, rx, closing, progress.clone()));
    (FrameSink { tx, progress }, Writer { close, task })
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
    mut closing: oneshot::Receiver<()>,
    progress: Arc<Progress>,
) -> io::Result<()> {
    // Grown by the first frame, not allocated up front: a connection that is sent nothing
    // after its handshake holds no 4 KiB for it.
    let mut batch = Vec::new();
    let mut pace = Pace::default();
    // The close signal completes once, and polling a finished oneshot again panics: the
    // branch is off from then on. Closing the receiver refuses new frames but still yields
    // the queued ones and those of senders that reserved room before, then ends the loop.
    let mut close_heard = false;
    loop {
        let first = tokio::select! {
            biased;
            line = rx.recv() => match line {
                Some(line) => line,
                None => break,
            },
            _ = &mut closing, if !close_heard => {
                close_heard = true;
                rx.close();
                continue;
            }
        };
        let busy = pace.busy(Instant::now());
        batch.clear();
        batch.extend_from_slice(&first);
        let mut frames = 1 + drain(&mut rx, &mut batch);
        if busy && batch.len() < BATCH_BYTES && !rx.is_closed() {
            // Coalesce: let the tasks that are ready now (answers completing in the same
            // scheduler pass) queue their frames first, so one write carries them all. The
            // scheduler polls a yielded task again once it has no other ready task, so this
            // costs one extra poll, not a timer; without it every frame is its own syscall.
            tokio::task::yield_now().await;
            frames += drain(&mut rx, &mut batch);
        }
        progress.begin();
        let written = {
            let mut write = std::pin::pin!(writer.write_all(&batch));
            match std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await {
                Poll::Ready(done) => done,
                Poll::Pending => {
                    progress.blocked.notify_one();
                    write.await
                }
            }
        };
        progress.end();
        if let Err(err) = written {
            rx.close();
            return Err(err);
        }
        pace.wrote(Instant::now(), frames);
        if batch.capacity() > 4 * BATCH_BYTES {
            batch = Vec::new();
        }
    }
    writer.flush().await?;
    writer.shutdown().await
}

/// Moves queued lines into `batch` until it holds [`BATCH_BYTES`] or the queue is empty;
/// returns how many it moved.
fn drain(rx: &mut mpsc::Receiver<Vec<u8>>, batch: &mut Vec<u8>) -> usize {
    let mut moved = 0;
    while batch.len() < BATCH_BYTES {
        match rx.try_recv() {
            Ok(line) => batch.extend_from_slice(&line),
            Err(_) => break,
        }
        moved += 1;
    }
    moved
}

/// A frame that arrives this soon after the previous write means frames are produced back
/// to back (pipelined traffic): worth one yield to gather them. A lone request/answer
/// exchange is slower than this, and writes at once.
const BACK_TO_BACK: Duration = Duration::from_micros(20);

/// Decides whether the writer should yield before writing: only under back-to-back traffic,
/// so a sequential exchange pays no extra scheduler pass.
#[derive(Debug, Default)]
struct Pace {
    last_write: Option<Instant>,
    last_frames: usize,
}

impl Pace {
    fn busy(&self, now: Instant) -> bool {
        self.last_frames > 1
            || self.last_write.is_some_and(|at| now.saturating_duration_since(at) < BACK_TO_BACK)
    }

    fn wrote(&mut self, now: Instant, frames: usize) {
        self.last_write = Some(now);
        self.last_frames = frames;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_protocol::frame::Lifecycle;
    use tokio::io::AsyncReadExt;

    /// Counts the write calls that reach the byte stream.
    struct CountingWriter {
        inner: tokio::io::DuplexStream,
        writes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl AsyncWrite for CountingWriter {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    #[test]
    fn pace_yields_only_under_back_to_back_traffic() {
        let start = Instant::now();
        let mut pace = Pace::default();
        assert!(!pace.busy(start), "the first frame is written at once");
        pace.wrote(start, 1);
        assert!(pace.busy(start + Duration::from_micros(5)), "a frame right after a write");
        assert!(!pace.busy(start + Duration::from_millis(1)), "a lone exchange");
        pace.wrote(start + Duration::from_millis(1), 3);
        assert!(pace.busy(start + Duration::from_secs(1)), "the last write carried several");
    }

    // The multi-thread scheduler runs a task woken by the running one next (its LIFO slot):
    // without coalescing, the writer would wake after each sender and write one frame at a
    // time. Three frames queued together first put the writer in its back-to-back mode, so
    // the test does not depend on timing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn frames_queued_in_one_scheduler_pass_share_one_write() {
        let (client, mut server) = tokio::io::duplex(1024 * 1024);
        let writes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counting = CountingWriter { inner: client, writes: writes.clone() };
        let (sink, writer) = spawn_writer(counting, 256);
        let frame =
            |i: usize| Frame::Start(Lifecycle { request_id: format!("r{i}").try_into().unwrap() });
        for i in 0..3 {
            sink.send(&frame(i)).await.unwrap();
        }
        let go = std::sync::Arc::new(tokio::sync::Notify::new());
        let mut senders = Vec::new();
        for i in 3..53 {
            let (sink, waiting) = (sink.clone(), go.clone().notified_owned());
            senders.push(tokio::spawn(async move {
                waiting.await;
                sink.send(&frame(i)).await.unwrap();
            }));
        }
        go.notify_waiters();
        for sender in senders {
            sender.await.unwrap();
        }
        writer.close().await.unwrap();
        let mut received = Vec::new();
        server.read_to_end(&mut received).await.unwrap();
        assert_eq!(received.iter().filter(|b| **b == b'\n').count(), 53);
        let writes = writes.load(std::sync::atomic::Ordering::Relaxed);
        assert!(writes <= 5, "53 frames took {writes} writes");
    }

    /// A sender that reserved a slot before the close may still send; the writer waits for
    /// it without polling the finished close signal again (which would panic).
    #[tokio::test]
    async fn a_frame_sent_through_a_permit_reserved_before_close_is_still_written() {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let (sink, writer) = spawn_writer(client, 8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        let permit = sink.tx.clone().reserve_owned().await.unwrap();
        let closing = tokio::spawn(writer.close());
        // Let the writer write the first frame and hear the close, then use the permit.
        let mut first = vec![0u8; encode(&frame).unwrap().len()];
        tokio::io::AsyncReadExt::read_exact(&mut server, &mut first).await.unwrap();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        permit.send(encode(&frame).unwrap());
        drop(sink);
        closing.await.unwrap().unwrap();
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, encode(&frame).unwrap());
    }

    #[tokio::test]
    async fn a_peer_that_does_not_read_shows_as_a_blocked_write_until_it_reads() {
        let (client, mut server) = tokio::io::duplex(16);
        let (sink, _writer) = spawn_writer(client, 8);
        assert_eq!(sink.write_blocked_for(), None);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        while sink.write_blocked_for().is_none() {
            tokio::task::yield_now().await;
        }
        let mut line = vec![0u8; encode(&frame).unwrap().len()];
        tokio::io::AsyncReadExt::read_exact(&mut server, &mut line).await.unwrap();
        while sink.write_blocked_for().is_some() {
            tokio::task::yield_now().await;
        }
        assert_eq!(sink.queued(), 0);
    }

    #[tokio::test]
    async fn a_write_that_cannot_complete_at_once_is_announced_and_one_that_can_is_not() {
        let (client, mut server) = tokio::io::duplex(128);
        let (sink, _writer) = spawn_writer(client, 8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        let line = encode(&frame).unwrap();
        assert!(line.len() < 128 && 3 * line.len() > 128, "{}", line.len());
        sink.send(&frame).await.unwrap();
        let mut got = vec![0u8; line.len()];
        tokio::io::AsyncReadExt::read_exact(&mut server, &mut got).await.unwrap();
        let mut blocked = std::pin::pin!(sink.write_blocked());
        assert!(futures_poll(&mut blocked).is_pending(), "a write that fit was announced");
        // Three frames do not fit in the 128-byte pipe nobody reads.
        for _ in 0..3 {
            sink.send(&frame).await.unwrap();
        }
        blocked.await;
        assert!(sink.write_blocked_for().is_some());
    }

    fn futures_poll<F: std::future::Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        std::pin::Pin::new(future).poll(&mut cx)
    }

    #[tokio::test]
    async fn close_within_gives_up_on_a_peer_that_does_not_read() {
        // A 16-byte pipe nobody reads: the queued frame can never be written out.
        let (client, _server) = tokio::io::duplex(16);
        let (sink, writer) = spawn_writer(client, 8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        drop(sink);
        let err = writer.close_within(Duration::from_millis(50)).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    /// The frame is encoded when `send` is called, so its caller may drop it before the
    /// wait (this would not compile if the future borrowed it) and a frame changed after the
    /// call is not what is written.
    #[tokio::test]
    async fn a_send_takes_its_frame_when_called_not_when_awaited() {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let (sink, writer) = spawn_writer(client, 8);
        let mut frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        let expected = encode(&frame).unwrap();
        let sending = sink.send(&frame);
        frame = Frame::Start(Lifecycle { request_id: "b".try_into().unwrap() });
        drop(frame);
        sending.await.unwrap();
        writer.close().await.unwrap();
        let mut received = Vec::new();
        server.read_to_end(&mut received).await.unwrap();
        assert_eq!(received, expected);
    }

    #[tokio::test]
    async fn close_writes_what_was_queued_then_refuses_more() {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let (sink, writer) = spawn_writer(client, 8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        writer.close().await.unwrap();
        assert!(matches!(sink.send(&frame).await, Err(SinkError::Closed)));
        let mut received = Vec::new();
        server.read_to_end(&mut received).await.unwrap();
        assert_eq!(received, encode(&frame).unwrap());
    }
}
