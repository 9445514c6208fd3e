//! Answers control requests: `send` through the outbox, `health` by probing, `status` and
//! `catalog` from the hub's state (and the ledger's reply counts), `outbox` (paged,
//! previews), `outbox_get` and `outbox_retry` from the ledger, `replies` and
//! `replies_retry` through the reply courier, `action` through the connected driver, `history`
//! from the ledger, and the agent ops `inbox`, `read`, `respond`, `complete` (`agent.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use std::collections::HashMap;

use channeld_control::{
    ActionResult, CancelView, CatalogResult, CountersView, DriverProcess, Family, HealthResult,
    HistoryView, InstanceStatus, MAX_CONTROL_LINE, MAX_OUTBOX_PAGE, MAX_STATUS_PAGE, Op,
    OutboxEntry, OutboxResult, REPLY_STATES, RepliesResult, ReplyCounts, ReplyEntry, Request,
    StatusResult, code,
};
use channeld_protocol::types::OutboundMessage;
use tracing::{debug, info};

use super::server::{failure, success};
use crate::agent::{self, AgentError};
use crate::history;
use crate::hub::{HUB_NAME, Hub};
use crate::inbound::cancel;
use crate::instance::unix_ms;
use crate::ledger::{
    LedgerError, OutboxRecord, OutboxState, OutboxSummary, ReplyCount, ReplyRecord, ReplyState,
};
use crate::operator::{self, OperatorError};
use crate::proactive;
use crate::send::SendError;

/// The response line for one request. Every op but `send` (the hot one) awaits its work boxed, so this future — which the
/// server boxes per request, copying it whole — is about the size of a send.
pub(super) async fn handle(hub: &Arc<Hub>, request: Request) -> Vec<u8> {
    let id = request.id;
    match request.op {
        Op::Send(ask) => match proactive::send(hub, ask).await {
            Ok(result) => success(id, result),
            Err(error) => failure(id, &error.code, error.message, error.request_id),
        },
        Op::Health { instance } => match hub.instance(&instance) {
            Some(inst) => {
                let health = Box::pin(crate::health::probe(hub, &inst)).await;
                success(id, HealthResult { instance, health, storage: storage(hub) })
            }
            None => {
                let message = format!("no instance named {instance}");
                failure(id, code::UNKNOWN_INSTANCE, message, None)
            }
        },
        Op::Status { instance, after, limit } => {
            match Box::pin(status(hub, instance.as_deref(), after.as_deref(), limit)).await {
                Some(status) => success(id, status),
                None => {
                    let named = instance.unwrap_or_default();
                    let message = format!("no instance or driver family named {named}");
                    failure(id, code::UNKNOWN_INSTANCE, message, None)
                }
            }
        }
        Op::Catalog => success(id, catalog(std::env::current_exe().ok().as_deref())),
        Op::Outbox { instance, state, limit, before } => {
            let state = match state.as_deref().map(|s| OutboxState::parse(s).ok_or(s)) {
                None => None,
                Some(Ok(state)) => Some(state),
                Some(Err(bad)) => {
                    let message =
                        format!("unknown state {bad:?} (queued, sent, receipted, failed, unknown)");
                    return failure(id, code::INVALID_REQUEST, message, None);
                }
            };
            let limit = limit.unwrap_or(100).clamp(1, MAX_OUTBOX_PAGE);
            // One more than asked for tells whether another page follows.
            match Box::pin(hub.ledger.outbox_list(instance, state, before, limit + 1)).await {
                Ok(summaries) => {
                    let more = summaries.len() > limit;
                    let entries =
                        summaries.iter().take(limit).map(|r| summary_entry(hub, r)).collect();
                    success(id, page(entries, more, PAGE_BUDGET))
                }
                Err(err) => failure(id, ledger_code(&err), err.to_string(), None),
            }
        }
        Op::OutboxGet { outbox_id } => match Box::pin(hub.ledger.outbox_get(outbox_id)).await {
            Ok(Some(record)) => success(id, entry(hub, &record)),
            Ok(None) => failure(id, code::NOT_FOUND, format!("no outbox record {outbox_id}"), None),
            Err(err) => failure(id, ledger_code(&err), err.to_string(), None),
        },
        Op::OutboxRetry { outbox_id: record } => match Box::pin(hub.outbox.retry(record)).await {
            Ok(record) => success(id, entry(hub, &record)),
            Err(SendError::Ledger(LedgerError::NoSuchRecord(_))) => {
                failure(id, code::NOT_FOUND, format!("no outbox record {record}"), None)
            }
            Err(err @ SendError::Ledger(LedgerError::NotRetryable { .. })) => {
                failure(id, code::NOT_RETRYABLE, err.to_string(), None)
            }
            Err(err) => failure(id, err.code(), err.to_string(), None),
        },
        Op::Replies { instance, state, limit, before } => {
            let state = match state.as_deref().map(|s| ReplyState::parse(s).ok_or(s)) {
                None => None,
                Some(Ok(state)) => Some(state),
                Some(Err(bad)) => {
                    let message = format!("unknown state {bad:?} ({})", REPLY_STATES.join(", "));
                    return failure(id, code::INVALID_REQUEST, message, None);
                }
            };
            let limit = limit.unwrap_or(100).clamp(1, MAX_OUTBOX_PAGE);
            match Box::pin(hub.ledger.replies_list(instance, state, before, limit + 1)).await {
                Ok(records) => {
                    let more = records.len() > limit;
                    let replies: Vec<ReplyEntry> =
                        records.iter().take(limit).map(reply_entry).collect();
                    success(id, replies_page(replies, more, PAGE_BUDGET))
                }
                Err(err) => failure(id, ledger_code(&err), err.to_string(), None),
            }
        }
        Op::RepliesRetry { reply_id } => match Box::pin(hub.courier.retry(reply_id)).await {
            Ok(record) => success(id, reply_entry(&record)),
            Err(LedgerError::NoSuchReply(_)) => {
                failure(id, code::NOT_FOUND, format!("no reply {reply_id}"), None)
            }
            Err(err @ LedgerError::ReplyNotRetryable { .. }) => {
                failure(id, code::NOT_RETRYABLE, err.to_string(), None)
            }
            Err(err) => failure(id, ledger_code(&err), err.to_string(), None),
        },
        Op::Action { instance, name, args, timeout_ms } => {
            let timeout = timeout_ms.map_or(hub.config.command_timeout, Duration::from_millis);
            Box::pin(action(hub, id, instance, name, args, timeout)).await
        }
        Op::Cancel { instance, event_id } => {
            let Some(inst) = hub.instance(&instance) else {
                let message = format!("no instance named {instance}");
                return failure(id, code::UNKNOWN_INSTANCE, message, None);
            };
            let Ok(event) = channeld_protocol::Id::new(&event_id) else {
                return failure(id, code::INVALID_REQUEST, "event_id is not an id".into(), None);
            };
            match Box::pin(cancel::cancel(hub, &inst, event)).await {
                Ok(done) => {
                    let cancelled = done.cancelled.iter().map(ToString::to_string).collect();
                    success(
                        id,
                        CancelView { instance, event_id, cancelled, state: done.state.to_owned() },
                    )
                }
                Err(err) => failure(id, err.code(), err.to_string(), None),
            }
        }
        Op::History { instance, conversation, thread, limit } => {
            let Some(inst) = hub.instance(&instance) else {
                let message = format!("no instance named {instance}");
                return failure(id, code::UNKNOWN_INSTANCE, message, None);
            };
            match Box::pin(history::read(hub, &inst, conversation.clone(), thread.clone(), limit))
                .await
            {
                Ok(entries) => {
                    let (entries, truncated) = history::fit(entries, MAX_CONTROL_LINE);
                    let view = HistoryView { instance, conversation, thread, entries, truncated };
                    success(id, view)
                }
                Err(err) => failure(id, err.code(), err.to_string(), None),
            }
        }
        Op::Inbox { instance, unhandled, limit, before } => {
            let limit = limit.unwrap_or(50).clamp(1, MAX_OUTBOX_PAGE);
            answer(id, Box::pin(agent::inbox(hub, instance, unhandled, limit, before)).await)
        }
        Op::Read { locator, limit } => {
            let limit = limit.unwrap_or(agent::DEFAULT_READ_CONTEXT);
            answer(id, Box::pin(agent::read(hub, &locator, limit)).await)
        }
        Op::Respond { locator, text } => {
            answer(id, Box::pin(agent::respond(hub, &locator, text)).await)
        }
        Op::Complete { locator } => answer(id, Box::pin(agent::complete(hub, &locator)).await),
    }
}

/// The answer to an agent op.
fn answer<T: serde::Serialize>(id: u64, result: Result<T, AgentError>) -> Vec<u8> {
    match result {
        Ok(result) => success(id, result),
        Err(err) => {
            let request_id = match &err {
                AgentError::Send(
                    SendError::Failed { request_id, .. } | SendError::Unknown { request_id, .. },
                ) => Some(request_id.to_string()),
                _ => None,
            };
            failure(id, err.code(), err.to_string(), request_id)
        }
    }
}

/// `action`: refused by the hub when it can decide alone (no such instance, no driver
/// connected, a name the driver did not declare), otherwise the driver's answer.
async fn action(
    hub: &Arc<Hub>,
    id: u64,
    instance: String,
    name: String,
    args: serde_json::Value,
    timeout: Duration,
) -> Vec<u8> {
    let Some(inst) = hub.instance(&instance) else {
        return failure(id, code::UNKNOWN_INSTANCE, format!("no instance named {instance}"), None);
    };
    let Some(conn) = inst.live() else {
        let message = format!("{instance} has no driver connected");
        return failure(id, code::DRIVER_OFFLINE, message, None);
    };
    let request_id = hub.ids.request("op");
    let rid = request_id.to_string();
    match operator::perform(&conn, request_id, name.clone(), args, timeout).await {
        Ok(result) if result.ok => {
            info!(%instance, action = %name, request_id = %rid, "operator action performed");
            success(id, ActionResult { instance, name, message: result.message, data: result.data })
        }
        Ok(result) => {
            let code = result.code.unwrap_or_else(|| "failed".to_owned());
            let message = match result.message {
                Some(message) => format!("the driver refused {name}: {code}: {message}"),
                None => format!("the driver refused {name}: {code}"),
            };
            info!(%instance, action = %name, request_id = %rid, %code, "operator action failed");
            failure(id, code::ACTION_FAILED, message, Some(rid))
        }
        Err(err) => {
            let code = match err {
                OperatorError::NotNegotiated | OperatorError::NotDeclared { .. } => {
                    code::NOT_DECLARED
                }
                OperatorError::ArgsNotObject => code::INVALID_REQUEST,
                OperatorError::Disconnected | OperatorError::Send(_) => code::DRIVER_OFFLINE,
                OperatorError::Timeout(_) => code::ACTION_TIMEOUT,
            };
            failure(id, code, err.to_string(), None)
        }
    }
}

fn reply_entry(record: &ReplyRecord) -> ReplyEntry {
    ReplyEntry {
        id: record.id,
        instance: record.instance.clone(),
        event_id: record.event_id.clone(),
        conversation: record.conversation.clone(),
        state: record.state.as_str().to_owned(),
        text: record.text.clone(),
        text_bytes: record.text_bytes,
        receipt: record.receipt.as_ref().and_then(|r| serde_json::from_slice(r).ok()),
        error: record.error.clone(),
        attempts: record.attempts,
        next_ms: record.next_ms,
        expires_ms: record.expires_ms,
        created_ms: record.created_ms,
        updated_ms: record.updated_ms,
    }
}

/// The replies that fit in `budget` bytes of JSON and the cursor to the next page, as
/// [`page`] does for the outbox. Pure.
fn replies_page(entries: Vec<ReplyEntry>, more: bool, budget: usize) -> RepliesResult {
    let mut used = 0;
    let total = entries.len();
    let mut replies = Vec::with_capacity(total);
    for entry in entries {
        let size = serde_json::to_vec(&entry).map_or(usize::MAX, |json| json.len() + 1);
        if used + size > budget && !replies.is_empty() {
            break;
        }
        used = used.saturating_add(size);
        replies.push(entry);
    }
    let cut = replies.len() < total;
    let next_before = (more || cut).then(|| replies.last().map(|r| r.id)).flatten();
    RepliesResult { replies, next_before }
}

/// The ledger's reply counts as `status` shows them, by instance.
fn reply_counts(counts: Vec<ReplyCount>) -> HashMap<String, ReplyCounts> {
    let mut by_instance: HashMap<String, ReplyCounts> = HashMap::new();
    for ReplyCount { instance, state, count } in counts {
        let entry = by_instance.entry(instance).or_default();
        let slot = match state {
            ReplyState::Pending => &mut entry.pending,
            ReplyState::Handed => &mut entry.handed,
            ReplyState::Posted => &mut entry.posted,
            ReplyState::FailedRetryable => &mut entry.failed_retryable,
            ReplyState::Failed => &mut entry.failed,
            ReplyState::Unknown => &mut entry.unknown,
            ReplyState::Expired => &mut entry.expired,
        };
        *slot += count;
    }
    by_instance
}

fn ledger_code(err: &LedgerError) -> &'static str {
    match err {
        LedgerError::Off => code::LEDGER_OFF,
        LedgerError::StorageFull => code::STORAGE_FULL,
        _ => code::LEDGER_UNAVAILABLE,
    }
}

/// Room an `outbox` page's records may take in the answer line; the rest of the line (ids,
/// keys, the cursor) fits in what is left.
const PAGE_BUDGET: usize = MAX_CONTROL_LINE - 4096;

/// The records that fit in `budget` bytes of JSON, newest first, and the cursor to the next
/// page when some were left out (or `more` says the ledger holds more). Pure.
fn page(entries: Vec<OutboxEntry>, more: bool, budget: usize) -> OutboxResult {
    let mut used = 0;
    let mut records = Vec::with_capacity(entries.len());
    let total = entries.len();
    for entry in entries {
        let size = serde_json::to_vec(&entry).map_or(usize::MAX, |json| json.len() + 1);
        if used + size > budget && !records.is_empty() {
            break;
        }
        used = used.saturating_add(size);
        records.push(entry);
    }
    let cut = records.len() < total;
    let next_before = (more || cut).then(|| records.last().map(|r| r.id)).flatten();
    OutboxResult { records, next_before }
}

/// The rows that fit in `limit` rows and `budget` bytes of JSON (always at least one), and
/// the id to continue after when some were left out. Pure.
fn status_page(
    rows: impl Iterator<Item = InstanceStatus>,
    limit: usize,
    budget: usize,
) -> (Vec<InstanceStatus>, Option<String>) {
    let mut rows = rows.peekable();
    let mut used = 0;
    let mut page = Vec::new();
    while let Some(row) = rows.peek() {
        let size = serde_json::to_vec(row).map_or(usize::MAX, |json| json.len() + 1);
        if page.len() == limit || (used + size > budget && !page.is_empty()) {
            break;
        }
        used = used.saturating_add(size);
        page.extend(rows.next());
    }
    let next_after =
        rows.peek().is_some().then(|| page.last().map(|row| row.instance.clone())).flatten();
    (page, next_after)
}

fn summary_entry(hub: &Hub, summary: &OutboxSummary) -> OutboxEntry {
    OutboxEntry {
        id: summary.id,
        request_id: hub.ledger.outbox_request_id(summary.id),
        instance: summary.instance.clone(),
        state: summary.state.as_str().to_owned(),
        idempotency_key: summary.idempotency_key.clone(),
        conversation: summary.conversation.clone(),
        text: summary.text_preview.clone(),
        text_bytes: summary.text_bytes,
        receipt: summary.receipt.as_ref().and_then(|r| serde_json::from_slice(r).ok()),
        error: summary.error_preview.clone(),
        attempts: summary.attempts,
        created_ms: summary.created_ms,
        updated_ms: summary.updated_ms,
    }
}

fn entry(hub: &Hub, record: &OutboxRecord) -> OutboxEntry {
    let message: Option<OutboundMessage> = serde_json::from_slice(&record.message).ok();
    let text = message.as_ref().map(|m| m.body.text_str().to_owned()).unwrap_or_default();
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
        text_bytes: text.len(),
        text,
        receipt: record.receipt.as_ref().and_then(|r| serde_json::from_slice(r).ok()),
        error: record.error.clone(),
        attempts: record.attempts,
        created_ms: record.created_ms,
        updated_ms: record.updated_ms,
    }
}

/// `storage_full` while the ledger cannot write for lack of space.
fn storage(hub: &Hub) -> Option<String> {
    hub.ledger.storage_full().then(|| code::STORAGE_FULL.to_owned())
}

/// Whether the instance `id` is the one `filter` names, or of the family it names. Pure.
fn status_matches(id: &str, family: &str, filter: Option<&str>) -> bool {
    filter.is_none_or(|filter| filter == id || filter == family)
}

/// Instances' state in id order: those `filter` names, after `after`, at most `limit` of
/// them (capped at [`MAX_STATUS_PAGE`]) and fewer when their rows would not fit the line;
/// `None` when a filter names no instance.
async fn status(
    hub: &Hub,
    filter: Option<&str>,
    after: Option<&str>,
    limit: Option<usize>,
) -> Option<StatusResult> {
    use std::sync::atomic::Ordering::Relaxed;
    let mut replies = if hub.ledger.is_on() {
        match hub.ledger.replies_counts().await {
            Ok(counts) => Some(reply_counts(counts)),
            Err(err) => {
                debug!(error = %err, "reply counts not read");
                None
            }
        }
    } else {
        None
    };
    let limit = limit.unwrap_or(MAX_STATUS_PAGE).clamp(1, MAX_STATUS_PAGE);
    let snapshot = hub.instances.snapshot();
    let matching: Vec<_> = snapshot
        .values()
        .filter(|inst| status_matches(inst.config.id.as_str(), inst.config.id.family(), filter))
        .collect();
    let total = matching.len();
    if total == 0 && filter.is_some() {
        return None;
    }
    let rows = matching
        .into_iter()
        .filter(|inst| after.is_none_or(|after| inst.config.id.as_str() > after))
        .map(|inst| {
            let live = inst.live();
            let health = inst.health();
            let c = &inst.counters;
            let last_error = inst.last_error();
            InstanceStatus {
                instance: inst.config.id.to_string(),
                family: inst.config.id.family().to_owned(),
                socket: inst.config.socket.display().to_string(),
                runtime: inst.policy().runtime.name.clone(),
                connected: live.is_some(),
                connected_since_ms: live.as_ref().map(|conn| unix_ms(conn.connected_at)),
                driver_pid: live.as_ref().and_then(|conn| conn.peer_pid),
                health: health.health,
                health_updated_ms: unix_ms(health.updated),
                in_flight: inst.runs_running(),
                queued: inst.runs_waiting(),
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
                driver_process: inst.process().map(|process| DriverProcess {
                    state: process.state.as_str().to_owned(),
                    pid: process.pid,
                    starts: process.starts,
                    last_exit: process.last_exit,
                }),
                replies: replies
                    .as_mut()
                    .map(|counts| counts.remove(inst.config.id.as_str()).unwrap_or_default()),
                agent_env: inst.agent_env().keys().cloned().collect(),
            }
        });
    let (instances, next_after) = status_page(rows, limit, PAGE_BUDGET);
    Some(StatusResult {
        hub: HUB_NAME.to_owned(),
        pid: std::process::id(),
        started_ms: unix_ms(hub.started),
        instances,
        total,
        next_after,
        storage: storage(hub),
        amqp_sends: hub.amqp_sends.as_ref().map(|state| state.view()),
    })
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
        ("acecode", "an ACECode channel platform plugin (stdio JSONL child)"),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: i64, text_len: usize) -> OutboxEntry {
        OutboxEntry {
            id,
            request_id: format!("ob-x-{id}"),
            instance: "a.b".into(),
            state: "queued".into(),
            idempotency_key: None,
            conversation: "c".into(),
            text: "t".repeat(text_len),
            text_bytes: text_len,
            receipt: None,
            error: None,
            attempts: 0,
            created_ms: 0,
            updated_ms: 0,
        }
    }

    #[test]
    fn a_page_stops_before_its_budget_and_points_to_the_next() {
        let entries: Vec<_> = (0..10).rev().map(|id| entry(id, 900)).collect();
        let page = page(entries.clone(), false, 3500);
        assert_eq!(page.records.iter().map(|r| r.id).collect::<Vec<_>>(), vec![9, 8, 7]);
        assert_eq!(page.next_before, Some(7));
        let json = serde_json::to_vec(&page.records).unwrap();
        assert!(json.len() <= 3500, "{}", json.len());
        // Everything fits: no cursor, unless the ledger said more follow.
        assert_eq!(super::page(entries.clone(), false, 1 << 20).next_before, None);
        assert_eq!(super::page(entries, true, 1 << 20).next_before, Some(0));
    }

    #[test]
    fn a_single_record_larger_than_the_budget_still_makes_progress() {
        let page = page(vec![entry(5, 5000), entry(4, 10)], false, 1000);
        assert_eq!(page.records.len(), 1);
        assert_eq!(page.next_before, Some(5));
    }

    fn row(id: &str, error_len: usize) -> InstanceStatus {
        InstanceStatus {
            instance: id.into(),
            family: id.split('.').next().unwrap_or_default().into(),
            socket: format!("/run/channeld/{id}.sock"),
            runtime: "echo".into(),
            connected: true,
            connected_since_ms: None,
            driver_pid: None,
            health: channeld_protocol::types::Health::new(
                channeld_protocol::types::HealthState::Ready,
                None,
            ),
            health_updated_ms: 0,
            in_flight: 0,
            queued: 0,
            counters: Default::default(),
            last_error: Some("e".repeat(error_len)),
            last_error_ms: None,
            driver_process: None,
            replies: None,
            agent_env: Vec::new(),
        }
    }

    fn ids(rows: &[InstanceStatus]) -> Vec<&str> {
        rows.iter().map(|row| row.instance.as_str()).collect()
    }

    #[test]
    fn a_status_page_stops_at_its_limit_or_budget_and_names_where_to_go_on() {
        let rows = || ["a.1", "a.2", "a.3", "b.1"].into_iter().map(|id| row(id, 400));
        let (page, next) = status_page(rows(), 2, 1 << 20);
        assert_eq!((ids(&page), next.as_deref()), (vec!["a.1", "a.2"], Some("a.2")));
        let (page, next) = status_page(rows(), 10, 1 << 20);
        assert_eq!((page.len(), next), (4, None));
        let one = serde_json::to_vec(&row("a.1", 400)).unwrap().len() + 1;
        let (page, next) = status_page(rows(), 10, one * 3 - 1);
        assert_eq!((ids(&page), next.as_deref()), (vec!["a.1", "a.2"], Some("a.2")));
        // A row larger than the budget is still answered, one per page.
        let (page, next) = status_page(rows(), 10, 10);
        assert_eq!((ids(&page), next.as_deref()), (vec!["a.1"], Some("a.1")));
        // Exactly the limit left: no cursor to an empty page.
        let (page, next) = status_page(rows(), 4, 1 << 20);
        assert_eq!((page.len(), next), (4, None));
    }

    #[test]
    fn a_status_filter_names_an_instance_or_a_family() {
        assert!(status_matches("slack.primary", "slack", None));
        assert!(status_matches("slack.primary", "slack", Some("slack")));
        assert!(status_matches("slack.primary", "slack", Some("slack.primary")));
        assert!(!status_matches("slack.primary", "slack", Some("slack.prim")));
        assert!(!status_matches("slack.primary", "slack", Some("mqtt")));
    }
}
