//! The Web API side of the fake: `POST /api/<method>` with Slack's authentication rules
//! (bearer token in the header, or `token` in a form body), arguments from the query string,
//! a form body or a JSON body (only where Slack accepts JSON), errors as HTTP 200
//! `{"ok":false,…}`, and the injected faults (429 + `Retry-After`, delays, hangs, 5xx).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, RawQuery, State as AxumState};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::state::{ApiCall, Fault, State, StatusRecord, StoredMessage};
use super::{Shared, events};

/// Longest `text` Slack takes in one message.
pub const MAX_TEXT_CHARS: usize = 40_000;

/// Methods that take no JSON body: their arguments come from the query string or a form body.
const FORM_ONLY: &[&str] = &["users.info", "auth.test", "apps.connections.open"];

/// An answer: HTTP status, extra headers, JSON body.
struct Answer {
    status: StatusCode,
    retry_after: Option<u64>,
    body: Value,
}

impl Answer {
    fn ok(body: Value) -> Self {
        let mut body = body;
        body["ok"] = json!(true);
        Self { status: StatusCode::OK, retry_after: None, body }
    }

    fn error(code: &str) -> Self {
        Self {
            status: StatusCode::OK,
            retry_after: None,
            body: json!({"ok": false, "error": code}),
        }
    }
}

/// `/api/{method}`.
pub(crate) async fn api(
    AxumState(shared): AxumState<Arc<Shared>>,
    Path(method): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let parsed = arguments(&method, query.as_deref(), content_type.as_deref(), &body);
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let (args, answer) = match parsed {
        Ok((args, form_token)) => {
            let token = bearer.or(form_token);
            let answer = authorise(&shared, &method, token.as_deref());
            (args, answer.map_err(|answer| (token_kind(&shared, token.as_deref()), answer)))
        }
        Err(code) => {
            (Value::Null, Err((token_kind(&shared, bearer.as_deref()), Answer::error(code))))
        }
    };
    let token = match &answer {
        Ok(kind) | Err((kind, _)) => *kind,
    };
    let fault = if answer.is_ok() { shared.lock().take_fault(&method) } else { None };
    let answer = match (answer, fault) {
        (Err((_, refused)), _) => refused,
        (Ok(_), Some(Fault::Error(code))) => Answer::error(&code),
        (Ok(_), Some(Fault::RateLimited { retry_after_secs })) => Answer {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: Some(retry_after_secs),
            body: json!({"ok": false, "error": "ratelimited"}),
        },
        (Ok(_), Some(Fault::ServerError(code))) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            record(&shared, &method, token, &content_type, &args, status.as_u16(), Value::Null);
            return (status, "<html><body>upstream error</body></html>").into_response();
        }
        (Ok(_), Some(Fault::Hang)) => {
            record(&shared, &method, token, &content_type, &args, 0, Value::Null);
            shared.shutdown.cancelled().await;
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        (Ok(_), Some(Fault::Delay(delay))) => {
            tokio::time::sleep(delay).await;
            perform(&shared, &method, &args)
        }
        (Ok(_), None) => perform(&shared, &method, &args),
    };
    let mut body = answer.body;
    if content_type.as_deref() == Some("application/json") {
        // Slack takes JSON without a charset but says so.
        body["response_metadata"] = json!({"warnings": ["missing_charset"]});
    }
    record(&shared, &method, token, &content_type, &args, answer.status.as_u16(), body.clone());
    let mut response = (answer.status, axum::Json(body)).into_response();
    if let Some(secs) = answer.retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, secs.into());
    }
    response
}

fn record(
    shared: &Shared,
    method: &str,
    token: &'static str,
    content_type: &Option<String>,
    args: &Value,
    status: u16,
    response: Value,
) {
    shared.update(|state| {
        state.record.calls.push(ApiCall {
            method: method.to_owned(),
            token,
            content_type: content_type.clone(),
            args: args.clone(),
            at: Instant::now(),
            status,
            response,
        });
    });
}

/// Merges query, form and JSON arguments; returns them with a `token` given as an argument.
fn arguments(
    method: &str,
    query: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<(Value, Option<String>), &'static str> {
    let mut args = Map::new();
    let mut token = None;
    let mut take_pairs = |raw: &str| -> Result<(), &'static str> {
        for (key, value) in form_pairs(raw).ok_or("invalid_form_data")? {
            if key == "token" {
                token = Some(value);
            } else {
                args.insert(key, Value::String(value));
            }
        }
        Ok(())
    };
    if let Some(query) = query {
        take_pairs(query)?;
    }
    let media = content_type.map(|ct| ct.split(';').next().unwrap_or("").trim().to_owned());
    match media.as_deref() {
        _ if body.is_empty() => {}
        Some("application/x-www-form-urlencoded") => {
            take_pairs(std::str::from_utf8(body).map_err(|_| "invalid_form_data")?)?;
        }
        Some("application/json") if !FORM_ONLY.contains(&method) => {
            let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else {
                return Err("invalid_json");
            };
            args.extend(object);
        }
        // Slack ignores a body it cannot read for this method, then finds arguments missing.
        _ => {}
    }
    Ok((Value::Object(args), token))
}

/// `a=1&b=x+y` → pairs, through the same urlencoded parser axum's `Query` uses.
fn form_pairs(raw: &str) -> Option<Vec<(String, String)>> {
    let uri: Uri = format!("/?{raw}").parse().ok()?;
    Query::<Vec<(String, String)>>::try_from_uri(&uri).ok().map(|Query(pairs)| pairs)
}

fn token_kind(shared: &Shared, token: Option<&str>) -> &'static str {
    match token {
        None => "none",
        Some(t) if t == shared.options.app_token => "app",
        Some(t) if t == shared.options.bot_token => "bot",
        Some(_) => "unknown",
    }
}

/// Slack's token rules: the app-level token opens connections and nothing else; the bot token
/// does everything else.
fn authorise(shared: &Shared, method: &str, token: Option<&str>) -> Result<&'static str, Answer> {
    let kind = token_kind(shared, token);
    let revoked = shared.lock().tokens_revoked;
    match kind {
        "none" => Err(Answer::error("not_authed")),
        "unknown" => Err(Answer::error("invalid_auth")),
        _ if revoked => Err(Answer::error("invalid_auth")),
        "app" if method != "apps.connections.open" => Err(Answer::error("not_allowed_token_type")),
        "bot" if method == "apps.connections.open" => Err(Answer::error("not_allowed_token_type")),
        kind => Ok(kind),
    }
}

fn text_arg<'a>(args: &'a Value, name: &str) -> Option<&'a str> {
    args.get(name).and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// Runs a method against the workspace.
fn perform(shared: &Shared, method: &str, args: &Value) -> Answer {
    let options = &shared.options;
    match method {
        "apps.connections.open" => {
            let mut state = shared.lock();
            let ticket = format!("{:016x}{:08x}", fastrand::u64(..), state.next());
            state.tickets.insert(ticket.clone(), false);
            let url =
                format!("ws://{}/link/?ticket={ticket}&app_id={}", shared.addr, options.app_id);
            Answer::ok(json!({"url": url}))
        }
        "auth.test" => Answer::ok(json!({
            "url": "https://fake-workspace.slack.com/",
            "team": "Fake Workspace",
            "user": "channeld",
            "team_id": options.team_id,
            "user_id": options.bot_user_id,
            "bot_id": options.bot_id,
            "is_enterprise_install": false,
        })),
        "users.info" => {
            let Some(user) = text_arg(args, "user") else {
                return Answer::error("invalid_arguments");
            };
            match shared.lock().users.get(user) {
                Some(found) => Answer::ok(json!({"user": found})),
                None => Answer::error("user_not_found"),
            }
        }
        "conversations.open" => {
            let Some(users) = text_arg(args, "users") else {
                return Answer::error("users_list_not_supplied");
            };
            let users: Vec<&str> = users.split(',').map(str::trim).collect();
            let id = if users.len() == 1 {
                events::dm_channel(users[0])
            } else {
                format!("G{}", users.join(""))
            };
            Answer::ok(json!({"channel": {"id": id}}))
        }
        "assistant.threads.setStatus" => {
            let (Some(channel_id), Some(thread_ts)) =
                (text_arg(args, "channel_id"), text_arg(args, "thread_ts"))
            else {
                return Answer::error("invalid_arguments");
            };
            let Some(status) = args.get("status").and_then(Value::as_str) else {
                return Answer::error("invalid_arguments");
            };
            let status = StatusRecord {
                channel_id: channel_id.to_owned(),
                thread_ts: thread_ts.to_owned(),
                status: status.to_owned(),
            };
            shared.update(|state| state.record.statuses.push(status));
            Answer::ok(json!({}))
        }
        "chat.postMessage" => post_message(shared, args),
        "chat.update" => update_message(shared, args),
        "chat.delete" => delete_message(shared, args),
        "reactions.add" | "reactions.remove" => react(shared, args, method == "reactions.add"),
        _ => Answer::error("unknown_method"),
    }
}

/// The channel a post goes to: a user id means the app's DM with that user.
fn resolve_channel(state: &State, args: &Value) -> Result<String, Answer> {
    let channel = text_arg(args, "channel").ok_or_else(|| Answer::error("channel_not_found"))?;
    if let Some(code) = state.channel_errors.get(channel) {
        return Err(Answer::error(code));
    }
    if channel.starts_with('U') || channel.starts_with('W') {
        return Ok(events::dm_channel(channel));
    }
    Ok(channel.to_owned())
}

fn content(args: &Value) -> Result<(String, Option<Value>), Answer> {
    let text = args.get("text").and_then(Value::as_str).unwrap_or_default().to_owned();
    let blocks = match args.get("blocks") {
        // Form bodies carry blocks as a JSON string.
        Some(Value::String(raw)) => {
            Some(serde_json::from_str(raw).map_err(|_| Answer::error("invalid_blocks"))?)
        }
        Some(Value::Array(blocks)) => Some(Value::Array(blocks.clone())),
        Some(_) => return Err(Answer::error("invalid_blocks")),
        None => None,
    };
    if text.is_empty() && blocks.is_none() {
        return Err(Answer::error("no_text"));
    }
    if text.chars().count() > MAX_TEXT_CHARS {
        return Err(Answer::error("msg_too_long"));
    }
    Ok((text, blocks))
}

fn post_message(shared: &Shared, args: &Value) -> Answer {
    let options = &shared.options;
    let mut state = shared.lock();
    let channel = match resolve_channel(&state, args) {
        Ok(channel) => channel,
        Err(answer) => return answer,
    };
    let (text, blocks) = match content(args) {
        Ok(content) => content,
        Err(answer) => return answer,
    };
    if let Some(limit) = options.posts_per_channel_second {
        let now = Instant::now();
        let recent = state.recent_posts.entry(channel.clone()).or_default();
        while recent.front().is_some_and(|at| now.duration_since(*at) >= Duration::from_secs(1)) {
            recent.pop_front();
        }
        if recent.len() >= limit {
            return Answer {
                status: StatusCode::TOO_MANY_REQUESTS,
                retry_after: Some(1),
                body: json!({"ok": false, "error": "ratelimited"}),
            };
        }
        recent.push_back(now);
    }
    let thread_ts = text_arg(args, "thread_ts").map(str::to_owned);
    let ts = state.next_ts();
    let message = StoredMessage {
        channel: channel.clone(),
        ts: ts.clone(),
        thread_ts: thread_ts.clone(),
        user: options.bot_user_id.clone(),
        by_bot: true,
        text,
        blocks,
        edits: Vec::new(),
        deleted: false,
        reactions: Vec::new(),
    };
    let event = events::bot_message_event(options, &message);
    state.record.messages.push(message);
    drop(state);
    shared.changed();
    if options.echo_bot_messages {
        shared.push_events_api(event.clone());
    }
    let mut echoed = event;
    if let Some(object) = echoed.as_object_mut() {
        object.remove("channel");
        object.remove("channel_type");
        object.remove("event_ts");
    }
    Answer::ok(json!({"channel": channel, "ts": ts, "message": echoed}))
}

fn update_message(shared: &Shared, args: &Value) -> Answer {
    let options = &shared.options;
    let (Some(channel), Some(ts)) = (text_arg(args, "channel"), text_arg(args, "ts")) else {
        return Answer::error("message_not_found");
    };
    let (text, blocks) = match content(args) {
        Ok(content) => content,
        Err(answer) => return answer,
    };
    let mut state = shared.lock();
    let Some(message) = state.message_mut(channel, ts) else {
        return Answer::error("message_not_found");
    };
    if !message.by_bot {
        return Answer::error("cant_update_message");
    }
    let previous = message.clone();
    message.edits.push(std::mem::replace(&mut message.text, text.clone()));
    // Without `blocks`, an update keeps none: Slack replaces the whole message.
    message.blocks = blocks;
    let event = events::changed_event(options, &previous, message);
    drop(state);
    shared.changed();
    if options.echo_bot_messages {
        shared.push_events_api(event);
    }
    Answer::ok(json!({"channel": channel, "ts": ts, "text": text}))
}

fn delete_message(shared: &Shared, args: &Value) -> Answer {
    let options = &shared.options;
    let (Some(channel), Some(ts)) = (text_arg(args, "channel"), text_arg(args, "ts")) else {
        return Answer::error("message_not_found");
    };
    let mut state = shared.lock();
    let Some(message) = state.message_mut(channel, ts) else {
        return Answer::error("message_not_found");
    };
    if !message.by_bot {
        return Answer::error("cant_delete_message");
    }
    message.deleted = true;
    let event = events::deleted_event(options, message);
    drop(state);
    shared.changed();
    if options.echo_bot_messages {
        shared.push_events_api(event);
    }
    Answer::ok(json!({"channel": channel, "ts": ts}))
}

fn react(shared: &Shared, args: &Value, add: bool) -> Answer {
    let (Some(channel), Some(ts)) = (text_arg(args, "channel"), text_arg(args, "timestamp")) else {
        return Answer::error("no_item_specified");
    };
    let Some(name) = text_arg(args, "name") else {
        return Answer::error("invalid_name");
    };
    if name.contains(':') || name.contains(char::is_whitespace) {
        return Answer::error("invalid_name");
    }
    let mut state = shared.lock();
    let Some(message) = state.message_mut(channel, ts) else {
        return Answer::error("message_not_found");
    };
    let present = message.reactions.iter().any(|r| r == name);
    match (add, present) {
        (true, true) => return Answer::error("already_reacted"),
        (false, false) => return Answer::error("no_reaction"),
        (true, false) => message.reactions.push(name.to_owned()),
        (false, true) => message.reactions.retain(|r| r != name),
    }
    drop(state);
    shared.changed();
    Answer::ok(json!({}))
}
