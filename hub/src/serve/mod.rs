//! Serves one instance socket: checks each connecting process's credentials, then lets the
//! first frame decide what the connection is — the instance's driver (`hello`, `driver.rs`),
//! a controller (`control_hello`, `controller.rs`) or a legacy one-shot driver (anything
//! else, served like a driver that declared nothing).
//!
//! The connection itself ([`serve`]) works over any reader and writer, so tests drive it
//! in memory.

mod controller;
mod driver;

use std::sync::Arc;
use std::time::Duration;

use channeld_link::{FrameReader, FrameSink, FrameWrite, quiet, spawn_writer};
use channeld_protocol::ext::PeerDeclaration;
use channeld_protocol::{DecodeError, Frame};
use tokio::io::AsyncRead;
use tokio::net::UnixListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use crate::connection::{Connection, PeerKind};
use crate::hub::Hub;
use crate::instance::Instance;
use crate::liveness::Responder;
use crate::metrics::ConnectionKind;
use crate::peer::{PeerCreds, PeerPolicy, describe_peer, peer_creds};

/// Outgoing frames queued per connection before senders wait (live effects are dropped
/// instead: see `inbound::run`).
pub const CONNECTION_QUEUE: usize = 1024;
/// How long a new connection may take to send its first frame.
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections per instance socket that have not sent their first frame yet; one more is
/// answered `too_many_connections` (retryable) and closed, so a flood of silent
/// connections cannot exhaust the hub while the driver keeps being served.
pub const MAX_UNIDENTIFIED: usize = 64;
/// How long a closing connection may take to write what is queued.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Accepts connections on an instance socket until shutdown (or a reload removes the
/// instance), one tracked task each. Answers the watchdog's liveness probe between accepts.
pub(crate) async fn accept_loop(
    hub: Arc<Hub>,
    inst: Arc<Instance>,
    listener: UnixListener,
    mut liveness: Responder,
) {
    let policy = Arc::new(PeerPolicy::for_socket(inst.config.peers.clone(), &inst.config.socket));
    let unidentified = Arc::new(Semaphore::new(MAX_UNIDENTIFIED));
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => break,
            () = inst.removed.cancelled() => break,
            () = liveness.answer() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (hub, inst, policy) = (hub.clone(), inst.clone(), policy.clone());
                    let slot = unidentified.clone().try_acquire_owned().ok();
                    hub.clone().connections.spawn(async move {
                        let creds = peer_creds(&stream);
                        let (read, write) = match quiet::split(stream) {
                            Ok(halves) => halves,
                            Err(err) => {
                                warn!(instance = %inst.config.id, error = %err, "could not watch a new connection");
                                return;
                            }
                        };
                        match (creds.as_ref().filter(|cred| policy.admits(cred)), slot) {
                            (Some(cred), Some(slot)) => {
                                serve_counted(hub, inst, read, write, cred.pid, Some(slot)).await;
                            }
                            (Some(_), None) => refuse_crowd(&inst, write).await,
                            (None, _) => refuse_peer(&inst, &policy, creds.as_ref(), write).await,
                        }
                    });
                }
                Err(err) => {
                    warn!(instance = %inst.config.id, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Serves one admitted connection to `inst` until the peer leaves or the hub closes
/// connections. `peer_pid` is the connecting process, when known (for status and logs).
pub async fn serve<R, W>(
    hub: Arc<Hub>,
    inst: Arc<Instance>,
    read: R,
    write: W,
    peer_pid: Option<i32>,
) where
    R: AsyncRead + Unpin + Send,
    W: FrameWrite,
{
    serve_counted(hub, inst, read, write, peer_pid, None).await;
}

/// [`serve`], holding `slot` (one of [`MAX_UNIDENTIFIED`]) until the first frame arrived.
async fn serve_counted<R, W>(
    hub: Arc<Hub>,
    inst: Arc<Instance>,
    read: R,
    write: W,
    peer_pid: Option<i32>,
    slot: Option<OwnedSemaphorePermit>,
) where
    R: AsyncRead + Unpin + Send,
    W: FrameWrite,
{
    let mut reader = FrameReader::new(read);
    let (sink, writer) = spawn_writer(write, CONNECTION_QUEUE);
    let first = tokio::select! {
        () = closing(&hub, &inst) => None,
        first = tokio::time::timeout(FIRST_FRAME_TIMEOUT, next_valid(&mut reader, &sink)) => {
            first.ok().flatten()
        }
    };
    drop(slot);
    match first {
        Some(Frame::Hello(hello)) => {
            let _open = hub.metrics.connection(ConnectionKind::Driver);
            driver::run(&hub, &inst, hello, &sink, &mut reader, peer_pid).await;
        }
        Some(Frame::ControlHello(hello)) => {
            let _open = hub.metrics.connection(ConnectionKind::Controller);
            controller::run(&hub, &inst, hello, &sink, &mut reader, peer_pid).await;
        }
        Some(frame) => {
            let _open = hub.metrics.connection(ConnectionKind::Legacy);
            let conn = Arc::new(Connection::new(
                hub.ids.connection(),
                PeerKind::Legacy,
                sink.clone(),
                PeerDeclaration::legacy(),
                peer_pid,
            ));
            debug!(instance = %inst.config.id, conn = conn.id, "legacy connection without hello");
            driver::frames(&hub, &inst, &conn, &mut reader, Some(frame)).await;
            conn.close();
        }
        None => {}
    }
    drop(sink);
    let _ = writer.close_within(CLOSE_GRACE).await;
}

/// Resolves when connections to `inst` must end: the hub is closing connections, or a
/// reload removed the instance.
async fn closing(hub: &Hub, inst: &Instance) {
    tokio::select! {
        () = hub.close_connections.cancelled() => {}
        () = inst.removed.cancelled() => {}
    }
}

/// Answers a connection beyond [`MAX_UNIDENTIFIED`] with `too_many_connections`
/// (retryable) and closes it without reading from it.
async fn refuse_crowd<W>(inst: &Instance, write: W)
where
    W: FrameWrite,
{
    warn!(instance = %inst.config.id, limit = MAX_UNIDENTIFIED, "connection refused: too many connections that have not said hello");
    let message = format!(
        "{} has {MAX_UNIDENTIFIED} connections that have not sent a first frame; try again",
        inst.config.id
    );
    let (sink, writer) = spawn_writer(write, 1);
    let _ = sink.send(&Frame::error(None, "too_many_connections", message, true)).await;
    drop(sink);
    let _ = writer.close_within(CLOSE_GRACE).await;
}

/// Answers a process the socket's peer rule does not admit with `peer_not_allowed` and
/// closes the connection without reading from it.
async fn refuse_peer<W>(inst: &Instance, policy: &PeerPolicy, creds: Option<&PeerCreds>, write: W)
where
    W: FrameWrite,
{
    let who = describe_peer(creds);
    let pid = creds.and_then(|c| c.pid);
    warn!(
        instance = %inst.config.id,
        uid = creds.map(|c| c.uid),
        gid = creds.map(|c| c.gid),
        pid,
        allowed = %policy.describe(),
        "connection refused: peer not allowed on this socket"
    );
    let pid_text = pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string());
    inst.record_error(format!("refused a connection from {who} (pid {pid_text})"));
    let message = format!("{who} may not connect to the socket of {}", inst.config.id);
    let (sink, writer) = spawn_writer(write, 1);
    let _ = sink.send(&Frame::error(None, "peer_not_allowed", message, false)).await;
    drop(sink);
    let _ = writer.close_within(CLOSE_GRACE).await;
}

/// Reads until a frame decodes, answering bad lines with `error` frames. `None` at EOF.
async fn next_valid<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    sink: &FrameSink,
) -> Option<Frame> {
    loop {
        match reader.next().await {
            Ok(Some(Ok(frame))) => return Some(frame),
            Ok(Some(Err(err))) => answer_decode_error(sink, &err),
            Ok(None) | Err(_) => return None,
        }
    }
}

/// Answers a line that did not decode (`line_too_long`, `invalid_json`, …); a full queue
/// drops the answer rather than stall the reader.
fn answer_decode_error(sink: &FrameSink, err: &DecodeError) {
    debug!(code = err.code(), error = %err, "rejected a line");
    let _ = sink.try_send(&err.to_error_frame());
}
