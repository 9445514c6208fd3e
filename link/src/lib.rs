//! Async plumbing shared by the hub, the driver SDK and `channelctl`: framed connections over
//! any byte stream (bounded reads, batched writes through a bounded queue, a loop's turns
//! between its socket and its other wake-ups), reconnect backoff,
//! the start-up every process shares ([`process`]: logging and signals), and the CPU
//! scheduling policy a process may move its threads to ([`sched`]).

mod backoff;
pub mod process;
pub mod quiet;
mod reader;
pub mod sched;
mod turns;
mod writer;

pub use backoff::Backoff;
pub use reader::FrameReader;
pub use turns::{FRAMES_BETWEEN_CHECKS, SocketFirst, Turn};
pub use writer::{FrameSink, FrameWrite, SinkError, Writer, spawn_writer};

use tokio::net::UnixStream;

pub use quiet::{QuietRead, QuietWrite};

/// Default capacity of a connection's outgoing frame queue.
pub const DEFAULT_QUEUE: usize = 1024;

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
