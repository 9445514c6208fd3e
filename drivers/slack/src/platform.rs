//! The [`SlackDriver`]: its declaration, the Socket Mode side (`run`, in [`crate::socket`]),
//! and posts, effects and commands through the Web API ([`crate::outbound`],
//! [`crate::commands`]). State shared between them lives in [`Shared`].

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{Actions, Capabilities, DeliveryReceipt};
use channeld_driver_sdk::{
    CancellationToken, CommandAnswer, CommandRequest, Declaration, Driver, DriverError,
    EffectError, EffectRequest, Hub, Nudge, OperatorAction, OperatorActionError, Post, PostError,
};
use tracing::debug;

use crate::commands::Commands;
use crate::config::SlackConfig;
use crate::convert::{self, BotIdentity};
use crate::outbound::Outbound;
use crate::seen::Seen;
use crate::web::WebApi;

/// Display names remembered (oldest forgotten first).
const NAMES: usize = 4096;
/// How long a `users.info` lookup may hold up an inbound message.
const NAME_LOOKUP_WITHIN: Duration = Duration::from_secs(1);

/// Display names by user id (`None`: looked up, none found), and their insertion order.
#[derive(Debug, Default)]
struct Names {
    by_user: HashMap<String, Option<String>>,
    order: VecDeque<String>,
}

/// State shared by the socket loop and the hub-facing methods.
#[derive(Debug)]
pub struct Shared {
    pub config: SlackConfig,
    pub web: WebApi,
    pub outbound: Outbound,
    pub commands: Commands,
    bot: Mutex<Option<BotIdentity>>,
    seen: Mutex<Seen>,
    names: Mutex<Names>,
    nudge: Mutex<Option<Nudge>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    pub fn bot(&self) -> Option<BotIdentity> {
        lock(&self.bot).clone()
    }

    /// Who the bot is (`auth.test`, once per process).
    pub(crate) async fn identity(&self) -> Result<BotIdentity, crate::socket::End> {
        if let Some(bot) = self.bot() {
            return Ok(bot);
        }
        let bot = crate::socket::identify(&self.web).await?;
        *lock(&self.bot) = Some(bot.clone());
        Ok(bot)
    }

    pub fn answered(&self, id: &Id) -> bool {
        lock(&self.seen).answered(id, Instant::now())
    }

    pub fn remember_answered(&self, id: Id) {
        lock(&self.seen).remember(id, Instant::now());
    }

    pub fn set_nudge(&self, nudge: Nudge) {
        *lock(&self.nudge) = Some(nudge);
    }

    /// The display name of `user` (cached, also when unknown); `None` when lookups are off.
    pub async fn display_name(&self, user: &str) -> Option<String> {
        if !self.config.user_names {
            return None;
        }
        if let Some(known) = lock(&self.names).by_user.get(user) {
            return known.clone();
        }
        let name = match tokio::time::timeout(NAME_LOOKUP_WITHIN, self.web.users_info(user)).await {
            Ok(Ok(info)) => {
                let profile = info.user.profile.as_ref();
                profile
                    .and_then(|p| p.display_name.clone().filter(|n| !n.is_empty()))
                    .or_else(|| profile.and_then(|p| p.real_name.clone()).filter(|n| !n.is_empty()))
                    .or(info.user.real_name)
                    .or(info.user.name)
            }
            Ok(Err(err)) => {
                debug!(%user, error = %err, "no display name");
                None
            }
            Err(_) => {
                // Not cached: a slow lookup is tried again next time.
                return None;
            }
        };
        let mut names = lock(&self.names);
        if names.by_user.insert(user.to_owned(), name.clone()).is_none() {
            names.order.push_back(user.to_owned());
        }
        while names.order.len() > NAMES {
            if let Some(old) = names.order.pop_front() {
                names.by_user.remove(&old);
            }
        }
        name
    }
}

/// The Slack driver.
#[derive(Debug, Clone)]
pub struct SlackDriver {
    shared: Arc<Shared>,
}

impl SlackDriver {
    pub fn new(config: SlackConfig, client: reqwest::Client) -> Self {
        let web = WebApi::new(
            client,
            config.api_url.clone(),
            config.app_token.clone(),
            config.bot_token.clone(),
        );
        let outbound = Outbound::new(web.clone(), &config);
        let commands = Commands::new(outbound.clone(), config.command_timeout);
        Self {
            shared: Arc::new(Shared {
                config,
                web,
                outbound,
                commands,
                bot: Mutex::new(None),
                seen: Mutex::new(Seen::default()),
                names: Mutex::new(Names::default()),
                nudge: Mutex::new(None),
            }),
        }
    }
}

/// The operator action that ends a slow retry at once (after fixing a token or switching
/// Socket Mode back on).
pub const RESUME: &str = "resume";

impl Driver for SlackDriver {
    fn declaration(&self) -> Declaration {
        let capabilities = Capabilities {
            receive: true,
            send: true,
            group: true,
            threads: true,
            receive_attachments: true,
            reactions: true,
            typing: true,
            draft_updates: true,
            commands: true,
            choices: true,
            websocket: true,
            ..Capabilities::default()
        };
        let actions = Actions {
            typing: true,
            preview: true,
            reaction: true,
            edit: true,
            delete: true,
            ..Actions::default()
        };
        Declaration::new(capabilities).with_actions(actions).with_operator_actions([RESUME])
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        crate::socket::run(self.shared.clone(), hub, shutdown).await;
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = post.message.target;
        let placed = self.shared.outbound.post(&target, &post.message.body).await?;
        let message_id = convert::message_id(&placed.channel, &placed.ts)
            .map_err(|_| PostError::unknown("slack answered with an unusable ts"))?;
        Ok(DeliveryReceipt {
            channel: target.channel.clone(),
            message_id,
            timestamp_ms: convert::ts_millis(&placed.ts),
            target,
        })
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        self.shared.outbound.effect(&request.target, &request.effect).await
    }

    async fn command(&self, request: CommandRequest) -> CommandAnswer {
        self.shared
            .commands
            .present(&request.command_id, &request.command, request.target.as_ref())
            .await
    }

    async fn operator_action(
        &self,
        request: OperatorAction,
    ) -> Result<serde_json::Value, OperatorActionError> {
        match request.name.as_str() {
            RESUME => {
                if let Some(nudge) = lock(&self.shared.nudge).clone() {
                    nudge.nudge();
                }
                Ok(serde_json::json!({"resumed": true}))
            }
            _ => Err(OperatorActionError::Unsupported),
        }
    }
}
