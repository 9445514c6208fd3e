//! An async client for the hub's control socket (`channeld.control/v1`), pipelined: many
//! requests in flight on one connection, answers matched by id.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use channeld_protocol::framing::{LineEvent, LineFramer};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// One control connection.
#[derive(Debug)]
pub struct ControlClient {
    write: tokio::sync::Mutex<OwnedWriteHalf>,
    waiters: Waiters,
    next: AtomicU64,
}

/// Why a request got no answer.
#[derive(Debug, PartialEq, Eq)]
pub enum ControlError {
    /// The connection broke (e.g. the hub died) before the answer.
    Disconnected,
}

impl ControlClient {
    pub async fn connect(socket: &Path) -> std::io::Result<Self> {
        let stream = UnixStream::connect(socket).await?;
        let (mut read, write) = stream.into_split();
        let waiters: Waiters = Arc::default();
        let reader_waiters = waiters.clone();
        tokio::spawn(async move {
            let mut framer = LineFramer::new(1 << 20);
            loop {
                while let Some(event) = framer.next_line() {
                    if let LineEvent::Line(line) = event {
                        let Ok(value) = serde_json::from_slice::<Value>(line) else { continue };
                        let id = value.get("id").and_then(Value::as_u64).unwrap_or(0);
                        let waiter = reader_waiters.lock().unwrap().remove(&id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(value);
                        }
                    }
                }
                match read.read_buf(framer.buffer_for_read()).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            // Dropping the remaining senders tells every waiter the connection is gone.
            reader_waiters.lock().unwrap().clear();
        });
        Ok(Self { write: tokio::sync::Mutex::new(write), waiters, next: AtomicU64::new(1) })
    }

    /// Sends `request` (an object without `id`) and waits for its answer.
    pub async fn call(&self, mut request: Value) -> Result<Value, ControlError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        request["id"] = Value::from(id);
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().unwrap().insert(id, tx);
        let mut line = serde_json::to_vec(&request).expect("request serialises");
        line.push(b'\n');
        if self.write.lock().await.write_all(&line).await.is_err() {
            self.waiters.lock().unwrap().remove(&id);
            return Err(ControlError::Disconnected);
        }
        rx.await.map_err(|_| ControlError::Disconnected)
    }
}
