//! `channelctl --amqp URL send …`: publishes the send to the hub's AMQP send queue
//! (`[hub.amqp_sends]`, PROTOCOL.md "Sends over RabbitMQ") with publisher confirms, and waits
//! on an exclusive reply queue for the hub's outcome — the same answer the control socket
//! gives, printed and exit-coded alike.
//!
//! The broker URL is a secret: `--amqp env:NAME` reads it from the environment; a URL with a
//! password given in argv still works, with a warning that the process list shows it. No
//! error printed here contains the password.

use std::time::Duration;

use channeld_control::{RemoteSendOutcome, SEND_MESSAGE_TYPE, SendArgs};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

/// Why a send over AMQP got no outcome. Messages never hold the URL's password.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AmqpError {
    #[error("--amqp: the environment variable {0} is not set")]
    NoVariable(String),
    #[error("--amqp takes an amqp:// or amqps:// URL or env:NAME")]
    NotAUrl,
    #[error("cannot reach the broker: {0}")]
    Unreachable(String),
    #[error(
        "the send queue {0} does not exist: is [hub.amqp_sends] set and has the hub connected once?"
    )]
    NoQueue(String),
    #[error("broker: {0}")]
    Broker(String),
    #[error("the broker did not take the send: {0}")]
    NotTaken(String),
    #[error(
        "no outcome within {secs} s; the send stays queued and the hub sends it when it takes it: repeat with --key {key} to learn its outcome"
    )]
    Timeout { secs: u64, key: String },
    #[error("unreadable outcome from the hub: {0}")]
    Decode(String),
}

/// A broker URL (a secret) and whether it came from argv with a password in it.
pub(crate) struct BrokerUrl {
    url: String,
    /// What to hide from errors.
    password: Option<String>,
}

impl std::fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl BrokerUrl {
    /// `env:NAME` or a URL; the second value says to warn that argv shows a password.
    pub(crate) fn resolve(arg: &str) -> Result<(Self, bool), AmqpError> {
        let (url, from_argv) = match arg.strip_prefix("env:") {
            Some(name) => (
                std::env::var(name)
                    .ok()
                    .filter(|url| !url.is_empty())
                    .ok_or_else(|| AmqpError::NoVariable(name.to_owned()))?,
                false,
            ),
            None => (arg.to_owned(), true),
        };
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err(AmqpError::NotAUrl);
        }
        let password = password_of(&url);
        let warn = from_argv && password.is_some();
        Ok((Self { url, password }, warn))
    }

    /// `text` with the password replaced by `***`.
    fn redact(&self, text: String) -> String {
        match &self.password {
            Some(password) if text.contains(password.as_str()) => text.replace(password, "***"),
            _ => text,
        }
    }
}

/// The password in an AMQP URL's user info (`amqp://user:password@host/`), if any.
fn password_of(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    let (_, password) = userinfo.split_once(':')?;
    (!password.is_empty()).then(|| password.to_owned())
}

/// A fresh idempotency key, when the caller gave none: unique per invocation.
pub(crate) fn fresh_key() -> String {
    let mut bytes = [0u8; 8];
    let random = std::fs::File::open("/dev/urandom")
        .and_then(|mut file| std::io::Read::read_exact(&mut file, &mut bytes));
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let suffix: String = match random {
        Ok(()) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
        Err(_) => format!("{:x}", std::process::id()),
    };
    format!("channelctl-{millis}-{suffix}")
}

/// Publishes `send` to `queue` and waits up to `budget` for its outcome.
pub(crate) async fn send(
    broker: &BrokerUrl,
    queue: &str,
    send: &SendArgs,
    budget: Duration,
) -> Result<RemoteSendOutcome, AmqpError> {
    let key = send.idempotency_key.clone().unwrap_or_default();
    let broker_error = |err: lapin::Error| AmqpError::Broker(broker.redact(err.to_string()));
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("channelctl {}", std::process::id())));
    let connection = Connection::connect(&broker.url, properties)
        .await
        .map_err(|err| AmqpError::Unreachable(broker.redact(err.to_string())))?;
    let outcome = async {
        // The hub declares the queue (quorum, dead-letter exchange); a passive declaration
        // only checks it is there, so a typo in --amqp-queue is not a new, unread queue.
        let check = connection.create_channel().await.map_err(broker_error)?;
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        if check.queue_declare(queue.into(), passive, FieldTable::default()).await.is_err() {
            return Err(AmqpError::NoQueue(queue.to_owned()));
        }
        let channel = connection.create_channel().await.map_err(broker_error)?;
        channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(broker_error)?;
        let private =
            QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
        let reply_queue = channel
            .queue_declare("".into(), private, FieldTable::default())
            .await
            .map_err(broker_error)?
            .name()
            .to_string();
        let mut replies = channel
            .basic_consume(
                reply_queue.as_str().into(),
                "".into(),
                BasicConsumeOptions { no_ack: true, ..Default::default() },
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)?;
        let correlation_id = fresh_key();
        let body = serde_json::to_vec(send).map_err(|err| AmqpError::Decode(err.to_string()))?;
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_type(SEND_MESSAGE_TYPE.into())
            .with_message_id(key.as_str().into())
            .with_correlation_id(correlation_id.as_str().into())
            .with_reply_to(reply_queue.as_str().into());
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                &body,
                properties,
            )
            .await
            .map_err(broker_error)?;
        match confirm.await.map_err(broker_error)? {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(returned)) => {
                return Err(AmqpError::NotTaken(format!(
                    "returned: {} {}",
                    returned.reply_code, returned.reply_text
                )));
            }
            Confirmation::Nack(_) => return Err(AmqpError::NotTaken("nack".into())),
            Confirmation::NotRequested => {
                return Err(AmqpError::NotTaken("no publisher confirm".into()));
            }
        }
        while let Some(delivery) = replies.next().await {
            let delivery = delivery.map_err(broker_error)?;
            let matches = delivery
                .properties
                .correlation_id()
                .as_ref()
                .is_some_and(|id| id.as_str() == correlation_id);
            if matches {
                return serde_json::from_slice::<RemoteSendOutcome>(&delivery.data)
                    .map_err(|err| AmqpError::Decode(err.to_string()));
            }
        }
        Err(AmqpError::Broker("the reply queue's consumer was cancelled".into()))
    };
    let result = tokio::time::timeout(budget, outcome)
        .await
        .unwrap_or(Err(AmqpError::Timeout { secs: budget.as_secs(), key }));
    let _ = connection.close(200, "done".into()).await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_found_and_redacted() {
        assert_eq!(password_of("amqp://u:s3cret@host:5672/%2f").as_deref(), Some("s3cret"));
        assert_eq!(password_of("amqp://u:p@ss@host/").as_deref(), Some("p@ss"));
        assert_eq!(password_of("amqp://u@host/"), None);
        assert_eq!(password_of("amqp://host:5672/v?x=a:b@c"), None);
        let (broker, warn) = BrokerUrl::resolve("amqp://u:s3cret@host/").unwrap();
        assert!(warn);
        assert_eq!(
            broker.redact("connect amqp://u:s3cret@host failed".into()),
            "connect amqp://u:***@host failed"
        );
        assert_eq!(format!("{broker:?}"), "***");
        let (_, warn) = BrokerUrl::resolve("amqp://host/").unwrap();
        assert!(!warn);
    }

    #[test]
    fn env_names_the_variable_and_never_warns() {
        let err = BrokerUrl::resolve("env:CHANNELCTL_TEST_UNSET_AMQP_URL").unwrap_err();
        assert!(err.to_string().contains("CHANNELCTL_TEST_UNSET_AMQP_URL"));
        assert!(matches!(BrokerUrl::resolve("http://x"), Err(AmqpError::NotAUrl)));
    }

    #[test]
    fn fresh_keys_differ() {
        assert_ne!(fresh_key(), fresh_key());
    }
}
