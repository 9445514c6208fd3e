//! Serves the control socket: requests run concurrently (bounded per connection) and each
//! response goes back as soon as it is ready, matched by `id`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use channeld_link::spawn_writer;
use channeld_protocol::framing::{LineEvent, LineFramer};
use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{ChannelId, Id};
use serde::Serialize;
use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::proto::{
    CatalogResult, CountersView, ErrorBody, Family, HealthResult, InstanceStatus, MAX_CONTROL_LINE,
    Op, Request, Response, SendResult, StatusResult,
};
use crate::hub::{HUB_NAME, Hub, SendError, SendOutcome};
use crate::instance::unix_ms;

/// Requests one control connection may have in flight.
const MAX_CONCURRENT_REQUESTS: usize = 1024;

pub(crate) async fn accept_loop(hub: Arc<Hub>, listener: UnixListener, tasks: TaskTracker) {
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tasks.spawn(serve(hub.clone(), stream));
                }
                Err(err) => {
                    warn!(error = %err, "control accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

async fn serve(hub: Arc<Hub>, stream: UnixStream) {
    let (mut read, write) = stream.into_split();
    let (sink, writer) = spawn_writer(write, 1024);
    let limit = Arc::new(Semaphore::new(MAX_CONCURRENT_REQUESTS));
    let mut framer = LineFramer::new(MAX_CONTROL_LINE);
    let requests = TaskTracker::new();
    'read: loop {
        while let Some(event) = framer.next_line() {
            let parsed = match event {
                LineEvent::Line(line) if line.iter().all(u8::is_ascii_whitespace) => continue,
                LineEvent::Line(line) => serde_json::from_slice::<Request>(line).map_err(|err| {
                    let id = serde_json::from_slice::<serde_json::Value>(line)
                        .ok()
                        .and_then(|v| v.get("id").and_then(serde_json::Value::as_u64))
                        .unwrap_or(0);
                    (id, err.to_string())
                }),
                LineEvent::TooLong => Err((0, format!("request exceeds {MAX_CONTROL_LINE} bytes"))),
            };
            match parsed {
                Ok(request) => {
                    let Ok(permit) = limit.clone().acquire_owned().await else { break 'read };
                    let hub = hub.clone();
                    let sink = sink.clone();
                    requests.spawn(async move {
                        let _permit = permit;
                        let response = handle(&hub, request).await;
                        let _ = sink.send_encoded(encode(&response)).await;
                    });
                }
                Err((id, message)) => {
                    let response = failure(id, "invalid_request", message, None);
                    let _ = sink.send_encoded(encode(&response)).await;
                }
            }
        }
        tokio::select! {
            () = hub.close_connections.cancelled() => break,
            read = read.read_buf(framer.buffer_for_read()) => match read {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            },
        }
    }
    requests.close();
    tokio::select! {
        () = requests.wait() => {}
        () = hub.close_connections.cancelled() => {}
    }
    drop(sink);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer.close()).await;
}

fn encode(response: &Response) -> Vec<u8> {
    let mut line = serde_json::to_vec(response).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    line
}

fn success(id: u64, result: impl Serialize) -> Response {
    Response { id, ok: true, result: serde_json::to_value(result).ok(), error: None }
}

fn failure(id: u64, code: &str, message: String, request_id: Option<String>) -> Response {
    Response {
        id,
        ok: false,
        result: None,
        error: Some(ErrorBody { code: code.to_owned(), message, request_id }),
    }
}

async fn handle(hub: &Arc<Hub>, request: Request) -> Response {
    let id = request.id;
    match request.op {
        Op::Send { instance, conversation, thread, text, metadata, wait, timeout_ms } => {
            let message = match outbound(&instance, &conversation, thread, text, metadata) {
                Ok(message) => message,
                Err(message) => return failure(id, "invalid_request", message, None),
            };
            let timeout = timeout_ms.map_or(hub.config.receipt_timeout, Duration::from_millis);
            match hub.send(&instance, message, wait.then_some(timeout)).await {
                Ok(SendOutcome::Receipted { request_id, receipt }) => success(
                    id,
                    SendResult {
                        request_id: request_id.into_string(),
                        state: "receipted".into(),
                        receipt: Some(receipt),
                    },
                ),
                Ok(SendOutcome::Handed { request_id }) => success(
                    id,
                    SendResult {
                        request_id: request_id.into_string(),
                        state: "handed".into(),
                        receipt: None,
                    },
                ),
                Err(err) => {
                    let request_id = match &err {
                        SendError::Failed { request_id, .. }
                        | SendError::Unknown { request_id, .. } => Some(request_id.to_string()),
                        _ => None,
                    };
                    debug!(%instance, code = err.code(), error = %err, "control send failed");
                    failure(id, err.code(), err.to_string(), request_id)
                }
            }
        }
        Op::Health { instance } => match hub.instance(&instance) {
            Some(inst) => {
                let health = hub.probe(inst).await;
                success(id, HealthResult { instance, health })
            }
            None => failure(id, "unknown_instance", format!("no instance named {instance}"), None),
        },
        Op::Status => success(id, status(hub)),
        Op::Catalog => success(id, catalog(std::env::current_exe().ok().as_deref())),
    }
}

fn outbound(
    instance: &str,
    conversation: &str,
    thread: Option<String>,
    text: String,
    metadata: std::collections::BTreeMap<String, String>,
) -> Result<OutboundMessage, String> {
    let channel = ChannelId::new(instance).map_err(|err| format!("instance: {err}"))?;
    let conversation = Id::new(conversation).map_err(|err| format!("conversation: {err}"))?;
    let thread = thread.map(Id::new).transpose().map_err(|err| format!("thread: {err}"))?;
    let body = MessageBody::text(text).map_err(|err| format!("text: {err}"))?;
    Ok(OutboundMessage {
        target: MessageTarget { channel, conversation, thread, reply_to: None },
        body,
        metadata,
    })
}

fn status(hub: &Hub) -> StatusResult {
    use std::sync::atomic::Ordering::Relaxed;
    let instances = hub
        .instances
        .values()
        .map(|inst| {
            let live = inst.live();
            let health = inst.health();
            let c = &inst.counters;
            let last_error = inst.last_error();
            InstanceStatus {
                instance: inst.config.id.to_string(),
                family: inst.config.id.family().to_owned(),
                socket: inst.config.socket.display().to_string(),
                runtime: inst.runtime.name.clone(),
                connected: live.is_some(),
                connected_since_ms: live.as_ref().map(|conn| unix_ms(conn.connected_at)),
                driver_pid: live.as_ref().and_then(|conn| conn.peer_pid),
                health: health.health,
                health_updated_ms: unix_ms(health.updated),
                in_flight: live.as_ref().map_or(0, |conn| conn.inflight_len()),
                counters: CountersView {
                    inbound: c.inbound.load(Relaxed),
                    denied: c.denied.load(Relaxed),
                    busy: c.busy.load(Relaxed),
                    replies: c.replies.load(Relaxed),
                    runs_failed: c.runs_failed.load(Relaxed),
                    outbound: c.outbound.load(Relaxed),
                    receipts: c.receipts.load(Relaxed),
                    errors: c.errors.load(Relaxed),
                },
                last_error_ms: last_error.as_ref().map(|(at, _)| unix_ms(*at)),
                last_error: last_error.map(|(_, message)| message),
            }
        })
        .collect();
    StatusResult {
        hub: HUB_NAME.to_owned(),
        pid: std::process::id(),
        started_ms: unix_ms(hub.started),
        instances,
    }
}

/// Driver families this build knows, and whether each binary sits next to `exe`.
pub fn catalog(exe: Option<&Path>) -> CatalogResult {
    const FAMILIES: &[(&str, &str)] = &[
        ("console", "terminal stdin/stdout"),
        ("mqtt", "MQTT 3.1.1 broker (rumqttc)"),
        ("amqp", "AMQP 0-9-1 broker (lapin)"),
        ("slack", "Slack Socket Mode WebSocket + Web API"),
        ("wechat", "WeChat iLink HTTP long-poll"),
        ("wecom", "WeCom AI Bot WebSocket"),
        ("nostr", "Nostr relays, NIP-04/NIP-17 DMs"),
    ];
    let dir: Option<PathBuf> = exe.and_then(Path::parent).map(Path::to_path_buf);
    let families = FAMILIES
        .iter()
        .map(|(family, transport)| {
            let binary = format!("channeld-{family}");
            let installed = dir.as_ref().is_some_and(|d| d.join(&binary).is_file());
            Family { family: (*family).into(), binary, transport: (*transport).into(), installed }
        })
        .collect();
    CatalogResult { families }
}
