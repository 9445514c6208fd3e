//! The checks about a driver's life rather than one request: the reconnect sequence (the
//! hub closes the socket three times; the first comeback is served as a reference hub, where
//! an unanswered inbound has to be resent), SIGTERM, and secrets leaked over the whole run.

use std::time::Duration;

use channeld_driver_sdk::testing::checks::backoff_problem;
use channeld_protocol::Frame;
use tokio::time::Instant;

use crate::conn::{HubMode, describe};
use crate::probes::{carries, probe, reply_to, request, take_stray};
use crate::report::CheckResult;
use crate::secrets::CANARY_VAR;
use crate::suite::{RECONNECT_WAIT, Session, Suite};

/// Reconnects observed in the `reconnect` check (the SDK waits about 1 s, 2 s, 4 s).
const RECONNECTS: usize = 3;
/// Beyond the drain time, how long a driver may take to exit after SIGTERM (process exit).
const EXIT_SLACK: Duration = Duration::from_secs(1);

impl Suite<'_> {
    /// `reference_hub`, `inject_redelivery` and `reconnect`, in that order.
    pub(crate) async fn reconnect_phase(&mut self) -> [CheckResult; 3] {
        if let Err(reason) = self.live().await {
            let skip = |name| CheckResult::skip(name, format!("no session: {reason}"));
            return [skip("reference_hub"), skip("inject_redelivery"), skip("reconnect")];
        }
        let mut gaps = Vec::new();
        let mut problem = None;
        let mut reference = None;
        let mut redelivery = None;
        for n in 0..RECONNECTS {
            let mode = if n == 0 { HubMode::Reference } else { HubMode::Extensions };
            match self.reopen(mode).await {
                Ok((session, gap)) => {
                    gaps.push(gap);
                    self.session = Some(session);
                }
                Err(reason) => {
                    problem = Some(reason);
                    break;
                }
            }
            if n == 0 {
                reference = Some(self.reference_checks().await);
                redelivery = Some(self.redelivery_check().await);
            } else if let Some(session) = self.session.as_mut()
                && let Err(err) = probe(&mut session.conn, "conformance-health-reconnected").await
            {
                let why = self.explain(err).await;
                problem = Some(format!("after reconnect {}: no health_response: {why}", n + 1));
                break;
            }
        }
        let shown: Vec<String> = gaps.iter().map(|g| format!("{:.2} s", g.as_secs_f64())).collect();
        let reconnect = match problem.or_else(|| backoff_problem(&gaps)) {
            Some(reason) => CheckResult::fail("reconnect", reason),
            None => CheckResult::pass(
                "reconnect",
                format!(
                    "reconnected {} times with hello first, after {}",
                    gaps.len(),
                    shown.join(", ")
                ),
            ),
        };
        let reference = match reference {
            Some(result) => result,
            None => self.reference_on_a_fresh_driver().await,
        };
        let redelivery = redelivery.unwrap_or_else(|| match self.opts.inject {
            None => CheckResult::skip("inject_redelivery", "no --inject command given"),
            Some(_) => CheckResult::fail("inject_redelivery", "the driver did not reconnect"),
        });
        [reference, redelivery, reconnect]
    }

    /// Closes the connection, waits for the driver to come back and shakes hands as `mode`
    /// says: the new session and how long the driver waited.
    async fn reopen(&mut self, mode: HubMode) -> Result<(Session, Duration), String> {
        self.drop_session();
        let closed = Instant::now();
        let conn = self.accept(RECONNECT_WAIT).await.map_err(|reason| {
            format!("no reconnect after the hub closed the connection: {reason}")
        })?;
        let gap = closed.elapsed();
        let session = self
            .handshake(conn, mode)
            .await
            .map_err(|reason| format!("after reconnecting: {reason}"))?;
        if session.hs.hello.channel != *self.channel() {
            return Err(format!(
                "after reconnecting the hello names channel {}",
                session.hs.hello.channel
            ));
        }
        Ok((session, gap))
    }

    /// `reference_hub` on the current (reference) session: health, and an outbound when the
    /// driver declared send.
    async fn reference_checks(&mut self) -> CheckResult {
        const NAME: &str = "reference_hub";
        let target = channeld_protocol::types::MessageTarget::new(
            self.channel().clone(),
            self.opts.conversation.clone(),
        );
        let Some(session) = self.session.as_mut() else {
            return CheckResult::fail(NAME, "no session");
        };
        let send = session.hs.hello.capabilities.send;
        if let Err(err) = probe(&mut session.conn, "conformance-health-reference").await {
            let why = self.explain(err).await;
            return CheckResult::fail(NAME, format!("no health_response without hello_ack: {why}"));
        }
        if !send {
            return CheckResult::pass(NAME, "no hello_ack sent; health_request answered");
        }
        let request_id = "conformance-outbound-reference";
        let frame = Frame::Outbound(channeld_protocol::frame::Delivery {
            request_id: crate::probes::id(request_id),
            message: channeld_protocol::types::OutboundMessage {
                target,
                body: channeld_protocol::types::MessageBody::text(
                    "conformance outbound, reference hub",
                )
                .expect("valid body"),
                metadata: Default::default(),
            },
        });
        match request(&mut session.conn, &frame, request_id).await {
            Ok(Frame::Receipt(_)) => {
                CheckResult::pass(NAME, "no hello_ack sent; health answered, outbound receipted")
            }
            Ok(Frame::Error(err)) => CheckResult::pass(
                NAME,
                format!("no hello_ack sent; health answered, outbound refused with {}", err.code),
            ),
            Ok(other) => CheckResult::fail(
                NAME,
                format!("the outbound was answered with {}", describe(&other)),
            ),
            Err(err) => {
                let why = self.explain(err).await;
                CheckResult::fail(NAME, format!("no receipt or error for {request_id}: {why}"))
            }
        }
    }

    /// `reference_hub` when the driver did not come back by itself: a new process.
    async fn reference_on_a_fresh_driver(&mut self) -> CheckResult {
        self.finish_driver().await;
        if let Err(err) = self.restart() {
            return CheckResult::skip("reference_hub", format!("no session: {err}"));
        }
        match self.connect(HubMode::Reference, RECONNECT_WAIT).await {
            Ok(session) => {
                self.session = Some(session);
                self.reference_checks().await
            }
            Err(reason) => CheckResult::fail("reference_hub", reason),
        }
    }

    /// `inject_redelivery`: the inbound left unanswered before the reconnect comes again with
    /// the same event id; the kit answers it (as a reference hub, with its `deliver`).
    async fn redelivery_check(&mut self) -> CheckResult {
        const NAME: &str = "inject_redelivery";
        if self.opts.inject.is_none() {
            return CheckResult::skip(NAME, "no --inject command given");
        }
        let Some(pending) = self.pending.take() else {
            return CheckResult::skip(NAME, "inject_inbound left no unanswered inbound");
        };
        let Some(session) = self.session.as_mut() else {
            return CheckResult::fail(NAME, "no session");
        };
        let found = match take_stray(&mut session.conn, &pending.text) {
            Some(inbound) => Ok(Frame::Inbound(inbound)),
            None => {
                let text = pending.text.clone();
                session
                    .conn
                    .wait_for(|frame| matches!(frame, Frame::Inbound(i) if carries(i, &text)))
                    .await
            }
        };
        let inbound = match found {
            Ok(Frame::Inbound(inbound)) => inbound,
            Ok(other) => return CheckResult::fail(NAME, format!("got {}", describe(&other))),
            Err(err) => {
                let why = self.explain(err).await;
                return CheckResult::fail(
                    NAME,
                    format!("the unanswered inbound {} was not resent: {why}", pending.event_id),
                );
            }
        };
        let reply = reply_to(&inbound, "conformance reply, reference hub");
        if let Some(session) = self.session.as_mut() {
            // A reference hub's deliver is what settles it; a failure shows in the next check.
            let _ = session.conn.send(&reply).await;
        }
        if inbound.event_id != pending.event_id {
            return CheckResult::fail(
                NAME,
                format!(
                    "resent with event id {}, first sent as {}: the id must be stable",
                    inbound.event_id, pending.event_id
                ),
            );
        }
        CheckResult::pass(
            NAME,
            format!("resent after reconnecting with the same event id {}", inbound.event_id),
        )
    }

    /// SIGTERM: the driver says `stop`, closes the connection and exits 0 within the drain time.
    pub(crate) async fn check_sigterm(&mut self) -> CheckResult {
        const NAME: &str = "sigterm";
        if let Err(reason) = self.live().await {
            return CheckResult::skip(NAME, format!("no session: {reason}"));
        }
        let drain = self.opts.drain;
        let started = Instant::now();
        let deadline = started + drain + EXIT_SLACK;
        let Some(driver) = self.driver.as_mut() else {
            return CheckResult::skip(NAME, "no driver process");
        };
        if !driver.terminate() {
            let exit = driver.describe_exit();
            return CheckResult::fail(NAME, format!("could not signal the driver: {exit}"));
        }
        let Some(session) = self.session.as_mut() else {
            return CheckResult::fail(NAME, "no session");
        };
        let stop = session.conn.wait_until(deadline, |f| matches!(f, Frame::Stop(_))).await;
        let stopped_after = started.elapsed();
        let closed = match &stop {
            Ok(_) => session.conn.wait_closed(deadline).await,
            Err(_) => Ok(()),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(driver) = self.driver.as_mut() else {
            return CheckResult::fail(NAME, "no driver process");
        };
        let status = driver.exited_within(left).await;
        let exited_after = started.elapsed();
        let limit = format!("{} s drain time + {} s", drain.as_secs(), EXIT_SLACK.as_secs());
        if let Err(err) = stop {
            let exit = match status {
                Some(status) => format!("; exited ({status})"),
                None => String::new(),
            };
            return CheckResult::fail(NAME, format!("no stop frame after SIGTERM: {err}{exit}"));
        }
        if closed.is_err() {
            return CheckResult::fail(
                NAME,
                format!("sent stop but kept the connection open past {limit}"),
            );
        }
        match status {
            None => CheckResult::fail(NAME, format!("still running {limit} after SIGTERM")),
            Some(status) if !status.success() => {
                let exit = driver.describe_exit();
                CheckResult::fail(NAME, format!("sent stop, then {exit}"))
            }
            Some(_) => CheckResult::pass(
                NAME,
                format!(
                    "stop after {} ms, exit 0 after {} ms (drain time {} s)",
                    stopped_after.as_millis(),
                    exited_after.as_millis(),
                    drain.as_secs()
                ),
            ),
        }
    }

    /// No watched value (the canary, `--secret` variables) on the socket, stdout or stderr of
    /// any process started in this run. Runs after every process was reaped.
    pub(crate) fn check_secret(&self) -> CheckResult {
        const NAME: &str = "secret";
        let leaks = self.leaks().found();
        if leaks.is_empty() {
            let vars = self.watched_vars().join(", ");
            return CheckResult::pass(
                NAME,
                format!("the values of {vars} never appeared on the socket, stdout or stderr"),
            );
        }
        let found: Vec<String> = leaks
            .iter()
            .map(|(var, place)| {
                let what = if var == CANARY_VAR { "the canary in " } else { "" };
                format!("{what}{var} appeared on {}", place.as_str())
            })
            .collect();
        CheckResult::fail(NAME, found.join("; "))
    }
}
