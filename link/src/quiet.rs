//! A Unix stream registered with the reactor for readability only, so the peer's reads do
//! not wake this process.
//!
//! Tokio registers a socket for reading and writing at once (edge-triggered). On a Unix
//! stream each read by the peer frees the writer's socket memory and wakes whoever polls for
//! the writer's `EPOLLOUT`: a process between messages is woken for nothing, once per batch
//! the peer takes (BENCHMARKS.md, thirty-third round). Here the socket's own registration
//! asks for readability only. A write goes straight to the socket; only one that finds the
//! socket's buffer full registers a duplicate of the descriptor for writability, which is
//! dropped once the write went through, so a peer that keeps up never wakes the writer.
//! A [`Direct`] handle lets a sender write without the writer task (`writer.rs`).

use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;

/// Splits `stream` into halves that share one readable-only registration. Must be called
/// on a tokio runtime (the registration is its reactor's).
pub fn split(stream: UnixStream) -> io::Result<(QuietRead, QuietWrite)> {
    let shared = Arc::new(register(stream.into_std()?, Interest::READABLE)?);
    Ok((QuietRead { shared: shared.clone() }, QuietWrite { shared, waiting: None, shut: false }))
}

/// Registers `stream` with the current runtime's reactor for `interest` only. Both callers
/// hand over a non-blocking descriptor: `into_std` leaves tokio's stream non-blocking, and a
/// duplicate shares that flag with its original (one open file description). A blocking one
/// would stall the runtime on a full buffer, which the 4 MiB write test would show as a hang.
fn register(stream: StdUnixStream, interest: Interest) -> io::Result<AsyncFd<StdUnixStream>> {
    // SAFETY: the stream owns its descriptor, which stays open and the same until the
    // `AsyncFd` that owns the stream is dropped.
    Ok(unsafe { AsyncFd::register_with_interest(stream, interest) }?)
}

/// The read half of [`split`].
#[derive(Debug)]
pub struct QuietRead {
    shared: Arc<AsyncFd<StdUnixStream>>,
}

/// The write half of [`split`]. Dropping it shuts the stream's write side down, as tokio's
/// own write half does.
#[derive(Debug)]
pub struct QuietWrite {
    shared: Arc<AsyncFd<StdUnixStream>>,
    /// A duplicate of the descriptor, registered for writability while a write waits for
    /// room in the socket's buffer.
    waiting: Option<AsyncFd<StdUnixStream>>,
    shut: bool,
}

impl QuietWrite {
    /// A handle that writes to this stream without waiting and without keeping it open.
    pub fn direct(&self) -> Direct {
        Direct { shared: Arc::downgrade(&self.shared) }
    }
}

/// Writes to a [`QuietWrite`]'s stream at once, from any thread, or says it would have to
/// wait. For a sender that writes its own frame while the connection's writer task has
/// nothing to write: the caller keeps its writes and the task's apart and in order.
#[derive(Debug, Clone)]
pub struct Direct {
    /// Weak, so that a frame sink kept after its connection ended does not hold the
    /// descriptor open.
    shared: Weak<AsyncFd<StdUnixStream>>,
}

impl Direct {
    /// Writes what the socket takes now: all of `data`, a part of it, or `WouldBlock` when
    /// its buffer is full. `NotConnected` once both halves are gone.
    pub fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        let Some(shared) = self.shared.upgrade() else {
            return Err(io::ErrorKind::NotConnected.into());
        };
        shared.get_ref().write(data)
    }
}

impl AsyncRead for QuietRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.shared.poll_read_ready(cx))?;
            let room = buf.remaining();
            match guard.try_io(|fd| recv_into(fd.get_ref(), buf)) {
                Ok(Ok(n)) => {
                    // A short read drained the socket (as tokio's own streams assume): the
                    // next read waits for a new edge instead of asking the kernel again
                    // only to hear `EAGAIN`. A newer edge is not cleared (the guard's tick).
                    if n > 0 && n < room {
                        guard.clear_ready();
                    }
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(err)) => return Poll::Ready(Err(err)),
                Err(_would_block) => continue,
            }
        }
    }
}

/// Receives into the unfilled part of `buf` without zeroing it first.
fn recv_into(stream: &StdUnixStream, buf: &mut ReadBuf<'_>) -> io::Result<usize> {
    // SAFETY: nothing is read from the unfilled part; `recv` writes at most its length.
    let unfilled = unsafe { buf.unfilled_mut() };
    // SAFETY: the pointer and length describe memory we may write for the call's duration.
    let n =
        unsafe { libc::recv(stream.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len(), 0) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: `recv` initialised the first `n` bytes of the unfilled part.
    unsafe { buf.assume_init(n) };
    buf.advance(n);
    Ok(n)
}

impl AsyncWrite for QuietWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let waiting = match &this.waiting {
            Some(waiting) => waiting,
            None => match this.shared.get_ref().write(data) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    let dup = this.shared.get_ref().try_clone()?;
                    this.waiting.insert(register(dup, Interest::WRITABLE)?)
                }
                done => return Poll::Ready(done),
            },
        };
        loop {
            let mut guard = ready!(waiting.poll_write_ready(cx))?;
            if let Ok(done) = guard.try_io(|fd| fd.get_ref().write(data)) {
                // Written (or failed for good): the duplicate's registration goes, and with it
                // the peer's power to wake this process by reading.
                this.waiting = None;
                return Poll::Ready(done);
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.shut = true;
        Poll::Ready(this.shared.get_ref().shutdown(Shutdown::Write))
    }
}

impl Drop for QuietWrite {
    fn drop(&mut self) {
        if !self.shut {
            // The peer may have gone already; there is nobody to tell then.
            let _ = self.shared.get_ref().shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The event masks the process's epoll instances hold for descriptor `fd`
    /// (`/proc/self/fdinfo` of each `anon_inode:[eventpoll]`).
    fn epoll_masks(fd: i32) -> Vec<u32> {
        let mut masks = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let is_epoll = std::fs::read_link(entry.path())
                .is_ok_and(|target| target.to_string_lossy().contains("eventpoll"));
            if !is_epoll {
                continue;
            }
            let name = entry.file_name();
            let info =
                std::fs::read_to_string(format!("/proc/self/fdinfo/{}", name.to_string_lossy()))
                    .unwrap_or_default();
            for line in info.lines() {
                let mut words = line.split_whitespace();
                if words.next() != Some("tfd:") || words.next() != Some(&fd.to_string()) {
                    continue;
                }
                if let (Some("events:"), Some(mask)) = (words.next(), words.next()) {
                    masks.push(u32::from_str_radix(mask, 16).unwrap());
                }
            }
        }
        masks
    }

    /// Held by every test that makes a write wait for room in a quiet stream (which
    /// registers for writability alone) while the test that looks for such registrations
    /// runs: they would see each other's.
    pub(crate) static BLOCKED_WRITES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// Whether some epoll instance of the process holds a registration for writability alone:
    /// only a [`QuietWrite`] waiting for room makes one (tokio's own streams ask for both).
    fn writable_only_registration() -> bool {
        (0..4096)
            .flat_map(epoll_masks)
            .any(|mask| mask & libc::EPOLLOUT as u32 != 0 && mask & libc::EPOLLIN as u32 == 0)
    }

    #[tokio::test]
    async fn the_stream_is_registered_for_reading_only_and_carries_bytes_both_ways() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fd = ours.as_raw_fd();
        let (mut read, mut write) = split(ours).unwrap();
        // Other tests' runtimes may hold a stale entry under the same number: every entry
        // must ask for reading and none for writing (tokio's own streams ask for both).
        let masks = epoll_masks(fd);
        assert!(!masks.is_empty(), "registered");
        for mask in &masks {
            assert_ne!(mask & libc::EPOLLIN as u32, 0, "{masks:x?}");
            assert_eq!(mask & libc::EPOLLOUT as u32, 0, "{masks:x?}");
        }

        let (mut their_read, mut their_write) = theirs.into_split();
        write.write_all(b"ping\n").await.unwrap();
        let mut got = [0; 5];
        their_read.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping\n");
        their_write.write_all(b"pong\n").await.unwrap();
        let mut back = Vec::with_capacity(64);
        read.read_buf(&mut back).await.unwrap();
        assert_eq!(back, b"pong\n");
    }

    #[tokio::test]
    async fn a_write_larger_than_the_socket_buffer_waits_for_the_reader_and_then_unregisters() {
        let _alone = BLOCKED_WRITES.lock().await;
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let (_read, mut write) = split(ours).unwrap();
        let payload: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let (go, read_now) = tokio::sync::oneshot::channel::<()>();
        let reader = tokio::spawn(async move {
            read_now.await.unwrap();
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.unwrap();
            got
        });
        let sending = payload.clone();
        let writer = tokio::spawn(async move {
            write.write_all(&sending).await.unwrap();
            let waiting_after = write.waiting.is_some();
            write.shutdown().await.unwrap();
            waiting_after
        });
        // The socket's buffer holds far less than 4 MiB: the writer waits for room.
        let mut registered = false;
        for _ in 0..200 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            registered = writable_only_registration();
            if registered {
                break;
            }
        }
        assert!(registered, "a blocked write registers for writability");
        go.send(()).unwrap();
        assert_eq!(reader.await.unwrap(), payload);
        assert!(!writer.await.unwrap(), "the writability registration outlived the write");
        assert!(!writable_only_registration(), "the duplicate descriptor is gone");
    }

    #[tokio::test]
    async fn a_short_read_waits_for_the_next_edge_instead_of_asking_the_socket_again() {
        let (ours, theirs) = StdUnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let (mut read, _write) = split(UnixStream::from_std(ours).unwrap()).unwrap();
        let mut theirs = theirs;
        theirs.write_all(b"a\n").unwrap();
        let mut got = Vec::with_capacity(64);
        read.read_buf(&mut got).await.unwrap();
        assert_eq!(got, b"a\n", "a short read: the buffer had room for more");

        // More bytes arrive, but this (current-thread) runtime has not polled epoll since:
        // the read must wait for that edge rather than try `recv` on a readiness it drained.
        theirs.write_all(b"b\n").unwrap();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut more = Vec::with_capacity(64);
        let mut room = [0; 64];
        let polled = Pin::new(&mut read).poll_read(&mut cx, &mut ReadBuf::new(&mut room));
        assert!(polled.is_pending(), "the short read left the socket marked readable");

        // The new edge is then seen: nothing is lost or held.
        read.read_buf(&mut more).await.unwrap();
        assert_eq!(more, b"b\n");
    }

    #[tokio::test]
    async fn dropping_the_write_half_ends_the_peers_stream_while_the_read_half_still_reads() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (mut read, write) = split(ours).unwrap();
        drop(write);
        let (mut their_read, mut their_write) = theirs.into_split();
        let mut got = Vec::new();
        assert_eq!(their_read.read_to_end(&mut got).await.unwrap(), 0, "EOF");
        their_write.write_all(b"still here\n").await.unwrap();
        drop(their_write);
        let mut back = Vec::new();
        read.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"still here\n");
    }

    #[tokio::test]
    async fn a_peer_that_resets_is_an_error_or_the_end_not_a_hang() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (mut read, mut write) = split(ours).unwrap();
        drop(theirs);
        let mut back = Vec::with_capacity(16);
        assert_eq!(read.read_buf(&mut back).await.unwrap(), 0);
        let err = write.write_all(&[0; 1 << 20]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe, "{err}");
    }
}
