//! Writes frames through a bounded queue drained by one task that batches and flushes.

use std::io;

use channeld_protocol::{EncodeError, Frame, encode};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
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

    /// Queues an already encoded line (from [`channeld_protocol::encode`]).
    pub async fn send_encoded(&self, line: Vec<u8>) -> Result<(), SinkError> {
        self.tx.send(line).await.map_err(|_| SinkError::Closed)
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
}

/// Spawns the writer task for `writer` with a queue of `capacity` frames.
pub fn spawn_writer<W>(writer: W, capacity: usize) -> (FrameSink, Writer)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let (close, closing) = oneshot::channel();
    let task = tokio::spawn(write_loop(writer, rx, closing));
    (FrameSink { tx }, Writer { close, task })
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
    mut closing: oneshot::Receiver<()>,
) -> io::Result<()> {
    let mut batch = Vec::with_capacity(4096);
    loop {
        let first = tokio::select! {
            biased;
            line = rx.recv() => match line {
                Some(line) => line,
                None => break,
            },
            _ = &mut closing => {
                rx.close();
                match rx.try_recv() {
                    Ok(line) => line,
                    Err(_) => break,
                }
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use channeld_protocol::frame::Lifecycle;
    use tokio::io::AsyncReadExt;

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
