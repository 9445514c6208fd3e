//! Serves one instance socket: the first frame decides whether a connection is the live driver
//! (`hello`), a controller (`control_hello`) or a legacy one-shot driver (anything else).

use std::sync::Arc;
use std::time::Duration;

use channeld_link::{FrameReader, FrameSink, split_unix};
use channeld_protocol::ext::{EffectGate, Extensions, PeerDeclaration};
use channeld_protocol::frame::{
    ControlHello, ControlRequest, ControlResponse, ControlResult, EffectFrame, Hello, HelloAck,
    Lifecycle,
};
use channeld_protocol::types::{ControlAction, Health, HealthState};
use channeld_protocol::{DecodeError, Frame, Id};
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::hub::{HUB_EXTENSIONS, HUB_NAME, Hub, SendError, SendOutcome};
use crate::instance::{Connection, Counters, Instance, PeerKind, ReceiptOutcome};
use crate::peer::{PeerCreds, PeerPolicy};

/// Outgoing frames queued per connection before senders wait.
pub const CONNECTION_QUEUE: usize = 1024;
/// How long a new connection may take to send its first frame.
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) async fn accept_loop(
    hub: Arc<Hub>,
    inst: Arc<Instance>,
    listener: UnixListener,
    tasks: TaskTracker,
) {
    let policy = Arc::new(peer_policy(&inst));
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tasks.spawn(serve(hub.clone(), inst.clone(), stream, policy.clone()));
                }
                Err(err) => {
                    warn!(instance = %inst.config.id, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// The instance's peer rule resolved against this hub: its uid and the socket's group.
fn peer_policy(inst: &Instance) -> PeerPolicy {
    use std::os::unix::fs::MetadataExt;
    let socket_gid = std::fs::metadata(&inst.config.socket)
        .map_or_else(|_| crate::peer::effective_gid(), |meta| meta.gid());
    PeerPolicy {
        rule: inst.config.peers.clone(),
        hub_uid: crate::peer::effective_uid(),
        socket_gid,
    }
}

/// The connecting process's credentials, or `None` when the kernel cannot say.
fn peer_creds(stream: &UnixStream) -> Option<PeerCreds> {
    let cred = stream.peer_cred().ok()?;
    let groups = crate::peer::peer_groups(std::os::fd::AsFd::as_fd(stream)).unwrap_or_else(|err| {
        debug!(error = %err, "supplementary groups of the peer unknown; checking its primary group only");
        Vec::new()
    });
    Some(PeerCreds { uid: cred.uid(), gid: cred.gid(), groups, pid: cred.pid() })
}

async fn serve(hub: Arc<Hub>, inst: Arc<Instance>, stream: UnixStream, policy: Arc<PeerPolicy>) {
    let creds = peer_creds(&stream);
    let peer_pid = creds.as_ref().and_then(|cred| cred.pid);
    let (mut reader, sink, writer) = split_unix(stream, CONNECTION_QUEUE);
    if !creds.as_ref().is_some_and(|cred| policy.admits(cred)) {
        refuse_peer(&inst, &policy, creds.as_ref(), &sink).await;
        drop(sink);
        let _ = tokio::time::timeout(Duration::from_secs(5), writer.close()).await;
        return;
    }
    let first = tokio::select! {
        () = hub.close_connections.cancelled() => None,
        first = tokio::time::timeout(FIRST_FRAME_TIMEOUT, next_valid(&mut reader, &sink)) => {
            first.ok().flatten()
        }
    };
    match first {
        Some(Frame::Hello(hello)) => {
            if let Some(conn) = driver_handshake(&hub, &inst, hello, &sink, peer_pid).await {
                frame_loop(&hub, &inst, &conn, &mut reader, None).await;
                conn.close();
                inst.release(&conn);
                info!(instance = %inst.config.id, conn = conn.id, "driver disconnected");
            }
        }
        Some(Frame::ControlHello(hello)) => {
            controller_loop(&hub, &inst, hello, &sink, &mut reader, peer_pid).await;
        }
        Some(frame) => {
            let conn = Arc::new(Connection::new(
                hub.next_connection_id(),
                PeerKind::Legacy,
                sink.clone(),
                PeerDeclaration::legacy(),
                peer_pid,
                inst.config.max_inflight,
            ));
            debug!(instance = %inst.config.id, conn = conn.id, "legacy connection without hello");
            frame_loop(&hub, &inst, &conn, &mut reader, Some(frame)).await;
            conn.close();
        }
        None => {}
    }
    drop(sink);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer.close()).await;
}

/// Answers a process the socket's peer rule does not admit with `peer_not_allowed`; the
/// caller then closes the connection without reading from it.
async fn refuse_peer(
    inst: &Instance,
    policy: &PeerPolicy,
    creds: Option<&PeerCreds>,
    sink: &FrameSink,
) {
    let who = match creds {
        Some(cred) => format!("uid {} gid {}", cred.uid, cred.gid),
        None => "a peer with unknown credentials".to_owned(),
    };
    warn!(
        instance = %inst.config.id,
        uid = creds.map(|c| c.uid),
        gid = creds.map(|c| c.gid),
        pid = creds.and_then(|c| c.pid),
        allowed = %policy.describe(),
        "connection refused: peer not allowed on this socket"
    );
    inst.record_error(format!(
        "refused a connection from {who} (pid {})",
        creds.and_then(|c| c.pid).map_or_else(|| "unknown".to_owned(), |p| p.to_string())
    ));
    let message = format!("{who} may not connect to the socket of {}", inst.config.id);
    let _ = sink.send(&Frame::error(None, "peer_not_allowed", message, false)).await;
}

/// Reads until a frame decodes, answering bad lines with `error` frames. `None` at EOF.
async fn next_valid(reader: &mut FrameReader<OwnedReadHalf>, sink: &FrameSink) -> Option<Frame> {
    loop {
        match reader.next().await {
            Ok(Some(Ok(frame))) => return Some(frame),
            Ok(Some(Err(err))) => answer_decode_error(sink, &err),
            Ok(None) | Err(_) => return None,
        }
    }
}

fn answer_decode_error(sink: &FrameSink, err: &DecodeError) {
    debug!(code = err.code(), error = %err, "rejected a line");
    let _ = sink.try_send(&err.to_error_frame());
}

async fn driver_handshake(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    hello: Hello,
    sink: &FrameSink,
    peer_pid: Option<i32>,
) -> Option<Arc<Connection>> {
    if hello.channel != inst.config.id {
        let message =
            format!("this socket serves {}, the hello names {}", inst.config.id, hello.channel);
        warn!(instance = %inst.config.id, channel = %hello.channel, "hello for the wrong channel");
        let _ = sink
            .send(&Frame::error(Some(hello.request_id), "channel_mismatch", message, false))
            .await;
        return None;
    }
    let declaration = PeerDeclaration::from_hello(&hello, HUB_EXTENSIONS);
    let conn = Arc::new(Connection::new(
        hub.next_connection_id(),
        PeerKind::Driver,
        sink.clone(),
        declaration,
        peer_pid,
        inst.config.max_inflight,
    ));
    if let Err(existing) = inst.claim(&conn) {
        warn!(
            instance = %inst.config.id,
            live = existing.id,
            live_pid = ?existing.peer_pid,
            new_pid = ?peer_pid,
            "a second driver said hello while one is connected; refused"
        );
        let message = format!("{} already has a connected driver", inst.config.id);
        let _ = sink
            .send(&Frame::error(Some(hello.request_id), "already_connected", message, true))
            .await;
        return None;
    }
    if !hello.extensions.is_empty() {
        let ack = Frame::HelloAck(HelloAck {
            request_id: hello.request_id.clone(),
            extensions: declaration.extensions.names(),
            hub: HUB_NAME.to_owned(),
        });
        let _ = sink.send(&ack).await;
    }
    info!(
        instance = %inst.config.id,
        conn = conn.id,
        pid = ?peer_pid,
        capabilities = ?hello.capabilities.enabled(),
        actions = ?hello.actions.enabled(),
        extensions = ?declaration.extensions.names(),
        "driver connected"
    );
    inst.set_health(Health::new(HealthState::Ready, Some("driver connected".into())));
    crate::delivery::driver_connected(hub, inst, &conn);
    Some(conn)
}

/// Reads a driver's frames until it leaves or the hub closes connections.
async fn frame_loop(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    reader: &mut FrameReader<OwnedReadHalf>,
    mut first: Option<Frame>,
) {
    loop {
        let item = match first.take() {
            Some(frame) => Ok(Some(Ok(frame))),
            None => tokio::select! {
                biased;
                () = hub.close_connections.cancelled() => {
                    let stop = Frame::Stop(Lifecycle { request_id: hub.request_id("stop") });
                    let _ = conn.sink.send(&stop).await;
                    return;
                }
                item = reader.next() => item,
                () = conn.sink.closed() => return,
            },
        };
        let frame = match item {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(err))) => {
                conn.touch();
                inst.record_error(format!("bad line from driver: {err}"));
                answer_decode_error(&conn.sink, &err);
                continue;
            }
            Ok(None) => return,
            Err(err) => {
                debug!(instance = %inst.config.id, error = %err, "read failed");
                return;
            }
        };
        conn.touch();
        match frame {
            Frame::Start(_) => debug!(instance = %inst.config.id, "driver started"),
            Frame::Stop(_) => {
                info!(instance = %inst.config.id, conn = conn.id, "driver said stop");
                return;
            }
            Frame::Inbound(inbound) => crate::delivery::on_inbound(hub, inst, conn, inbound).await,
            Frame::InboundEvent(event) => {
                crate::delivery::on_inbound_event(hub, inst, conn, event).await
            }
            Frame::Receipt(receipt) => crate::delivery::on_receipt(hub, inst, conn, receipt),
            Frame::CommandResult(result) => {
                let request_id = result.request_id.clone();
                if !conn.complete_command(result) {
                    debug!(%request_id, "command_result nobody waits for");
                }
            }
            Frame::Health(report) => inst.set_health(report.health),
            Frame::HealthResponse(response) => {
                conn.complete_health(&response.request_id, response.health)
            }
            Frame::HealthRequest(request) => {
                let health = Health::new(HealthState::Ready, None);
                let answer = Frame::HealthResponse(channeld_protocol::frame::HealthResponse {
                    request_id: request.request_id,
                    health,
                });
                let _ = conn.sink.try_send(&answer);
            }
            Frame::Event(_) => {}
            Frame::Error(err) => crate::delivery::on_error(hub, inst, conn, err),
            Frame::Hello(hello) => {
                let answer = Frame::error(
                    Some(hello.request_id),
                    "unexpected_frame",
                    "hello was already received",
                    false,
                );
                let _ = conn.sink.try_send(&answer);
            }
            other => {
                let kind = other.type_name();
                let answer = Frame::error(
                    None,
                    "unexpected_frame",
                    format!("the hub does not accept {kind} frames from a driver"),
                    false,
                );
                let _ = conn.sink.try_send(&answer);
            }
        }
    }
}

/// A tool on the instance socket: `control_request` frames, answered as the reference does,
/// with results when `control_result` was negotiated.
async fn controller_loop(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    hello: ControlHello,
    sink: &FrameSink,
    reader: &mut FrameReader<OwnedReadHalf>,
    peer_pid: Option<i32>,
) {
    if hello.channel != inst.config.id {
        let message = format!(
            "this socket serves {}, the control_hello names {}",
            inst.config.id, hello.channel
        );
        let _ = sink
            .send(&Frame::error(Some(hello.request_id), "channel_mismatch", message, false))
            .await;
        return;
    }
    let ext = HUB_EXTENSIONS.intersect(Extensions::from_names(&hello.extensions));
    if !hello.extensions.is_empty() {
        let ack = Frame::HelloAck(HelloAck {
            request_id: hello.request_id.clone(),
            extensions: ext.names(),
            hub: HUB_NAME.to_owned(),
        });
        let _ = sink.send(&ack).await;
    }
    debug!(instance = %inst.config.id, pid = ?peer_pid, "controller connected");
    loop {
        let item = tokio::select! {
            biased;
            () = hub.close_connections.cancelled() => return,
            item = reader.next() => item,
        };
        match item {
            Ok(Some(Ok(Frame::ControlRequest(request)))) => {
                let response = control_request(hub, inst, request, ext).await;
                if sink.send(&response).await.is_err() {
                    return;
                }
            }
            Ok(Some(Ok(Frame::HealthRequest(request)))) => {
                let health = hub.probe(inst).await;
                let answer = Frame::HealthResponse(channeld_protocol::frame::HealthResponse {
                    request_id: request.request_id,
                    health: strip_status(health, ext),
                });
                let _ = sink.send(&answer).await;
            }
            Ok(Some(Ok(Frame::Stop(_)))) | Ok(None) | Err(_) => return,
            Ok(Some(Ok(other))) => {
                let kind = other.type_name();
                let answer = Frame::error(
                    None,
                    "unexpected_frame",
                    format!("a controller may not send {kind} frames"),
                    false,
                );
                let _ = sink.try_send(&answer);
            }
            Ok(Some(Err(err))) => answer_decode_error(sink, &err),
        }
    }
}

fn strip_status(mut health: Health, ext: Extensions) -> Health {
    if !ext.health_status {
        health.status = None;
    }
    health
}

fn response(
    request_id: Id,
    outcome: Result<Option<ControlResult>, String>,
    ext: Extensions,
) -> Frame {
    let (accepted, error, result) = match outcome {
        Ok(result) => (true, None, result),
        Err(error) => (false, Some(error), None),
    };
    Frame::ControlResponse(ControlResponse {
        request_id,
        accepted,
        error,
        result: if ext.control_result { result } else { None },
    })
}

async fn control_request(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    request: ControlRequest,
    ext: Extensions,
) -> Frame {
    let request_id = request.request_id;
    let Some(conn) = inst.live() else {
        return response(
            request_id,
            Err(format!("driver for {} is not connected", inst.config.id)),
            ext,
        );
    };
    match request.action {
        ControlAction::Send { message } => {
            let wait = ext.control_result.then_some(hub.config.receipt_timeout);
            let outbound_id = hub.request_id("ctl");
            match hub.send_on(inst, &conn, outbound_id, message, wait).await {
                Ok(SendOutcome { receipt: Some(receipt), .. }) => {
                    response(request_id, Ok(Some(ControlResult::Receipt { receipt })), ext)
                }
                Ok(_) => response(request_id, Ok(None), ext),
                Err(SendError::Unknown { reason, .. }) if ext.control_result => {
                    Frame::ControlResponse(ControlResponse {
                        request_id,
                        accepted: true,
                        error: None,
                        result: Some(ControlResult::Unknown { reason }),
                    })
                }
                Err(err) => response(request_id, Err(err.to_string()), ext),
            }
        }
        ControlAction::Effect { target, effect } => {
            if target.channel != inst.config.id {
                return response(
                    request_id,
                    Err(format!("target channel {} does not match", target.channel)),
                    ext,
                );
            }
            match conn.declaration.effect_gate(&effect) {
                EffectGate::Send => {
                    let frame = Frame::Effect(EffectFrame {
                        request_id: hub.request_id("fx"),
                        target,
                        effect,
                    });
                    match conn.sink.send(&frame).await {
                        Ok(()) => response(request_id, Ok(None), ext),
                        Err(err) => response(request_id, Err(err.to_string()), ext),
                    }
                }
                EffectGate::Drop => response(
                    request_id,
                    Err(format!("action {} not declared by driver", effect.action())),
                    ext,
                ),
                EffectGate::Reject(reason) => response(request_id, Err(reason), ext),
            }
        }
        ControlAction::Command { session, command_id, command, target } => {
            if let Err(refusal) = conn.declaration.command_gate(&command) {
                return response(request_id, Err(refusal.to_string()), ext);
            }
            let timeout = hub.config.command_timeout;
            if ext.control_result {
                match hub.command(&conn, session, command_id, command, target, timeout).await {
                    Ok(answer) => {
                        let answer = crate::delivery::vet_answer(inst, &conn, answer);
                        response(
                            request_id,
                            Ok(Some(ControlResult::CommandResult { result: answer.result })),
                            ext,
                        )
                    }
                    Err(err) => response(request_id, Err(err.to_string()), ext),
                }
            } else {
                // A reference controller gets its answer once the command is forwarded; the
                // result is awaited (and its absence logged) in the background.
                let hub = hub.clone();
                tokio::spawn(async move {
                    if let Err(err) =
                        hub.command(&conn, session, command_id, command, target, timeout).await
                    {
                        debug!(error = %err, "controller command ended without an answer");
                    }
                });
                response(request_id, Ok(None), ext)
            }
        }
    }
}

/// Counts a receipt and completes its wait.
pub(crate) fn receipt_counted(
    inst: &Instance,
    conn: &Connection,
    request_id: &Id,
    outcome: ReceiptOutcome,
) -> bool {
    if matches!(outcome, ReceiptOutcome::Receipted(_)) {
        Counters::bump(&inst.counters.receipts);
    }
    conn.complete_receipt(request_id, outcome)
}
