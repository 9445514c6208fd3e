//! Pure mapping between AMQP messages and channeld frames: deliveries to inbound messages
//! (sender, event id, conversation, body), hub outcomes to acknowledgements, posts to
//! publications, publisher confirms to receipts, and connection failures to link states.
//!
//! Nothing here does I/O, so every rule is unit-tested with recorded properties and payloads.
//!
//! Inbound rules:
//! * sender: the `user_id` property, which RabbitMQ checks against the publishing
//!   connection's user. Without it the message is refused, unless `CHANNELD_AMQP_TRUST` names
//!   a header or `app_id` to use instead. A header never overrides a present `user_id`.
//! * event id (the hub's dedupe key): the `message_id` property. Without it the message is
//!   refused, or with `CHANNELD_AMQP_MISSING_MESSAGE_ID=digest` it gets a content digest.
//! * conversation: `reply_to` when set (replies go there), else the conversation header, else
//!   the sender; thread: the thread header.
//! * body: `application/json` is `{"text": ..., "attachments": [...]}`; anything else is
//!   UTF-8 text.
//! * everything that varies between redeliveries (delivery tag, `redelivered`, arrival time)
//!   is left out, so a redelivered message converts to exactly the same frame.

use std::collections::BTreeMap;

use channeld_driver_sdk::protocol::types::{
    Attachment, BodyError, DeliveryReceipt, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::{Acceptance, Failure, LinkState, Post, PostError, PostKind};
use lapin::BasicProperties;
use lapin::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{
    CONVERSATION_PLACEHOLDER, InboundRules, MissingMessageId, OutboundRules, Trust,
};

/// `delivery_mode` of a message the broker writes to disk.
pub const PERSISTENT: u8 = 2;
/// Content type of a text body.
pub const TEXT_PLAIN: &str = "text/plain; charset=utf-8";
/// Content type of a JSON body (text plus attachments).
pub const APPLICATION_JSON: &str = "application/json";

/// Longest AMQP short string (routing keys, message ids).
const MAX_SHORT_STRING: usize = 255;

/// A delivery as the broker handed it over.
#[derive(Debug, Clone, Copy)]
pub struct Received<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub properties: &'a BasicProperties,
    pub body: &'a [u8],
}

/// Why a delivery cannot become an inbound message. Such a message is rejected without
/// requeue (dead-lettered when a dead-letter exchange is configured): retrying cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("message has no user_id and no trusted sender")]
    NoSender,
    #[error("sender from {origin} is not a valid id")]
    InvalidSender { origin: String },
    #[error("message has no message_id")]
    NoMessageId,
    #[error("message_id is not a valid id")]
    InvalidMessageId,
    #[error("conversation is not a valid id")]
    InvalidConversation,
    #[error("thread header is not a valid id")]
    InvalidThread,
    #[error("body is not UTF-8 text")]
    NotUtf8,
    #[error("JSON body is invalid: {0}")]
    InvalidJson(String),
    #[error("body is invalid: {0}")]
    InvalidBody(BodyError),
}

impl Refusal {
    /// A machine-readable reason, for logs and metadata.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::NoSender | Refusal::InvalidSender { .. } => "no_sender",
            Refusal::NoMessageId | Refusal::InvalidMessageId => "no_message_id",
            Refusal::InvalidConversation | Refusal::InvalidThread => "invalid_target",
            Refusal::NotUtf8 | Refusal::InvalidJson(_) | Refusal::InvalidBody(_) => "invalid_body",
        }
    }
}

/// Converts a delivery to the inbound message reported to the hub.
pub fn inbound(
    channel: &ChannelId,
    rules: &InboundRules,
    received: &Received<'_>,
) -> Result<InboundMessage, Refusal> {
    let props = received.properties;
    let (sender, sender_source) = sender(rules, props)?;
    let (event_id, id_source) = match short(props.message_id()) {
        Some(raw) => (Id::new(raw).map_err(|_| Refusal::InvalidMessageId)?, "message_id"),
        None => match rules.missing_message_id {
            MissingMessageId::Reject => return Err(Refusal::NoMessageId),
            MissingMessageId::Digest => (digest_event_id(rules, &sender, received), "digest"),
        },
    };
    let conversation = match short(props.reply_to()) {
        Some(reply_to) => Id::new(reply_to).map_err(|_| Refusal::InvalidConversation)?,
        None => match header_text(props, &rules.conversation_header) {
            Some(header) => Id::new(header).map_err(|_| Refusal::InvalidConversation)?,
            None => sender.id.clone(),
        },
    };
    let thread = header_text(props, &rules.thread_header)
        .map(|thread| Id::new(thread).map_err(|_| Refusal::InvalidThread))
        .transpose()?;
    let body = body(props, received.body)?;

    let mut metadata = BTreeMap::new();
    metadata.insert("amqp.exchange".to_owned(), received.exchange.to_owned());
    metadata.insert("amqp.routing_key".to_owned(), received.routing_key.to_owned());
    metadata.insert("amqp.sender_source".to_owned(), sender_source);
    metadata.insert("amqp.event_id_source".to_owned(), id_source.to_owned());
    if let Some(correlation) = short(props.correlation_id()) {
        metadata.insert("amqp.correlation_id".to_owned(), correlation.to_owned());
    }
    if let Some(content_type) = short(props.content_type()) {
        metadata.insert("amqp.content_type".to_owned(), content_type.to_owned());
    }
    Ok(InboundMessage {
        id: event_id,
        target: MessageTarget { channel: channel.clone(), conversation, thread, reply_to: None },
        sender,
        body,
        timestamp_ms: props.timestamp().map(|secs| secs.saturating_mul(1000)),
        metadata,
    })
}

/// The sender and where it came from.
fn sender(rules: &InboundRules, props: &BasicProperties) -> Result<(Participant, String), Refusal> {
    let (raw, source) = match short(props.user_id()) {
        Some(user) => (user, "user_id".to_owned()),
        None => match &rules.trust {
            Trust::UserId => return Err(Refusal::NoSender),
            Trust::AppId => (short(props.app_id()).ok_or(Refusal::NoSender)?, "app_id".to_owned()),
            Trust::Header(name) => {
                (header_text(props, name).ok_or(Refusal::NoSender)?, format!("header:{name}"))
            }
        },
    };
    let id = Id::new(raw).map_err(|_| Refusal::InvalidSender { origin: source.clone() })?;
    Ok((Participant::new(id), source))
}

/// A content digest standing in for a missing `message_id`: the same for every redelivery of
/// one message, different for messages that differ in sender, routing, properties or body.
fn digest_event_id(rules: &InboundRules, sender: &Participant, received: &Received<'_>) -> Id {
    let props = received.properties;
    let timestamp = props.timestamp().map(|t| t.to_string());
    let fields = [
        Some(sender.id.as_str()),
        Some(received.exchange),
        Some(received.routing_key),
        short(props.content_type()),
        short(props.correlation_id()),
        short(props.reply_to()),
        short(props.app_id()),
        timestamp.as_deref(),
        header_text(props, &rules.conversation_header),
        header_text(props, &rules.thread_header),
    ];
    let mut hash = Sha256::new();
    hash.update(b"channeld.amqp.event/v1");
    for field in fields {
        match field {
            Some(value) => {
                hash.update([1u8]);
                hash.update((value.len() as u64).to_be_bytes());
                hash.update(value.as_bytes());
            }
            None => hash.update([0u8]),
        }
    }
    hash.update((received.body.len() as u64).to_be_bytes());
    hash.update(received.body);
    Id::new(format!("sha256:{}", hex(&hash.finalize()))).expect("a digest is a valid id")
}

/// The JSON body: text and attachments; unknown fields are ignored.
#[derive(Debug, Serialize, Deserialize)]
struct JsonBody {
    #[serde(default)]
    text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    attachments: Vec<Attachment>,
}

fn body(props: &BasicProperties, data: &[u8]) -> Result<MessageBody, Refusal> {
    let is_json = short(props.content_type())
        .is_some_and(|ct| ct.split(';').next().unwrap_or("").trim() == APPLICATION_JSON);
    if is_json {
        let parsed: JsonBody =
            serde_json::from_slice(data).map_err(|err| Refusal::InvalidJson(err.to_string()))?;
        MessageBody::with_attachments(parsed.text, parsed.attachments).map_err(Refusal::InvalidBody)
    } else {
        let text = std::str::from_utf8(data).map_err(|_| Refusal::NotUtf8)?;
        MessageBody::text(text).map_err(Refusal::InvalidBody)
    }
}

/// What to tell the broker once the hub has answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// `basic.ack`: the hub has the message.
    Ack,
    /// `basic.reject` without requeue: the hub refused it for good (dead-lettered when a
    /// dead-letter exchange is configured).
    Reject,
    /// `basic.nack` with requeue: no answer (shutdown, timeout); the broker redelivers.
    Requeue,
}

/// The acknowledgement for a hub outcome. Retryable hub errors (`busy`) never get here: the SDK
/// retries them itself.
pub fn settlement(outcome: &Acceptance) -> Settlement {
    match outcome {
        Acceptance::Accepted { .. } => Settlement::Ack,
        Acceptance::Rejected { .. } => Settlement::Reject,
        Acceptance::Unresolved => Settlement::Requeue,
    }
}

/// A message ready for `basic.publish`.
#[derive(Debug, Clone, PartialEq)]
pub struct Publication {
    pub exchange: String,
    pub routing_key: String,
    pub message_id: Id,
    pub properties: BasicProperties,
    pub payload: Vec<u8>,
}

/// The publication for a post. Replies go to the reply exchange with the conversation as
/// routing key and carry `correlation_id` (the request's, else its `message_id`); proactive
/// sends go to the outbound exchange and routing key. `now_ms` becomes the AMQP timestamp.
pub fn publication(
    channel: &ChannelId,
    rules: &OutboundRules,
    post: &Post,
    correlation_id: Option<&str>,
    now_ms: u64,
) -> Result<Publication, PostError> {
    let target = &post.message.target;
    let conversation = target.conversation.as_str();
    let (exchange, routing_key, correlation) = match &post.kind {
        PostKind::Reply { event_id } => (
            rules.reply_exchange.clone(),
            conversation.to_owned(),
            Some(correlation_id.unwrap_or(event_id.as_str()).to_owned()),
        ),
        PostKind::Proactive { .. } => (
            rules.outbound_exchange.clone(),
            rules.outbound_routing_key.replace(CONVERSATION_PLACEHOLDER, conversation),
            None,
        ),
    };
    if routing_key.len() > MAX_SHORT_STRING {
        return Err(PostError::failed("routing key longer than 255 bytes", false));
    }
    let message_id = outgoing_message_id(channel, &post.kind);
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(rules.conversation_header.as_str()),
        AMQPValue::LongString(LongString::from(conversation)),
    );
    if let Some(thread) = &target.thread {
        headers.insert(
            ShortString::from(rules.thread_header.as_str()),
            AMQPValue::LongString(LongString::from(thread.as_str())),
        );
    }
    let body = &post.message.body;
    let (content_type, payload) = if body.attachments().is_empty() {
        (TEXT_PLAIN, body.text_str().as_bytes().to_vec())
    } else {
        let json =
            JsonBody { text: body.text_str().to_owned(), attachments: body.attachments().to_vec() };
        let payload = serde_json::to_vec(&json)
            .map_err(|err| PostError::failed(format!("cannot encode the body: {err}"), false))?;
        (APPLICATION_JSON, payload)
    };
    let mut properties = BasicProperties::default()
        .with_content_type(ShortString::from(content_type))
        .with_delivery_mode(PERSISTENT)
        .with_message_id(ShortString::from(message_id.as_str()))
        .with_timestamp(now_ms / 1000)
        .with_app_id(ShortString::from(channel.as_str()))
        .with_headers(headers);
    if let Some(correlation) = correlation {
        properties = properties.with_correlation_id(ShortString::from(correlation));
    }
    Ok(Publication { exchange, routing_key, message_id, properties, payload })
}

/// The `message_id` of an outgoing message: derived from the hub's request, so a retried post
/// carries the same id and consumers can drop the copy.
pub fn outgoing_message_id(channel: &ChannelId, kind: &PostKind) -> Id {
    let raw = match kind {
        PostKind::Reply { event_id } => format!("{channel}/reply/{event_id}"),
        PostKind::Proactive { request_id } => format!("{channel}/out/{request_id}"),
    };
    if raw.len() <= MAX_SHORT_STRING
        && let Ok(id) = Id::new(&raw)
    {
        return id;
    }
    Id::new(format!("sha256:{}", hex(&Sha256::digest(raw.as_bytes()))))
        .expect("a digest is a valid id")
}

/// The outcome of a publish from its publisher confirm. A mandatory message the broker
/// returned (no queue bound for it) is a failure even though the broker acked it.
pub fn confirmation(confirmation: Confirmation) -> Result<(), PostError> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(PostError::failed(
            format!(
                "broker returned the message as unroutable: {} {}",
                returned.reply_code, returned.reply_text
            ),
            false,
        )),
        Confirmation::Nack(_) => Err(PostError::failed("broker refused the message (nack)", true)),
        Confirmation::NotRequested => {
            Err(PostError::unknown("publisher confirms are not enabled on this channel"))
        }
    }
}

/// The receipt for a published post.
pub fn receipt(channel: &ChannelId, post: &Post, message_id: Id, now_ms: u64) -> DeliveryReceipt {
    DeliveryReceipt {
        channel: channel.clone(),
        message_id,
        target: post.message.target.clone(),
        timestamp_ms: Some(now_ms),
    }
}

/// Why the broker link is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disconnect {
    /// The broker could not be reached or the connection was lost.
    Unreachable,
    /// The broker refused the credentials or the virtual host.
    AuthRefused,
    /// The queue or exchanges could not be declared (e.g. they exist with other arguments).
    Topology,
}

/// The kit's link state for a failed connection attempt, and the retry lane: the broker
/// refusing the credentials or the topology is an operator's to fix (Unavailable, slow lane);
/// anything else passes (Degraded). `error` never carries the URL.
pub fn link_state(cause: Disconnect, attempt: u32, error: String) -> (LinkState, Failure) {
    match cause {
        Disconnect::Unreachable => (LinkState::Retrying { attempt, error }, Failure::Transient),
        Disconnect::AuthRefused => (
            LinkState::AuthRejected {
                detail: format!("the broker refused the credentials or virtual host: {error}"),
            },
            Failure::Operator,
        ),
        Disconnect::Topology => (
            LinkState::SetupRefused {
                detail: format!("the broker refused the queue or exchange declaration: {error}"),
            },
            Failure::Operator,
        ),
    }
}

/// A header's value as text (long or short string), if present and UTF-8.
fn header_text<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a str> {
    let value = props.headers().as_ref()?.inner().get(name)?;
    let text = match value {
        AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok()?,
        AMQPValue::ShortString(text) => text.as_str(),
        _ => return None,
    };
    (!text.is_empty()).then_some(text)
}

/// A short-string property, treating an empty one as absent.
fn short(value: &Option<ShortString>) -> Option<&str> {
    value.as_ref().map(ShortString::as_str).filter(|s| !s.is_empty())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::types::OutboundMessage;

    use super::*;

    fn channel() -> ChannelId {
        ChannelId::new("amqp.test").unwrap()
    }

    fn rules(trust: Trust, missing: MissingMessageId) -> InboundRules {
        InboundRules {
            trust,
            conversation_header: "x-conversation".into(),
            thread_header: "x-thread".into(),
            missing_message_id: missing,
        }
    }

    fn strict() -> InboundRules {
        rules(Trust::UserId, MissingMessageId::Reject)
    }

    fn headers(pairs: &[(&str, &str)]) -> FieldTable {
        let mut table = FieldTable::default();
        for (key, value) in pairs {
            table.insert((*key).into(), AMQPValue::LongString((*value).into()));
        }
        table
    }

    /// What `rabbitmqadmin publish` / a pika RPC client sends.
    fn rpc_properties() -> BasicProperties {
        BasicProperties::default()
            .with_user_id("alice".into())
            .with_message_id("m-1".into())
            .with_reply_to("amq.gen-reply".into())
            .with_correlation_id("c-42".into())
            .with_content_type("text/plain".into())
            .with_timestamp(1_700_000_000)
    }

    fn convert(
        rules: &InboundRules,
        props: &BasicProperties,
        body: &[u8],
    ) -> Result<InboundMessage, Refusal> {
        let received = Received { exchange: "chat", routing_key: "inbox", properties: props, body };
        inbound(&channel(), rules, &received)
    }

    #[test]
    fn an_rpc_request_becomes_an_inbound_from_its_validated_user() {
        let message = convert(&strict(), &rpc_properties(), "hello there".as_bytes()).unwrap();
        assert_eq!(message.id, "m-1");
        assert_eq!(message.sender.id, "alice");
        assert_eq!(message.target.channel, channel());
        assert_eq!(message.target.conversation, "amq.gen-reply");
        assert_eq!(message.target.thread, None);
        assert_eq!(message.body.text_str(), "hello there");
        assert_eq!(message.timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(message.metadata["amqp.correlation_id"], "c-42");
        assert_eq!(message.metadata["amqp.sender_source"], "user_id");
        assert_eq!(message.metadata["amqp.event_id_source"], "message_id");
        assert_eq!(message.metadata["amqp.exchange"], "chat");
        assert_eq!(message.metadata["amqp.routing_key"], "inbox");
    }

    #[test]
    fn a_header_naming_someone_else_never_overrides_user_id() {
        let props = rpc_properties()
            .with_user_id("mallory".into())
            .with_headers(headers(&[("x-sender", "alice")]));
        let trusting = rules(Trust::Header("x-sender".into()), MissingMessageId::Reject);
        assert_eq!(convert(&trusting, &props, b"hi").unwrap().sender.id, "mallory");
        assert_eq!(convert(&strict(), &props, b"hi").unwrap().sender.id, "mallory");
    }

    #[test]
    fn without_user_id_only_an_explicit_trust_mode_names_the_sender() {
        let props = BasicProperties::default()
            .with_message_id("m-2".into())
            .with_app_id("billing".into())
            .with_headers(headers(&[("x-sender", "alice")]));
        assert_eq!(convert(&strict(), &props, b"hi").unwrap_err(), Refusal::NoSender);
        let by_header = rules(Trust::Header("x-sender".into()), MissingMessageId::Reject);
        let message = convert(&by_header, &props, b"hi").unwrap();
        assert_eq!(message.sender.id, "alice");
        assert_eq!(message.metadata["amqp.sender_source"], "header:x-sender");
        let by_app = rules(Trust::AppId, MissingMessageId::Reject);
        assert_eq!(convert(&by_app, &props, b"hi").unwrap().sender.id, "billing");
        let other_header = rules(Trust::Header("x-user".into()), MissingMessageId::Reject);
        assert_eq!(convert(&other_header, &props, b"hi").unwrap_err(), Refusal::NoSender);
        assert_eq!(Refusal::NoSender.code(), "no_sender");
    }

    #[test]
    fn a_missing_message_id_is_refused_or_digested_stably() {
        let props = rpc_properties().with_message_id("".into());
        assert_eq!(convert(&strict(), &props, b"hi").unwrap_err(), Refusal::NoMessageId);
        let digest = rules(Trust::UserId, MissingMessageId::Digest);
        let first = convert(&digest, &props, b"hi").unwrap();
        let again = convert(&digest, &props, b"hi").unwrap();
        assert_eq!(first, again, "a redelivery converts to the same inbound");
        assert!(first.id.as_str().starts_with("sha256:") && first.id.as_str().len() == 71);
        assert_eq!(first.metadata["amqp.event_id_source"], "digest");
        let other_body = convert(&digest, &props, b"hi!").unwrap();
        assert_ne!(first.id, other_body.id);
        let other_sender = convert(&digest, &props.clone().with_user_id("bob".into()), b"hi");
        assert_ne!(first.id, other_sender.unwrap().id);
    }

    #[test]
    fn conversation_falls_back_from_reply_to_to_header_to_sender() {
        let with_header = BasicProperties::default()
            .with_user_id("alice".into())
            .with_message_id("m-3".into())
            .with_headers(headers(&[("x-conversation", "room-7"), ("x-thread", "t-1")]));
        let message = convert(&strict(), &with_header, b"hi").unwrap();
        assert_eq!(message.target.conversation, "room-7");
        assert_eq!(message.target.thread.as_ref().map(Id::as_str), Some("t-1"));
        let with_reply_to = with_header.clone().with_reply_to("replies".into());
        assert_eq!(
            convert(&strict(), &with_reply_to, b"hi").unwrap().target.conversation,
            "replies"
        );
        let bare =
            BasicProperties::default().with_user_id("alice".into()).with_message_id("m-4".into());
        let message = convert(&strict(), &bare, b"hi").unwrap();
        assert_eq!(message.target.conversation, "alice");
        assert_eq!(message.timestamp_ms, None);
    }

    #[test]
    fn json_bodies_carry_attachments_and_bad_bodies_are_refused() {
        let json = rpc_properties().with_content_type("application/json; charset=utf-8".into());
        let body = br#"{"text":"see this","attachments":[{"url":"https://x/y.png","mime":"image/png"}],"extra":1}"#;
        let message = convert(&strict(), &json, body).unwrap();
        assert_eq!(message.body.text_str(), "see this");
        assert_eq!(message.body.attachments()[0].url, "https://x/y.png");
        assert!(matches!(convert(&strict(), &json, b"not json"), Err(Refusal::InvalidJson(_))));
        assert_eq!(
            convert(&strict(), &json, br#"{"text":""}"#),
            Err(Refusal::InvalidBody(BodyError::Empty))
        );
        let text = rpc_properties();
        assert_eq!(convert(&strict(), &text, &[0xff, 0xfe]).unwrap_err(), Refusal::NotUtf8);
        assert_eq!(convert(&strict(), &text, b""), Err(Refusal::InvalidBody(BodyError::Empty)));
        assert_eq!(convert(&strict(), &text, b"a\0b"), Err(Refusal::InvalidBody(BodyError::Nul)));
        // A JSON-looking text body stays text when the content type does not say JSON.
        let raw = convert(&strict(), &text, br#"{"text":"x"}"#).unwrap();
        assert_eq!(raw.body.text_str(), r#"{"text":"x"}"#);
    }

    #[test]
    fn hub_outcomes_map_to_ack_reject_and_requeue() {
        assert_eq!(settlement(&Acceptance::Accepted { duplicate: false }), Settlement::Ack);
        assert_eq!(settlement(&Acceptance::Accepted { duplicate: true }), Settlement::Ack);
        let denied = Acceptance::Rejected { code: "sender_denied".into(), message: "no".into() };
        assert_eq!(settlement(&denied), Settlement::Reject);
        assert_eq!(settlement(&Acceptance::Unresolved), Settlement::Requeue);
    }

    fn outbound_rules() -> OutboundRules {
        OutboundRules {
            reply_exchange: "".into(),
            outbound_exchange: "notify".into(),
            outbound_routing_key: "user.{conversation}".into(),
            conversation_header: "x-conversation".into(),
            thread_header: "x-thread".into(),
        }
    }

    fn post(kind: PostKind, conversation: &str, body: MessageBody) -> Post {
        let mut target = MessageTarget::new(channel(), Id::new(conversation).unwrap());
        target.thread = Some(Id::new("t-9").unwrap());
        Post { kind, message: OutboundMessage { target, body, metadata: Default::default() } }
    }

    fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a str> {
        header_text(props, name)
    }

    #[test]
    fn a_reply_goes_to_reply_to_with_the_request_correlation_id() {
        let kind = PostKind::Reply { event_id: Id::new("m-1").unwrap() };
        let reply = post(kind, "amq.gen-reply", MessageBody::text("pong").unwrap());
        let published =
            publication(&channel(), &outbound_rules(), &reply, Some("c-42"), 1_700_000_000_123)
                .unwrap();
        assert_eq!(published.exchange, "");
        assert_eq!(published.routing_key, "amq.gen-reply");
        assert_eq!(published.payload, b"pong");
        assert_eq!(published.message_id, "amqp.test/reply/m-1");
        let props = &published.properties;
        assert_eq!(short(props.correlation_id()), Some("c-42"));
        assert_eq!(short(props.message_id()), Some("amqp.test/reply/m-1"));
        assert_eq!(short(props.content_type()), Some(TEXT_PLAIN));
        assert_eq!(props.delivery_mode(), &Some(PERSISTENT));
        assert_eq!(props.timestamp(), &Some(1_700_000_000));
        assert_eq!(short(props.app_id()), Some("amqp.test"));
        assert_eq!(props.user_id(), &None, "the broker would refuse a user_id it cannot verify");
        assert_eq!(header(props, "x-conversation"), Some("amq.gen-reply"));
        assert_eq!(header(props, "x-thread"), Some("t-9"));
        // Without a recorded correlation id the request's message id correlates.
        let fallback = publication(&channel(), &outbound_rules(), &reply, None, 0).unwrap();
        assert_eq!(short(fallback.properties.correlation_id()), Some("m-1"));
    }

    #[test]
    fn a_proactive_send_uses_the_outbound_exchange_and_routing_key() {
        let kind = PostKind::Proactive { request_id: Id::new("out-7-1").unwrap() };
        let body = MessageBody::with_attachments(
            "report".into(),
            vec![Attachment { url: "https://x/r.pdf".into(), name: None, mime: None }],
        )
        .unwrap();
        let send = post(kind, "alice", body);
        let published = publication(&channel(), &outbound_rules(), &send, None, 0).unwrap();
        assert_eq!(published.exchange, "notify");
        assert_eq!(published.routing_key, "user.alice");
        assert_eq!(published.message_id, "amqp.test/out/out-7-1");
        assert_eq!(published.properties.correlation_id(), &None);
        assert_eq!(short(published.properties.content_type()), Some(APPLICATION_JSON));
        let json: serde_json::Value = serde_json::from_slice(&published.payload).unwrap();
        assert_eq!(json["text"], "report");
        assert_eq!(json["attachments"][0]["url"], "https://x/r.pdf");

        let long = post(
            PostKind::Proactive { request_id: Id::new("r").unwrap() },
            &"c".repeat(252),
            MessageBody::text("x").unwrap(),
        );
        let err = publication(&channel(), &outbound_rules(), &long, None, 0).unwrap_err();
        assert!(matches!(err, PostError::Failed { retryable: false, .. }));
    }

    #[test]
    fn outgoing_ids_are_stable_and_bounded() {
        let kind = PostKind::Proactive { request_id: Id::new("x".repeat(250)).unwrap() };
        let id = outgoing_message_id(&channel(), &kind);
        assert!(id.as_str().starts_with("sha256:") && id.as_str().len() <= 255);
        assert_eq!(id, outgoing_message_id(&channel(), &kind));
    }

    #[test]
    fn confirms_without_a_route_or_with_a_nack_are_failures() {
        assert_eq!(confirmation(Confirmation::Ack(None)), Ok(()));
        assert!(matches!(
            confirmation(Confirmation::Nack(None)),
            Err(PostError::Failed { retryable: true, .. })
        ));
        assert!(matches!(confirmation(Confirmation::NotRequested), Err(PostError::Unknown { .. })));
    }

    #[test]
    fn refused_credentials_and_topology_are_for_an_operator_and_outages_pass() {
        use channeld_driver_sdk::protocol::types::HealthState;
        let (down, lane) = link_state(Disconnect::Unreachable, 2, "connection refused".into());
        assert_eq!(lane, Failure::Transient);
        let health = down.health();
        assert_eq!(health.state, HealthState::Degraded);
        assert_eq!(health.status.unwrap().attempt, Some(2));
        let (refused, lane) = link_state(Disconnect::AuthRefused, 1, "ACCESS_REFUSED".into());
        assert_eq!(lane, Failure::Operator);
        let health = refused.health();
        assert_eq!(health.state, HealthState::Unavailable);
        assert_eq!(health.status.unwrap().reason.as_deref(), Some("auth_rejected"));
        let (topology, lane) = link_state(Disconnect::Topology, 1, "PRECONDITION_FAILED".into());
        assert_eq!(lane, Failure::Operator);
        assert_eq!(topology.health().status.unwrap().reason.as_deref(), Some("setup_refused"));
    }
}
