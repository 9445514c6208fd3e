//! The Nostr driver: [`Driver::run`] is one `session` (relay pool, inbox subscription, run
//! loop); [`Driver::post`] and [`Driver::effect`] address, sign, wrap and publish, and the
//! driver keeps what outlives a run: the settings, the state, recent inbound origins, and the
//! relay answers still outstanding after a receipt (`stragglers`, tracked and awaited when a
//! run ends).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{Actions, Capabilities, DeliveryReceipt, Effect};
use channeld_driver_sdk::{
    CancellationToken, ConfigError, Declaration, Driver, DriverError, EffectError, EffectRequest,
    Hub, Post, PostError, PostKind,
};
use nostr_sdk::{Client, EventId, RelayStatus, Timestamp};
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info};

use crate::config::{NostrConfig, VAR_STATE_DIR};
use crate::convert::{self, META_NIP, Nip, Participants, Published};
use crate::inbox::Origins;
use crate::outgoing::{self, Addressing};
use crate::publish::publish;
use crate::session;
use crate::state::{StateStore, unix_now};

/// How often a post waiting for a connected relay looks again.
const RELAY_POLL: Duration = Duration::from_millis(50);

/// The Nostr platform driver.
#[derive(Debug)]
pub struct NostrDriver {
    pub(crate) config: Arc<NostrConfig>,
    pub(crate) state: Arc<StateStore>,
    /// The relay pool of the current run, where posts go; `None` between runs.
    pub(crate) live: watch::Sender<Option<Client>>,
    pub(crate) origins: Arc<Mutex<Origins>>,
    /// Relay answers still outstanding after a post already had its receipt.
    pub(crate) stragglers: TaskTracker,
    /// The last `created_at` second given to a message: each post starts after it.
    last_second: Mutex<u64>,
}

impl NostrDriver {
    /// Opens the state file; nothing connects until [`Driver::run`].
    pub fn new(config: NostrConfig) -> Result<Self, DriverError> {
        let state = StateStore::open(config.state_file.clone(), unix_now()).map_err(|err| {
            ConfigError::invalid(
                channeld_driver_sdk::launch::setting_var(VAR_STATE_DIR),
                err.to_string(),
            )
        })?;
        Ok(Self {
            config: Arc::new(config),
            state: Arc::new(state),
            live: watch::Sender::new(None),
            origins: Arc::new(Mutex::new(Origins::default())),
            stragglers: TaskTracker::new(),
            last_second: Mutex::new(0),
        })
    }

    pub fn config(&self) -> &NostrConfig {
        &self.config
    }

    /// The relay pool once at least one relay is connected, waiting up to the send timeout.
    async fn connected_client(&self) -> Option<Client> {
        let deadline = tokio::time::Instant::now() + self.config.send_timeout;
        let mut live = self.live.subscribe();
        loop {
            let current = live.borrow_and_update().clone();
            if let Some(client) = current {
                let relays = client.pool().relays().await;
                if relays.values().any(|relay| relay.status() == RelayStatus::Connected) {
                    return Some(client);
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return None;
            }
            // A new pool is signalled; a relay connecting is not, so look again shortly.
            let _ = tokio::time::timeout_at((now + RELAY_POLL).min(deadline), live.changed()).await;
        }
    }

    /// The `created_at` of the first of `parts` messages: now, or just after the previous
    /// post's last part. A NIP-17 message's id hashes its second, so without this the same
    /// text sent twice within a second would be one message; and clients, which sort by it,
    /// show the posts in the order they were made.
    fn reserve_seconds(&self, parts: usize) -> Timestamp {
        let mut last = lock(&self.last_second);
        let first = unix_now().max(*last + 1);
        *last = first + parts.max(1) as u64 - 1;
        Timestamp::from_secs(first)
    }

    /// Whom a post goes to, in which NIP.
    fn address(&self, post: &Post) -> Result<Addressing, PostError> {
        let target = &post.message.target;
        let conversation = target.conversation.as_str();
        let recipients =
            self.recipients(conversation).map_err(|reason| PostError::failed(reason, false))?;
        let remembered = self.state.read(|s| s.conversations.get(conversation).map(|c| c.nip));
        let nip = match &post.kind {
            PostKind::Reply { event_id } => {
                let origin = lock(&self.origins).get(event_id.as_str()).map(|o| o.nip);
                origin.or_else(|| self.state.read(|s| s.nip_of(event_id.as_str()))).or(remembered)
            }
            PostKind::Proactive { .. } => match post.message.metadata.get(META_NIP) {
                Some(raw) => Some(Nip::parse(raw).ok_or_else(|| {
                    PostError::failed(format!("metadata {META_NIP} must be nip17 or nip04"), false)
                })?),
                None => remembered,
            },
        }
        .unwrap_or(Nip::Nip17);
        if nip == Nip::Nip04 && !self.config.accept_nip04 {
            return Err(PostError::failed(
                "NIP-04 is turned off (CHANNELD_NOSTR_ACCEPT_NIP04)",
                false,
            ));
        }
        let reply_to = target.reply_to.as_ref().and_then(|id| EventId::from_hex(id.as_str()).ok());
        Ok(Addressing { nip, recipients, reply_to })
    }

    /// The participants a conversation id names (the bot left out).
    fn recipients(&self, conversation: &str) -> Result<Participants, String> {
        match convert::parse_conversation(conversation, &self.config.public_key) {
            Ok(Some(participants)) => Ok(participants),
            Ok(None) => {
                let members = self
                    .state
                    .read(|s| s.conversations.get(conversation).map(|c| c.members.clone()));
                let members = members.filter(|m| !m.is_empty()).ok_or_else(|| {
                    format!(
                        "unknown group conversation {conversation}: its members are not remembered"
                    )
                })?;
                members
                    .iter()
                    .map(|hex| nostr_sdk::PublicKey::from_hex(hex).map_err(|err| err.to_string()))
                    .collect()
            }
            Err(err) => Err(err.to_string()),
        }
    }

    /// Publishes every chunk in order; an event counts once one relay stored it.
    async fn publish_all(
        &self,
        client: &Client,
        chunks: &[Vec<nostr_sdk::Event>],
    ) -> Result<(), PostError> {
        let total = chunks.len();
        let mut stored_any = false;
        for (n, chunk) in chunks.iter().enumerate() {
            for event in chunk {
                match publish(client, event, self.config.send_timeout, &self.stragglers).await {
                    Published::Stored { relays } => {
                        debug!(event_id = %event.id, part = n + 1, total, relays = ?relays, "stored by the relays");
                        stored_any = true;
                    }
                    Published::Failed(reason) if !stored_any => {
                        return Err(PostError::failed(reason, true));
                    }
                    Published::Failed(reason) | Published::Unknown(reason) if stored_any => {
                        return Err(PostError::unknown(format!(
                            "part {} of {total} was not stored after earlier parts were: {reason}",
                            n + 1
                        )));
                    }
                    Published::Failed(reason) | Published::Unknown(reason) => {
                        return Err(PostError::unknown(reason));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Driver for NostrDriver {
    /// The relay pool logs every failed connection attempt; the driver reports relay states
    /// in its health instead (`CHANNELD_LOG=info,nostr_relay_pool=info` shows the pool's).
    const LOG_FILTER: &'static str = "info,nostr_relay_pool=error,nostr_sdk=warn,nostr=warn";

    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities {
            receive: true,
            send: true,
            group: true,
            reactions: true,
            websocket: true,
            ..Capabilities::default()
        })
        .with_actions(Actions { reaction: true, ..Actions::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        session::run(self, hub, shutdown).await
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = post.message.target.clone();
        if target.channel != self.config.channel {
            return Err(PostError::failed(format!("target is channel {}", target.channel), false));
        }
        let receipt = |message_id: String| -> Result<DeliveryReceipt, PostError> {
            Ok(DeliveryReceipt {
                channel: self.config.channel.clone(),
                message_id: Id::new(message_id)
                    .map_err(|err| PostError::failed(err.to_string(), false))?,
                target: target.clone(),
                timestamp_ms: Some(unix_now() * 1000),
            })
        };
        if let PostKind::Reply { event_id } = &post.kind {
            let done =
                self.state.read(|s| s.reply(event_id.as_str()).map(|r| r.message_id.clone()));
            if let Some(message_id) = done {
                info!(%event_id, %message_id, "reply already posted before a restart; not posting it again");
                return receipt(message_id);
            }
        }
        let to = self.address(&post)?;
        let text = post_text(&post);
        let client = self.connected_client().await.ok_or_else(|| {
            PostError::failed(
                format!("no relay connected within {:?}", self.config.send_timeout),
                true,
            )
        })?;
        let keys = self.config.keys.expose();
        let first_second =
            self.reserve_seconds(convert::chunks(&text, self.config.chunk_bytes).len());
        let prepared = outgoing::message(keys, &to, &text, self.config.chunk_bytes, first_second)
            .await
            .map_err(|err| PostError::failed(err.to_string(), false))?;
        self.publish_all(&client, &prepared.chunks).await?;
        let message_id = prepared.message_id.to_hex();
        let conversation = target.conversation.as_str().to_owned();
        let members = if conversation.starts_with(convert::GROUP_PREFIX) {
            to.recipients.iter().map(nostr_sdk::PublicKey::to_hex).collect()
        } else {
            Vec::new()
        };
        let now = unix_now();
        self.state.update(|s| {
            s.use_conversation(&conversation, to.nip, members, now);
            if let PostKind::Reply { event_id } = &post.kind {
                s.record_reply(event_id.to_string(), message_id.clone(), now);
            }
        });
        let parts = prepared.chunks.len();
        if let PostKind::Reply { event_id } = &post.kind {
            // On disk before the receipt: a redelivered reply after a crash is not posted twice.
            match self.state.flush().await {
                Ok(()) => {
                    debug!(%event_id, %message_id, nip = to.nip.as_str(), parts, "reply posted and saved")
                }
                Err(err) => {
                    error!(%event_id, error = %err, "cannot save that the reply was posted")
                }
            }
        } else {
            debug!(%message_id, nip = to.nip.as_str(), parts, "posted");
        }
        receipt(message_id)
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        let Effect::Reaction { message_id, emoji, remove } = &request.effect else {
            return Err(EffectError::Unsupported);
        };
        if *remove {
            return Err(EffectError::Failed("Nostr reactions cannot be taken back here".into()));
        }
        let reacted = EventId::from_hex(message_id.as_str())
            .map_err(|_| EffectError::Failed(format!("{message_id} is not a Nostr event id")))?;
        let conversation = request.target.conversation.as_str();
        let recipients = self.recipients(conversation).map_err(EffectError::Failed)?;
        let origin = lock(&self.origins).get(message_id.as_str()).cloned();
        let nip = origin
            .as_ref()
            .map(|o| o.nip)
            .or_else(|| self.state.read(|s| s.nip_of(message_id.as_str())))
            .or_else(|| self.state.read(|s| s.conversations.get(conversation).map(|c| c.nip)))
            .unwrap_or(Nip::Nip17);
        let author = origin.map(|o| o.sender);
        let keys = self.config.keys.expose();
        let events = outgoing::reaction(keys, nip, &recipients, reacted, author, emoji)
            .await
            .map_err(|err| EffectError::Failed(err.to_string()))?;
        let client = self
            .connected_client()
            .await
            .ok_or_else(|| EffectError::Failed("no relay connected".into()))?;
        for event in &events {
            match publish(&client, event, self.config.send_timeout, &self.stragglers).await {
                Published::Stored { .. } => {}
                Published::Failed(reason) | Published::Unknown(reason) => {
                    return Err(EffectError::Failed(reason));
                }
            }
        }
        Ok(())
    }
}
/// The text to post: the body, then one line per attachment URL (the driver declares no
/// attachments, but a URL is never dropped silently).
fn post_text(post: &Post) -> String {
    let body = &post.message.body;
    let mut text = body.text_str().to_owned();
    for attachment in body.attachments() {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&attachment.url);
    }
    text
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
