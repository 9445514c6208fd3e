//! Serves the control socket: checks each connecting process's credentials, holds at most
//! [`MAX_CONNECTIONS`] connections, and on each runs requests concurrently (bounded) with
//! each response going back as soon as it is ready, matched by `id`.

use std::sync::Arc;
use std::time::Duration;

use channeld_control::{ErrorBody, MAX_CONTROL_LINE, Op, Request, Response, SendArgs, code};
use channeld_link::{FrameWrite, quiet, spawn_writer};
use channeld_protocol::framing::{LineEvent, LineFramer};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::UnixListener;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::hub::Hub;
use crate::liveness::Responder;
use crate::peer::{PeerPolicy, describe_peer, peer_creds};

/// Control connections served at once; one more is answered `too_many_connections` and
/// closed (the client retries), so a flood of clients cannot exhaust the hub.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a new control connection may take to send its first request line before it is
/// closed (so idle connections cannot hold every slot).
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Requests one control connection may have in flight; reading waits beyond this.
const MAX_CONCURRENT_REQUESTS: usize = 1024;

/// Responses queued per connection before the requests producing them wait.
const RESPONSE_QUEUE: usize = 1024;

/// How long a closing connection may take to write what is queued.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Accepts control connections until shutdown, one tracked task each. Answers the
/// watchdog's liveness probe between accepts.
pub(crate) async fn accept_loop(hub: Arc<Hub>, listener: UnixListener, mut liveness: Responder) {
    let policy =
        PeerPolicy::for_socket(hub.config.control_peers.clone(), &hub.config.control_socket);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        tokio::select! {
            () = hub.shutdown.cancelled() => break,
            () = liveness.answer() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let creds = peer_creds(&stream);
                    let (read, write) = match quiet::split(stream) {
                        Ok(halves) => halves,
                        Err(err) => {
                            warn!(error = %err, "could not watch a new control connection");
                            continue;
                        }
                    };
                    if !creds.as_ref().is_some_and(|cred| policy.admits(cred)) {
                        let who = describe_peer(creds.as_ref());
                        warn!(
                            uid = creds.as_ref().map(|c| c.uid),
                            gid = creds.as_ref().map(|c| c.gid),
                            pid = creds.as_ref().and_then(|c| c.pid),
                            allowed = %policy.describe(),
                            "control connection refused: peer not allowed"
                        );
                        let message = format!("{who} may not use the control socket of this hub");
                        hub.connections.spawn(refuse(write, code::PEER_NOT_ALLOWED, message));
                        continue;
                    }
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        warn!(limit = MAX_CONNECTIONS, "control connection refused: too many connections");
                        let message = format!(
                            "the hub serves {MAX_CONNECTIONS} control connections already; try again"
                        );
                        hub.connections.spawn(refuse(write, code::TOO_MANY_CONNECTIONS, message));
                        continue;
                    };
                    let hub = hub.clone();
                    hub.clone().connections.spawn(async move {
                        let _slot = slot;
                        serve(hub, read, write).await;
                    });
                }
                Err(err) => {
                    warn!(error = %err, "control accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Answers a connection the hub will not serve with one error (`id` 0) and closes it.
async fn refuse<W>(write: W, error_code: &'static str, message: String)
where
    W: FrameWrite,
{
    let (sink, writer) = spawn_writer(write, 1);
    let _ = sink.send_encoded(failure(0, error_code, message, None)).await;
    drop(sink);
    let _ = writer.close_within(CLOSE_GRACE).await;
}

/// Serves one admitted control connection until the client leaves or the hub closes
/// connections; works over any reader and writer.
pub async fn serve<R, W>(hub: Arc<Hub>, mut read: R, write: W)
where
    R: AsyncRead + Unpin,
    W: FrameWrite,
{
    let _open = hub.metrics.connection(crate::metrics::ConnectionKind::Control);
    let (sink, writer) = spawn_writer(write, RESPONSE_QUEUE);
    let limit = Arc::new(Semaphore::new(MAX_CONCURRENT_REQUESTS));
    let mut framer = LineFramer::new(MAX_CONTROL_LINE);
    let requests = TaskTracker::new();
    let mut eof = false;
    // A connection that sends nothing must not hold one of the MAX_CONNECTIONS slots.
    let first_request_by = tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT;
    let mut heard = false;
    'read: loop {
        while let Some(event) = framer.next_line() {
            heard = true;
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
                    // One box for the whole request: tokio copies a task's future when it
                    // spawns it and when it finishes, so the task holds a pointer, and the
                    // request's state (mostly `handle`'s) is copied once, into the box.
                    requests.spawn(Box::pin(async move {
                        let _permit = permit;
                        let response = super::handle::handle(&hub, request).await;
                        let _ = sink.send_encoded(response).await;
                    }));
                }
                Err((id, message)) => {
                    let response = failure(id, code::INVALID_REQUEST, message, None);
                    let _ = sink.send_encoded(response).await;
                }
            }
        }
        if eof {
            break;
        }
        tokio::select! {
            () = hub.close_connections.cancelled() => break,
            () = tokio::time::sleep_until(first_request_by), if !heard => {
                debug!(timeout_s = FIRST_REQUEST_TIMEOUT.as_secs(), "control connection sent no request in time; closed");
                break;
            }
            read = read.read_buf(framer.buffer_for_read()) => match read {
                // A last request that the end of input cut off before its newline is still
                // a request: end it, answer it, then stop reading.
                Ok(0) => {
                    eof = true;
                    framer.extend(b"\n");
                }
                Err(_) => break,
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
    let _ = writer.close_within(CLOSE_GRACE).await;
}

fn encode(response: &Response) -> Vec<u8> {
    let mut line = serde_json::to_vec(response).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    line
}

/// `{"id":N,"ok":true,"result":...}` written straight from the result, no `Value` tree.
pub(super) fn success(id: u64, result: impl Serialize) -> Vec<u8> {
    let mut line = Vec::with_capacity(512);
    line.extend_from_slice(b"{\"id\":");
    line.extend_from_slice(id.to_string().as_bytes());
    line.extend_from_slice(b",\"ok\":true,\"result\":");
    match serde_json::to_writer(&mut line, &result) {
        // A client cannot read a longer line: answer what happened instead.
        Ok(()) if line.len() + 2 > MAX_CONTROL_LINE => {
            let message = format!(
                "the answer would be {} bytes, over the {MAX_CONTROL_LINE}-byte line limit",
                line.len() + 2
            );
            failure(id, code::ANSWER_TOO_LARGE, message, None)
        }
        Ok(()) => {
            line.extend_from_slice(b"}\n");
            line
        }
        Err(err) => failure(id, code::INTERNAL, err.to_string(), None),
    }
}

pub(super) fn failure(id: u64, code: &str, message: String, request_id: Option<String>) -> Vec<u8> {
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
        let args = SendArgs {
            instance: send.instance,
            conversation: send.conversation,
            thread: send.thread,
            text: send.text,
            metadata: send.metadata,
            wait: send.wait,
            timeout_ms: send.timeout_ms,
            idempotency_key: send.idempotency_key,
        };
        return Ok(Request { id: send.id, op: Op::Send(args) });
    }
    serde_json::from_slice::<Request>(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A JSON value for one request field: mostly the right type, sometimes not.
    fn field_value() -> impl Strategy<Value = serde_json::Value> {
        prop_oneof![
            "\\PC{0,12}".prop_map(serde_json::Value::from),
            any::<u32>().prop_map(serde_json::Value::from),
            any::<bool>().prop_map(serde_json::Value::from),
            Just(serde_json::Value::Null),
            Just(serde_json::json!({"k": "v"})),
            Just(serde_json::json!(-1)),
        ]
    }

    fn request_line() -> impl Strategy<Value = Vec<u8>> {
        let key = prop::sample::select(vec![
            "id",
            "op",
            "instance",
            "conversation",
            "thread",
            "text",
            "metadata",
            "wait",
            "timeout_ms",
            "idempotency_key",
            "outbox_id",
            "limit",
            "extra",
        ]);
        let op = prop::sample::select(vec!["send", "health", "status", "outbox_retry", "x"]);
        (op, any::<u32>(), prop::collection::vec((key, field_value()), 0..8)).prop_map(
            |(op, id, fields)| {
                let mut object = serde_json::Map::new();
                object.insert("id".into(), id.into());
                object.insert("op".into(), op.into());
                for (key, value) in fields {
                    object.insert(key.into(), value);
                }
                serde_json::to_vec(&object).unwrap()
            },
        )
    }

    proptest! {
        /// The control protocol parser: its fast `send` path and the general `Request` parse
        /// accept the same lines and read them the same way; nothing panics on any bytes.
        #[test]
        fn fuzz_the_send_fast_path_agrees_with_the_general_parse(line in request_line()) {
            let general = serde_json::from_slice::<Request>(&line).ok();
            prop_assert_eq!(parse_request(&line).ok(), general);
        }

        #[test]
        fn fuzz_any_bytes_are_parsed_or_refused(line in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_request(&line);
        }
    }
}
