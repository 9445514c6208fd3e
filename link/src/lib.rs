//! Async plumbing shared by the hub, the driver SDK and `channelctl`: framed connections over
//! any byte stream (bounded reads, batched writes through a bounded queue), reconnect backoff,
//! the start-up every process shares ([`process`]: logging and signals), and the CPU
//! scheduling policy a process may move its threads to ([`sched`]).

mod backoff;
pub mod process;
pub mod quiet;
mod reader;
pub mod sched;
mod writer;

pub use backoff::Backoff;
pub use reader::FrameReader;
pub use writer::{FrameSink, SinkError, Writer, spawn_writer};

use tokio::net::UnixStream;

pub use quiet::{QuietRead, QuietWrite};

/// Default capacity of a connection's outgoing frame queue.
pub const DEFAULT_QUEUE: usize = 1024;

/// Frames a connection's loop takes from its socket, while frames keep coming, before it
/// polls its other wake-ups (a stop, a timer, its writer's end) ahead of the socket again.
///
/// The loops of the hub and the SDK poll the socket first: a frame already read, or the one
/// that woke the task, is taken without polling the rest, each of which takes a lock per
/// poll (a cancellation token's, a `Notify`'s). The rest are polled whenever the socket has
/// nothing, which is where a connection waits; this bounds how long a peer that never
/// pauses delays them.
pub const FRAMES_BETWEEN_CHECKS: u32 = 64;

/// Splits a connected Unix stream into a frame reader and a frame sink whose writer task
/// is spawned on the current runtime. The stream is registered for readability only
/// ([`quiet`]); registering it fails only when the reactor cannot take one more descriptor.
pub fn split_unix(
    stream: UnixStream,
    queue: usize,
) -> std::io::Result<(FrameReader<QuietRead>, FrameSink, Writer)> {
    let (read, write) = quiet::split(stream)?;
    let (sink, task) = spawn_writer(write, queue);
    Ok((FrameReader::new(read), sink, task))
}
