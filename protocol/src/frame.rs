//! The envelope and every frame of `cortexfs.channel.socket/v1`, with encode and decode.
//!
//! Decoding reads the envelope once, checks `abi`, reads the `type` tag and then parses the
//! frame body straight into the variant's struct (no intermediate JSON tree). Unknown fields
//! are ignored; an unknown `type` is an error.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::ext::{
    AgentEnv, CancelRequest, CancelResult, HistoryRequest, HistoryResult, StreamFrame,
};
use crate::ids::{ChannelId, Id};
use crate::types::{
    Actions, Capabilities, Command, CommandResult, ControlAction, DeliveryReceipt, Effect, Health,
    InboundMessage, IncomingEvent, LifecycleEvent, MessageTarget, OutboundMessage, Participant,
};
use crate::{ABI, MAX_LINE_BYTES};

/// `hello` (driver → hub, first frame): who the driver is and what it can do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub request_id: Id,
    pub channel: ChannelId,
    pub capabilities: Capabilities,
    #[serde(default, skip_serializing_if = "Actions::is_empty")]
    pub actions: Actions,
    /// channeld extension list (see [`crate::ext`]). Reference peers never send it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
    /// Extension `operator_action`: the operator action names this driver performs (see
    /// [`crate::ext::valid_operator_action_name`]); the hub refuses any other name. Sent only
    /// by a driver that lists the extension.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operator_actions: Vec<String>,
}

/// `control_hello` (controller → hub, first frame): a tool connection on a channel socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlHello {
    pub request_id: Id,
    pub channel: ChannelId,
    /// channeld extension list (see [`crate::ext`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
}

/// `start` and `stop`: lifecycle markers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub request_id: Id,
}

/// `inbound` (driver → hub): a platform message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inbound {
    pub event_id: Id,
    pub message: InboundMessage,
}

/// `inbound_event` (driver → hub): a reaction, typing, edit, delete or read event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboundEventFrame {
    pub event_id: Id,
    pub event: IncomingEvent,
}

/// `deliver` (hub → driver, `request_id` = the inbound's `event_id`) and `outbound`
/// (hub → driver, proactive).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    pub request_id: Id,
    pub message: OutboundMessage,
}

/// `receipt` (driver → hub): the answer to an `outbound`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub request_id: Id,
    pub receipt: DeliveryReceipt,
}

/// `effect` (hub → driver): a live side effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectFrame {
    pub request_id: Id,
    pub target: MessageTarget,
    pub effect: Effect,
}

/// `command` (hub → driver): a runtime command to present.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandFrame {
    pub request_id: Id,
    pub session: Id,
    pub command_id: Id,
    pub command: Command,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<MessageTarget>,
}

/// `command_result` (driver → hub).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandResultFrame {
    pub request_id: Id,
    pub session: Id,
    pub command_id: Id,
    pub result: CommandResult,
    /// Extension `responder`: who answered on the platform.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub responder: Option<Participant>,
}

/// `control_request` (controller → hub).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRequest {
    pub request_id: Id,
    pub action: ControlAction,
}

/// `control_response` (hub → controller).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlResponse {
    pub request_id: Id,
    pub accepted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Extension `control_result`: what the action produced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ControlResult>,
}

/// Extension `control_result`: the outcome carried by a `control_response`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlResult {
    /// A `send` reached the platform.
    Receipt { receipt: DeliveryReceipt },
    /// A `command` was answered (for `invoke`, the value).
    CommandResult { result: CommandResult },
    /// A `send` was handed to the driver but no receipt came back in time: it may or may
    /// not have been posted.
    Unknown { reason: String },
}

/// `health_request` (either side).
pub type HealthRequest = Lifecycle;

/// `health_response` (either side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthResponse {
    pub request_id: Id,
    pub health: Health,
}

/// `health` (driver → hub, unsolicited).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthReport {
    pub health: Health,
}

/// `event` (either side): lifecycle notices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventFrame {
    pub event: LifecycleEvent,
}

/// `error` (either side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorFrame {
    pub request_id: Option<Id>,
    pub code: String,
    pub message: String,
    pub retryable: bool,
}

impl ErrorFrame {
    pub fn new(
        request_id: Option<Id>,
        code: impl Into<String>,
        message: impl Into<String>,
        retryable: bool,
    ) -> Self {
        Self { request_id, code: code.into(), message: message.into(), retryable }
    }
}

/// Extension frame `hello_ack` (hub → peer): the hub's answer to a `hello` or
/// `control_hello` that declared extensions. Sent only to peers that declared at least one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloAck {
    pub request_id: Id,
    /// The extensions both sides will use on this connection.
    pub extensions: Vec<String>,
    /// The hub's name and version, for logs.
    pub hub: String,
}

/// Extension frame `accepted` (hub → driver): the hub has taken responsibility for an
/// `inbound` or `inbound_event`, so the driver may acknowledge it to its platform.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    pub event_id: Id,
    /// True when the hub had already seen this event (a platform redelivery).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
}

/// Extension frame `operator_action` (hub → driver): an operator asks the driver to perform
/// one of the actions it declared in `hello.operator_actions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorActionFrame {
    pub request_id: Id,
    /// The action's name, e.g. `resume`.
    pub name: String,
    /// The action's arguments (an object; `{}` when it takes none).
    #[serde(default = "empty_object")]
    pub args: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

/// Extension frame `operator_action_result` (driver → hub): the answer to one
/// `operator_action`, with the same `request_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorActionResult {
    pub request_id: Id,
    /// Whether the action was performed.
    pub ok: bool,
    /// Why it was not, machine-readable (`unsupported`, `invalid_args`, `failed`); omitted
    /// when `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// A sentence for the operator; never a secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// What the action produced (an object), when it produced anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

/// One line of the protocol, without its envelope.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Frame {
    Hello(Hello),
    ControlHello(ControlHello),
    Start(Lifecycle),
    Stop(Lifecycle),
    Inbound(Inbound),
    InboundEvent(InboundEventFrame),
    Deliver(Delivery),
    Outbound(Delivery),
    Receipt(Receipt),
    Effect(EffectFrame),
    Command(CommandFrame),
    CommandResult(CommandResultFrame),
    ControlRequest(ControlRequest),
    ControlResponse(ControlResponse),
    HealthRequest(HealthRequest),
    HealthResponse(HealthResponse),
    Health(HealthReport),
    Event(EventFrame),
    Error(ErrorFrame),
    /// Extension (any): answer to a hello that declared extensions.
    HelloAck(HelloAck),
    /// Extension `accepted`.
    Accepted(Accepted),
    /// Extension `operator_action`.
    OperatorAction(OperatorActionFrame),
    /// Extension `operator_action`.
    OperatorActionResult(OperatorActionResult),
    /// Extension `history`.
    HistoryRequest(HistoryRequest),
    /// Extension `history`.
    HistoryResult(HistoryResult),
    /// Extension `cancel`.
    Cancel(CancelRequest),
    /// Extension `cancel`.
    CancelResult(CancelResult),
    /// Extension `stream`.
    Stream(StreamFrame),
    /// Extension `agent_env`.
    AgentEnv(AgentEnv),
}

impl Frame {
    /// The wire name of this frame's `type`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Frame::Hello(_) => "hello",
            Frame::ControlHello(_) => "control_hello",
            Frame::Start(_) => "start",
            Frame::Stop(_) => "stop",
            Frame::Inbound(_) => "inbound",
            Frame::InboundEvent(_) => "inbound_event",
            Frame::Deliver(_) => "deliver",
            Frame::Outbound(_) => "outbound",
            Frame::Receipt(_) => "receipt",
            Frame::Effect(_) => "effect",
            Frame::Command(_) => "command",
            Frame::CommandResult(_) => "command_result",
            Frame::ControlRequest(_) => "control_request",
            Frame::ControlResponse(_) => "control_response",
            Frame::HealthRequest(_) => "health_request",
            Frame::HealthResponse(_) => "health_response",
            Frame::Health(_) => "health",
            Frame::Event(_) => "event",
            Frame::Error(_) => "error",
            Frame::HelloAck(_) => "hello_ack",
            Frame::Accepted(_) => "accepted",
            Frame::OperatorAction(_) => "operator_action",
            Frame::OperatorActionResult(_) => "operator_action_result",
            Frame::HistoryRequest(_) => "history_request",
            Frame::HistoryResult(_) => "history_result",
            Frame::Cancel(_) => "cancel",
            Frame::CancelResult(_) => "cancel_result",
            Frame::Stream(_) => "stream",
            Frame::AgentEnv(_) => "agent_env",
        }
    }

    /// Shorthand for an `error` frame.
    pub fn error(
        request_id: Option<Id>,
        code: impl Into<String>,
        message: impl Into<String>,
        retryable: bool,
    ) -> Frame {
        Frame::Error(ErrorFrame::new(request_id, code, message, retryable))
    }
}

/// Why a line did not decode. Each variant has a machine-readable [`code`](Self::code).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("line exceeds {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    #[error("line is not valid JSON: {0}")]
    NotJson(String),
    #[error("line is not a JSON object")]
    NotObject,
    #[error("envelope has no abi field")]
    MissingAbi,
    #[error("unsupported abi {0:?}")]
    AbiMismatch(String),
    #[error("envelope has no frame object")]
    MissingFrame,
    #[error("frame has no type")]
    MissingType,
    #[error("unknown frame type {0:?}")]
    UnknownType(String),
    #[error("invalid {frame_type} frame: {reason}")]
    InvalidFrame {
        frame_type: &'static str,
        reason: String,
        /// The frame's `request_id` or `event_id`, when it is itself a valid id, so an error
        /// answer can be correlated.
        correlation: Option<Id>,
    },
}

impl DecodeError {
    /// The snake_case code used in the `error` frame that answers this line.
    pub fn code(&self) -> &'static str {
        match self {
            DecodeError::LineTooLong => "line_too_long",
            DecodeError::NotJson(_) => "invalid_json",
            DecodeError::NotObject => "invalid_frame",
            DecodeError::MissingAbi | DecodeError::AbiMismatch(_) => "unsupported_abi",
            DecodeError::MissingFrame | DecodeError::MissingType => "invalid_frame",
            DecodeError::UnknownType(_) => "unknown_frame_type",
            DecodeError::InvalidFrame { .. } => "invalid_frame",
        }
    }

    /// The id an error answer should carry, if one could be read.
    pub fn correlation(&self) -> Option<&Id> {
        match self {
            DecodeError::InvalidFrame { correlation, .. } => correlation.as_ref(),
            _ => None,
        }
    }

    /// The `error` frame that answers the offending line.
    pub fn to_error_frame(&self) -> Frame {
        Frame::error(self.correlation().cloned(), self.code(), self.to_string(), false)
    }
}

/// Why a frame could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("encoded {frame_type} frame is {len} bytes, over the {MAX_LINE_BYTES}-byte line limit")]
    TooLong { frame_type: &'static str, len: usize },
    #[error("frame does not serialise: {0}")]
    Json(#[from] serde_json::Error),
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    abi: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    frame: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct TypeTag<'a> {
    #[serde(rename = "type", borrow, default)]
    ty: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct CorrelationIds<'a> {
    #[serde(borrow, default)]
    request_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    event_id: Option<Cow<'a, str>>,
}

/// Decodes one line (without its trailing newline).
pub fn decode(line: &[u8]) -> Result<Frame, DecodeError> {
    if line.len() >= MAX_LINE_BYTES {
        return Err(DecodeError::LineTooLong);
    }
    if let Some(frame) = decode_canonical(line) {
        return Ok(frame);
    }
    decode_general(line)
}

/// The fast path for lines laid out as [`encode`] writes them: the envelope head verbatim,
/// then a frame object that starts with its `type`, then the closing brace. The body is then
/// parsed once instead of three times (envelope, tag, body). `None` sends the line down the
/// general path, which accepts the same lines and names the error of a bad one. A frame with
/// a second `"type"` key anywhere goes there too: the general path rejects a duplicate tag.
fn decode_canonical(line: &[u8]) -> Option<Frame> {
    const TAG: &[u8] = b"{\"type\":\"";
    let raw = line.strip_prefix(ENVELOPE_HEAD)?.strip_suffix(b"}")?;
    let after_tag = raw.strip_prefix(TAG)?;
    let end = memchr::memchr(b'"', after_tag)?;
    let ty = &after_tag[..end];
    if ty.contains(&b'\\') || memchr::memmem::find(&after_tag[end..], b"\"type\"").is_some() {
        return None;
    }
    let raw = std::str::from_utf8(raw).ok()?;
    let ty = std::str::from_utf8(ty).ok()?;
    decode_body(ty, raw).ok()
}

/// Any valid line, in any key order or spacing.
fn decode_general(line: &[u8]) -> Result<Frame, DecodeError> {
    let first = line.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
            Ok(_) => DecodeError::NotObject,
            Err(err) => DecodeError::NotJson(err.to_string()),
        });
    }
    let envelope: Envelope<'_> =
        serde_json::from_slice(line).map_err(|err| DecodeError::NotJson(err.to_string()))?;
    match envelope.abi.as_deref() {
        None => return Err(DecodeError::MissingAbi),
        Some(ABI) => {}
        Some(other) => return Err(DecodeError::AbiMismatch(truncate(other, 64))),
    }
    let raw = envelope.frame.ok_or(DecodeError::MissingFrame)?.get();
    if !raw.starts_with('{') {
        return Err(DecodeError::MissingFrame);
    }
    let tag: TypeTag<'_> = serde_json::from_str(raw).map_err(|_| DecodeError::MissingType)?;
    let ty = tag.ty.ok_or(DecodeError::MissingType)?;
    decode_body(&ty, raw)
}

fn decode_body(ty: &str, raw: &str) -> Result<Frame, DecodeError> {
    fn parse<'a, T: Deserialize<'a>>(
        frame_type: &'static str,
        raw: &'a str,
    ) -> Result<T, DecodeError> {
        serde_json::from_str(raw).map_err(|err| DecodeError::InvalidFrame {
            frame_type,
            reason: err.to_string(),
            correlation: correlation(raw),
        })
    }
    Ok(match ty {
        "hello" => Frame::Hello(parse("hello", raw)?),
        "control_hello" => Frame::ControlHello(parse("control_hello", raw)?),
        "start" => Frame::Start(parse("start", raw)?),
        "stop" => Frame::Stop(parse("stop", raw)?),
        "inbound" => Frame::Inbound(parse("inbound", raw)?),
        "inbound_event" => Frame::InboundEvent(parse("inbound_event", raw)?),
        "deliver" => Frame::Deliver(parse("deliver", raw)?),
        "outbound" => Frame::Outbound(parse("outbound", raw)?),
        "receipt" => Frame::Receipt(parse("receipt", raw)?),
        "effect" => Frame::Effect(parse("effect", raw)?),
        "command" => Frame::Command(parse("command", raw)?),
        "command_result" => Frame::CommandResult(parse("command_result", raw)?),
        "control_request" => Frame::ControlRequest(parse("control_request", raw)?),
        "control_response" => Frame::ControlResponse(parse("control_response", raw)?),
        "health_request" => Frame::HealthRequest(parse("health_request", raw)?),
        "health_response" => Frame::HealthResponse(parse("health_response", raw)?),
        "health" => Frame::Health(parse("health", raw)?),
        "event" => Frame::Event(parse("event", raw)?),
        "error" => Frame::Error(parse("error", raw)?),
        "hello_ack" => Frame::HelloAck(parse("hello_ack", raw)?),
        "accepted" => Frame::Accepted(parse("accepted", raw)?),
        "operator_action" => Frame::OperatorAction(parse("operator_action", raw)?),
        "operator_action_result" => {
            Frame::OperatorActionResult(parse("operator_action_result", raw)?)
        }
        "history_request" => Frame::HistoryRequest(parse("history_request", raw)?),
        "history_result" => Frame::HistoryResult(parse("history_result", raw)?),
        "cancel" => Frame::Cancel(parse("cancel", raw)?),
        "cancel_result" => Frame::CancelResult(parse("cancel_result", raw)?),
        "stream" => Frame::Stream(parse("stream", raw)?),
        "agent_env" => Frame::AgentEnv(parse("agent_env", raw)?),
        other => return Err(DecodeError::UnknownType(truncate(other, 64))),
    })
}

fn correlation(raw: &str) -> Option<Id> {
    let ids: CorrelationIds<'_> = serde_json::from_str(raw).ok()?;
    let value = ids.request_id.or(ids.event_id)?;
    Id::new(&value).ok()
}

fn truncate(value: &str, max: usize) -> String {
    match value.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &value[..end]),
        None => value.to_owned(),
    }
}

const ENVELOPE_HEAD: &[u8] = b"{\"abi\":\"cortexfs.channel.socket/v1\",\"frame\":";

/// Appends one encoded line (envelope and trailing newline) to `out`.
///
/// On error `out` is left as it was.
pub fn encode_into(frame: &Frame, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(ENVELOPE_HEAD);
    if let Err(err) = serde_json::to_writer(&mut *out, frame) {
        out.truncate(start);
        return Err(err.into());
    }
    out.extend_from_slice(b"}\n");
    let len = out.len() - start;
    if len > MAX_LINE_BYTES {
        out.truncate(start);
        return Err(EncodeError::TooLong { frame_type: frame.type_name(), len });
    }
    Ok(())
}

/// Encodes one line, envelope and trailing newline included.
pub fn encode(frame: &Frame) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(512);
    encode_into(frame, &mut out)?;
    Ok(out)
}

/// Encodes the `outbound` frame for `request_id` around `message`, a message already
/// encoded by `serde_json::to_vec` of an [`OutboundMessage`](crate::types::OutboundMessage):
/// the line [`encode`] writes for `Frame::Outbound` of that message, without encoding the
/// message again (the hub records those bytes before it hands them over). `message` is
/// copied as it is, so it must be such an encoding, made by this build.
pub fn encode_outbound(request_id: &Id, message: &[u8]) -> Result<Vec<u8>, EncodeError> {
    const TYPE: &[u8] = b"{\"type\":\"outbound\",\"request_id\":";
    let mut out = Vec::with_capacity(
        ENVELOPE_HEAD.len() + TYPE.len() + request_id.as_str().len() + message.len() + 20,
    );
    out.extend_from_slice(ENVELOPE_HEAD);
    out.extend_from_slice(TYPE);
    serde_json::to_writer(&mut out, request_id)?;
    out.extend_from_slice(b",\"message\":");
    out.extend_from_slice(message);
    out.extend_from_slice(b"}}\n");
    if out.len() > MAX_LINE_BYTES {
        return Err(EncodeError::TooLong { frame_type: "outbound", len: out.len() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outbound_around_an_encoded_message_is_the_line_encode_writes() {
        use crate::types::{MessageBody, MessageTarget, OutboundMessage};
        let mut target = MessageTarget::new(
            crate::ChannelId::new("slack.primary").unwrap(),
            Id::new("C\u{e9}1").unwrap(),
        );
        target.thread = Some(Id::new("1700000000.000100").unwrap());
        let mut message = OutboundMessage {
            target,
            body: MessageBody::text("quote \" backslash \\ newline \n tab \t \u{1F600} \u{7}")
                .unwrap(),
            metadata: Default::default(),
        };
        message.metadata.insert("idempotency_key".into(), "k-\"1\"".into());
        message.metadata.insert("a".into(), "\u{0}".into());
        let request_id = Id::new("ob-7f3a-12").unwrap();
        let encoded = serde_json::to_vec(&message).unwrap();
        let expected =
            encode(&Frame::Outbound(Delivery { request_id: request_id.clone(), message })).unwrap();
        assert_eq!(
            String::from_utf8(encode_outbound(&request_id, &encoded).unwrap()).unwrap(),
            String::from_utf8(expected).unwrap()
        );
        let long = vec![b'x'; MAX_LINE_BYTES];
        assert!(matches!(encode_outbound(&request_id, &long), Err(EncodeError::TooLong { .. })));
    }

    #[test]
    fn envelope_head_matches_abi() {
        let expected = format!("{{\"abi\":\"{ABI}\",\"frame\":");
        assert_eq!(ENVELOPE_HEAD, expected.as_bytes());
    }

    #[test]
    fn encode_rejects_oversize_frames() {
        let text = "x".repeat(MAX_LINE_BYTES);
        let frame = Frame::Error(ErrorFrame::new(None, "x", text, false));
        let mut out = b"keep".to_vec();
        assert!(matches!(encode_into(&frame, &mut out), Err(EncodeError::TooLong { .. })));
        assert_eq!(out, b"keep");
    }

    #[test]
    fn invalid_frame_keeps_a_valid_correlation_id() {
        let line =
            br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"inbound","event_id":"m-1"}}"#;
        let err = decode(line).unwrap_err();
        assert_eq!(err.code(), "invalid_frame");
        assert_eq!(err.correlation().map(Id::as_str), Some("m-1"));
    }

    #[test]
    fn canonical_and_general_paths_agree() {
        let frames = [
            Frame::Start(Lifecycle { request_id: "a".try_into().unwrap() }),
            Frame::error(Some("r-1".try_into().unwrap()), "busy", "try \"later\"\n", true),
            Frame::Accepted(Accepted { event_id: "é-1".try_into().unwrap(), duplicate: true }),
        ];
        for frame in frames {
            let line = encode(&frame).unwrap();
            let line = &line[..line.len() - 1];
            assert_eq!(decode_canonical(line).as_ref(), Some(&frame));
            assert_eq!(decode_general(line).unwrap(), frame);
        }
    }

    #[test]
    fn lines_the_fast_path_cannot_vouch_for_take_the_general_path() {
        let duplicate_tag = br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"start","request_id":"a","type":"stop"}}"#;
        assert_eq!(decode_canonical(duplicate_tag), None);
        assert_eq!(decode(duplicate_tag).unwrap_err().code(), "invalid_frame");
        let extra_key = br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"start","request_id":"a"},"x":{"y":1}}"#;
        assert_eq!(decode_canonical(extra_key), None);
        assert!(matches!(decode(extra_key), Ok(Frame::Start(_))));
        let two_values = br#"{"abi":"cortexfs.channel.socket/v1","frame":{"type":"start","request_id":"a"},{"b":1}}"#;
        assert_eq!(decode_canonical(two_values), None);
        assert_eq!(decode(two_values).unwrap_err().code(), "invalid_json");
    }

    #[test]
    fn abi_mismatch_has_its_own_code() {
        let line =
            br#"{"abi":"cortexfs.channel.socket/v2","frame":{"type":"start","request_id":"a"}}"#;
        assert_eq!(decode(line).unwrap_err().code(), "unsupported_abi");
    }
}
