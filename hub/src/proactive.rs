//! A proactive send asked for by a caller — the control op `send` or a message on the AMQP
//! send queue (`sendq.rs`) — validated, submitted through the outbox and answered as the
//! control protocol's `SendResult` or `ErrorBody`, so both paths behave alike.

use std::collections::BTreeMap;
use std::time::Duration;

use channeld_control::{ErrorBody, SendArgs, SendResult, code};
use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};
use channeld_protocol::{ChannelId, Id};
use tracing::debug;

use crate::hub::Hub;
use crate::outbox::SendRequest;
use crate::send::{SendError, SendOutcome};

/// Longest idempotency key.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;

fn refused(code: &str, message: String) -> ErrorBody {
    ErrorBody { code: code.to_owned(), message, request_id: None }
}

/// Sends what a caller asked for as the control op `send` does: through the outbox,
/// idempotent by key.
pub async fn send(hub: &Hub, ask: SendArgs) -> Result<SendResult, ErrorBody> {
    let SendArgs {
        instance,
        conversation,
        thread,
        text,
        metadata,
        wait,
        timeout_ms,
        idempotency_key,
    } = ask;
    let message = outbound(&instance, &conversation, thread, text, metadata)
        .map_err(|message| refused(code::INVALID_REQUEST, message))?;
    if let Some(key) = &idempotency_key
        && (key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY)
    {
        let message = format!("idempotency_key must be 1-{MAX_IDEMPOTENCY_KEY} bytes");
        return Err(refused(code::INVALID_REQUEST, message));
    }
    let timeout = timeout_ms.map_or(hub.config.receipt_timeout, Duration::from_millis);
    let request = SendRequest {
        instance: instance.clone(),
        message,
        wait: wait.then_some(timeout),
        idempotency_key,
    };
    match hub.outbox.submit(request).await {
        Ok(SendOutcome { request_id, outbox_id, state, receipt, repeated }) => Ok(SendResult {
            request_id: request_id.into_string(),
            state: state.as_str().into(),
            receipt,
            outbox_id,
            repeated,
        }),
        Err(err) => {
            let request_id = match &err {
                SendError::Failed { request_id, .. } | SendError::Unknown { request_id, .. } => {
                    Some(request_id.to_string())
                }
                _ => None,
            };
            debug!(%instance, code = err.code(), error = %err, "send failed");
            Err(ErrorBody { code: err.code().to_owned(), message: err.to_string(), request_id })
        }
    }
}

fn outbound(
    instance: &str,
    conversation: &str,
    thread: Option<String>,
    text: String,
    metadata: BTreeMap<String, String>,
) -> Result<OutboundMessage, String> {
    let channel = ChannelId::new(instance).map_err(|err| format!("instance: {err}"))?;
    let conversation = Id::new(conversation).map_err(|err| format!("conversation: {err}"))?;
    let thread = thread.map(Id::new).transpose().map_err(|err| format!("thread: {err}"))?;
    let body = MessageBody::text(text).map_err(|err| format!("text: {err}"))?;
    Ok(OutboundMessage {
        target: MessageTarget { channel, conversation, thread, reply_to: None },
        body,
        metadata,
    })
}
