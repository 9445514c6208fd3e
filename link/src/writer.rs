//! Writes frames through a bounded queue drained by one task that batches and flushes.

use std::io;

use channeld_protocol::{EncodeError, Frame, encode};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
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

/// The sending side of a connection. Cheap to clone; the connection's writer task ends when
/// every clone is dropped.
#[derive(Debug, Clone)]
pub struct FrameSink {
    tx: mpsc::Sender<Vec<u8>>,
}

impl FrameSink {
    /// Encodes and queues a frame, waiting while the queue is full.
    pub async fn send(&self, frame: &Frame) -> Result<(), SinkError> {
        let line = encode(frame)?;
        self.tx.send(line).await.map_err(|_| SinkError::Closed)
    }

    /// Encodes and queues a frame, failing at once when the queue is full.
    pub fn try_send(&self, frame: &Frame) -> Result<(), SinkError> {
        let line = encode(frame)?;
        self.tx.try_send(line).map_err(|err| match err {
            mpsc::error::TrySendError::Full(_) => SinkError::Full,
            mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
        })
    }

    /// True once the writer task has stopped (peer gone or write failed).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves when the writer task has stopped.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Spawns the writer task for `writer` with a queue of `capacity` frames.
pub fn spawn_writer<W>(writer: W, capacity: usize) -> (FrameSink, JoinHandle<io::Result<()>>)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let task = tokio::spawn(write_loop(writer, rx));
    (FrameSink { tx }, task)
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
) -> io::Result<()> {
    let mut batch = Vec::with_capacity(4096);
    while let Some(first) = rx.recv().await {
        batch.clear();
        batch.extend_from_slice(&first);
        while batch.len() < BATCH_BYTES {
            match rx.try_recv() {
                Ok(line) => batch.extend_from_slice(&line),
                Err(_) => break,
            }
        }
        if let Err(err) = writer.write_all(&batch).await {
            rx.close();
            return Err(err);
        }
        if batch.capacity() > 4 * BATCH_BYTES {
            batch = Vec::with_capacity(4096);
        }
    }
    writer.flush().await?;
    writer.shutdown().await
}
