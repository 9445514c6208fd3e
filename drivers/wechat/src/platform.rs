//! The WeChat iLink driver: the [`Driver`] the SDK runs.
//!
//! Its parts share the token [`Session`] and the [`Store`]:
//! * the poll loop ([`Poller`]) is [`Driver::run`]: long polls, hands batches to the hub,
//!   moves the cursor once the hub answered;
//! * posts ([`Outbound`]) send replies and proactive messages with the user's context token;
//! * [`Typing`] shows "typing…" while runs go, and on `typing` effects;
//! * a small watcher turns changes of the token session into link states (the SDK's health
//!   rule), so a `-14` seen by a post shows at once;
//! * the operator action `resume` (`channelctl resume`) gives refused tokens another chance.

use std::sync::{Arc, Mutex, MutexGuard};

use channeld_driver_sdk::protocol::types::{Actions, Capabilities, DeliveryReceipt, Effect};
use channeld_driver_sdk::transport::http::reqwest;
use channeld_driver_sdk::{
    CancellationToken, Declaration, Driver, DriverError, EffectError, EffectRequest, Hub,
    OperatorAction, OperatorActionError, Post, PostError,
};

use crate::client::IlinkClient;
use crate::config::WechatConfig;
use crate::health::{Link, link_state};
use crate::outbound::Outbound;
use crate::poll::{LinkReport, Poller};
use crate::session::{Auth, Session};
use crate::state::StateDir;
use crate::store::Store;
use crate::typing::Typing;

/// The operator action that gives refused tokens another chance at once.
pub const RESUME: &str = "resume";

/// The link state and where it goes once `run` has the hub handle.
#[derive(Debug)]
struct Reporter {
    link: Mutex<Link>,
    hub: Mutex<Option<Hub>>,
    session: Arc<Session>,
    config: Arc<WechatConfig>,
}

impl Reporter {
    fn lock(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn attach(&self, hub: Hub) {
        *self.hub.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(hub);
    }

    fn push(&self) {
        let base_url =
            self.session.current().map_or_else(|| self.config.base_url.clone(), |c| c.base_url);
        let state = link_state(&self.lock(), &self.session.auth(), &base_url);
        if let Some(hub) = self.hub.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).as_ref()
        {
            hub.link_state(state);
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
        let dir = StateDir::open(&config.state_dir).map_err(state_error)?;
        let store = Arc::new(Store::load(dir.clone(), config.dedupe_ttl).map_err(state_error)?);
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
            hub: Mutex::new(None),
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
        Declaration::new(Capabilities {
            receive: true,
            send: true,
            receive_attachments: true,
            typing: true,
            long_polling: true,
            ..Capabilities::default()
        })
        .with_actions(Actions { typing: true, ..Actions::default() })
        .with_operator_actions([RESUME])
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        self.reporter.attach(hub.clone());
        self.reporter.push();
        self.typing.open();
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

    async fn operator_action(
        &self,
        request: OperatorAction,
    ) -> Result<serde_json::Value, OperatorActionError> {
        if request.name != RESUME {
            return Err(OperatorActionError::Unsupported);
        }
        self.session.resume();
        let auth = match self.session.auth() {
            Auth::Usable => "usable",
            Auth::Expired { .. } => "expired",
            Auth::Missing => "missing",
            Auth::Unreadable(_) => "unreadable",
        };
        tracing::info!(auth, "resume: refused tokens get another chance");
        Ok(serde_json::json!({ "auth": auth }))
    }
}

/// A state directory the driver cannot use stops it for good (exit 78): an operator must
/// fix or move the file, restarting cannot help.
fn state_error(err: crate::state::StateError) -> DriverError {
    let var = channeld_driver_sdk::launch::setting_var(crate::config::VAR_STATE_DIR);
    DriverError::Config(channeld_driver_sdk::ConfigError::invalid(var, err.to_string()))
}
