//! The WeChat iLink driver: the [`Driver`] the SDK runs.
//!
//! Its parts share the token [`Session`] and the [`Store`]:
//! * the poll loop ([`Poller`]) is [`Driver::run`]: long polls, hands batches to the hub,
//!   moves the cursor once the hub answered;
//! * posts ([`Outbound`]) send replies and proactive messages with the user's context token;
//! * [`Typing`] shows "typing…" while runs go, and on `typing` effects;
//! * a small watcher turns changes of the token session into health reports, so a `-14` seen
//!   by a post shows at once.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use channeld_driver_sdk::protocol::types::{
    Actions, Capabilities, DeliveryReceipt, Effect, Health,
};
use channeld_driver_sdk::{
    CancellationToken, Declaration, Driver, DriverError, EffectError, EffectRequest, Hub, Post,
    PostError,
};

use crate::client::IlinkClient;
use crate::config::WechatConfig;
use crate::health::{Link, health};
use crate::outbound::Outbound;
use crate::poll::{LinkReport, Poller};
use crate::session::Session;
use crate::state::StateDir;
use crate::store::Store;
use crate::typing::Typing;

/// The link state and where health reports go once the hub handle exists.
#[derive(Debug)]
struct Reporter {
    link: Mutex<Link>,
    hub: OnceLock<Hub>,
    session: Arc<Session>,
    config: Arc<WechatConfig>,
}

impl Reporter {
    fn lock(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn health(&self) -> Health {
        let base_url =
            self.session.current().map_or_else(|| self.config.base_url.clone(), |c| c.base_url);
        health(&self.lock(), &self.session.auth(), &base_url)
    }

    fn push(&self) {
        if let Some(hub) = self.hub.get() {
            hub.health(self.health());
        }
    }
}

impl LinkReport for Reporter {
    fn link(&self, link: Link) {
        *self.lock() = link;
        self.push();
    }
}

/// The WeChat iLink platform driver.
pub struct WechatDriver {
    config: Arc<WechatConfig>,
    client: IlinkClient,
    session: Arc<Session>,
    store: Arc<Store>,
    typing: Arc<Typing>,
    outbound: Outbound,
    reporter: Arc<Reporter>,
}

impl std::fmt::Debug for WechatDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WechatDriver")
            .field("channel", &self.config.channel)
            .field("state_dir", &self.config.state_dir)
            .finish_non_exhaustive()
    }
}

impl WechatDriver {
    /// Opens the state directory and reads the token sources; nothing is sent until
    /// [`Driver::run`].
    pub fn new(config: WechatConfig, http: reqwest::Client) -> Result<Self, DriverError> {
        let config = Arc::new(config);
        let dir = StateDir::open(&config.state_dir)
            .map_err(|err| DriverError::Config(err.to_string()))?;
        let store = Arc::new(
            Store::load(dir.clone(), config.dedupe_ttl)
                .map_err(|err| DriverError::Config(err.to_string()))?,
        );
        let client = IlinkClient::new(http, &config.bot_agent, config.route_tag.clone());
        let session = Arc::new(Session::new(config.clone(), dir));
        let typing =
            Arc::new(Typing::new(client.clone(), session.clone(), store.clone(), config.clone()));
        let outbound = Outbound {
            client: client.clone(),
            session: session.clone(),
            store: store.clone(),
            config: config.clone(),
            typing: typing.clone(),
        };
        let reporter = Arc::new(Reporter {
            link: Mutex::new(Link::Starting),
            hub: OnceLock::new(),
            session: session.clone(),
            config: config.clone(),
        });
        Ok(Self { config, client, session, store, typing, outbound, reporter })
    }

    /// The token session (an operator's `resume` reaches it).
    pub fn session(&self) -> &Arc<Session> {
        &self.session
    }
}

impl Driver for WechatDriver {
    fn declaration(&self) -> Declaration {
        let capabilities = Capabilities {
            receive: true,
            send: true,
            receive_attachments: true,
            typing: true,
            long_polling: true,
            ..Capabilities::default()
        };
        let actions = Actions { typing: true, ..Actions::default() };
        Declaration { capabilities, actions }
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let _ = self.reporter.hub.set(hub.clone());
        self.reporter.push();
        let watcher = tokio::spawn({
            let reporter = self.reporter.clone();
            let mut auth = self.session.watch_auth();
            let shutdown = shutdown.clone();
            async move {
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        changed = auth.changed() => if changed.is_err() { return },
                    }
                    reporter.push();
                }
            }
        });
        let poller = Poller {
            client: &self.client,
            session: &self.session,
            store: &self.store,
            config: &self.config,
            typing: &self.typing,
            report: self.reporter.as_ref(),
        };
        poller.run(&hub, &shutdown).await;
        self.typing.stop_all().await;
        let _ = watcher.await;
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        self.outbound.post(post).await
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        let user = request.target.conversation.as_str();
        match request.effect {
            Effect::Typing { active: true } => self.typing.effect_on(user),
            Effect::Typing { active: false } => self.typing.effect_off(user),
            _ => return Err(EffectError::Unsupported),
        }
        Ok(())
    }

    fn health(&self) -> Health {
        self.reporter.health()
    }
}
