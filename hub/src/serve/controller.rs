//! A controller connection on an instance socket (`control_hello`, the reference's tool
//! protocol): `control_request` frames (send, effect, command) answered as the reference
//! does, with results when `control_result` was negotiated, and health probes.

use std::sync::Arc;

use channeld_link::{FrameReader, FrameSink, SocketFirst, Turn};
use channeld_protocol::ext::{EffectGate, Extensions};
use channeld_protocol::frame::{
    ControlHello, ControlRequest, ControlResponse, ControlResult, EffectFrame, HelloAck,
};
use channeld_protocol::types::{ControlAction, Health};
use channeld_protocol::{Frame, Id};
use tokio::io::AsyncRead;
use tracing::debug;

use super::{answer_decode_error, closing};
use crate::command::{self, Presented};
use crate::hub::{HUB_EXTENSIONS, HUB_NAME, Hub};
use crate::instance::Instance;
use crate::send::{self, SendError, SendOutcome};

/// Serves a connection that said `control_hello`, until it leaves or the hub closes
/// connections. Requests are answered one at a time, in order.
pub(super) async fn run<R: AsyncRead + Unpin>(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    hello: ControlHello,
    sink: &FrameSink,
    reader: &mut FrameReader<R>,
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
    // Made once per connection, not per request (a fresh one registers its waiters again),
    // and polled when no request is here, or ahead of the socket every
    // `FRAMES_BETWEEN_CHECKS` requests (`SocketFirst`).
    let closing = closing(hub, inst);
    tokio::pin!(closing);
    let mut turns = SocketFirst::default();
    loop {
        let item = match turns.next(reader.next(), closing.as_mut()).await {
            Turn::Frame(item) => item,
            Turn::Other(()) => return,
        };
        match item {
            Ok(Some(Ok(Frame::ControlRequest(request)))) => {
                let response = control_request(hub, inst, request, ext).await;
                if sink.send(&response).await.is_err() {
                    return;
                }
            }
            Ok(Some(Ok(Frame::HealthRequest(request)))) => {
                let health = crate::health::probe(hub, inst).await;
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

/// `health.status` only for a controller that negotiated `health_status`.
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
            let outbound_id = hub.ids.request("ctl");
            match send::send_on(inst, &conn, outbound_id, message, wait).await {
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
                        request_id: hub.ids.request("fx"),
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
            let presented = Presented {
                request_id: hub.ids.request("cmd"),
                session,
                command_id,
                command,
                target,
            };
            if ext.control_result {
                match command::present(&conn, presented, timeout, &inst.metrics).await {
                    Ok(answer) => {
                        let responder = conn.declaration.extensions.responder;
                        let allow = &inst.policy().allow;
                        let answer = command::vet_answer(&inst.config.id, allow, responder, answer);
                        let result = ControlResult::CommandResult { result: answer.result };
                        response(request_id, Ok(Some(result)), ext)
                    }
                    Err(err) => response(request_id, Err(err.to_string()), ext),
                }
            } else {
                // A reference controller gets its answer once the command is forwarded; the
                // result is awaited (and its absence logged) in the background.
                let metrics = inst.metrics.clone();
                hub.tasks.spawn(async move {
                    if let Err(err) = command::present(&conn, presented, timeout, &metrics).await {
                        debug!(error = %err, "controller command ended without an answer");
                    }
                });
                response(request_id, Ok(None), ext)
            }
        }
    }
}
