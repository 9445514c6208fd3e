//! Socket Mode envelopes: each `events_api` envelope becomes a hub report (or is dropped with
//! a reason) and is acknowledged on its socket only after the hub's answer; a copy the hub
//! already answered is acknowledged at once; interactive envelopes are acknowledged at once
//! and handed to the waiting commands.

use std::sync::Arc;

use channeld_driver_sdk::transport::websocket::WsSender;
use channeld_driver_sdk::{Acceptance, Hub, Settle};
use tracing::{debug, warn};

use crate::convert::{self, Classified};
use crate::platform::Shared;
use crate::socket::Link;
use crate::wire::{self, Envelope, EventCallback, Interaction};

/// Acknowledges one envelope on its socket once the hub answered.
struct EnvelopeAck {
    sender: WsSender,
    envelope_id: String,
    inbound_id: Option<channeld_driver_sdk::protocol::Id>,
    shared: Arc<Shared>,
}

impl Settle for EnvelopeAck {
    async fn settle(self, outcome: &Acceptance) {
        if matches!(outcome, Acceptance::Unresolved) {
            return;
        }
        if let Some(id) = self.inbound_id {
            self.shared.remember_answered(id);
        }
        ack(&self.sender, &self.envelope_id).await;
    }
}

pub(crate) async fn ack(sender: &WsSender, envelope_id: &str) {
    let frame = serde_json::to_string(&wire::Ack { envelope_id }).unwrap_or_default();
    if sender.send_text(frame).await.is_err() {
        debug!(%envelope_id, "socket gone before the ack; Slack redelivers the envelope");
    }
}

/// An `events_api` envelope: dropped events are acknowledged at once; messages go to the hub
/// and are acknowledged after its answer.
pub(crate) async fn on_event(shared: &Arc<Shared>, hub: &Hub, link: &Link, envelope: Envelope) {
    let callback: EventCallback = match serde_json::from_value(envelope.payload) {
        Ok(callback) => callback,
        Err(err) => {
            warn!(error = %err, "unreadable event payload; acknowledged and dropped");
            ack(&link.sender, &envelope.envelope_id).await;
            return;
        }
    };
    let Some(bot) = shared.bot() else {
        // Without the bot's identity own posts cannot be told apart: let Slack redeliver.
        return;
    };
    let classified = convert::classify(
        hub.channel(),
        &bot,
        shared.config.respond,
        shared.config.inbound_events,
        &callback,
    );
    let ack_now = |why: &str| debug!(event_id = %callback.event_id, retry = envelope.retry_attempt, why, "event acknowledged without the hub");
    match classified {
        Classified::Message(mut message) => {
            if shared.answered(&message.id) {
                ack_now("answered before");
                ack(&link.sender, &envelope.envelope_id).await;
                return;
            }
            message.sender.display_name = shared.display_name(message.sender.id.as_str()).await;
            let id = message.id.clone();
            shared.outbound.inbound_seen(&message.target, id.as_str());
            match hub.inbound(message).await {
                Ok(ticket) => link.acks.track(
                    ticket,
                    EnvelopeAck {
                        sender: link.sender.clone(),
                        envelope_id: envelope.envelope_id,
                        inbound_id: Some(id),
                        shared: shared.clone(),
                    },
                ),
                Err(err) if err.is_permanent() => {
                    warn!(%id, error = %err, "message cannot be reported; acknowledged and dropped");
                    ack(&link.sender, &envelope.envelope_id).await;
                }
                Err(err) => debug!(%id, error = %err, "not reported (stopping); Slack redelivers"),
            }
        }
        Classified::Event { event_id, event } => {
            match hub.inbound_event(event_id.clone(), event).await {
                Ok(ticket) => link.acks.track(
                    ticket,
                    EnvelopeAck {
                        sender: link.sender.clone(),
                        envelope_id: envelope.envelope_id,
                        inbound_id: None,
                        shared: shared.clone(),
                    },
                ),
                Err(err) => debug!(%event_id, error = %err, "event not reported"),
            }
        }
        Classified::AssistantThread { channel, thread_ts } => {
            shared.outbound.assistant_thread(&channel, &thread_ts);
            ack(&link.sender, &envelope.envelope_id).await;
        }
        Classified::Ignore(reason) => {
            ack_now(&format!("{reason:?}"));
            ack(&link.sender, &envelope.envelope_id).await;
        }
    }
}

pub(crate) fn on_interaction(shared: &Shared, envelope: Envelope) {
    match serde_json::from_value::<Interaction>(envelope.payload) {
        Ok(Interaction::BlockActions(click)) => shared.commands.on_click(&click),
        Ok(Interaction::Other) => debug!("interaction type not handled"),
        Err(err) => warn!(error = %err, "unreadable interaction payload"),
    }
}
