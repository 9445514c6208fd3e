//! A driver connection: the handshake (`hello` for this instance, one driver per instance,
//! `hello_ack` with the negotiated extensions), then its frames — inbound to the inbound
//! path, receipts and errors to the outbox (or the reply courier), command results, operator
//! action results and health to their waits, history requests to the ledger,
//! cancels to the run they name.
//! Legacy connections (no `hello`) use the same frame loop.

use std::sync::Arc;
use std::time::Duration;

use channeld_link::{FrameReader, FrameSink, SocketFirst, Turn};
use channeld_protocol::Frame;
use channeld_protocol::ext::{CancelRequest, CancelResult, PeerDeclaration};
use channeld_protocol::frame::{Hello, HelloAck, Lifecycle};
use channeld_protocol::types::{Health, HealthState};
use tokio::io::AsyncRead;
use tracing::{debug, info, warn};

use super::{answer_decode_error, closing};
use crate::connection::{Connection, PeerKind};
use crate::history;
use crate::hub::{HUB_NAME, Hub};
use crate::inbound::{self, cancel};
use crate::instance::Instance;
use crate::ledger;
use crate::outbox::receipts;

/// Serves a connection that said `hello`, until it leaves or the hub closes connections.
/// How long a closing connection's `stop` may wait for room in a queue a stalled driver
/// does not drain.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// Where a connection's writes stand against the stall timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stall {
    /// Nothing waits for the driver, or not for long.
    Flowing,
    /// A write has waited a third of the timeout: the instance shows Degraded.
    Degraded(Duration),
    /// A write has waited the whole timeout: the connection is closed (replies handed on
    /// it go back to pending, for the next connection).
    Close(Duration),
}

/// Pure: the verdict for a write blocked for `blocked` (`None`: not writing).
pub(crate) fn stall(blocked: Option<Duration>, timeout: Duration) -> Stall {
    match blocked {
        Some(blocked) if blocked >= timeout => Stall::Close(blocked),
        Some(blocked) if blocked >= timeout / 3 => Stall::Degraded(blocked),
        _ => Stall::Flowing,
    }
}

/// How often a connection checks its writes: ten times per timeout, at most once a second.
fn stall_check_every(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

pub(super) async fn run<R: AsyncRead + Unpin>(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    hello: Hello,
    sink: &FrameSink,
    reader: &mut FrameReader<R>,
    peer_pid: Option<i32>,
) {
    let Some(conn) = handshake(hub, inst, hello, sink, peer_pid).await else { return };
    frames(hub, inst, &conn, reader, None).await;
    conn.close();
    inst.release(&conn);
    hub.courier.connection_closed(inst, &conn);
    info!(instance = %inst.config.id, conn = conn.id, "driver disconnected");
}

async fn handshake(
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
    let declaration = PeerDeclaration::from_hello(&hello, hub.driver_extensions());
    let operator_actions = if declaration.extensions.operator_action {
        hello.operator_actions.clone()
    } else {
        Vec::new()
    };
    let conn = Arc::new(
        Connection::new(
            hub.ids.connection(),
            PeerKind::Driver,
            sink.clone(),
            declaration,
            peer_pid,
        )
        .with_operator_actions(operator_actions),
    );
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
    if !declaration.extensions.agent_env {
        // It sends no environment: runs waiting for one (after a restart) start without it.
        inst.settle_agent_env();
    } else if let Some(wait) = inst.agent_env_wait() {
        // Nor do they wait longer than `hub.agent_env_wait_secs` for a driver that sends none
        // (`env_settles`). The timer ends with the wait, or the hub's stop, whichever comes
        // first.
        let (inst, stopping, grace) =
            (inst.clone(), hub.shutdown.clone(), hub.config.agent_env_wait);
        hub.tasks.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(grace) => inst.settle_agent_env(),
                () = wait.cancelled() => {}
                () = stopping.cancelled() => {}
            }
        });
    }
    if hub.ledger.is_on() {
        // Hand the new driver the replies it is owed (retryable failures at once) and the
        // sends queued for it.
        hub.courier.ready(inst.config.id.as_str());
        let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
        hub.clone().tasks.spawn(async move {
            hub.outbox.dispatch_queued(&inst, &conn).await;
        });
    }
    Some(conn)
}

/// Whether `frame`, from a driver with `agent_env`, settles the environment of the runs that
/// wait for it after a restart before it is handled: an inbound (the driver sends its
/// environment before its first inbound, so it has none to send). The `agent_env` frame
/// settles it too, once applied. Pure.
fn env_settles(frame: &Frame) -> bool {
    matches!(frame, Frame::Inbound(_) | Frame::InboundEvent(_))
}

/// Reads a driver's frames until it leaves, or the hub closes connections or a reload removes
/// the instance (then it says `stop` first).
///
/// Corked (`ledger/cork.rs`): the ledger calls of the frames that came in one read (a
/// receipt and the next message) go to the ledger together, when the reader would wait for
/// the socket, so they share one commit. (A frame whose handling waits, e.g. for room in a
/// driver's full write queue, delays the calls held before it by as long.) A plain
/// function, not an `async fn` around the
/// loop: a wrapper that takes the loop's future by value keeps copies of its state (it cost
/// 16 KiB per idle connection), and a boxed loop no longer shares its memory with the
/// handshake before it (3 KiB).
pub(super) fn frames<'a, R: AsyncRead + Unpin>(
    hub: &'a Arc<Hub>,
    inst: &'a Arc<Instance>,
    conn: &'a Arc<Connection>,
    reader: &'a mut FrameReader<R>,
    first: Option<Frame>,
) -> impl Future<Output = ()> + 'a {
    ledger::corked(read_frames(hub, inst, conn, reader, first))
}

async fn read_frames<R: AsyncRead + Unpin>(
    hub: &Arc<Hub>,
    inst: &Arc<Instance>,
    conn: &Arc<Connection>,
    reader: &mut FrameReader<R>,
    mut first: Option<Frame>,
) {
    let stall_timeout = hub.config.stall_timeout;
    let check_every = stall_check_every(stall_timeout);
    // Armed only while a write waits for the driver: an idle or flowing connection costs no
    // timer (thousands of connections would otherwise wake the hub every second each).
    let mut stall_check: Option<tokio::time::Interval> = None;
    let mut degraded = false;
    // Made once per connection, not once per frame: each registers a waiter when first
    // polled, and a fresh one per frame would register and drop it again for every frame.
    let closing = closing(hub, inst);
    let writer_gone = conn.sink.closed();
    let write_blocked = conn.sink.write_blocked();
    tokio::pin!(closing, writer_gone, write_blocked);
    // A driver with `agent_env` sends it before its first inbound, if at all (PROTOCOL.md).
    let mut env_unsettled = conn.declaration.extensions.agent_env;
    // A frame already here goes on without polling the rest (each poll takes a lock);
    // the rest still go first every `FRAMES_BETWEEN_CHECKS` frames, so a driver that never
    // pauses is still closed.
    let mut turns = SocketFirst::default();
    loop {
        if first.is_none() && !reader.ready() {
            // About to wait for the socket: what the frames so far queued goes now.
            ledger::release().await;
        }
        let turn = match first.take() {
            Some(frame) => Turn::Frame(Ok(Some(Ok(frame)))),
            None => {
                let others = async {
                    tokio::select! {
                        biased;
                        () = &mut closing => Woke::Closing,
                        () = &mut write_blocked, if stall_check.is_none() => Woke::WriteBlocked,
                        _ = tick(&mut stall_check) => Woke::Check,
                        () = &mut writer_gone => Woke::WriterGone,
                    }
                };
                turns.next(reader.next(), others).await
            }
        };
        let item = match turn {
            Turn::Frame(item) => item,
            Turn::Other(Woke::Closing) => {
                // A driver that does not read would hold this send: bounded by the grace.
                let stop = Frame::Stop(Lifecycle { request_id: hub.ids.request("stop") });
                let _ = tokio::time::timeout(STOP_GRACE, conn.sink.send(&stop)).await;
                break;
            }
            Turn::Other(Woke::WriteBlocked) => {
                let mut check = tokio::time::interval_at(
                    tokio::time::Instant::now() + check_every,
                    check_every,
                );
                check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                stall_check = Some(check);
                write_blocked.set(conn.sink.write_blocked());
                continue;
            }
            Turn::Other(Woke::Check) => {
                let blocked = conn.sink.write_blocked_for();
                if blocked.is_none() {
                    // Nothing waits for the driver now: disarmed until a write waits again.
                    stall_check = None;
                }
                match stall(blocked, stall_timeout) {
                    Stall::Flowing if degraded => {
                        degraded = false;
                        info!(instance = %inst.config.id, conn = conn.id, "driver reads its socket again");
                        inst.set_health(Health::new(
                            HealthState::Ready,
                            Some("driver reads its socket again".into()),
                        ));
                    }
                    Stall::Flowing => {}
                    Stall::Degraded(blocked) => {
                        if !degraded {
                            degraded = true;
                            warn!(instance = %inst.config.id, conn = conn.id, blocked_s = blocked.as_secs(), queued = conn.sink.queued(), "driver is not reading its socket");
                        }
                        let detail =
                            format!("driver has not read its socket for {} s", blocked.as_secs());
                        inst.set_health(Health::new(HealthState::Degraded, Some(detail)));
                    }
                    Stall::Close(blocked) => {
                        warn!(instance = %inst.config.id, conn = conn.id, blocked_s = blocked.as_secs(), "driver did not read its socket within stall_timeout_secs; closing the connection");
                        inst.record_error(format!(
                            "closed a driver connection that did not read for {} s",
                            blocked.as_secs()
                        ));
                        break;
                    }
                }
                continue;
            }
            Turn::Other(Woke::WriterGone) => break,
        };
        let frame = match item {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(err))) => {
                conn.touch();
                inst.record_error(format!("bad line from driver: {err}"));
                answer_decode_error(&conn.sink, &err);
                continue;
            }
            Ok(None) => break,
            Err(err) => {
                debug!(instance = %inst.config.id, error = %err, "read failed");
                break;
            }
        };
        conn.touch();
        if env_unsettled && env_settles(&frame) {
            env_unsettled = false;
            inst.settle_agent_env();
        }
        match frame {
            Frame::Start(_) => debug!(instance = %inst.config.id, "driver started"),
            Frame::Stop(_) => {
                info!(instance = %inst.config.id, conn = conn.id, "driver said stop");
                break;
            }
            // Boxed, the four of them: awaited inline, the largest (an inbound's handling,
            // 4.7 KB) sized this loop's state, and so every connection's task, idle or not
            // (8 KB each; 4 KB boxed). A box lives only while its frame is handled.
            Frame::Inbound(inbound) => {
                Box::pin(inbound::on_message(hub, inst, conn, inbound)).await
            }
            Frame::InboundEvent(event) => Box::pin(inbound::on_event(hub, inst, conn, event)).await,
            Frame::Receipt(receipt) => {
                if let Some(receipt) = receipts::on_receipt(inst, conn, receipt) {
                    Box::pin(hub.courier.on_receipt(inst, conn, receipt)).await;
                }
            }
            Frame::Error(err) => {
                if let Some(err) = receipts::on_error(inst, conn, err) {
                    Box::pin(hub.courier.on_error(inst, conn, err)).await;
                }
            }
            Frame::CommandResult(result) => {
                let request_id = result.request_id.clone();
                if !conn.complete_command(result) {
                    debug!(%request_id, "command_result nobody waits for");
                }
            }
            Frame::OperatorActionResult(result) => {
                let request_id = result.request_id.clone();
                if !conn.complete_operator_action(result) {
                    debug!(%request_id, "operator_action_result nobody waits for");
                }
            }
            Frame::Health(report) => {
                if inst.set_health(report.health) {
                    hub.courier.ready(inst.config.id.as_str());
                }
            }
            Frame::HealthResponse(response) => {
                conn.complete_health(&response.request_id, response.health)
            }
            Frame::HealthRequest(request) => {
                let answer = Frame::HealthResponse(channeld_protocol::frame::HealthResponse {
                    request_id: request.request_id,
                    health: Health::new(HealthState::Ready, None),
                });
                let _ = conn.sink.try_send(&answer);
            }
            Frame::HistoryRequest(request) if conn.declaration.extensions.history => {
                // A ledger read: answered off the reader, so the frames behind it go on.
                let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
                hub.clone().tasks.spawn(async move {
                    let answer = history::answer(&hub, &inst, request).await;
                    let _ = conn.sink.send(&answer).await;
                });
            }
            Frame::Cancel(request) if conn.declaration.extensions.cancel => {
                // Answered once the run stopped: off the reader, which must go on meanwhile.
                let (hub, inst, conn) = (hub.clone(), inst.clone(), conn.clone());
                hub.clone().tasks.spawn(async move {
                    let CancelRequest { request_id, event_id } = request;
                    let answer = match cancel::cancel(&hub, &inst, event_id.clone()).await {
                        Ok(done) => Frame::CancelResult(CancelResult {
                            request_id,
                            event_id,
                            cancelled: done.cancelled,
                            state: done.state.to_owned(),
                        }),
                        Err(err) => Frame::error(
                            Some(request_id),
                            err.code(),
                            err.to_string(),
                            err.retryable(),
                        ),
                    };
                    let _ = conn.sink.send(&answer).await;
                });
            }
            Frame::AgentEnv(env) if conn.declaration.extensions.agent_env => {
                let names: Vec<String> = env.env.keys().cloned().collect();
                match inst.set_agent_env(env) {
                    Ok(()) => {
                        info!(instance = %inst.config.id, ?names, "agent environment set");
                        // The names only, so runs a restart recovers wait for the values.
                        // Queued in order with the frames' other calls; its commit is not
                        // waited for (losing it costs only that wait).
                        let id = inst.config.id.to_string();
                        let _ = hub.ledger.remember_agent_env(id, names).await;
                    }
                    Err(why) => {
                        warn!(instance = %inst.config.id, %why, "agent environment refused");
                        let answer = Frame::error(None, "invalid_agent_env", why, false);
                        let _ = conn.sink.try_send(&answer);
                    }
                }
                inst.settle_agent_env();
                env_unsettled = false;
            }
            Frame::Event(_) => {}
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
    // Whatever the last frames queued goes before the connection ends.
    ledger::release().await;
}

/// What a driver connection's frame loop woke for, besides its socket.
enum Woke {
    /// The hub closes connections, or a reload removed the instance.
    Closing,
    /// A write began to wait for the driver: the stall check is armed.
    WriteBlocked,
    /// The stall check's tick.
    Check,
    /// The connection's writer ended (a write failed).
    WriterGone,
}

/// The next tick of the stall check while it is armed; never while it is not.
async fn tick(check: &mut Option<tokio::time::Interval>) {
    match check {
        Some(check) => {
            check.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_write_degrades_at_a_third_of_the_timeout_and_closes_at_the_timeout() {
        let timeout = Duration::from_secs(60);
        assert_eq!(stall(None, timeout), Stall::Flowing);
        assert_eq!(stall(Some(Duration::from_secs(19)), timeout), Stall::Flowing);
        let degraded = Duration::from_secs(20);
        assert_eq!(stall(Some(degraded), timeout), Stall::Degraded(degraded));
        assert_eq!(stall(Some(timeout), timeout), Stall::Close(timeout));
        assert_eq!(stall_check_every(timeout), Duration::from_secs(1));
        assert_eq!(stall_check_every(Duration::from_millis(500)), Duration::from_millis(100));
    }

    #[test]
    fn only_an_inbound_settles_the_agent_env_before_it_is_handled() {
        use channeld_protocol::decode;
        let inbound = decode(
            br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"inbound","event_id":"e-1","message":{"id":"m-1","target":{"channel":"t.one","conversation":"c"},"sender":{"id":"u"},"body":{"text":"hi"},"timestamp_ms":1700000000000,"metadata":{}}}}"#,
        )
        .unwrap();
        assert!(env_settles(&inbound), "{inbound:?}");
        let start =
            Frame::Start(Lifecycle { request_id: channeld_protocol::Id::new("s-1").unwrap() });
        assert!(!env_settles(&start));
        let env = Frame::AgentEnv(channeld_protocol::ext::AgentEnv { env: Default::default() });
        assert!(!env_settles(&env), "applied first, then settled");
    }
}
