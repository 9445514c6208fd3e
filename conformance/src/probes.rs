//! The checks that need one live session: hello, health, outbound and its repeat, undeclared
//! effects and commands, error frames, invalid and oversize lines, and the `--inject` checks
//! that run on the first connection. Each returns its result; none panics.

use channeld_driver_sdk::testing::checks::{
    answers, commands_to_reject, hello_problems, inbound_problems, receipt_problem,
    rejection_problem, sample_effects,
};
use channeld_protocol::frame::{Accepted, CommandFrame, Delivery, EffectFrame, Inbound, Lifecycle};
use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{ABI, Frame, Id, MAX_LINE_BYTES};

use crate::conn::{Conn, Handshake, WaitError, describe};
use crate::inject;
use crate::report::CheckResult;
use crate::suite::{Pending, Suite};

/// The request id of the first `outbound` (sent again by `outbound_repeat`).
const OUTBOUND_ID: &str = "conformance-outbound-1";

/// Gets the live session or returns the check's SKIP from the calling function.
macro_rules! live {
    ($suite:expr, $name:expr) => {
        match $suite.live().await {
            Ok(session) => session,
            Err(reason) => return CheckResult::skip($name, format!("no session: {reason}")),
        }
    };
}

/// Turns a wait's failure into the check's FAIL, returned from the calling function.
macro_rules! or_fail {
    ($suite:expr, $name:expr, $what:expr, $result:expr) => {
        match $result {
            Ok(value) => value,
            Err(err) => {
                let why = $suite.explain(err).await;
                return CheckResult::fail($name, format!("{}: {why}", $what));
            }
        }
    };
}

impl Suite<'_> {
    pub(crate) fn check_hello(&self, hs: &Handshake) -> CheckResult {
        let problems = hello_problems(&hs.hello, self.channel());
        if !problems.is_empty() {
            return CheckResult::fail("hello", problems.join("; "));
        }
        let extensions = if hs.negotiated.is_empty() {
            "no extensions".to_owned()
        } else {
            format!("extensions {}", hs.negotiated.names().join(", "))
        };
        CheckResult::pass(
            "hello",
            format!(
                "hello for {} then start, declaration consistent, {extensions}",
                hs.hello.channel
            ),
        )
    }

    pub(crate) async fn check_health(&mut self) -> CheckResult {
        const NAME: &str = "health";
        let session = live!(self, NAME);
        let answer = probe(&mut session.conn, "conformance-health-1").await;
        or_fail!(self, NAME, "no health_response", answer);
        CheckResult::pass(NAME, "health_request answered with a health_response for its id")
    }

    pub(crate) async fn check_outbound(&mut self) -> CheckResult {
        const NAME: &str = "outbound";
        let target = self.target();
        let channel = self.channel().clone();
        let session = live!(self, NAME);
        let send = session.hs.hello.capabilities.send;
        let frame = outbound(OUTBOUND_ID, target, "conformance outbound");
        let answer = request(&mut session.conn, &frame, OUTBOUND_ID).await;
        let answer = or_fail!(self, NAME, format!("no receipt or error for {OUTBOUND_ID}"), answer);
        match answer {
            Frame::Receipt(receipt) if !send => CheckResult::fail(
                NAME,
                format!(
                    "receipted (message id {}) although the hello did not declare send",
                    receipt.receipt.message_id
                ),
            ),
            Frame::Receipt(receipt) => match receipt_problem(&receipt.receipt, &channel) {
                Some(problem) => CheckResult::fail(NAME, problem),
                None => {
                    let id = receipt.receipt.message_id.clone();
                    self.receipt = Some(receipt.receipt);
                    CheckResult::pass(NAME, format!("receipt with message id {id}"))
                }
            },
            Frame::Error(err) => {
                let declared = if send { "send declared" } else { "send not declared" };
                CheckResult::pass(NAME, format!("refused with error {} ({declared})", err.code))
            }
            other => CheckResult::fail(NAME, format!("answered with {}", describe(&other))),
        }
    }

    pub(crate) async fn check_outbound_repeat(&mut self) -> CheckResult {
        const NAME: &str = "outbound_repeat";
        let Some(first) = self.receipt.clone() else {
            return CheckResult::skip(NAME, "the first outbound was not receipted");
        };
        let target = self.target();
        let session = live!(self, NAME);
        let frame = outbound(OUTBOUND_ID, target, "conformance outbound");
        let answer = request(&mut session.conn, &frame, OUTBOUND_ID).await;
        let answer = or_fail!(self, NAME, format!("the repeated {OUTBOUND_ID}"), answer);
        match answer {
            Frame::Receipt(again) if again.receipt.message_id == first.message_id => {
                CheckResult::pass(
                    NAME,
                    format!(
                        "the same receipt again (message id {}): posted once",
                        first.message_id
                    ),
                )
            }
            Frame::Receipt(again) => CheckResult::fail(
                NAME,
                format!(
                    "a repeated outbound got message id {}, the first {}: posted twice",
                    again.receipt.message_id, first.message_id
                ),
            ),
            other => CheckResult::fail(
                NAME,
                format!("a repeated outbound was answered with {}", describe(&other)),
            ),
        }
    }

    pub(crate) async fn check_undeclared_effect(&mut self) -> CheckResult {
        const NAME: &str = "undeclared_effect";
        let target = self.target();
        let session = live!(self, NAME);
        let declared = session.hs.hello.actions;
        let effects: Vec<_> =
            sample_effects().into_iter().filter(|effect| !declared.allows(effect)).collect();
        if effects.is_empty() {
            return CheckResult::skip(NAME, "every effect is declared");
        }
        let mut names = Vec::new();
        for effect in effects {
            let action = effect.action();
            let request_id = format!("conformance-effect-{action}");
            let frame = Frame::Effect(EffectFrame {
                request_id: id(&request_id),
                target: target.clone(),
                effect,
            });
            let answer = request(&mut session.conn, &frame, &request_id).await;
            let answer = or_fail!(self, NAME, format!("undeclared {action}"), answer);
            match answer {
                Frame::Error(err) if err.code == "unsupported_effect" => names.push(action),
                other => {
                    return CheckResult::fail(
                        NAME,
                        format!(
                            "undeclared {action} answered with {}, expected error unsupported_effect",
                            describe(&other)
                        ),
                    );
                }
            }
        }
        CheckResult::pass(NAME, format!("refused with unsupported_effect: {}", names.join(", ")))
    }

    pub(crate) async fn check_undeclared_command(&mut self) -> CheckResult {
        const NAME: &str = "undeclared_command";
        let target = self.target();
        let session = live!(self, NAME);
        let commands = commands_to_reject(&session.hs.hello.capabilities);
        if commands.is_empty() {
            return CheckResult::skip(NAME, "every kind of command is declared");
        }
        let mut names = Vec::new();
        for (name, command) in commands {
            let request_id = format!("conformance-command-{name}");
            let frame = CommandFrame {
                request_id: id(&request_id),
                session: id("conformance-session"),
                command_id: id(&format!("conformance-{name}")),
                command,
                target: Some(target.clone()),
            };
            let answer =
                request(&mut session.conn, &Frame::Command(frame.clone()), &request_id).await;
            let answer = or_fail!(self, NAME, format!("undeclared {name}"), answer);
            let problem = match &answer {
                Frame::CommandResult(result) => rejection_problem(&frame, result),
                other => Some(format!(
                    "answered with {}, expected command_result rejected",
                    describe(other)
                )),
            };
            if let Some(problem) = problem {
                return CheckResult::fail(NAME, format!("{name}: {problem}"));
            }
            names.push(name);
        }
        CheckResult::pass(NAME, format!("rejected: {}", names.join(", ")))
    }

    pub(crate) async fn check_error_frame(&mut self) -> CheckResult {
        const NAME: &str = "error_frame";
        let unknown = id(&format!("conformance-unknown-{}", self.nonce));
        let session = live!(self, NAME);
        let frames = [
            Frame::error(None, "conformance", "an error about nothing in particular", false),
            Frame::error(Some(unknown), "conformance", "an error about no known request", true),
        ];
        for frame in &frames {
            let sent = session.conn.send(frame).await;
            or_fail!(self, NAME, "sending an error frame", sent);
        }
        let session = live!(self, NAME);
        let answer = probe(&mut session.conn, "conformance-health-after-error").await;
        or_fail!(self, NAME, "after two error frames", answer);
        CheckResult::pass(
            NAME,
            "error frames (null and unknown request id) did not end the session",
        )
    }

    pub(crate) async fn check_invalid_line(&mut self) -> CheckResult {
        const NAME: &str = "invalid_line";
        let lines = [
            ("this line is not json\n".to_owned(), "invalid_json"),
            (
                format!("{{\"abi\":\"{ABI}\",\"frame\":{{\"type\":\"conformance_no_such_frame\"}}}}\n"),
                "unknown_frame_type",
            ),
            (
                "{\"abi\":\"cortexfs.channel.socket/v0\",\"frame\":{\"type\":\"health_request\",\"request_id\":\"conformance-old-abi\"}}\n"
                    .to_owned(),
                "unsupported_abi",
            ),
        ];
        let session = live!(self, NAME);
        for (line, _) in &lines {
            let sent = session.conn.send_raw(line.as_bytes()).await;
            or_fail!(self, NAME, "sending an invalid line", sent);
        }
        let session = live!(self, NAME);
        let codes = survive(&mut session.conn, "conformance-health-after-invalid").await;
        let codes = or_fail!(self, NAME, "after three invalid lines", codes);
        let missing: Vec<&str> = lines
            .iter()
            .map(|(_, code)| *code)
            .filter(|code| !codes.iter().any(|c| c == code))
            .collect();
        if !missing.is_empty() {
            return CheckResult::fail(
                NAME,
                format!("survived, but no error frame answered with {}", missing.join(", ")),
            );
        }
        CheckResult::pass(
            NAME,
            "answered invalid_json, unknown_frame_type and unsupported_abi, and carried on",
        )
    }

    pub(crate) async fn check_oversize_line(&mut self) -> CheckResult {
        const NAME: &str = "oversize_line";
        let mut line = format!(
            "{{\"abi\":\"{ABI}\",\"frame\":{{\"type\":\"health_request\",\"request_id\":\"conformance-oversize\",\"pad\":\""
        );
        line.push_str(&"x".repeat(MAX_LINE_BYTES + 4096));
        line.push_str("\"}}\n");
        let session = live!(self, NAME);
        let sent = session.conn.send_raw(line.as_bytes()).await;
        or_fail!(self, NAME, format!("sending a {} byte line", line.len()), sent);
        let session = live!(self, NAME);
        let codes = survive(&mut session.conn, "conformance-health-after-oversize").await;
        let codes = or_fail!(self, NAME, format!("after a {} byte line", line.len()), codes);
        if codes.iter().any(|c| c == "answered") {
            return CheckResult::fail(NAME, "the oversize line was read as a frame and answered");
        }
        if !codes.iter().any(|c| c == "line_too_long") {
            return CheckResult::fail(
                NAME,
                "survived, but no error frame answered with line_too_long",
            );
        }
        CheckResult::pass(
            NAME,
            format!(
                "a {} byte line was answered with line_too_long, and the session carried on",
                line.len()
            ),
        )
    }

    pub(crate) async fn check_inject_inbound(&mut self) -> CheckResult {
        const NAME: &str = "inject_inbound";
        let Some(template) = self.opts.inject.clone() else {
            return CheckResult::skip(NAME, "no --inject command given");
        };
        let text = format!("conformance {} first", self.nonce);
        let inbound = match self.injected(&template, &text).await {
            Ok(inbound) => inbound,
            Err(reason) => return CheckResult::fail(NAME, reason),
        };
        let Some(session) = self.session.as_ref() else {
            return CheckResult::fail(NAME, "the session ended");
        };
        let problems = inbound_problems(&session.hs.hello, self.channel(), &inbound, &text);
        if !problems.is_empty() {
            return CheckResult::fail(NAME, problems.join("; "));
        }
        // Left unanswered on purpose: after the next reconnect it has to come again.
        self.pending = Some(Pending { event_id: inbound.event_id.clone(), text });
        CheckResult::pass(NAME, format!("inbound with event id {}", inbound.event_id))
    }

    pub(crate) async fn check_deliver_once(&mut self) -> CheckResult {
        const NAME: &str = "deliver_once";
        let Some(template) = self.opts.inject.clone() else {
            return CheckResult::skip(NAME, "no --inject command given");
        };
        let text = format!("conformance {} second", self.nonce);
        let inbound = match self.injected(&template, &text).await {
            Ok(inbound) => inbound,
            Err(reason) => return CheckResult::fail(NAME, reason),
        };
        let session = live!(self, NAME);
        let negotiated = session.hs.negotiated;
        if negotiated.accepted {
            let accepted = Accepted { event_id: inbound.event_id.clone(), duplicate: false };
            let sent = session.conn.send(&Frame::Accepted(accepted)).await;
            or_fail!(self, NAME, "sending accepted", sent);
        }
        let reply = reply_to(&inbound, "conformance reply");
        let session = live!(self, NAME);
        if !negotiated.reply_receipt {
            let sent = session.conn.send(&reply).await;
            or_fail!(self, NAME, "sending the deliver", sent);
            return CheckResult::skip(
                NAME,
                "without the reply_receipt extension a repeated deliver cannot be observed",
            );
        }
        let event_id = inbound.event_id.as_str();
        let first = request(&mut session.conn, &reply, event_id).await;
        let first = or_fail!(self, NAME, "no receipt for the deliver", first);
        let Frame::Receipt(first) = first else {
            return CheckResult::fail(
                NAME,
                format!("the deliver was answered with {}", describe(&first)),
            );
        };
        let session = live!(self, NAME);
        let again = request(&mut session.conn, &reply, event_id).await;
        let again = or_fail!(self, NAME, "no receipt for the repeated deliver", again);
        match again {
            Frame::Receipt(again) if again.receipt.message_id == first.receipt.message_id => {
                CheckResult::pass(
                    NAME,
                    format!(
                        "a repeated deliver got the same receipt (message id {}): posted once",
                        first.receipt.message_id
                    ),
                )
            }
            Frame::Receipt(again) => CheckResult::fail(
                NAME,
                format!(
                    "a repeated deliver got message id {}, the first {}: posted twice",
                    again.receipt.message_id, first.receipt.message_id
                ),
            ),
            other => CheckResult::fail(
                NAME,
                format!("the repeated deliver was answered with {}", describe(&other)),
            ),
        }
    }

    /// Runs the stimulus for `text` and waits for the inbound that carries it.
    pub(crate) async fn injected(&mut self, template: &str, text: &str) -> Result<Inbound, String> {
        let limit = self.opts.timeout;
        let session = self.live().await.map_err(|reason| format!("no session: {reason}"))?;
        inject::run(template, text, limit).await?;
        let found = take_stray(&mut session.conn, text);
        let waited = match found {
            Some(inbound) => return Ok(inbound),
            None => {
                session
                    .conn
                    .wait_for(|frame| matches!(frame, Frame::Inbound(i) if carries(i, text)))
                    .await
            }
        };
        match waited {
            Ok(Frame::Inbound(inbound)) => Ok(inbound),
            Ok(other) => Err(format!("expected an inbound, got {}", describe(&other))),
            Err(err) => {
                let why = self.explain(err).await;
                Err(format!("no inbound carrying {text:?} after the --inject command: {why}"))
            }
        }
    }

    pub(crate) fn check_frames(&self) -> CheckResult {
        const NAME: &str = "frames";
        let mut codes = self.bad_lines.clone();
        if let Some(session) = &self.session {
            codes.extend(session.conn.bad_lines.iter().cloned());
        }
        if codes.is_empty() {
            return CheckResult::pass(NAME, "every line the driver sent decoded as a frame");
        }
        codes.dedup();
        CheckResult::fail(
            NAME,
            format!("lines from the driver that did not decode: {}", codes.join(", ")),
        )
    }

    fn target(&self) -> MessageTarget {
        MessageTarget::new(self.channel().clone(), self.opts.conversation.clone())
    }
}

/// Sends `frame` and waits for the frame that answers `request_id`.
pub(crate) async fn request(
    conn: &mut Conn,
    frame: &Frame,
    request_id: &str,
) -> Result<Frame, WaitError> {
    conn.send(frame).await?;
    conn.wait_for(|f| answers(f, request_id)).await
}

/// A `health_request` answered by its `health_response` (an `error` for it counts as no).
pub(crate) async fn probe(conn: &mut Conn, request_id: &str) -> Result<(), WaitError> {
    let frame = Frame::HealthRequest(Lifecycle { request_id: id(request_id) });
    match request(conn, &frame, request_id).await? {
        Frame::HealthResponse(_) => Ok(()),
        other => Err(WaitError::Answered(describe(&other))),
    }
}

/// Probes health after bad lines: the codes of every `error` frame read until the
/// `health_response`, plus `answered` if the oversize request itself got one.
async fn survive(conn: &mut Conn, request_id: &str) -> Result<Vec<String>, WaitError> {
    let frame = Frame::HealthRequest(Lifecycle { request_id: id(request_id) });
    conn.send(&frame).await?;
    let mut codes = Vec::new();
    loop {
        let frame = conn
            .wait_for(|f| {
                matches!(f, Frame::Error(_))
                    || answers(f, request_id)
                    || answers(f, "conformance-oversize")
            })
            .await?;
        match frame {
            Frame::HealthResponse(response) if response.request_id == request_id => {
                return Ok(codes);
            }
            Frame::HealthResponse(_) => codes.push("answered".to_owned()),
            Frame::Error(err) => codes.push(err.code),
            _ => {}
        }
    }
}

fn outbound(request_id: &str, target: MessageTarget, text: &str) -> Frame {
    Frame::Outbound(Delivery { request_id: id(request_id), message: message(target, text) })
}

/// The `deliver` answering `inbound`.
pub(crate) fn reply_to(inbound: &Inbound, text: &str) -> Frame {
    let mut target = inbound.message.target.clone();
    target.reply_to = Some(inbound.message.id.clone());
    Frame::Deliver(Delivery {
        request_id: inbound.event_id.clone(),
        message: message(target, text),
    })
}

fn message(target: MessageTarget, text: &str) -> OutboundMessage {
    let body = MessageBody::text(text).expect("the kit's texts are valid bodies");
    OutboundMessage { target, body, metadata: Default::default() }
}

pub(crate) fn carries(inbound: &Inbound, text: &str) -> bool {
    inbound.message.body.text_str().contains(text)
}

/// An inbound carrying `text` that arrived while the kit waited for something else.
pub(crate) fn take_stray(conn: &mut Conn, text: &str) -> Option<Inbound> {
    let at = conn.strays.iter().position(|inbound| carries(inbound, text))?;
    Some(conn.strays.remove(at))
}

pub(crate) fn id(value: &str) -> Id {
    Id::new(value).expect("the kit's ids are valid")
}
