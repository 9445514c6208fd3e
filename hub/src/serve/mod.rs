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

use channeld_link::{FrameReader, FrameSink, spawn_writer};
use channeld_protocol::ext::PeerDeclaration;
use channeld_protocol::{DecodeError, Frame};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixListener;
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
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => break,
            () = inst.removed.cancelled() => break,
            () = liveness.answer() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (hub, inst, policy) = (hub.clone(), inst.clone(), policy.clone());
                    hub.clone().connections.spawn(async move {
                        let creds = peer_creds(&stream);
                        let (read, write) = stream.into_split();
                        match creds.as_ref().filter(|cred| policy.admits(cred)) {
                            Some(cred) => serve(hub, inst, read, write, cred.pid).await,
                            None => refuse_peer(&inst, &policy, creds.as_ref(), write).await,
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
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut reader = FrameReader::new(read);
    let (sink, writer) = spawn_writer(write, CONNECTION_QUEUE);
    let first = tokio::select! {
        () = closing(&hub, &inst) => None,
        first = tokio::time::timeout(FIRST_FRAME_TIMEOUT, next_valid(&mut reader, &sink)) => {
            first.ok().flatten()
        }
    };
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

/// Answers a process the socket's peer rule does not admit with `peer_not_allowed` and
/// closes the connection without reading from it.
async fn refuse_peer<W>(inst: &Instance, policy: &PeerPolicy, creds: Option<&PeerCreds>, write: W)
where
    W: AsyncWrite + Unpin + Send + 'static,
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
