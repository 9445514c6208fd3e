//! Settings of the AMQP driver, read from the launch environment (`CHANNELD_AMQP_*`) and
//! validated before anything connects.
//!
//! The broker URL carries credentials, so the whole URL is a secret: it is read through the
//! SDK's credential lookup, never printed (`Debug` shows `***`), and errors about it never
//! quote it.

use std::str::FromStr;
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret};
use lapin::ExchangeKind;
use lapin::uri::AMQPUri;

/// `$CREDENTIALS_DIRECTORY/amqp-url`, then `CHANNELD_AMQP_URL`: the broker URL (a secret).
pub const CREDENTIAL_URL: &str = "amqp-url";
/// The environment name of the URL (after the `CHANNELD_` prefix).
pub const VAR_URL: &str = "AMQP_URL";
/// The queue this instance consumes (required).
pub const VAR_QUEUE: &str = "AMQP_QUEUE";
/// `true` (default): declare the queue, exchanges and bindings (idempotently); `false`: only
/// check that the queue exists (passive declare) and leave the topology to the operator.
pub const VAR_DECLARE: &str = "AMQP_DECLARE";
/// An exchange to declare and bind the queue to (optional).
pub const VAR_EXCHANGE: &str = "AMQP_EXCHANGE";
/// Its type: `topic` (default), `direct`, `fanout` or `headers`.
pub const VAR_EXCHANGE_TYPE: &str = "AMQP_EXCHANGE_TYPE";
/// Comma-separated binding keys for the queue on that exchange (default: the queue name).
pub const VAR_BINDINGS: &str = "AMQP_BINDINGS";
/// Unacknowledged deliveries at once (1-256, default 16).
pub const VAR_PREFETCH: &str = "AMQP_PREFETCH";
/// Exchange replies are published to, with the conversation as routing key (default `""`, the
/// default exchange, which routes to the queue named by `reply_to`).
pub const VAR_REPLY_EXCHANGE: &str = "AMQP_REPLY_EXCHANGE";
/// Exchange proactive sends are published to (default `""`).
pub const VAR_OUTBOUND_EXCHANGE: &str = "AMQP_OUTBOUND_EXCHANGE";
/// Routing key of proactive sends; `{conversation}` is replaced (default `{conversation}`).
pub const VAR_OUTBOUND_ROUTING_KEY: &str = "AMQP_OUTBOUND_ROUTING_KEY";
/// Dead-letter exchange for rejected messages (optional; declared as a durable fanout).
pub const VAR_DEAD_LETTER_EXCHANGE: &str = "AMQP_DEAD_LETTER_EXCHANGE";
/// A queue to declare and bind to the dead-letter exchange (optional).
pub const VAR_DEAD_LETTER_QUEUE: &str = "AMQP_DEAD_LETTER_QUEUE";
/// Where the sender comes from when a message has no `user_id`: `user_id` (default: such
/// messages are denied), `header:<name>` or `app_id`.
pub const VAR_TRUST: &str = "AMQP_TRUST";
/// Header naming the conversation when a message has no `reply_to` (default `x-conversation`).
pub const VAR_CONVERSATION_HEADER: &str = "AMQP_CONVERSATION_HEADER";
/// Header naming the thread (default `x-thread`).
pub const VAR_THREAD_HEADER: &str = "AMQP_THREAD_HEADER";
/// What a message without `message_id` gets: `reject` (default: dead-lettered) or `digest`
/// (an event id derived from its content).
pub const VAR_MISSING_MESSAGE_ID: &str = "AMQP_MISSING_MESSAGE_ID";
/// How long a post waits for the broker (recovery plus publisher confirm), 1-600 s, default 30.
pub const VAR_CONFIRM_TIMEOUT: &str = "AMQP_CONFIRM_TIMEOUT_SECONDS";

/// Heartbeat asked for when the URL does not say (`?heartbeat=N`); RabbitMQ's own default of
/// 60 s would leave a dead TCP connection unnoticed for up to two minutes.
pub const DEFAULT_HEARTBEAT_SECONDS: u16 = 10;
/// TCP connect timeout when the URL does not say (`?connection_timeout=MS`).
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Largest AMQP frame offered to the broker when the URL does not say (`?frame_max=N`).
/// lapin keeps a receive and a send buffer of 32 frames each, allocated and zeroed at once:
/// with RabbitMQ's default of 128 KiB that is 8 MiB of an idle driver's heap, with this 1 MiB.
/// Larger messages still pass, split into body frames of this size.
pub const DEFAULT_FRAME_MAX: u32 = 16 * 1024;
/// Default prefetch.
pub const DEFAULT_PREFETCH: u16 = 16;
/// The largest prefetch: the SDK holds at most this many unanswered inbound messages.
pub const MAX_PREFETCH: u16 = channeld_driver_sdk::MAX_PENDING_INBOUND as u16;
/// The placeholder in the outbound routing key.
pub const CONVERSATION_PLACEHOLDER: &str = "{conversation}";

/// Longest AMQP short string (names, routing keys, properties).
const MAX_SHORT_STRING: usize = 255;

fn invalid(var: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(var), reason)
}

/// The broker URL, parsed; it carries the password, so it is a [`Secret`] (prints `***`).
pub type BrokerUrl = Secret<AMQPUri>;

/// Parses the broker URL; the error never quotes it. Adds a heartbeat, a connect timeout and
/// a frame size ([`DEFAULT_FRAME_MAX`]) when the URL does not set them.
pub fn parse_broker_url(raw: &str) -> Result<BrokerUrl, ConfigError> {
    let mut uri = AMQPUri::from_str(raw.trim()).map_err(|err| {
        // Only the scheme error is safe to repeat; the others may quote the URL.
        let reason = if err.starts_with("Invalid AMQP scheme") {
            "the scheme must be amqp or amqps"
        } else {
            "not a valid amqp:// or amqps:// URL"
        };
        invalid(VAR_URL, reason)
    })?;
    uri.query.heartbeat.get_or_insert(DEFAULT_HEARTBEAT_SECONDS);
    uri.query.connection_timeout.get_or_insert(DEFAULT_CONNECT_TIMEOUT_MS);
    uri.query.frame_max.get_or_insert(DEFAULT_FRAME_MAX);
    Ok(Secret::new(uri))
}

/// Whether the connection uses TLS (safe to log).
pub fn is_tls(url: &BrokerUrl) -> bool {
    matches!(url.expose().scheme, lapin::uri::AMQPScheme::AMQPS)
}

/// Who a message is from when it carries no `user_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Only the broker-validated `user_id` property; messages without it are denied.
    UserId,
    /// `user_id` when present, else this header. Only safe when every publisher that can reach
    /// the queue without a `user_id` is trusted to name the sender honestly.
    Header(String),
    /// `user_id` when present, else the `app_id` property (same caveat).
    AppId,
}

impl Trust {
    fn parse(raw: &str) -> Result<Self, ConfigError> {
        match raw.trim() {
            "user_id" => Ok(Trust::UserId),
            "app_id" => Ok(Trust::AppId),
            other => match other.strip_prefix("header:") {
                Some(name) if valid_header_name(name) => Ok(Trust::Header(name.to_owned())),
                _ => Err(invalid(VAR_TRUST, "expected user_id, app_id or header:<name>")),
            },
        }
    }
}

/// What a message without `message_id` gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingMessageId {
    /// Rejected (dead-lettered when a dead-letter exchange is set): without a publisher-chosen
    /// id, a redelivery cannot be told from a new message.
    Reject,
    /// The event id is a SHA-256 digest of sender, routing, properties and body: redeliveries
    /// are recognised, but two byte-identical messages without ids count as one.
    Digest,
}

/// How inbound deliveries become messages (the pure part, used by `convert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundRules {
    pub trust: Trust,
    pub conversation_header: String,
    pub thread_header: String,
    pub missing_message_id: MissingMessageId,
}

/// Where replies and proactive sends go (the pure part, used by `convert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundRules {
    pub reply_exchange: String,
    pub outbound_exchange: String,
    /// Contains at most [`CONVERSATION_PLACEHOLDER`]s and otherwise literal text.
    pub outbound_routing_key: String,
    pub conversation_header: String,
    pub thread_header: String,
}

/// The exchange the queue is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub exchange: String,
    pub kind: ExchangeKind,
    pub keys: Vec<String>,
}

/// The dead-letter exchange and its optional queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub exchange: String,
    pub queue: Option<String>,
}

/// Everything the driver needs, validated.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    pub channel: ChannelId,
    pub url: BrokerUrl,
    pub queue: String,
    pub declare: bool,
    pub binding: Option<Binding>,
    pub prefetch: u16,
    pub dead_letter: Option<DeadLetter>,
    pub inbound: InboundRules,
    pub outbound: OutboundRules,
    pub confirm_timeout: Duration,
    /// How long a stopping driver waits for the hub to answer deliveries it already has
    /// (half the SDK's drain deadline).
    pub drain_grace: Duration,
}

impl AmqpConfig {
    /// Reads and validates the settings of `launch`.
    pub fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, ConfigError> {
        let url = launch
            .secret(CREDENTIAL_URL, VAR_URL)?
            .ok_or_else(|| ConfigError::missing(setting_var(VAR_URL)))?;
        let url = parse_broker_url(url.as_str())?;
        let var = |name: &str| launch.var(name);
        let queue = name(VAR_QUEUE, &launch.require::<String>(VAR_QUEUE)?)?;
        if queue.is_empty() || queue.starts_with("amq.") {
            return Err(invalid(VAR_QUEUE, "must be a non-empty name not starting with amq."));
        }
        let declare = launch.parse_or(VAR_DECLARE, true)?;
        let binding = match var(VAR_EXCHANGE) {
            None => {
                for other in [VAR_EXCHANGE_TYPE, VAR_BINDINGS] {
                    if var(other).is_some() {
                        return Err(invalid(other, format!("needs CHANNELD_{VAR_EXCHANGE}")));
                    }
                }
                None
            }
            Some(exchange) => {
                let exchange = name(VAR_EXCHANGE, exchange)?;
                if exchange.is_empty() || exchange.starts_with("amq.") {
                    return Err(invalid(VAR_EXCHANGE, "cannot bind to a reserved exchange"));
                }
                let kind = exchange_kind(var(VAR_EXCHANGE_TYPE).unwrap_or("topic"))?;
                let keys = match var(VAR_BINDINGS) {
                    Some(raw) => raw
                        .split(',')
                        .map(|key| name(VAR_BINDINGS, key))
                        .collect::<Result<Vec<_>, _>>()?,
                    None => vec![queue.clone()],
                };
                Some(Binding { exchange, kind, keys })
            }
        };
        let prefetch =
            launch.parse_within(VAR_PREFETCH, 1..=MAX_PREFETCH)?.unwrap_or(DEFAULT_PREFETCH);
        let dead_letter = match var(VAR_DEAD_LETTER_EXCHANGE) {
            None => {
                if var(VAR_DEAD_LETTER_QUEUE).is_some() {
                    return Err(invalid(
                        VAR_DEAD_LETTER_QUEUE,
                        format!("needs CHANNELD_{VAR_DEAD_LETTER_EXCHANGE}"),
                    ));
                }
                None
            }
            Some(exchange) => {
                let exchange = name(VAR_DEAD_LETTER_EXCHANGE, exchange)?;
                if exchange.is_empty() || exchange.starts_with("amq.") {
                    return Err(invalid(
                        VAR_DEAD_LETTER_EXCHANGE,
                        "cannot use a reserved exchange",
                    ));
                }
                let queue = var(VAR_DEAD_LETTER_QUEUE)
                    .map(|q| name(VAR_DEAD_LETTER_QUEUE, q))
                    .transpose()?;
                Some(DeadLetter { exchange, queue })
            }
        };
        let conversation_header =
            header(VAR_CONVERSATION_HEADER, var(VAR_CONVERSATION_HEADER), "x-conversation")?;
        let thread_header = header(VAR_THREAD_HEADER, var(VAR_THREAD_HEADER), "x-thread")?;
        if conversation_header == thread_header {
            return Err(invalid(VAR_THREAD_HEADER, "must differ from the conversation header"));
        }
        let trust = var(VAR_TRUST).map_or(Ok(Trust::UserId), Trust::parse)?;
        let missing_message_id = match var(VAR_MISSING_MESSAGE_ID).map(str::trim) {
            None | Some("reject") => MissingMessageId::Reject,
            Some("digest") => MissingMessageId::Digest,
            Some(_) => return Err(invalid(VAR_MISSING_MESSAGE_ID, "expected reject or digest")),
        };
        let reply_exchange = name(VAR_REPLY_EXCHANGE, var(VAR_REPLY_EXCHANGE).unwrap_or(""))?;
        let outbound_exchange =
            name(VAR_OUTBOUND_EXCHANGE, var(VAR_OUTBOUND_EXCHANGE).unwrap_or(""))?;
        let outbound_routing_key = routing_key_template(
            var(VAR_OUTBOUND_ROUTING_KEY).unwrap_or(CONVERSATION_PLACEHOLDER),
        )?;
        let confirm_timeout = launch
            .parse_within(VAR_CONFIRM_TIMEOUT, Duration::from_secs(1)..=Duration::from_secs(600))?
            .unwrap_or(Duration::from_secs(30));
        Ok(Self {
            channel: launch.channel.clone(),
            url,
            queue,
            declare,
            binding,
            prefetch,
            dead_letter,
            inbound: InboundRules {
                trust,
                conversation_header: conversation_header.clone(),
                thread_header: thread_header.clone(),
                missing_message_id,
            },
            outbound: OutboundRules {
                reply_exchange,
                outbound_exchange,
                outbound_routing_key,
                conversation_header,
                thread_header,
            },
            confirm_timeout,
            drain_grace: launch.drain_timeout / 2,
        })
    }

    /// The consumer tag: names the instance in the broker's management views.
    pub fn consumer_tag(&self) -> String {
        format!("channeld.{}", self.channel)
    }
}

/// An AMQP name (queue, exchange, routing key): trimmed, at most 255 bytes, no NUL.
fn name(var: &'static str, raw: &str) -> Result<String, ConfigError> {
    let value = raw.trim();
    if value.len() > MAX_SHORT_STRING || value.contains('\0') {
        return Err(invalid(var, "must be at most 255 bytes without NUL"));
    }
    Ok(value.to_owned())
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_SHORT_STRING && !name.contains(['\0', ' ', ','])
}

fn header(var: &'static str, raw: Option<&str>, default: &str) -> Result<String, ConfigError> {
    let value = raw.map_or(default, str::trim);
    if !valid_header_name(value) {
        return Err(invalid(var, "must be a header name of 1-255 bytes without spaces"));
    }
    Ok(value.to_owned())
}

fn exchange_kind(raw: &str) -> Result<ExchangeKind, ConfigError> {
    match raw.trim() {
        "topic" => Ok(ExchangeKind::Topic),
        "direct" => Ok(ExchangeKind::Direct),
        "fanout" => Ok(ExchangeKind::Fanout),
        "headers" => Ok(ExchangeKind::Headers),
        _ => Err(invalid(VAR_EXCHANGE_TYPE, "expected topic, direct, fanout or headers")),
    }
}

/// A routing key whose only braces are `{conversation}` placeholders.
fn routing_key_template(raw: &str) -> Result<String, ConfigError> {
    let template = name(VAR_OUTBOUND_ROUTING_KEY, raw)?;
    if template.replace(CONVERSATION_PLACEHOLDER, "").contains(['{', '}']) {
        return Err(invalid(
            VAR_OUTBOUND_ROUTING_KEY,
            format!("the only placeholder is {CONVERSATION_PLACEHOLDER}"),
        ));
    }
    Ok(template)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET_URL: &str = "amqp://bot:hunter2@broker.internal:5671/%2f";

    fn parse(vars: &[(&str, &str)]) -> Result<AmqpConfig, ConfigError> {
        let mut launch =
            DriverLaunchConfig::for_socket(ChannelId::new("amqp.test").unwrap(), "/tmp/a.sock")
                .with_var(VAR_URL, SECRET_URL);
        for (name, value) in vars {
            launch = launch.with_var(name, *value);
        }
        AmqpConfig::from_launch(&launch)
    }

    #[test]
    fn defaults_need_only_a_queue() {
        let config = parse(&[("AMQP_QUEUE", "inbox")]).unwrap();
        assert_eq!(config.queue, "inbox");
        assert!(config.declare);
        assert_eq!(config.binding, None);
        assert_eq!(config.prefetch, DEFAULT_PREFETCH);
        assert_eq!(config.dead_letter, None);
        assert_eq!(config.inbound.trust, Trust::UserId);
        assert_eq!(config.inbound.missing_message_id, MissingMessageId::Reject);
        assert_eq!(config.outbound.reply_exchange, "");
        assert_eq!(config.outbound.outbound_routing_key, "{conversation}");
        assert_eq!(config.confirm_timeout, Duration::from_secs(30));
        assert_eq!(config.consumer_tag(), "channeld.amqp.test");
        assert_eq!(parse(&[]).unwrap_err(), ConfigError::missing("CHANNELD_AMQP_QUEUE"));
    }

    #[test]
    fn exchange_bindings_and_dead_letters() {
        let config = parse(&[
            ("AMQP_QUEUE", "inbox"),
            ("AMQP_EXCHANGE", "chat"),
            ("AMQP_EXCHANGE_TYPE", "direct"),
            ("AMQP_BINDINGS", "a.b, c"),
            ("AMQP_DEAD_LETTER_EXCHANGE", "chat.dlx"),
            ("AMQP_DEAD_LETTER_QUEUE", "chat.dead"),
            ("AMQP_PREFETCH", "256"),
            ("AMQP_TRUST", "header:x-sender"),
            ("AMQP_MISSING_MESSAGE_ID", "digest"),
            ("AMQP_OUTBOUND_EXCHANGE", "notify"),
            ("AMQP_OUTBOUND_ROUTING_KEY", "user.{conversation}"),
        ])
        .unwrap();
        let binding = config.binding.unwrap();
        assert_eq!(binding.kind, ExchangeKind::Direct);
        assert_eq!(binding.keys, vec!["a.b", "c"]);
        assert_eq!(
            config.dead_letter,
            Some(DeadLetter { exchange: "chat.dlx".into(), queue: Some("chat.dead".into()) })
        );
        assert_eq!(config.prefetch, 256);
        assert_eq!(config.inbound.trust, Trust::Header("x-sender".into()));
        assert_eq!(config.inbound.missing_message_id, MissingMessageId::Digest);
        assert_eq!(config.outbound.outbound_routing_key, "user.{conversation}");
        let default_key = parse(&[("AMQP_QUEUE", "inbox"), ("AMQP_EXCHANGE", "chat")]).unwrap();
        assert_eq!(default_key.binding.unwrap().keys, vec!["inbox"]);
    }

    #[test]
    fn invalid_settings_name_their_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("AMQP_QUEUE", "amq.x")], "CHANNELD_AMQP_QUEUE"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_PREFETCH", "0")], "CHANNELD_AMQP_PREFETCH"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_PREFETCH", "257")], "CHANNELD_AMQP_PREFETCH"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_TRUST", "anyone")], "CHANNELD_AMQP_TRUST"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_TRUST", "header:")], "CHANNELD_AMQP_TRUST"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_BINDINGS", "x")], "CHANNELD_AMQP_BINDINGS"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_DEAD_LETTER_QUEUE", "d")], "DEAD_LETTER_QUEUE"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_OUTBOUND_ROUTING_KEY", "{user}")], "ROUTING_KEY"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_DECLARE", "maybe")], "CHANNELD_AMQP_DECLARE"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_CONFIRM_TIMEOUT_SECONDS", "0")], "CONFIRM_TIMEOUT"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_THREAD_HEADER", "x-conversation")], "THREAD_HEADER"),
            (&[("AMQP_QUEUE", "q"), ("AMQP_MISSING_MESSAGE_ID", "skip")], "MISSING_MESSAGE_ID"),
        ];
        for (vars, expected) in cases {
            let err = parse(vars).unwrap_err().to_string();
            assert!(err.contains(expected), "{vars:?}: {err}");
        }
        let long = "q".repeat(256);
        assert!(parse(&[("AMQP_QUEUE", &long)]).is_err());
    }

    #[test]
    fn the_url_never_prints_and_gets_a_heartbeat() {
        let url = parse_broker_url(SECRET_URL).unwrap();
        assert_eq!(format!("{url:?}"), "***");
        assert_eq!(url.expose().query.heartbeat, Some(DEFAULT_HEARTBEAT_SECONDS));
        assert_eq!(url.expose().query.frame_max, Some(DEFAULT_FRAME_MAX));
        assert_eq!(url.expose().authority.userinfo.password, "hunter2");
        assert!(!is_tls(&url));
        let explicit = parse_broker_url("amqps://u:p@h/%2f?heartbeat=30&frame_max=131072").unwrap();
        assert_eq!(explicit.expose().query.heartbeat, Some(30));
        assert_eq!(explicit.expose().query.frame_max, Some(131_072));
        assert!(is_tls(&explicit));
        let config = parse(&[("AMQP_QUEUE", "q")]).unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn url_errors_do_not_quote_the_url() {
        for bad in
            ["amqp:hunter2", "http://u:hunter2@h/", "not a url hunter2", "amqp://u:hunter2@[::1/"]
        {
            let err = parse_broker_url(bad).unwrap_err().to_string();
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.starts_with("CHANNELD_AMQP_URL is invalid"), "{err}");
        }
    }
}
