//! Writes frames through a bounded queue drained by one task that batches and flushes; on an
//! idle connection a sender writes its frame itself.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use channeld_protocol::{EncodeError, Frame, encode};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::quiet::{Direct, QuietWrite};

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

/// A byte stream a connection's writer task writes frames to.
pub trait FrameWrite: AsyncWrite + Unpin + Send + 'static {
    /// A handle through which a sender may write its own frame when the writer task has
    /// nothing to write, sparing the task's wake-up. `None` (the default): every frame goes
    /// through the task.
    fn direct(&self) -> Option<Direct> {
        None
    }
}

impl FrameWrite for QuietWrite {
    fn direct(&self) -> Option<Direct> {
        Some(QuietWrite::direct(self))
    }
}

impl FrameWrite for tokio::io::DuplexStream {}
impl FrameWrite for tokio::io::Sink {}
impl FrameWrite for tokio::net::unix::OwnedWriteHalf {}
impl<T: AsyncWrite + Send + 'static> FrameWrite for tokio::io::WriteHalf<T> {}

/// The sending side of a connection. Cheap to clone.
#[derive(Debug, Clone)]
pub struct FrameSink {
    tx: mpsc::Sender<Vec<u8>>,
    shared: Arc<Shared>,
}

/// What a connection's senders and its writer task share.
#[derive(Debug)]
struct Shared {
    progress: Progress,
    pace: Pace,
    /// The stream's direct handle, if it has one.
    direct: Option<DirectPath>,
}

/// A sender's own way to the stream, and the count that says when it may take it.
#[derive(Debug)]
struct DirectPath {
    stream: Direct,
    /// Frames queued for the writer task (or about to be) and not yet written by it. A
    /// sender writes its frame itself only while this is zero, holding this lock for the
    /// write: so no write overlaps another, and no frame overtakes one queued before it.
    owed: Mutex<usize>,
}

impl DirectPath {
    fn owed(&self) -> std::sync::MutexGuard<'_, usize> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A frame counted in [`DirectPath::owed`] that is not queued yet: the count is given back
/// if it never is (a full queue, a closed connection, a cancelled send).
struct Owe<'a>(Option<&'a DirectPath>);

impl Owe<'_> {
    /// The frame is queued: the writer task pays the count back once it wrote it.
    fn queued(mut self) {
        self.0 = None;
    }
}

impl Drop for Owe<'_> {
    fn drop(&mut self) {
        if let Some(direct) = self.0 {
            let mut owed = direct.owed();
            *owed = owed.saturating_sub(1);
        }
    }
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
    /// Encodes a frame and writes it at once when the connection is idle (nothing queued, no
    /// back-to-back traffic, a stream with a [direct](FrameWrite::direct) handle); otherwise
    /// queues it for the writer task, waiting while the queue is full.
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
        async move { self.send_encoded(line?).await }
    }

    /// Encodes a frame and writes or queues it as [`send`](Self::send) does, failing at once
    /// when it would have to wait for room in the queue.
    pub fn try_send(&self, frame: &Frame) -> Result<(), SinkError> {
        let line = encode(frame)?;
        let Some((line, owe)) = self.write_now(line)? else { return Ok(()) };
        self.tx.try_send(line).map_err(|err| match err {
            mpsc::error::TrySendError::Full(_) => SinkError::Full,
            mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
        })?;
        owe.queued();
        Ok(())
    }

    /// Writes or queues an already encoded line (from [`channeld_protocol::encode`]) as
    /// [`send`](Self::send) does.
    pub async fn send_encoded(&self, line: Vec<u8>) -> Result<(), SinkError> {
        let Some((line, owe)) = self.write_now(line)? else { return Ok(()) };
        let permit = self.tx.reserve().await.map_err(|_| SinkError::Closed)?;
        permit.send(line);
        owe.queued();
        Ok(())
    }

    /// Writes `line` to the stream now if the connection is idle: `None` when it was
    /// written (or, written in part, its rest queued ahead of everything else). Otherwise
    /// gives it back, counted as owed, for the caller to queue.
    fn write_now(&self, mut line: Vec<u8>) -> Result<Option<(Vec<u8>, Owe<'_>)>, SinkError> {
        let Some(direct) = &self.shared.direct else { return Ok(Some((line, Owe(None)))) };
        let mut owed = direct.owed();
        // Cheapest first: under pipelined traffic something is owed, or the last write
        // carried several frames, and the clock is not read.
        let now = (*owed == 0 && !self.shared.pace.several()).then(Instant::now);
        if let Some(now) = now.filter(|now| !self.shared.pace.busy(*now)) {
            // A socket that would block, or fails, leaves the frame to the writer task: it
            // waits for room, or meets the error as it would for any frame. A closed writer
            // has shut the socket down, so the write fails (`EPIPE`) and the queue says
            // `Closed`; the queue's state is not read here, as its cache line is cold on a
            // connection sent one frame at a time.
            if let Ok(written) = direct.stream.try_write(&line) {
                self.shared.pace.wrote(now, 1);
                if written == line.len() {
                    return Ok(None);
                }
                // Nothing is owed, so the queue is empty and has room: the rest is queued
                // before the lock lets any other frame in.
                line.drain(..written);
                return match self.tx.try_send(line) {
                    Ok(()) => {
                        *owed += 1;
                        Ok(None)
                    }
                    Err(_) => Err(SinkError::Closed),
                };
            }
        }
        *owed += 1;
        Ok(Some((line, Owe(Some(direct)))))
    }

    /// How long the writer task has been waiting for the peer to take a write, if it is
    /// waiting: a peer that stopped reading shows here (the hub's stall timeout).
    pub fn write_blocked_for(&self) -> Option<Duration> {
        self.shared.progress.blocked_for()
    }

    /// Resolves once a write the writer task began could not complete at once (the peer is
    /// not taking bytes as fast as they come), counting from the last time it resolved: the
    /// moment to start watching [`write_blocked_for`](Self::write_blocked_for). Cancel-safe.
    pub async fn write_blocked(&self) {
        self.shared.progress.blocked.notified().await
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
pub fn spawn_writer<W: FrameWrite>(writer: W, capacity: usize) -> (FrameSink, Writer) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let (close, closing) = oneshot::channel();
    let direct = writer.direct().map(|stream| DirectPath { stream, owed: Mutex::new(0) });
    let shared = Arc::new(Shared { progress: Progress::new(), pace: Pace::new(), direct });
    let task = tokio::spawn(write_loop(writer, rx, closing, shared.clone()));
    (FrameSink { tx, shared }, Writer { close, task })
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
    mut closing: oneshot::Receiver<()>,
    shared: Arc<Shared>,
) -> io::Result<()> {
    let Shared { progress, pace, direct } = &*shared;
    // Grown by the first frame, not allocated up front: a connection that is sent nothing
    // after its handshake holds no 4 KiB for it.
    let mut batch = Vec::new();
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
        if let Some(direct) = direct {
            // Written: senders may write their own frames again once nothing is owed.
            let mut owed = direct.owed();
            *owed = owed.saturating_sub(frames);
        }
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

/// Decides whether the writer should yield before writing, and whether a sender may write
/// its own frame: only a writer under back-to-back traffic yields (and takes every frame),
/// so a sequential exchange pays no extra scheduler pass, and pipelined frames share writes.
#[derive(Debug)]
struct Pace {
    base: Instant,
    /// Nanoseconds after `base` (plus one, so 0 means "never") when the last write was made.
    last_write: AtomicU64,
    /// Whether the last write carried more than one frame.
    several: AtomicBool,
}

impl Pace {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last_write: AtomicU64::new(0),
            several: AtomicBool::new(false),
        }
    }

    /// Whether the last write carried more than one frame (then it is [busy](Self::busy)).
    fn several(&self) -> bool {
        self.several.load(Ordering::Relaxed)
    }

    fn busy(&self, now: Instant) -> bool {
        if self.several() {
            return true;
        }
        let Some(at) = self.last_write.load(Ordering::Relaxed).checked_sub(1) else {
            return false;
        };
        let since = now.saturating_duration_since(self.base).as_nanos();
        since.saturating_sub(u128::from(at)) < BACK_TO_BACK.as_nanos()
    }

    fn wrote(&self, now: Instant, frames: usize) {
        let at = now.saturating_duration_since(self.base).as_nanos();
        let at = u64::try_from(at).unwrap_or(u64::MAX - 1);
        self.last_write.store(at + 1, Ordering::Relaxed);
        self.several.store(frames > 1, Ordering::Relaxed);
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

    impl FrameWrite for CountingWriter {}

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
        let pace = Pace::new();
        let start = pace.base;
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

    /// A quiet Unix stream's frame sink, and the peer's end as a plain non-blocking socket
    /// this (current-thread) test reads without running the runtime.
    fn quiet_pair(capacity: usize) -> (FrameSink, Writer, std::os::unix::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let (_read, write) =
            crate::quiet::split(tokio::net::UnixStream::from_std(ours).unwrap()).unwrap();
        let (sink, writer) = spawn_writer(write, capacity);
        (sink, writer, theirs)
    }

    /// Reads what the peer's socket holds now, without waiting.
    fn read_now(peer: &mut std::os::unix::net::UnixStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0; 64 * 1024];
        loop {
            match std::io::Read::read(peer, &mut buf) {
                Ok(0) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return got,
                Err(err) => panic!("{err}"),
            }
        }
    }

    /// A line far larger than a Unix socket's buffer: a sender's own write takes part of it.
    fn big_line() -> Vec<u8> {
        let mut big = vec![b'x'; 4 * 1024 * 1024];
        big.push(b'\n');
        big
    }

    fn owed(sink: &FrameSink) -> usize {
        *sink.shared.direct.as_ref().expect("a quiet stream has a direct path").owed()
    }

    /// On this current-thread runtime the writer task runs only when the test yields: a
    /// frame the peer can read before that was written by its sender.
    #[tokio::test]
    async fn a_frame_on_an_idle_connection_is_written_by_its_sender() {
        let (sink, _writer, mut peer) = quiet_pair(8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        assert_eq!(read_now(&mut peer), encode(&frame).unwrap(), "written without the task");
        assert_eq!(owed(&sink), 0);
        // A stream without a direct handle still goes through the task.
        let (client, mut server) = tokio::io::duplex(1024);
        let (sink, writer) = spawn_writer(client, 8);
        sink.send(&frame).await.unwrap();
        assert_eq!(sink.queued(), 1, "queued for the task");
        writer.close().await.unwrap();
        let mut received = Vec::new();
        server.read_to_end(&mut received).await.unwrap();
        assert_eq!(received, encode(&frame).unwrap());
    }

    /// The direct path does not look at the queue: a closed writer has shut the socket
    /// down, so a sender's own write fails and the frame is refused like a queued one.
    #[tokio::test]
    async fn a_quiet_streams_sink_refuses_frames_once_its_writer_closed() {
        let (sink, writer, mut peer) = quiet_pair(8);
        let frame = Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() });
        sink.send(&frame).await.unwrap();
        writer.close().await.unwrap();
        std::thread::sleep(BACK_TO_BACK * 50);
        assert!(matches!(sink.send(&frame).await, Err(SinkError::Closed)));
        assert!(matches!(sink.try_send(&frame), Err(SinkError::Closed)));
        assert_eq!(read_now(&mut peer), encode(&frame).unwrap(), "nothing after the close");
        assert_eq!(owed(&sink), 0);
    }

    /// A line larger than the socket's buffer is written in part by its sender and the rest
    /// queued. A frame sent while that rest waits, after the peer made room and the pace went
    /// idle, must queue behind it rather than write into the room.
    #[tokio::test]
    async fn a_frame_sent_behind_the_rest_of_a_partial_write_waits_for_it() {
        let _alone = crate::quiet::tests::BLOCKED_WRITES.lock().await;
        let (sink, writer, mut peer) = quiet_pair(8);
        let big = big_line();
        sink.send_encoded(big.clone()).await.unwrap();
        assert_eq!(owed(&sink), 1, "the rest is queued");
        let mut received = read_now(&mut peer);
        assert!(!received.is_empty() && received.len() < big.len(), "{}", received.len());
        std::thread::sleep(BACK_TO_BACK * 50);
        sink.send_encoded(b"small\n".to_vec()).await.unwrap();
        assert_eq!(owed(&sink), 2, "queued behind the rest");
        assert!(read_now(&mut peer).iter().all(|b| *b == b'x'), "the small line went ahead");
        let reading = tokio::task::spawn_blocking(move || {
            peer.set_nonblocking(false).unwrap();
            std::io::Read::read_to_end(&mut peer, &mut received).unwrap();
            received
        });
        writer.close().await.unwrap();
        let received = reading.await.unwrap();
        let mut expected = big;
        expected.extend_from_slice(b"small\n");
        assert!(received == expected, "{} bytes, out of order or cut", received.len());
        assert_eq!(owed(&sink), 0);
    }

    /// Senders on two threads, each pausing now and then so the connection goes idle and
    /// some frames are written by their senders: every line arrives whole, and each
    /// sender's lines in the order it sent them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn senders_on_many_threads_neither_interleave_nor_reorder() {
        let _alone = crate::quiet::tests::BLOCKED_WRITES.lock().await;
        const SENDERS: usize = 8;
        const EACH: usize = 400;
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (_read, write) = crate::quiet::split(ours).unwrap();
        let (sink, writer) = spawn_writer(write, 16);
        let reading = tokio::spawn(async move {
            let mut theirs = theirs;
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut senders = Vec::new();
        for who in 0..SENDERS {
            let sink = sink.clone();
            senders.push(tokio::spawn(async move {
                for seq in 0..EACH {
                    let pad = "p".repeat((who * 131 + seq * 17) % 3000);
                    sink.send_encoded(format!("{who} {seq} {pad}\n").into_bytes()).await.unwrap();
                    if seq % 40 == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }));
        }
        for sender in senders {
            sender.await.unwrap();
        }
        drop(sink);
        writer.close().await.unwrap();
        let got = String::from_utf8(reading.await.unwrap()).unwrap();
        let mut next = [0; SENDERS];
        for line in got.lines() {
            let mut words = line.split(' ');
            let who: usize = words.next().unwrap().parse().unwrap();
            let seq: usize = words.next().unwrap().parse().unwrap();
            let pad = words.next().unwrap();
            assert_eq!(pad.len(), (who * 131 + seq * 17) % 3000, "a cut line: {line:.40}");
            assert!(pad.bytes().all(|b| b == b'p'), "lines mixed: {line:.40}");
            assert_eq!(seq, next[who], "sender {who} out of order");
            next[who] += 1;
        }
        assert_eq!(next, [EACH; SENDERS]);
    }

    /// A send cancelled while it waits for room gives its count back, so the connection's
    /// senders may write their own frames again once the queue is written out.
    #[tokio::test]
    async fn a_cancelled_send_does_not_keep_senders_off_the_direct_path() {
        let _alone = crate::quiet::tests::BLOCKED_WRITES.lock().await;
        let (sink, writer, mut peer) = quiet_pair(1);
        let big = big_line();
        sink.send_encoded(big.clone()).await.unwrap();
        // The writer task takes the rest and waits for the peer to read; a second line then
        // fills the queue's one slot, and a third waits for room and is dropped.
        sink.send_encoded(b"queued\n".to_vec()).await.unwrap();
        let waiting = sink.send_encoded(b"dropped\n".to_vec());
        assert!(tokio::time::timeout(Duration::from_millis(20), waiting).await.is_err());
        assert_eq!(owed(&sink), 2, "the rest and the queued line");
        let mut expected = big;
        expected.extend_from_slice(b"queued\n");
        let mut received = read_now(&mut peer);
        for _ in 0..5000 {
            if received.len() >= expected.len() && owed(&sink) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            received.extend(read_now(&mut peer));
        }
        assert!(received == expected, "{} bytes", received.len());
        assert_eq!(owed(&sink), 0, "the dropped send's count was given back");
        std::thread::sleep(BACK_TO_BACK * 50);
        sink.send_encoded(b"after\n".to_vec()).await.unwrap();
        assert_eq!(read_now(&mut peer), b"after\n", "written by its sender");
        drop(writer);
    }
}
