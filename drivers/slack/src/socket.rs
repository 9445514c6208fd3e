//! Socket Mode: the connection loop that keeps one live socket (two during a refresh), turns
//! envelopes into hub reports and acknowledges each only after the hub's answer.
//!
//! Envelopes themselves are handled in [`crate::envelopes`].
//!
//! Tasks: one reader per open socket (a `JoinSet` owned by the loop, drained when the loop
//! ends) forwards parsed frames into one bounded queue ([`LINK_EVENTS`]; readers wait when
//! it is full, so Slack's envelopes back up on the socket rather than in memory). The loop
//! owns the sockets and decides; acknowledgements travel on the socket the envelope came
//! from, settled by the SDK's `PendingAcks` (drained before the sockets close).
//!
//! Refresh: on `warning` / `refresh_requested` a new socket is opened while the old one keeps
//! delivering; once the new one said `hello` it is primary and the old one is closed after its
//! pending acknowledgements settled ([`DRAIN_OLD_SOCKET`] at most). An envelope the old socket
//! could not acknowledge is redelivered by Slack on the new one and acknowledged there from
//! the answer already recorded in [`Seen`](crate::seen::Seen): nothing lost, nothing answered
//! twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use channeld_driver_sdk::protocol::types::{Health, HealthState, HealthStatus};
use channeld_driver_sdk::transport::TransportError;
use channeld_driver_sdk::transport::websocket::{self, WsMessage, WsOptions, WsReceiver, WsSender};
use channeld_driver_sdk::{
    CancellationToken, Failure, Hub, LinkState, PendingAcks, Reconnect, ReconnectPolicy, Url,
};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::convert::BotIdentity;
use crate::envelopes::{ack, on_event, on_interaction};
use crate::platform::Shared;
use crate::web::CallError;
use crate::wire::SocketFrame;

/// Frames read but not yet handled, across all sockets.
pub const LINK_EVENTS: usize = 256;
/// How long a replaced socket keeps serving (Slack may still deliver there during a
/// refresh) before it is drained and closed.
pub const RETIRE_GRACE: Duration = Duration::from_secs(2);
/// How long a replaced socket then waits for its pending acknowledgements.
pub const DRAIN_OLD_SOCKET: Duration = Duration::from_secs(3);
/// The longest `Retry-After` honoured for `apps.connections.open` before the normal backoff.
const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(60);
/// How long stopping waits for the hub's answers before closing the sockets.
const DRAIN_ON_STOP: Duration = Duration::from_secs(5);

/// What a reader reports.
enum LinkEvent {
    Frame(u64, SocketFrame),
    Ended(u64, Result<(), TransportError>),
}

/// One open socket.
pub(crate) struct Link {
    pub sender: WsSender,
    /// Acknowledgements waiting for the hub, sent on this socket.
    pub acks: PendingAcks,
    hello: bool,
    /// Replaced by a newer socket: still serving until its grace period ends.
    retiring: bool,
}

/// How a connection attempt or a socket ended.
pub(crate) enum End {
    Shutdown,
    /// Retry on the normal lane, with this link state meanwhile.
    Transient(LinkState),
    /// Retry on the normal lane, showing this health (a Slack reason the link states lack).
    TransientHealth(Health),
    /// Retry on the slow lane.
    Operator(Health),
}

fn unavailable(reason: &str, detail: &str) -> Health {
    Health {
        state: HealthState::Unavailable,
        detail: Some(detail.to_owned()),
        status: Some(HealthStatus {
            transport: Some("disconnected".into()),
            reason: Some(reason.into()),
            ..HealthStatus::default()
        }),
    }
}

fn degraded(reason: &str, detail: &str) -> Health {
    Health {
        state: HealthState::Degraded,
        detail: Some(detail.to_owned()),
        status: Some(HealthStatus {
            transport: Some("disconnected".into()),
            reason: Some(reason.into()),
            ..HealthStatus::default()
        }),
    }
}

/// Slack's codes for a token it will not take.
fn is_auth_error(code: &str) -> bool {
    matches!(
        code,
        "invalid_auth"
            | "not_authed"
            | "account_inactive"
            | "token_revoked"
            | "token_expired"
            | "not_allowed_token_type"
            | "missing_scope"
    )
}

fn call_end(what: &str, err: &CallError) -> End {
    match err {
        CallError::Slack(code) if is_auth_error(code) => End::Operator(
            LinkState::AuthRejected {
                detail: format!("slack refused the token for {what}: {code}"),
            }
            .health(),
        ),
        CallError::RateLimited(wait) => End::Transient(LinkState::Retrying {
            attempt: 0,
            error: format!("{what} rate limited for {}s", wait.as_secs()),
        }),
        other => {
            End::Transient(LinkState::Retrying { attempt: 0, error: format!("{what}: {other}") })
        }
    }
}

/// The Socket Mode loop; returns when `shutdown` fires.
pub async fn run(shared: Arc<Shared>, hub: Hub, shutdown: CancellationToken) {
    let config = &shared.config;
    let policy = ReconnectPolicy {
        initial: Duration::from_secs(1),
        max: config.reconnect_max,
        reset_after: Duration::ZERO,
        operator_initial: config.slow_retry,
        operator_max: config.slow_retry,
    };
    let mut reconnect = Reconnect::new(policy);
    shared.set_nudge(reconnect.nudger());
    loop {
        hub.link_state(LinkState::Connecting { attempt: reconnect.attempt() });
        let end = session(&shared, &hub, &shutdown, &mut reconnect).await;
        let failure = match end {
            End::Shutdown => return,
            End::Transient(state) => {
                let state = match state {
                    LinkState::Retrying { error, .. } => {
                        LinkState::Retrying { attempt: reconnect.attempt() + 1, error }
                    }
                    other => other,
                };
                hub.link_state(state);
                Failure::Transient
            }
            End::TransientHealth(health) => {
                warn!(detail = ?health.detail, "slack refused the socket; retrying");
                hub.health(health);
                Failure::Transient
            }
            End::Operator(health) => {
                warn!(detail = ?health.detail, "slack refuses the link; retrying slowly");
                hub.health(health);
                Failure::Operator
            }
        };
        if !reconnect.wait(failure, &shutdown).await {
            return;
        }
    }
}

/// Opens a socket: a fresh URL from `apps.connections.open`, then the WebSocket.
async fn open(shared: &Shared) -> Result<(WsSender, WsReceiver), End> {
    let url = match shared.web.connections_open().await {
        Ok(url) => url,
        Err(err) => {
            if let CallError::RateLimited(wait) = err {
                // Slack says when to ask again (the task is aborted if the driver stops).
                tokio::time::sleep(wait.min(MAX_RATE_LIMIT_WAIT)).await;
            }
            return Err(call_end("apps.connections.open", &err));
        }
    };
    let url = Url::parse(&url).map_err(|_| {
        End::Transient(LinkState::Retrying {
            attempt: 0,
            error: "apps.connections.open returned an invalid URL".into(),
        })
    })?;
    let options = WsOptions {
        ping_interval: shared.config.ping_interval,
        idle_timeout: shared.config.idle_timeout,
        ..WsOptions::default()
    };
    websocket::connect(&url, &options)
        .await
        .map_err(|err| End::Transient(LinkState::Retrying { attempt: 0, error: err.to_string() }))
}

/// Reads one socket into the loop's queue until it ends.
async fn read(id: u64, mut receiver: WsReceiver, events: mpsc::Sender<LinkEvent>) {
    let end = loop {
        match receiver.recv().await {
            Ok(Some(WsMessage::Text(text))) => match serde_json::from_str::<SocketFrame>(&text) {
                Ok(frame) => {
                    if events.send(LinkEvent::Frame(id, frame)).await.is_err() {
                        return;
                    }
                }
                Err(err) => warn!(socket = id, error = %err, "unreadable Socket Mode frame"),
            },
            Ok(Some(WsMessage::Binary(_))) => debug!(socket = id, "binary frame ignored"),
            Ok(None) => break Ok(()),
            Err(err) => break Err(err),
        }
    };
    let _ = events.send(LinkEvent::Ended(id, end)).await;
}

/// One connection's life: identity, the first socket, and serving until it is lost.
async fn session(
    shared: &Arc<Shared>,
    hub: &Hub,
    shutdown: &CancellationToken,
    reconnect: &mut Reconnect,
) -> End {
    tokio::select! {
        () = shutdown.cancelled() => return End::Shutdown,
        identity = shared.identity() => {
            if let Err(end) = identity {
                return end;
            }
        }
    }
    let (events_tx, mut events) = mpsc::channel(LINK_EVENTS);
    let mut readers = JoinSet::new();
    let mut links: HashMap<u64, Link> = HashMap::new();
    let mut next_id = 0u64;
    let mut primary: Option<u64> = None;
    let mut replacing = false;
    let mut opening: JoinSet<Result<(WsSender, WsReceiver), End>> = JoinSet::new();
    // Replaced sockets: the grace timers, then their drains.
    let mut retiring: JoinSet<u64> = JoinSet::new();
    let mut closing: JoinSet<()> = JoinSet::new();
    // A socket that does not say hello within the idle timeout is given up.
    let mut hello_due: Option<tokio::time::Instant> = None;

    let first = shared.clone();
    opening.spawn(async move { open(&first).await });
    let end = loop {
        let hello_timeout = async {
            match hello_due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => break End::Shutdown,
            () = hello_timeout => {
                hello_due = None;
                if primary.is_none() {
                    break End::Transient(LinkState::Retrying { attempt: 0, error: "slack sent no hello".into() });
                }
                replacing = false;
                warn!("the replacement socket sent no hello; the current one keeps serving");
            }
            Some(opened) = opening.join_next() => match opened {
                Ok(Ok((sender, receiver))) => {
                    next_id += 1;
                    let id = next_id;
                    readers.spawn(read(id, receiver, events_tx.clone()));
                    links.insert(id, Link { sender, acks: PendingAcks::new(), hello: false, retiring: false });
                    hello_due = Some(tokio::time::Instant::now() + shared.config.idle_timeout);
                    debug!(socket = id, "socket open; waiting for hello");
                }
                Ok(Err(end)) => {
                    if primary.is_none() {
                        break end;
                    }
                    // A failed refresh: the old socket still serves until Slack closes it.
                    replacing = false;
                    warn!("could not open the replacement socket; the current one keeps serving");
                }
                Err(_) => break End::Transient(LinkState::Retrying { attempt: 0, error: "socket open task failed".into() }),
            },
            Some(event) = events.recv() => match event {
                LinkEvent::Frame(id, SocketFrame::Hello(hello)) => {
                    let Some(link) = links.get_mut(&id) else { continue };
                    link.hello = true;
                    hello_due = None;
                    let previous = primary.replace(id);
                    replacing = false;
                    reconnect.connected();
                    hub.link_state(LinkState::up());
                    info!(socket = id, connections = ?hello.num_connections, "slack socket up");
                    if let Some(old) = previous.filter(|old| *old != id)
                        && let Some(link) = links.get_mut(&old)
                    {
                        // It keeps serving for a grace period: Slack may still deliver there.
                        link.retiring = true;
                        retiring.spawn(async move {
                            tokio::time::sleep(RETIRE_GRACE).await;
                            old
                        });
                    }
                }
                LinkEvent::Frame(id, SocketFrame::EventsApi(envelope)) => {
                    if let Some(link) = links.get(&id) {
                        on_event(shared, hub, link, envelope).await;
                    }
                }
                LinkEvent::Frame(id, SocketFrame::Interactive(envelope)) => {
                    if let Some(link) = links.get(&id) {
                        ack(&link.sender, &envelope.envelope_id).await;
                        on_interaction(shared, envelope);
                    }
                }
                LinkEvent::Frame(id, SocketFrame::SlashCommands(envelope)) => {
                    if let Some(link) = links.get(&id) {
                        ack(&link.sender, &envelope.envelope_id).await;
                        info!("slash commands are not handled by this driver; acknowledged and dropped");
                    }
                }
                LinkEvent::Frame(_, SocketFrame::Other) => {}
                LinkEvent::Frame(id, SocketFrame::Disconnect(disconnect)) => {
                    info!(socket = id, reason = %disconnect.reason, "slack asks to disconnect");
                    match disconnect.reason.as_str() {
                        "warning" | "refresh_requested" => {
                            if Some(id) == primary && !replacing {
                                replacing = true;
                                let next = shared.clone();
                                opening.spawn(async move { open(&next).await });
                            }
                        }
                        "link_disabled" => {
                            break End::Operator(unavailable(
                                "link_disabled",
                                "Socket Mode is switched off in the Slack app settings (link_disabled)",
                            ));
                        }
                        "too_many_websockets" => {
                            break End::TransientHealth(degraded(
                                "too_many_websockets",
                                "slack refused the socket: the app holds too many (too_many_websockets)",
                            ));
                        }
                        other => {
                            break End::Transient(LinkState::Retrying { attempt: 0, error: format!("slack disconnected: {other}") });
                        }
                    }
                }
                LinkEvent::Ended(id, result) => {
                    let Some(link) = links.remove(&id) else { continue };
                    // Acknowledgements for this socket can no longer be sent: Slack redelivers.
                    let _ = link.acks.drain(Duration::ZERO).await;
                    if Some(id) != primary {
                        debug!(socket = id, retiring = link.retiring, "a socket other than the primary closed");
                        continue;
                    }
                    // The primary is gone: promote a replacement that already said hello.
                    primary = links.iter().find(|(_, l)| l.hello && !l.retiring).map(|(id, _)| *id);
                    if primary.is_some() {
                        continue;
                    }
                    break match result {
                        Err(TransportError::Idle(idle)) => End::Transient(LinkState::Stalled { idle }),
                        Err(err) => End::Transient(LinkState::Retrying { attempt: 0, error: err.to_string() }),
                        Ok(()) => End::Transient(LinkState::Retrying { attempt: 0, error: "slack closed the socket".into() }),
                    };
                }
            },
            Some(done) = retiring.join_next() => {
                if let Ok(id) = done
                    && let Some(link) = links.remove(&id)
                {
                    closing.spawn(close_retired(id, link));
                }
            }
            Some(_) = closing.join_next() => {}
        }
    };
    // Settle what the hub answers in time, then close every socket.
    let drain = if matches!(end, End::Shutdown) { DRAIN_ON_STOP } else { Duration::ZERO };
    for (_, link) in links.drain() {
        let _ = link.acks.drain(drain).await;
        link.sender.close().await;
    }
    opening.abort_all();
    retiring.abort_all();
    while closing.join_next().await.is_some() {}
    drop(events_tx);
    readers.abort_all();
    while readers.join_next().await.is_some() {}
    end
}

/// Closes a replaced socket once its acknowledgements settled (bounded).
async fn close_retired(id: u64, link: Link) {
    let left = link.acks.drain(DRAIN_OLD_SOCKET).await;
    if left > 0 {
        info!(
            socket = id,
            left, "replaced socket closed with envelopes unanswered; Slack redelivers them"
        );
    }
    link.sender.close().await;
}

/// `auth.test`, as a connection step.
pub(crate) async fn identify(web: &crate::web::WebApi) -> Result<BotIdentity, End> {
    match web.auth_test().await {
        Ok(auth) => Ok(BotIdentity { user_id: auth.user_id, bot_id: auth.bot_id }),
        Err(err) => {
            if let CallError::RateLimited(wait) = err {
                tokio::time::sleep(wait.min(MAX_RATE_LIMIT_WAIT)).await;
            }
            Err(call_end("auth.test", &err))
        }
    }
}
