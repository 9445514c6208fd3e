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
    Op, OutboxEntry, OutboxResult, Request, Response, SendResult, StatusResult,
};
use crate::hub::{HUB_NAME, Hub, SendError, SendOutcome};
use crate::instance::unix_ms;
use crate::ledger::{LedgerError, OutboxRecord, OutboxState};
use crate::outbox::SendRequest;

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
                LineEvent::Line(line) => parse_request(line).map_err(|err| {
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
                        // Boxed: the spawned task then holds a pointer, not the whole state
                        // machine, which spawning would otherwise copy several times.
                        let response = Box::pin(handle(&hub, request)).await;
                        let _ = sink.send_encoded(response).await;
                    });
                }
                Err((id, message)) => {
                    let response = failure(id, "invalid_request", message, None);
                    let _ = sink.send_encoded(response).await;
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

/// `{"id":N,"ok":true,"result":...}` written straight from the result, no `Value` tree.
fn success(id: u64, result: impl Serialize) -> Vec<u8> {
    let mut line = Vec::with_capacity(512);
    line.extend_from_slice(b"{\"id\":");
    line.extend_from_slice(id.to_string().as_bytes());
    line.extend_from_slice(b",\"ok\":true,\"result\":");
    match serde_json::to_writer(&mut line, &result) {
        Ok(()) => {
            line.extend_from_slice(b"}\n");
            line
        }
        Err(err) => failure(id, "internal", err.to_string(), None),
    }
}

fn failure(id: u64, code: &str, message: String, request_id: Option<String>) -> Vec<u8> {
    encode(&Response {
        id,
        ok: false,
        result: None,
        error: Some(ErrorBody { code: code.to_owned(), message, request_id }),
    })
}

/// The common request, `send`, parsed straight into its fields; everything else (and any
/// `send` this refuses) through [`Request`], whose flattened, tagged layout buffers every
/// field first.
fn parse_request(line: &[u8]) -> Result<Request, serde_json::Error> {
    #[derive(serde::Deserialize)]
    enum SendTag {
        #[serde(rename = "send")]
        Send,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct SendLine {
        id: u64,
        #[allow(dead_code)]
        op: SendTag,
        instance: String,
        conversation: String,
        #[serde(default)]
        thread: Option<String>,
        text: String,
        #[serde(default)]
        metadata: std::collections::BTreeMap<String, String>,
        #[serde(default = "yes")]
        wait: bool,
        #[serde(default)]
        timeout_ms: Option<u64>,
        #[serde(default)]
        idempotency_key: Option<String>,
    }
    fn yes() -> bool {
        true
    }
    if let Ok(send) = serde_json::from_slice::<SendLine>(line) {
        return Ok(Request {
            id: send.id,
            op: Op::Send {
                instance: send.instance,
                conversation: send.conversation,
                thread: send.thread,
                text: send.text,
                metadata: send.metadata,
                wait: send.wait,
                timeout_ms: send.timeout_ms,
                idempotency_key: send.idempotency_key,
            },
        });
    }
    serde_json::from_slice::<Request>(line)
}

async fn handle(hub: &Arc<Hub>, request: Request) -> Vec<u8> {
    let id = request.id;
    match request.op {
        Op::Send {
            instance,
            conversation,
            thread,
            text,
            metadata,
            wait,
            timeout_ms,
            idempotency_key,
        } => {
            let message = match outbound(&instance, &conversation, thread, text, metadata) {
                Ok(message) => message,
                Err(message) => return failure(id, "invalid_request", message, None),
            };
            if let Some(key) = &idempotency_key
                && (key.is_empty() || key.len() > 256)
            {
                return failure(
                    id,
                    "invalid_request",
                    "idempotency_key must be 1-256 bytes".into(),
                    None,
                );
            }
            let timeout = timeout_ms.map_or(hub.config.receipt_timeout, Duration::from_millis);
            let request = SendRequest {
                instance: instance.clone(),
                message,
                wait: wait.then_some(timeout),
                idempotency_key,
            };
            match hub.submit(request).await {
                Ok(SendOutcome { request_id, outbox_id, state, receipt }) => success(
                    id,
                    SendResult {
                        request_id: request_id.into_string(),
                        state: state.as_str().into(),
                        receipt,
                        outbox_id,
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
        Op::Outbox { instance, state, limit } => {
            let state = match state.as_deref().map(|s| OutboxState::parse(s).ok_or(s)) {
                None => None,
                Some(Ok(state)) => Some(state),
                Some(Err(bad)) => {
                    return failure(
                        id,
                        "invalid_request",
                        format!("unknown state {bad:?} (queued, sent, receipted, failed, unknown)"),
                        None,
                    );
                }
            };
            match hub.ledger.outbox_list(instance, state, limit.unwrap_or(100).min(10_000)).await {
                Ok(records) => success(
                    id,
                    OutboxResult { records: records.iter().map(|r| entry(hub, r)).collect() },
                ),
                Err(err) => failure(id, ledger_code(&err), err.to_string(), None),
            }
        }
        Op::OutboxRetry { id: record } => match hub.retry_send(record).await {
            Ok(record) => success(id, entry(hub, &record)),
            Err(SendError::Ledger(LedgerError::NoSuchRecord(_))) => {
                failure(id, "not_found", format!("no outbox record {record}"), None)
            }
            Err(err @ SendError::Ledger(LedgerError::NotRetryable { .. })) => {
                failure(id, "not_retryable", err.to_string(), None)
            }
            Err(err) => failure(id, err.code(), err.to_string(), None),
        },
    }
}

fn ledger_code(err: &LedgerError) -> &'static str {
    match err {
        LedgerError::Off => "ledger_off",
        _ => "ledger_unavailable",
    }
}

fn entry(hub: &Hub, record: &OutboxRecord) -> OutboxEntry {
    let message: Option<OutboundMessage> = serde_json::from_slice(&record.message).ok();
    OutboxEntry {
        id: record.id,
        request_id: hub.ledger.outbox_request_id(record.id),
        instance: record.instance.clone(),
        state: record.state.as_str().to_owned(),
        idempotency_key: record.idempotency_key.clone(),
        conversation: message
            .as_ref()
            .map(|m| m.target.conversation.to_string())
            .unwrap_or_default(),
        text: message.as_ref().map(|m| m.body.text_str().to_owned()).unwrap_or_default(),
        receipt: record.receipt.as_ref().and_then(|r| serde_json::from_slice(r).ok()),
        error: record.error.clone(),
        attempts: record.attempts,
        created_ms: record.created_ms,
        updated_ms: record.updated_ms,
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
