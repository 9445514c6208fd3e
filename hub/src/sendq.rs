//! The AMQP send queue (`[hub.amqp_sends]`, PROTOCOL.md "Sends over RabbitMQ"): applications
//! on other machines publish a send to a durable quorum queue, the hub sends it exactly as
//! the control op `send` would (`proactive.rs`: same outbox, same idempotency keys, same
//! outcomes) and publishes the outcome to the message's `reply_to` with its
//! `correlation_id`.
//!
//! A message is acknowledged only after its outcome was confirmed by the broker (or it had no
//! `reply_to`, or its reply queue is gone): a hub that stops or loses the broker mid-send
//! leaves the message to be delivered again, and its idempotency key — required on every
//! message — answers that second delivery from the first send's record, never posting twice.
//! A message that is not a send is answered with an `invalid_request` outcome (when it has
//! `reply_to`) and dead-lettered to `<queue>.dead`; the consumer goes on. At most `prefetch`
//! messages are worked on at once. The connection is remade with backoff for as long as the
//! hub runs.

use std::sync::Arc;
use std::time::Duration;

use channeld_agent_exec::amqp::{
    PublishError, confirm_channel, declare_run_queue, json_properties, publish_confirmed,
};
use channeld_control::{
    ErrorBody, MAX_CONTROL_LINE, RemoteSendOutcome, SEND_OUTCOME_TYPE, SendArgs, code,
};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::types::{FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::config::AmqpSendsConfig;
use crate::hub::Hub;
use crate::metrics::{AmqpSendsState, RemoteSendOutcome as Outcome};
use crate::proactive;

/// Pause between broker reconnects (doubling up to the maximum).
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// Longest receipt wait a message may ask for: a longer one would hold a prefetch slot.
pub const MAX_REMOTE_WAIT_MS: u64 = 600_000;

/// Why a session with the broker ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker cancelled the send queue's consumer")]
    Cancelled,
}

/// Consumes the send queue until the hub shuts down, reconnecting with backoff.
pub(crate) async fn consume(hub: Arc<Hub>, config: AmqpSendsConfig, state: Arc<AmqpSendsState>) {
    let mut pause = RECONNECT_MIN;
    loop {
        let ended = tokio::select! {
            ended = session(&hub, &config, &state, &mut pause) => ended,
            () = hub.shutdown.cancelled() => Ok(()),
        };
        match ended {
            Ok(()) => {
                state.down(None);
                return;
            }
            Err(err) => {
                warn!(queue = %config.queue, error = %err, "send queue connection lost; reconnecting");
                state.down(Some(err.to_string()));
            }
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = hub.shutdown.cancelled() => return,
        }
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// One connection's life: `Ok` once the hub shuts down, `Err` when the connection failed.
/// Sends in progress when it ends are dropped unacknowledged: RabbitMQ delivers them again.
async fn session(
    hub: &Arc<Hub>,
    config: &AmqpSendsConfig,
    state: &AmqpSendsState,
    pause: &mut Duration,
) -> Result<(), SessionError> {
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("channeld sends {}", config.queue)));
    let connection = Connection::connect(config.url.expose(), properties).await?;
    let consume = connection.create_channel().await?;
    declare_run_queue(&consume, &config.queue).await?;
    consume.basic_qos(config.prefetch, BasicQosOptions::default()).await?;
    let publish = confirm_channel(&connection).await?;
    let tag = format!("channeld-sends-{}", std::process::id());
    let mut consumer = consume
        .basic_consume(
            config.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    info!(queue = %config.queue, prefetch = config.prefetch, "send queue consumer ready");
    state.up();
    *pause = RECONNECT_MIN;
    let mut sends = JoinSet::new();
    let mut stopping = std::pin::pin!(hub.shutdown.cancelled());
    let ended = loop {
        tokio::select! {
            () = &mut stopping => break Ok(()),
            delivery = consumer.next() => match delivery {
                Some(Ok(delivery)) => {
                    state.received();
                    sends.spawn(handle(hub.clone(), publish.clone(), delivery));
                }
                Some(Err(err)) => break Err(SessionError::Broker(err)),
                None => break Err(SessionError::Cancelled),
            },
            Some(_) = sends.join_next() => {}
        }
    };
    // Unacknowledged sends go back to the queue with the channel.
    sends.abort_all();
    if ended.is_ok() {
        let _ = consume.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
        let _ = connection.close(200, "hub stopping".into()).await;
    }
    ended
}

/// A message's send, as [`proactive::send`] takes it, or why it is not one.
fn parse(data: &[u8], message_id: Option<&str>) -> Result<SendArgs, String> {
    if data.len() > MAX_CONTROL_LINE {
        return Err(format!("the message is over {MAX_CONTROL_LINE} bytes"));
    }
    let mut send: SendArgs =
        serde_json::from_slice(data).map_err(|err| format!("not a send message: {err}"))?;
    if send.idempotency_key.is_none() {
        send.idempotency_key = message_id.filter(|id| !id.is_empty()).map(str::to_owned);
    }
    if send.idempotency_key.is_none() {
        return Err("idempotency_key is required (or the message_id property): a message may be delivered twice".into());
    }
    if send.timeout_ms.is_some_and(|ms| ms > MAX_REMOTE_WAIT_MS) {
        return Err(format!("timeout_ms must be at most {MAX_REMOTE_WAIT_MS}"));
    }
    Ok(send)
}

/// Sends one message and answers it; the message is settled here.
async fn handle(hub: Arc<Hub>, publish: Channel, delivery: Delivery) {
    let properties = &delivery.properties;
    let reply_to = properties.reply_to().as_ref().map(ToString::to_string);
    let message_id = properties.message_id().as_ref().map(ToString::to_string);
    let correlation_id = properties
        .correlation_id()
        .as_ref()
        .map(ToString::to_string)
        .or_else(|| message_id.clone())
        .unwrap_or_default();
    let (outcome, answer) = match parse(&delivery.data, message_id.as_deref()) {
        Ok(ask) => match proactive::send(&hub, ask).await {
            Ok(result) => (Outcome::Sent, RemoteSendOutcome::sent(result)),
            Err(error) => (Outcome::Failed, RemoteSendOutcome::failed(error)),
        },
        Err(message) => {
            warn!(%correlation_id, reason = %message, "send queue message refused (dead-lettered)");
            let error =
                ErrorBody { code: code::INVALID_REQUEST.to_owned(), message, request_id: None };
            (Outcome::Malformed, RemoteSendOutcome::failed(error))
        }
    };
    // Counted before the caller can hear of it.
    if let Some(state) = &hub.amqp_sends {
        state.ended(outcome);
    }
    hub.metrics.amqp_send(outcome);
    let answered = match reply_to.as_deref().filter(|queue| !queue.is_empty()) {
        None => Ok(()),
        Some(queue) => {
            let body = serde_json::to_vec(&answer).expect("outcomes serialize");
            let properties = json_properties(SEND_OUTCOME_TYPE, &correlation_id);
            match publish_confirmed(&publish, queue, &body, properties).await {
                // Nobody to tell any more: the send stands, the answer is dropped.
                Err(PublishError::Unroutable(why)) => {
                    warn!(%correlation_id, reply_to = %queue, %why, "the send's reply queue is gone; outcome dropped");
                    Ok(())
                }
                other => other,
            }
        }
    };
    let settled = match (answered, outcome) {
        (Ok(()), Outcome::Malformed) => {
            delivery.acker.reject(BasicRejectOptions { requeue: false }).await
        }
        (Ok(()), _) => delivery.acker.ack(BasicAckOptions::default()).await,
        (Err(err), _) => {
            // Delivered again later: its key answers without a second post.
            warn!(%correlation_id, error = %err, "send outcome not published; the message goes back to the queue");
            delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await
        }
    };
    if let Err(err) = settled {
        debug!(%correlation_id, error = %err, "send queue message not settled (connection lost?); it will be delivered again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_message_needs_a_key_from_its_body_or_message_id() {
        let body = br#"{"instance":"mqtt.a","conversation":"c1","text":"hi"}"#;
        let err = parse(body, None).unwrap_err();
        assert!(err.contains("idempotency_key is required"), "{err}");
        let ask = parse(body, Some("m-1")).unwrap();
        assert_eq!(ask.idempotency_key.as_deref(), Some("m-1"));
        assert!(ask.wait);
        let keyed =
            br#"{"instance":"mqtt.a","conversation":"c1","text":"hi","idempotency_key":"k"}"#;
        assert_eq!(parse(keyed, Some("m-1")).unwrap().idempotency_key.as_deref(), Some("k"));
    }

    #[test]
    fn malformed_messages_say_why() {
        assert!(parse(b"not json", Some("m")).unwrap_err().starts_with("not a send message"));
        let unknown = br#"{"instance":"a.b","conversation":"c","text":"t","op":"send"}"#;
        assert!(parse(unknown, Some("m")).unwrap_err().contains("unknown field"));
        let long_wait = br#"{"instance":"a.b","conversation":"c","text":"t","timeout_ms":600001}"#;
        assert!(parse(long_wait, Some("m")).unwrap_err().contains("timeout_ms"));
        let big = vec![b' '; MAX_CONTROL_LINE + 1];
        assert!(parse(&big, Some("m")).unwrap_err().contains("bytes"));
    }
}
