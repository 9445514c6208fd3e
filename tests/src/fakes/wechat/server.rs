//! The fake iLink server's HTTP side: one axum fallback handler that parses every request,
//! records it, applies the operation's mode, holds `getupdates` open, and asks the
//! [`World`] for the answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::world::{Answer, Incoming, World};
use super::{FakeOptions, Mode};

/// Every path the fake serves starts with this.
const PREFIX: &str = "/ilink/bot/";

/// The world behind a lock, a change counter that wakes held polls and waiting tests, and
/// the server's shutdown signal.
#[derive(Debug)]
pub struct Shared {
    world: Mutex<World>,
    changed: watch::Sender<u64>,
    shutdown: CancellationToken,
}

impl Shared {
    pub fn new(options: FakeOptions, base_url: String) -> Self {
        Self {
            world: Mutex::new(World::new(options, base_url)),
            changed: watch::Sender::new(0),
            shutdown: CancellationToken::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reads the world.
    pub fn with<T>(&self, read: impl FnOnce(&World) -> T) -> T {
        read(&self.lock())
    }

    /// Changes the world and wakes everyone waiting on it.
    pub fn update<T>(&self, change: impl FnOnce(&mut World) -> T) -> T {
        let result = change(&mut self.lock());
        self.changed.send_modify(|version| *version += 1);
        result
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }
}

/// Serves until [`Shared::shutdown`].
pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let stop = shared.shutdown.clone();
    let app = Router::new().fallback(handle).with_state(shared);
    let served = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
    if let Err(err) = served {
        eprintln!("fake iLink server stopped: {err}");
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(op) = uri.path().strip_prefix(PREFIX).map(str::to_owned) else {
        shared.update(|world| world.records.violations.push(format!("request for {uri}")));
        return (StatusCode::NOT_FOUND, "not found").into_response();
    };
    let incoming = parse(op, &method, query, &headers, &body);
    let mode = shared.update(|world| {
        world.record(&incoming);
        world.mode_for(&incoming.op)
    });
    let mode = match mode {
        Mode::Silent => match wait_out_silence(&shared, &incoming.op).await {
            Some(mode) => mode,
            None => return shutting_down(),
        },
        other => other,
    };
    let answer = match mode {
        Mode::Http(status) => Answer::Status(status, gateway_page(status)),
        Mode::Ret(code) => Answer::Json(json!({"ret": code, "errcode": code, "errmsg": ""})),
        Mode::Normal | Mode::Slow(_) | Mode::Silent => {
            match shared.update(|world| world.check(&incoming)) {
                Err(refusal) => refusal,
                Ok(()) if incoming.op == "getupdates" => {
                    match hold_poll(&shared, &incoming).await {
                        Some(answer) => answer,
                        None => return shutting_down(),
                    }
                }
                Ok(()) => shared.update(|world| world.answer(&incoming)),
            }
        }
    };
    if let Mode::Slow(delay) = mode {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shared.shutdown.cancelled() => return shutting_down(),
        }
    }
    respond(answer)
}

/// Waits until the operation's mode is no longer silent; `None` on shutdown.
async fn wait_out_silence(shared: &Shared, op: &str) -> Option<Mode> {
    let mut changed = shared.subscribe();
    loop {
        changed.borrow_and_update();
        let mode = shared.with(|world| world.mode_for(op));
        if mode != Mode::Silent {
            return Some(mode);
        }
        tokio::select! {
            result = changed.changed() => result.ok()?,
            () = shared.shutdown.cancelled() => return None,
        }
    }
}

/// Holds a `getupdates` until a message is available or the hold ends; `None` on shutdown.
async fn hold_poll(shared: &Shared, incoming: &Incoming) -> Option<Answer> {
    let hold = shared.with(|world| world.options.hold);
    let deadline = tokio::time::Instant::now() + hold;
    let mut changed = shared.subscribe();
    loop {
        changed.borrow_and_update();
        let passed = tokio::time::Instant::now() >= deadline;
        if let Some(body) = shared.update(|world| world.poll_updates(&incoming.body, passed)) {
            return Some(Answer::Json(body));
        }
        tokio::select! {
            result = changed.changed() => result.ok()?,
            () = tokio::time::sleep_until(deadline) => {}
            () = shared.shutdown.cancelled() => return None,
        }
    }
}

fn parse(
    op: String,
    method: &Method,
    query: HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Incoming {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(name, value)| {
            (name.as_str().to_ascii_lowercase(), String::from_utf8_lossy(value.as_bytes()).into())
        })
        .collect();
    let (body, body_invalid) = if body.is_empty() {
        (Value::Null, false)
    } else {
        match serde_json::from_slice(body) {
            Ok(value) => (value, false),
            Err(_) => (Value::Null, true),
        }
    };
    Incoming { op, method: method.as_str().to_owned(), query, headers, body, body_invalid }
}

fn respond(answer: Answer) -> Response {
    match answer {
        Answer::Json(body) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string())
                .into_response()
        }
        Answer::Status(status, text) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, [(header::CONTENT_TYPE, "text/html")], text).into_response()
        }
    }
}

fn shutting_down() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
}

/// What a gateway in front of the real server answers when the backend fails.
fn gateway_page(status: u16) -> String {
    format!("<html><head><title>{status}</title></head><body><h1>{status}</h1></body></html>")
}
