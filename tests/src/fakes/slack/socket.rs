//! The Socket Mode side of the fake: single-use tickets, `hello`, envelopes handed to one live
//! socket at a time, acknowledgements matched per socket, redelivery of unacknowledged
//! `events_api` envelopes with a new envelope id and `retry_attempt + 1`, `disconnect`
//! frames, abrupt closes and a silent (half-open) mode.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State as AxumState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Shared;
use super::state::{
    AckRecord, EnvelopeRecord, SocketCommand, SocketEnd, SocketHandle, SocketRecord,
};

/// Commands one socket task may have queued before the handle waits.
const SOCKET_COMMANDS: usize = 4096;

/// `GET /link/?ticket=…`: upgrades when the ticket was issued and not used yet.
pub(crate) async fn link(
    AxumState(shared): AxumState<Arc<Shared>>,
    Query(query): Query<HashMap<String, String>>,
    upgrade: WebSocketUpgrade,
) -> Response {
    let ticket = query.get("ticket").cloned().unwrap_or_default();
    let id = {
        let mut state = shared.lock();
        match state.tickets.get_mut(&ticket) {
            Some(used @ false) => *used = true,
            // A used or unknown ticket: Slack's URLs are single-use.
            _ => return (StatusCode::UNAUTHORIZED, "invalid or used ticket").into_response(),
        }
        state.next_socket += 1;
        let id = state.next_socket;
        state.record.sockets.push(SocketRecord {
            id,
            ticket: ticket.clone(),
            opened_at: Instant::now(),
            hello_at: None,
            disconnects: Vec::new(),
            silent: false,
            closed_at: None,
            end: None,
            pings: 0,
            unexpected: Vec::new(),
        });
        id
    };
    shared.changed();
    upgrade.on_upgrade(move |socket| serve(shared, id, socket))
}

/// One socket: hello (or an immediate disconnect), then envelopes out and acks in.
async fn serve(shared: Arc<Shared>, id: u64, mut socket: WebSocket) {
    let (tx, mut commands) = mpsc::channel(SOCKET_COMMANDS);
    let refusal = {
        let mut state = shared.lock();
        let open = state.record.sockets.iter().filter(|s| s.is_live()).count();
        if state.link_disabled {
            Some("link_disabled")
        } else if open >= shared.options.max_sockets {
            Some("too_many_websockets")
        } else {
            state.live.push(SocketHandle { id, commands: tx.clone() });
            None
        }
    };
    if let Some(reason) = refusal {
        let _ = socket.send(Message::Text(disconnect_frame(reason).into())).await;
        let _ = socket.send(Message::Close(None)).await;
        shared.update(|state| {
            if let Some(record) = state.socket_mut(id) {
                record.disconnects.push(reason.to_owned());
                record.closed_at = Some(Instant::now());
                record.end = Some(SocketEnd::ByServer);
            }
        });
        return;
    }
    let num_connections = shared.lock().live.len();
    let hello = json!({
        "type": "hello",
        "num_connections": num_connections,
        "debug_info": {
            "host": format!("applink-fake-{id}"),
            "build_number": 1,
            "approximate_connection_time": shared.options.approximate_connection_time_secs,
        },
        "connection_info": { "app_id": shared.options.app_id },
    });
    // Recorded first: a client that saw hello must find the socket live in the record.
    shared.update(|state| {
        if let Some(record) = state.socket_mut(id) {
            record.hello_at = Some(Instant::now());
        }
    });
    if socket.send(Message::Text(hello.to_string().into())).await.is_err() {
        finish(&shared, id, SocketEnd::ByClient);
        return;
    }
    shared.dispatch();

    let mut ping = shared.options.ping_interval.map(tokio::time::interval);
    let mut close_at: Option<tokio::time::Instant> = None;
    let end = loop {
        let ping_tick = async {
            match ping.as_mut() {
                Some(interval) => interval.tick().await,
                None => std::future::pending().await,
            }
        };
        let close_due = async {
            match close_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shared.shutdown.cancelled() => break SocketEnd::ByServer,
            () = close_due => {
                let _ = socket.send(Message::Close(None)).await;
                break SocketEnd::ByServer;
            }
            _ = ping_tick => {
                if socket.send(Message::Ping(Vec::new().into())).await.is_err() {
                    break SocketEnd::ByClient;
                }
            }
            command = commands.recv() => match command {
                Some(SocketCommand::Send(text)) => {
                    if socket.send(Message::Text(text.into())).await.is_err() {
                        break SocketEnd::ByClient;
                    }
                }
                Some(SocketCommand::Disconnect { reason, close_after }) => {
                    shared.update(|state| {
                        if let Some(record) = state.socket_mut(id) {
                            record.disconnects.push(reason.clone());
                        }
                    });
                    if socket.send(Message::Text(disconnect_frame(&reason).into())).await.is_err() {
                        break SocketEnd::ByClient;
                    }
                    if let Some(after) = close_after {
                        close_at = Some(tokio::time::Instant::now() + after);
                    }
                }
                Some(SocketCommand::Abrupt) => break SocketEnd::Abrupt,
                Some(SocketCommand::Close) | None => {
                    let _ = socket.send(Message::Close(None)).await;
                    break SocketEnd::ByServer;
                }
                Some(SocketCommand::Silent) => {
                    shared.update(|state| {
                        if let Some(record) = state.socket_mut(id) {
                            record.silent = true;
                        }
                    });
                    // Half-open: nothing is read (so no pong) and nothing is written until
                    // the fake shuts down; the client must notice by itself.
                    shared.shutdown.cancelled().await;
                    return;
                }
            },
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Text(text))) => on_text(&shared, id, text.as_str()),
                Some(Ok(Message::Ping(_))) => shared.update(|state| {
                    if let Some(record) = state.socket_mut(id) {
                        record.pings += 1;
                    }
                }),
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break SocketEnd::ByClient,
                Some(Ok(Message::Pong(_) | Message::Binary(_))) => {}
            },
        }
    };
    finish(&shared, id, end);
}

fn finish(shared: &Shared, id: u64, end: SocketEnd) {
    shared.update(|state| {
        state.live.retain(|handle| handle.id != id);
        if let Some(record) = state.socket_mut(id) {
            record.closed_at.get_or_insert_with(Instant::now);
            record.end.get_or_insert(end);
        }
    });
    // Envelopes that were waiting for a first socket may go to another one now.
    shared.dispatch();
}

fn disconnect_frame(reason: &str) -> String {
    json!({"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake"}})
        .to_string()
}

/// A text frame from the client: an acknowledgement `{"envelope_id": …, "payload"?: …}`.
fn on_text(shared: &Shared, socket: u64, text: &str) {
    let parsed: Option<Value> = serde_json::from_str(text).ok();
    let envelope_id = parsed
        .as_ref()
        .and_then(|frame| frame.get("envelope_id"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    shared.update(|state| {
        let Some(envelope_id) = envelope_id else {
            if let Some(record) = state.socket_mut(socket) {
                record.unexpected.push(text.to_owned());
            }
            return;
        };
        let now = Instant::now();
        let mut acked_event = None;
        let mut matched = false;
        if let Some(envelope) = state
            .record
            .envelopes
            .iter_mut()
            .find(|e| e.envelope_id == envelope_id && e.socket == socket)
        {
            matched = true;
            envelope.acks += 1;
            envelope.acked_at.get_or_insert(now);
            if envelope.ack_payload.is_none() {
                envelope.ack_payload = parsed.as_ref().and_then(|f| f.get("payload")).cloned();
            }
            acked_event = Some((envelope.event_id.clone(), envelope.envelope_id.clone()));
        }
        state.record.acks.push(AckRecord { socket, envelope_id, matched, at: now });
        // Any acknowledged delivery of an event settles it: no more redeliveries.
        if let Some((event_id, envelope_id)) = acked_event {
            state.outstanding.retain(|out| match (&event_id, &out.event_id) {
                (Some(acked), Some(pending)) => acked != pending,
                _ => out.envelope_id.as_deref() != Some(envelope_id.as_str()),
            });
        }
    });
}

/// Sends every outstanding envelope that is due: first deliveries when a live socket exists,
/// redeliveries of unacknowledged `events_api` envelopes after the retry interval (up to the
/// retry limit, then Slack gives up on the event).
pub(crate) fn dispatch(shared: &Shared) {
    let now = Instant::now();
    let options = &shared.options;
    let mut state = shared.lock();
    let mut index = 0;
    while index < state.outstanding.len() {
        let out = &state.outstanding[index];
        // Never sent yet (a new event, or one redelivered on request) goes out now.
        let unsent = out.due.is_none();
        let due = out.due.is_some_and(|due| due <= now);
        if !unsent && !due {
            index += 1;
            continue;
        }
        if !unsent && (out.kind != "events_api" || out.attempts > options.max_retries) {
            // Interactive envelopes are not redelivered; events give up after the last retry.
            state.outstanding.remove(index);
            continue;
        }
        let Some((socket, commands)) = state.pick_socket() else {
            break;
        };
        let envelope_id = state.next_envelope_id();
        let out = &mut state.outstanding[index];
        let retry_attempt = out.attempts;
        let mut frame = json!({
            "envelope_id": envelope_id,
            "payload": out.payload,
            "type": out.kind,
            "accepts_response_payload": false,
        });
        if out.kind == "events_api" {
            frame["retry_attempt"] = json!(retry_attempt);
            frame["retry_reason"] = json!(if retry_attempt == 0 { "" } else { "timeout" });
        }
        if commands.try_send(SocketCommand::Send(frame.to_string())).is_err() {
            break;
        }
        out.attempts += 1;
        out.envelope_id = Some(envelope_id.clone());
        out.socket = Some(socket);
        out.due = Some(now + options.redeliver_after);
        let record = EnvelopeRecord {
            envelope_id,
            kind: out.kind.to_owned(),
            event_id: out.event_id.clone(),
            retry_attempt,
            socket,
            sent_at: now,
            acked_at: None,
            acks: 0,
            ack_payload: None,
        };
        state.record.envelopes.push(record);
        index += 1;
    }
    drop(state);
    shared.changed();
}
