//! Runs over RabbitMQ (the hub's `amqp` runtime and `channeld-worker`): how the run queue is
//! declared and what travels on it and on the reply queues. See PROTOCOL.md, "Runs over
//! RabbitMQ".
//!
//! - A run message (hub → run queue): the envelope as body, `message_id` = `correlation_id`
//!   = run id, `reply_to` = the hub's reply queue, persistent.
//!   Its header `channeld-env` (a table of strings) carries the environment from the
//!   inbound's metadata ([`crate::metadata_env`]; the envelope may be body-free).
//! - Records (worker → `reply_to`): [`Record`] as JSON, `correlation_id` = run id.
//! - A command answer (hub → the command record's `reply_to`): [`CommandReply`] as JSON,
//!   `correlation_id` = command id, `type` [`COMMAND_RESULT_TYPE`].
//! - A cancel (hub → the stream `<queue>.cancels`, [`cancel_stream_name`], which every worker
//!   reads from its start when it connects and then follows): [`CancelRun`] as JSON, `type`
//!   [`CANCEL_TYPE`]. A worker's own [`CancelSync`] marks where its catch-up ends.

use std::collections::BTreeMap;

use channeld_protocol::Id;
use channeld_protocol::ext::ToolReport;
use channeld_protocol::types::{
    Command, CommandAnswer, CommandResult, Effect, Metadata, Participant,
};
use lapin::Confirmation;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, ExchangeKind};
use serde::{Deserialize, Serialize};

/// The broker URLs in a URL setting: one URL, or several separated by commas (the nodes of
/// a RabbitMQ cluster), in the order they are tried. Blanks around each are ignored.
pub fn broker_urls(setting: &str) -> Vec<&str> {
    setting.split(',').map(str::trim).filter(|url| !url.is_empty()).collect()
}

/// Connects to the first broker of `setting` ([`broker_urls`]) that accepts the connection,
/// trying them in order; the error is the last one's (errors never carry the URL, a secret).
pub async fn connect_first(
    setting: &str,
    properties: lapin::ConnectionProperties,
) -> lapin::Result<lapin::Connection> {
    let urls = broker_urls(setting);
    let mut last = None;
    for url in urls {
        match lapin::Connection::connect(url, properties.clone()).await {
            Ok(connection) => return Ok(connection),
            Err(err) => last = Some(err),
        }
    }
    Err(last.unwrap_or_else(|| {
        lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed))
    }))
}

/// Deliveries of one run message before RabbitMQ dead-letters it (a run that kills every
/// worker it reaches does not go round forever).
pub const RUN_DELIVERY_LIMIT: i64 = 5;

/// The `type` property of a run message.
pub const RUN_MESSAGE_TYPE: &str = "channeld.run";

/// The run message header that carries the environment from the inbound's metadata.
pub const ENV_HEADER: &str = "channeld-env";

/// The [`ENV_HEADER`] table of a run.
pub fn env_header(env: &BTreeMap<String, String>) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in env {
        table
            .insert(ShortString::from(name.as_str()), AMQPValue::LongString(value.as_str().into()));
    }
    table
}

/// The environment a run message's headers carry ([`ENV_HEADER`]; entries that are not
/// strings are skipped). The caller filters it again ([`crate::AgentRun::set_metadata_env`]).
pub fn env_from_headers(headers: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(AMQPValue::FieldTable(table)) = headers.and_then(|h| h.inner().get(ENV_HEADER)) else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .filter_map(|(name, value)| match value {
            AMQPValue::LongString(text) => {
                Some((name.to_string(), String::from_utf8_lossy(text.as_bytes()).into_owned()))
            }
            _ => None,
        })
        .collect()
}

/// The `type` property of a command answer.
pub const COMMAND_RESULT_TYPE: &str = "channeld.command_result";
/// The `type` property of a cancel.
pub const CANCEL_TYPE: &str = "channeld.cancel";

/// The `type` property of a worker's catch-up marker on the cancel stream.
pub const CANCEL_SYNC_TYPE: &str = "channeld.cancel_sync";

/// The stream that carries a run queue's cancels: `<queue>.cancels`. A stream, not a fanout
/// exchange: a worker that connects after a cancel still reads it (from the stream's start)
/// before it takes a run, so a run cancelled while it waited in the run queue never starts.
pub fn cancel_stream_name(queue: &str) -> String {
    format!("{queue}.cancels")
}

/// How much of the cancel stream RabbitMQ keeps: the newest 16 MiB (about 150,000 cancels)
/// and nothing older than a week, dropped a 1-MiB segment at a time.
const CANCEL_STREAM_MAX_BYTES: i64 = 16 * 1024 * 1024;
const CANCEL_STREAM_SEGMENT_BYTES: i64 = 1024 * 1024;
const CANCEL_STREAM_MAX_AGE: &str = "7D";

/// Declares a run queue's cancel stream as both sides expect it (durable,
/// `x-queue-type = stream`, bounded retention).
pub async fn declare_cancel_stream(channel: &Channel, queue: &str) -> lapin::Result<()> {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("stream")),
    );
    arguments.insert(
        ShortString::from("x-max-length-bytes"),
        AMQPValue::LongLongInt(CANCEL_STREAM_MAX_BYTES),
    );
    arguments.insert(
        ShortString::from("x-stream-max-segment-size-bytes"),
        AMQPValue::LongLongInt(CANCEL_STREAM_SEGMENT_BYTES),
    );
    arguments.insert(
        ShortString::from("x-max-age"),
        AMQPValue::LongString(LongString::from(CANCEL_STREAM_MAX_AGE)),
    );
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    channel.queue_declare(cancel_stream_name(queue).as_str().into(), durable, arguments).await?;
    Ok(())
}

/// The consumer arguments that read the cancel stream from its first retained message.
pub fn cancel_stream_from_start() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-stream-offset"),
        AMQPValue::LongString(LongString::from("first")),
    );
    arguments
}

/// A worker's marker on the cancel stream: once it reads its own marker back, it has read
/// every cancel published before it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelSync {
    pub sync: String,
}

/// What a message on the cancel stream is, by its `type` property and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnCancelStream {
    Cancel(CancelRun),
    Sync(CancelSync),
    /// Another type, or a body that does not parse: skipped (a newer hub's message).
    Other,
}

impl OnCancelStream {
    pub fn read(kind: Option<&str>, body: &[u8]) -> Self {
        match kind {
            Some(CANCEL_TYPE) => serde_json::from_slice(body).map_or(Self::Other, Self::Cancel),
            Some(CANCEL_SYNC_TYPE) => serde_json::from_slice(body).map_or(Self::Other, Self::Sync),
            _ => Self::Other,
        }
    }
}

/// A run cancelled at the hub: the worker running it stops its agent (SIGTERM to the process
/// group, SIGKILL after the exec grace), and a worker that picks it later does not run it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRun {
    pub run_id: String,
}

/// The dead-letter exchange (and queue) of a run queue: `<queue>.dead`.
pub fn dead_letter_name(queue: &str) -> String {
    format!("{queue}.dead")
}

fn quorum_arguments() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    arguments
}

/// Declares the run queue as both sides expect it: durable, quorum, a delivery limit and a
/// dead-letter exchange whose queue keeps what was given up.
pub async fn declare_run_queue(channel: &Channel, queue: &str) -> lapin::Result<()> {
    let dead = dead_letter_name(queue);
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    channel
        .exchange_declare(
            dead.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() },
            FieldTable::default(),
        )
        .await?;
    channel.queue_declare(dead.as_str().into(), durable, quorum_arguments()).await?;
    channel
        .queue_bind(
            dead.as_str().into(),
            dead.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arguments = quorum_arguments();
    arguments
        .insert(ShortString::from("x-delivery-limit"), AMQPValue::LongLongInt(RUN_DELIVERY_LIMIT));
    arguments.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString(LongString::from(dead.as_str())),
    );
    channel.queue_declare(queue.into(), durable, arguments).await?;
    Ok(())
}

/// Declares a hub's reply queue: durable, quorum (results outlive a broker restart).
pub async fn declare_reply_queue(channel: &Channel, queue: &str) -> lapin::Result<()> {
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    channel.queue_declare(queue.into(), durable, quorum_arguments()).await?;
    Ok(())
}

/// Properties of a persistent JSON message.
pub fn json_properties(kind: &str, correlation_id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_type(kind.into())
        .with_correlation_id(correlation_id.into())
}

/// Why a message was not taken by the broker.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("broker connection: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker refused the message (nack)")]
    Nacked,
    #[error("no queue takes the message (returned: {0})")]
    Unroutable(String),
    #[error("publisher confirms are not enabled on the channel")]
    NoConfirms,
}

/// Publishes `payload` to `queue` (default exchange, `mandatory`) on a channel in confirm
/// mode and waits for the broker's confirm: `Ok` only once the broker has taken it.
pub async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    publish_confirmed_to(channel, "", queue, payload, properties).await
}

/// [`publish_confirmed`] through `exchange` with `routing_key`: `Unroutable` when no queue
/// is bound that takes it.
pub async fn publish_confirmed_to(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions { mandatory: true, immediate: false },
            payload,
            properties,
        )
        .await?;
    match confirm.await? {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(PublishError::Unroutable(format!(
            "{} {}",
            returned.reply_code, returned.reply_text
        ))),
        Confirmation::Nack(_) => Err(PublishError::Nacked),
        Confirmation::NotRequested => Err(PublishError::NoConfirms),
    }
}

/// A channel in confirm mode.
pub async fn confirm_channel(connection: &lapin::Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(channel)
}

/// What a worker sends back about a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// The worker took the run and starts its agent (sent without waiting for the confirm).
    /// The hub answers a run it no longer waits for because it was cancelled with a cancel.
    Started { run_id: String, worker: String },
    /// A live effect (typing, preview, …) from the agent's output.
    Effect { run_id: String, effect: Effect },
    /// A piece of the reply (agent line `delta`), in order.
    Delta { run_id: String, text: String },
    /// A tool call report (agent line `tool`), in order.
    Tool { run_id: String, tool: ToolReport },
    /// A command the agent asked for; the answer goes to `reply_to` as a [`CommandReply`].
    Command { run_id: String, command_id: Id, command: Command, reply_to: String },
    /// The run's end: exactly one per run and worker attempt.
    Final {
        run_id: String,
        /// Which worker ran it (`host:pid`), for logs.
        worker: String,
        redelivered: bool,
        #[serde(flatten)]
        outcome: Outcome,
    },
}

impl Record {
    pub fn run_id(&self) -> &str {
        match self {
            Record::Started { run_id, .. }
            | Record::Effect { run_id, .. }
            | Record::Delta { run_id, .. }
            | Record::Tool { run_id, .. }
            | Record::Command { run_id, .. }
            | Record::Final { run_id, .. } => run_id,
        }
    }

    /// The `type` property of the message carrying it.
    pub fn kind(&self) -> &'static str {
        match self {
            Record::Started { .. } => "channeld.started",
            Record::Effect { .. } => "channeld.effect",
            Record::Delta { .. } => "channeld.delta",
            Record::Tool { .. } => "channeld.tool",
            Record::Command { .. } => "channeld.command",
            Record::Final { .. } => "channeld.final",
        }
    }
}

/// How a run ended on its worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The agent's reply text (`None`: it produced none).
    Reply {
        reply: Option<String>,
        /// The reply's metadata (agent `reply` lines' `metadata`).
        #[serde(default, skip_serializing_if = "Metadata::is_empty")]
        metadata: Metadata,
    },
    /// The agent failed: the exec error code and its public message (never stderr).
    Failed { code: String, message: String },
}

/// The hub's answer to a [`Record::Command`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandReply {
    pub run_id: String,
    pub command_id: Id,
    pub result: CommandResult,
    #[serde(default)]
    pub responder: Option<Participant>,
}

impl CommandReply {
    pub fn new(run_id: &str, command_id: Id, answer: CommandAnswer) -> Self {
        Self {
            run_id: run_id.to_owned(),
            command_id,
            result: answer.result,
            responder: answer.responder,
        }
    }

    pub fn answer(self) -> CommandAnswer {
        CommandAnswer { result: self.result, responder: self.responder }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cancel_stream_tells_cancels_from_markers_and_skips_the_rest() {
        assert_eq!(
            OnCancelStream::read(Some(CANCEL_TYPE), br#"{"run_id":"run-1"}"#),
            OnCancelStream::Cancel(CancelRun { run_id: "run-1".into() })
        );
        assert_eq!(
            OnCancelStream::read(Some(CANCEL_SYNC_TYPE), br#"{"sync":"w:1-7"}"#),
            OnCancelStream::Sync(CancelSync { sync: "w:1-7".into() })
        );
        assert_eq!(OnCancelStream::read(Some(CANCEL_TYPE), b"{}"), OnCancelStream::Other);
        assert_eq!(
            OnCancelStream::read(Some("channeld.other"), br#"{"run_id":"x"}"#),
            OnCancelStream::Other
        );
        assert_eq!(OnCancelStream::read(None, br#"{"run_id":"x"}"#), OnCancelStream::Other);
    }

    #[test]
    fn a_url_setting_lists_the_nodes_in_order() {
        assert_eq!(broker_urls("amqp://a:1/%2f"), ["amqp://a:1/%2f"]);
        assert_eq!(
            broker_urls("amqp://a:1/%2f, amqp://b:2/%2f,,amqps://c:3/v "),
            ["amqp://a:1/%2f", "amqp://b:2/%2f", "amqps://c:3/v"]
        );
        assert!(broker_urls(" , ").is_empty());
    }

    #[tokio::test]
    async fn connecting_tries_the_next_node_when_one_refuses() {
        // Two loopback ports nobody listens on: both refused, the last error is returned.
        let closed = || {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let setting =
            format!("amqp://127.0.0.1:{}/%2f,amqp://127.0.0.1:{}/%2f", closed(), closed());
        let err = connect_first(&setting, lapin::ConnectionProperties::default()).await;
        assert!(err.is_err());
        assert!(!format!("{:?}", err.err()).contains("127.0.0.1:"), "errors do not name the URL");
    }

    #[test]
    fn records_round_trip_and_finals_are_flat() {
        let record = Record::Final {
            run_id: "run-1".into(),
            worker: "w:1".into(),
            redelivered: true,
            outcome: Outcome::Reply { reply: Some("hi".into()), metadata: Metadata::new() },
        };
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(
            text,
            r#"{"type":"final","run_id":"run-1","worker":"w:1","redelivered":true,"outcome":"reply","reply":"hi"}"#
        );
        assert_eq!(serde_json::from_str::<Record>(&text).unwrap(), record);
        let failed: Record = serde_json::from_str(
            r#"{"type":"final","run_id":"r","worker":"w","redelivered":false,"outcome":"failed","code":"agent_timeout","message":"m"}"#,
        )
        .unwrap();
        assert!(matches!(failed, Record::Final { outcome: Outcome::Failed { .. }, .. }));
        let tool = Record::Tool {
            run_id: "r".into(),
            tool: serde_json::from_str(r#"{"name":"search","status":"done","n":1}"#).unwrap(),
        };
        let text = serde_json::to_string(&tool).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&text).unwrap(), tool);
    }

    #[test]
    fn the_env_header_round_trips() {
        let env: BTreeMap<String, String> =
            [("BCN_BOT_UUID".to_owned(), "bot-1".to_owned())].into_iter().collect();
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from(ENV_HEADER), AMQPValue::FieldTable(env_header(&env)));
        assert_eq!(
            env_from_headers(Some(&headers)),
            [("BCN_BOT_UUID".to_owned(), "bot-1".to_owned())]
        );
        assert!(env_from_headers(None).is_empty());
    }
}
