//! The WeCom driver: the [`Driver`] implementation tying the pieces together.
//!
//! `run` keeps one long connection ([`session`]) up with the kit's [`Reconnect`]: transient
//! failures retry at 1 s doubling to the configured cap (jittered); a refused subscribe is
//! `auth_rejected` on the slow lane; a `disconnected_event` (another client took the bot) is
//! `fenced` and is **not** retried by itself, since two instances would displace each other
//! forever: the operator action `resume` (`channelctl resume INSTANCE`) takes the bot back.
//! Callbacks go through a bounded queue to the dispatcher, which reports messages to the hub
//! (the placeholder follows the hub's `accepted`), answers cards and welcomes.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::protocol::types::{
    Actions, Capabilities, Command, CommandResult, DeliveryReceipt, Effect, MessageBody,
    OutboundMessage,
};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, CommandAnswer, CommandRequest, Declaration, Driver, DriverError,
    EffectError, EffectRequest, Failure, Hub, HubError, LinkState, OperatorAction,
    OperatorActionError, PendingAcks, Post, PostError, PostKind, Reconnect, ReconnectPolicy,
    Settle,
};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn};

use crate::cards::{Cards, Click};
use crate::config::WeComConfig;
use crate::convert::{self, Chat};
use crate::link::Link;
use crate::outbound::Outbound;
use crate::replies::{Progress, Replies};
use crate::session::{self, End};
use crate::wire::{EventCallback, Incoming, MessageCallback, event};

/// The operator action that takes a fenced bot back (or retries refused credentials now).
pub const RESUME: &str = "resume";
/// How long a stopping driver waits for its own sends (placeholders, welcomes, card
/// updates) before it disconnects.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Where the platform side stands, for `resume`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Connecting,
    Retrying,
    AuthRejected,
    Fenced,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Connecting => "connecting or connected",
            Phase::Retrying => "retrying",
            Phase::AuthRejected => "auth_rejected",
            Phase::Fenced => "fenced",
        }
    }
}

/// The WeCom AI Bot driver.
#[derive(Debug)]
pub struct WeComDriver {
    config: Arc<WeComConfig>,
    link: Link,
    outbound: Arc<Outbound>,
    replies: Arc<Replies>,
    cards: Arc<Cards>,
    phase: Mutex<Phase>,
    /// Bumped by `resume`; a fenced or refused link waits for it to change.
    resume: watch::Sender<u64>,
}

impl WeComDriver {
    /// Builds the driver; nothing connects until the SDK calls [`Driver::run`].
    pub fn new(config: WeComConfig) -> Self {
        let config = Arc::new(config);
        let link = Link::new();
        let outbound = Arc::new(Outbound::new(config.clone(), link.clone()));
        let replies = Arc::new(Replies::new(config.clone(), outbound.clone()));
        let cards = Arc::new(Cards::new(config.responders.clone()));
        let (resume, _) = watch::channel(0);
        Self { config, link, outbound, replies, cards, phase: Mutex::new(Phase::Idle), resume }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps a connection up until `shutdown`, following the fencing and slow-lane rules.
    async fn connect(
        &self,
        hub: &Hub,
        shutdown: &CancellationToken,
        dispatch: mpsc::Sender<Incoming>,
    ) {
        let config = &self.config;
        let mut reconnect = Reconnect::new(ReconnectPolicy {
            initial: Duration::from_secs(1),
            max: config.reconnect_max,
            reset_after: Duration::from_secs(60),
            operator_initial: config.auth_retry,
            operator_max: config.auth_retry.max(Duration::from_secs(3600)),
        });
        let cx = session::Context { config, link: &self.link, hub, dispatch: &dispatch, shutdown };
        let mut refusals = 0u32;
        loop {
            *self.phase() = Phase::Connecting;
            hub.link_state(LinkState::Connecting { attempt: reconnect.attempt() });
            let end = session::run(&cx, &mut reconnect).await;
            // Taken before the phase changes: a resume from then on wakes the wait below.
            let mut resumed = self.resume.subscribe();
            resumed.borrow_and_update();
            match end {
                End::Stopped => return,
                End::Fenced => {
                    *self.phase() = Phase::Fenced;
                    refusals = 0;
                    error!(
                        bot_id = %config.bot_id,
                        "another client took this bot's connection (disconnected_event); not reconnecting until `channelctl resume`"
                    );
                    hub.link_state(LinkState::Fenced {
                        detail: "another client subscribed this bot and WeCom dropped this connection; `channelctl resume` takes it back".into(),
                    });
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        _ = resumed.changed() => info!("resumed by the operator: taking the bot back"),
                    }
                }
                End::AuthRejected(detail) => {
                    *self.phase() = Phase::AuthRejected;
                    refusals += 1;
                    if refusals == 1 {
                        error!(bot_id = %config.bot_id, %detail, "WeCom refused the bot id or secret; retrying slowly");
                    } else {
                        warn!(bot_id = %config.bot_id, %detail, refusals, "WeCom still refuses the bot id or secret");
                    }
                    hub.link_state(LinkState::AuthRejected {
                        detail: format!(
                            "{detail}; retrying slowly (`channelctl resume` retries at once after a fix)"
                        ),
                    });
                    tokio::select! {
                        waited = reconnect.wait(Failure::Operator, shutdown) => if !waited { return },
                        _ = resumed.changed() => info!("resumed by the operator: subscribing again"),
                    }
                }
                End::Lost(error) => {
                    *self.phase() = Phase::Retrying;
                    refusals = 0;
                    let attempt = reconnect.attempt() + 1;
                    if attempt == 1 || attempt.is_multiple_of(10) {
                        warn!(%error, attempt, "WeCom connection lost or unreachable; reconnecting");
                    } else {
                        debug!(%error, attempt, "WeCom still unreachable");
                    }
                    hub.link_state(LinkState::Retrying { attempt, error });
                    if !reconnect.wait(Failure::Transient, shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// Hands callbacks to the hub (messages) or answers them (events), in arrival order.
    async fn dispatch(
        &self,
        hub: &Hub,
        pending: &PendingAcks,
        mut queue: mpsc::Receiver<Incoming>,
        shutdown: &CancellationToken,
    ) {
        loop {
            let incoming = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                incoming = queue.recv() => match incoming {
                    Some(incoming) => incoming,
                    None => return,
                },
            };
            match incoming {
                Incoming::Message { req_id, callback } => {
                    if !self.on_message(hub, pending, &req_id, *callback, shutdown).await {
                        return;
                    }
                }
                Incoming::Event { req_id, callback } => self.on_event(&req_id, *callback),
                Incoming::Ack(_) | Incoming::Other { .. } => {}
            }
        }
    }

    /// Reports a message; false once the SDK is stopping the platform side.
    async fn on_message(
        &self,
        hub: &Hub,
        pending: &PendingAcks,
        req_id: &str,
        callback: MessageCallback,
        shutdown: &CancellationToken,
    ) -> bool {
        let msgid = callback.msgid.clone();
        let inbound = match convert::inbound_message(&callback, self.config.bot_name.as_deref()) {
            Ok(inbound) => inbound,
            Err(skip) => {
                info!(%msgid, reason = %skip, "callback not passed on");
                return true;
            }
        };
        let chat = Chat::of(
            callback.chatid.as_deref(),
            callback.chattype.as_deref(),
            &callback.from.userid,
        );
        self.replies.register(&msgid, req_id, chat);
        let reported = tokio::select! {
            biased;
            () = shutdown.cancelled() => return false,
            reported = hub.inbound(inbound) => reported,
        };
        match reported {
            Ok(ticket) => {
                let placeholder = Placeholder { replies: self.replies.clone(), event_id: msgid };
                pending.track(ticket, placeholder);
                true
            }
            Err(HubError::ShuttingDown) => false,
            Err(err) => {
                warn!(%msgid, error = %err, "message cannot be passed to the hub; dropped");
                true
            }
        }
    }

    fn on_event(&self, req_id: &str, callback: EventCallback) {
        let user = callback.from.as_ref().map(|from| from.userid.clone());
        match callback.event.eventtype.as_str() {
            event::ENTER_CHAT => {
                let (Some(text), Some(user)) = (self.config.welcome_text.clone(), user) else {
                    return;
                };
                let outbound = self.outbound.clone();
                let req_id = req_id.to_owned();
                self.replies.tasks().spawn(async move {
                    outbound.welcome(&req_id, &user, &text).await;
                });
            }
            event::TEMPLATE_CARD => {
                let (Some(click), Some(user)) = (callback.event.card_click(), user) else {
                    warn!(%req_id, "card event without a task id, button or user; ignored");
                    return;
                };
                match self.cards.click(&click, &user) {
                    Click::Answered { card } => {
                        info!(task_id = %click.task_id, %user, key = %click.event_key, "card answered");
                        let outbound = self.outbound.clone();
                        let req_id = req_id.to_owned();
                        self.replies.tasks().spawn(async move {
                            outbound.update_card(&req_id, card).await;
                        });
                    }
                    Click::NotAllowed => {
                        info!(task_id = %click.task_id, %user, "card click from someone not in CHANNELD_WECOM_RESPONDERS; ignored");
                    }
                    Click::UnknownButton | Click::UnknownCard => {
                        debug!(task_id = %click.task_id, key = %click.event_key, "click on a card that waits for nothing");
                    }
                }
            }
            other => debug!(eventtype = other, "event ignored"),
        }
    }
}

/// Shows the placeholder once the hub has a message (not for a duplicate: its reply comes
/// again from the hub's record).
#[derive(Debug)]
struct Placeholder {
    replies: Arc<Replies>,
    event_id: String,
}

impl Settle for Placeholder {
    async fn settle(self, outcome: &Acceptance) {
        if matches!(outcome, Acceptance::Accepted { duplicate: false }) {
            self.replies.accepted(&self.event_id);
        }
    }
}

impl Driver for WeComDriver {
    fn declaration(&self) -> Declaration {
        let capabilities = Capabilities {
            receive: true,
            send: true,
            group: true,
            media: true,
            video: true,
            attachments: true,
            receive_attachments: true,
            send_attachments: true,
            typing: true,
            streaming: true,
            multi_message_streaming: true,
            commands: true,
            choices: true,
            websocket: true,
            ..Capabilities::default()
        };
        let actions = Actions { typing: true, preview: true, ..Actions::default() };
        Declaration::new(capabilities).with_actions(actions).with_operator_actions([RESUME])
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        self.replies.tasks().reopen();
        let pending = PendingAcks::new();
        let (dispatch, queue) = mpsc::channel(session::DISPATCH_QUEUE);
        tokio::join!(
            self.connect(&hub, &shutdown, dispatch),
            self.dispatch(&hub, &pending, queue, &shutdown),
        );
        // Placeholders still waiting for the hub's answer are not worth a delay.
        pending.drain(Duration::ZERO).await;
        self.replies.tasks().close();
        if tokio::time::timeout(hub.stop_budget(STOP_GRACE), self.replies.tasks().wait())
            .await
            .is_err()
        {
            debug!("progress sends still running at stop");
        }
        *self.phase() = Phase::Idle;
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = &post.message.target;
        if target.channel != self.config.channel {
            return Err(PostError::failed(format!("target is channel {}", target.channel), false));
        }
        match &post.kind {
            PostKind::Reply { event_id } => self.replies.reply(event_id, &post.message).await,
            PostKind::Proactive { .. } => self.outbound.post(&post.message).await,
        }
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        let conversation = request.target.conversation.as_str();
        let progress = match request.effect {
            Effect::Typing { active: true } => Progress::Placeholder,
            Effect::Typing { active: false } => return Ok(()),
            Effect::Preview { text } => Progress::Preview(text),
            _ => return Err(EffectError::Unsupported),
        };
        if !self.replies.progress(conversation, progress) {
            debug!(%conversation, "progress for a conversation with no reply in progress");
        }
        Ok(())
    }

    async fn command(&self, request: CommandRequest) -> CommandAnswer {
        let Some(target) = request.target else {
            return CommandAnswer::rejected("the command names no conversation");
        };
        let conversation = target.conversation.as_str();
        match &request.command {
            Command::Notify { level, text } => {
                let text =
                    if level == "info" { text.clone() } else { format!("**{level}** {text}") };
                let body = match MessageBody::text(text) {
                    Ok(body) => body,
                    Err(err) => return CommandAnswer::rejected(err.to_string()),
                };
                let message =
                    OutboundMessage { target: target.clone(), body, metadata: Default::default() };
                match self.outbound.post(&message).await {
                    Ok(_) => CommandAnswer { result: CommandResult::Accepted, responder: None },
                    Err(err) => CommandAnswer::rejected(format!("the notice was not shown: {err}")),
                }
            }
            Command::RequestApproval { .. } | Command::RequestChoice { .. } => {
                let task_id = self.cards.next_task_id();
                let (card, kind) = match convert::command_card(&request.command, &task_id) {
                    Ok(card) => card,
                    Err(err) => return CommandAnswer::rejected(err.to_string()),
                };
                let (_open, answer) = match self.cards.open(card.clone(), kind) {
                    Ok(open) => open,
                    Err(err) => return CommandAnswer::rejected(err.to_string()),
                };
                if let Err(err) = self.outbound.send_card(conversation, card).await {
                    return CommandAnswer::rejected(format!("the card could not be shown: {err}"));
                }
                match tokio::time::timeout(self.config.card_timeout, answer).await {
                    Ok(Ok(answer)) => answer,
                    Ok(Err(_)) => CommandAnswer::rejected("the card was closed"),
                    Err(_) => CommandAnswer::rejected(format!(
                        "nobody answered the card within {:?}",
                        self.config.card_timeout
                    )),
                }
            }
            other => {
                CommandAnswer::rejected(format!("{} cannot be presented on WeCom", other.kind()))
            }
        }
    }

    async fn operator_action(
        &self,
        request: OperatorAction,
    ) -> Result<serde_json::Value, OperatorActionError> {
        if request.name != RESUME {
            return Err(OperatorActionError::Unsupported);
        }
        let phase = *self.phase();
        let resumed = matches!(phase, Phase::Fenced | Phase::AuthRejected);
        if resumed {
            info!(was = phase.as_str(), "operator asked to resume");
            self.resume.send_modify(|count| *count += 1);
        }
        Ok(json!({"resumed": resumed, "was": phase.as_str()}))
    }
}
