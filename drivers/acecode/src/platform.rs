//! The plugin host as a [`Driver`]: `run` starts the plugin, initializes it, turns its
//! events into health and inbound messages, and restarts it with the seed's backoff when it
//! exits, fails `initialize` or breaks the protocol. `login_required` stops the restarts
//! until an operator acts (`resume`, or `login`). Posts become `send_text` requests (long
//! text split to the plugin's `max_text_units`), typing becomes `set_typing`.
//!
//! The `hello` is declared before the plugin runs (the SDK starts the platform side only
//! once the hub accepted the driver), so it declares what the plugin protocol offers every
//! plugin: receive, send, groups and typing. The plugin's `initialize` capabilities then
//! govern what is sent: text is split to its `max_text_units` (UTF-16 units when
//! `count_utf16`) and typing reaches it only when it `supports_typing`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use channeld_driver_sdk::protocol::acecode::{
    self as wire, InboundParams, InitializeParams, InitializeResult, Outcome, PROTOCOL_VERSION,
    PluginCapabilities, SendResult, SendTextParams, SetTypingParams, Settings, StatusParams, event,
    method,
};
use channeld_driver_sdk::protocol::types::{Actions, Capabilities, DeliveryReceipt, Effect};
use channeld_driver_sdk::protocol::{Id, acecode::Address};
use channeld_driver_sdk::{
    CancellationToken, Declaration, Driver, DriverError, EffectError, EffectRequest, Hub,
    LinkState, OperatorAction, OperatorActionError, Post, PostError,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};

use crate::backoff::RestartBackoff;
use crate::config::AcecodeConfig;
use crate::convert;
use crate::plugin::{Plugin, PluginError};

/// Operator action: start the plugin again now, with `reason` `user`.
pub const RESUME: &str = "resume";
/// Operator action: the card's Sign in button, passed to the plugin as `action login`.
pub const LOGIN: &str = "login";
/// Recent sends remembered so an echo of one is not reported as inbound.
const RECENT_SENDS: usize = 256;

/// The host's state shared by `run` and the request handlers.
#[derive(Debug, Default)]
struct State {
    plugin: Option<Arc<Plugin>>,
    capabilities: PluginCapabilities,
    account: Option<String>,
    /// (chat, text) of recent sends.
    sent: VecDeque<(String, String)>,
}

/// The `channeld-acecode` driver.
#[derive(Debug)]
pub struct AcecodeDriver {
    config: AcecodeConfig,
    state: Mutex<State>,
    /// An operator's `resume`: restart now with `reason` `user`.
    resume: Notify,
    /// Distinguishes this process's receipt ids from an earlier one's.
    boot: u64,
    posts: AtomicU64,
}

impl AcecodeDriver {
    pub fn new(config: AcecodeConfig) -> Self {
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            config,
            state: Mutex::default(),
            resume: Notify::new(),
            boot,
            posts: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn plugin(&self) -> Option<Arc<Plugin>> {
        self.state().plugin.clone().filter(|p| !p.ended.is_cancelled())
    }

    /// Starts the plugin and initializes it.
    async fn start(
        &self,
        reason: &str,
    ) -> Result<(Arc<Plugin>, mpsc::Receiver<wire::Event>), PluginError> {
        let (plugin, events) = Plugin::spawn(&self.config.manifest)?;
        let params = InitializeParams {
            protocol_version: PROTOCOL_VERSION,
            platform: self.config.manifest.name.clone(),
            reason: reason.to_owned(),
            settings: Settings { watched_groups: self.config.watched_groups.clone() },
        };
        let params = serde_json::to_value(params).unwrap_or_default();
        let timeout = wire::method_timeout(method::INITIALIZE);
        let result = match plugin.request(method::INITIALIZE, params, timeout).await {
            Ok(result) => result,
            Err(err) => {
                plugin.kill("initialize failed").await;
                return Err(err);
            }
        };
        let result: InitializeResult = match serde_json::from_value(result) {
            Ok(result) => result,
            Err(err) => {
                plugin.kill("unreadable initialize result").await;
                return Err(PluginError::Refused {
                    method: method::INITIALIZE.into(),
                    reason: format!("unreadable result: {err}"),
                });
            }
        };
        if result.protocol_version != PROTOCOL_VERSION {
            plugin.kill("protocol version mismatch").await;
            return Err(PluginError::Refused {
                method: method::INITIALIZE.into(),
                reason: format!(
                    "protocol_version {} (expected {PROTOCOL_VERSION})",
                    result.protocol_version
                ),
            });
        }
        info!(
            plugin = %self.config.manifest.name,
            %reason,
            max_text_units = result.capabilities.text_units(),
            count_utf16 = result.capabilities.count_utf16,
            supports_typing = result.capabilities.supports_typing,
            "plugin initialized"
        );
        let mut state = self.state();
        state.capabilities = result.capabilities;
        state.plugin = Some(plugin.clone());
        Ok((plugin, events))
    }

    /// Serves one running plugin's events until it ends or `shutdown`; true when it asked
    /// for a login (no automatic restart).
    async fn serve(
        &self,
        hub: &Hub,
        plugin: &Plugin,
        events: &mut mpsc::Receiver<wire::Event>,
        shutdown: &CancellationToken,
        attempt: u32,
    ) -> Serve {
        let mut login_required = false;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Serve::Shutdown,
                () = self.resume.notified() => return Serve::Resume,
                event = events.recv() => match event {
                    Some(event) => {
                        if let Some(login) = self.on_event(hub, event, attempt).await {
                            login_required = login;
                        }
                    }
                    None => {
                        plugin.ended.cancelled().await;
                        return Serve::Ended { login_required };
                    }
                },
            }
        }
    }

    /// One event; `Some(login_required)` for a status.
    async fn on_event(&self, hub: &Hub, event: wire::Event, attempt: u32) -> Option<bool> {
        match event.event.as_str() {
            event::STATUS => {
                let status: StatusParams = match serde_json::from_value(event.params) {
                    Ok(status) => status,
                    Err(err) => {
                        warn!(error = %err, "unreadable status event; ignored");
                        return None;
                    }
                };
                if let Some(account) = status.account.as_ref().filter(|a| !a.is_empty()) {
                    self.state().account = Some(account.clone());
                }
                let view = convert::status(&status, attempt);
                debug!(state = %status.state, login_required = view.login_required, "plugin status");
                hub.link_state(view.link);
                Some(view.login_required)
            }
            event::INBOUND => {
                let params: InboundParams = match serde_json::from_value(event.params) {
                    Ok(params) => params,
                    Err(err) => {
                        warn!(error = %err, "unreadable inbound event; dropped");
                        return None;
                    }
                };
                let account = self.state().account.clone();
                let own = |chat: &str, text: &str| {
                    self.state().sent.iter().any(|(c, t)| c == chat && t == text)
                };
                match convert::inbound(&params, account.as_deref(), own) {
                    Ok(inbound) => {
                        // The plugin has no acknowledgement: the hub's answer is not awaited.
                        if let Err(err) = hub.inbound(inbound).await {
                            warn!(message_id = %params.message_id, error = %err, "inbound not reported");
                        }
                    }
                    Err(why) => {
                        debug!(message_id = %params.message_id, reason = %why, "inbound dropped")
                    }
                }
                None
            }
            // Unknown events are ignored, so plugins may add events first.
            other => {
                debug!(event = %other, "unknown plugin event; ignored");
                None
            }
        }
    }

    fn remember_send(&self, chat: &str, text: &str) {
        let mut state = self.state();
        if state.sent.len() == RECENT_SENDS {
            state.sent.pop_front();
        }
        state.sent.push_back((chat.to_owned(), text.to_owned()));
    }

    fn receipt_id(&self, held: bool) -> Id {
        let n = self.posts.fetch_add(1, Ordering::Relaxed) + 1;
        let prefix = if held { "held" } else { "sent" };
        Id::new(format!("{prefix}:{}-{n}", self.boot)).expect("a short ascii id")
    }
}

/// How serving one plugin process ended.
enum Serve {
    Shutdown,
    Resume,
    Ended { login_required: bool },
}

impl Driver for AcecodeDriver {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities {
            receive: true,
            send: true,
            group: true,
            typing: true,
            ..Capabilities::default()
        })
        .with_actions(Actions { typing: true, ..Actions::default() })
        .with_operator_actions([RESUME, LOGIN])
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let mut backoff = RestartBackoff::default();
        let mut attempt = 0u32;
        let mut reason = "auto";
        loop {
            hub.link_state(LinkState::Connecting { attempt });
            let started = tokio::time::Instant::now();
            let outcome = match self.start(reason).await {
                Ok((plugin, mut events)) => {
                    let served = self.serve(&hub, &plugin, &mut events, &shutdown, attempt).await;
                    match served {
                        Serve::Shutdown => {
                            // Posts in flight travel through the plugin: they finish first.
                            hub.requests_done().await;
                            plugin.shutdown().await;
                            return Ok(());
                        }
                        Serve::Resume => {
                            info!("operator resume: restarting the plugin");
                            plugin.shutdown().await;
                            Serve::Resume
                        }
                        ended @ Serve::Ended { .. } => {
                            warn!(reason = %plugin.end_reason(), "the plugin stopped");
                            ended
                        }
                    }
                }
                Err(err) => {
                    warn!(error = %err, "the plugin did not start");
                    hub.link_state(LinkState::Retrying {
                        attempt: attempt + 1,
                        error: err.to_string(),
                    });
                    Serve::Ended { login_required: false }
                }
            };
            self.state().plugin = None;
            match outcome {
                Serve::Resume => {
                    backoff.reset();
                    attempt = 0;
                    reason = "user";
                    continue;
                }
                Serve::Ended { login_required: true } => {
                    // The seed's rule: no restart on our own; the health says why.
                    info!("the plugin needs a new sign-in; waiting for channelctl resume");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = self.resume.notified() => {}
                    }
                    backoff.reset();
                    attempt = 0;
                    reason = "user";
                    continue;
                }
                _ => {}
            }
            attempt = attempt.saturating_add(1);
            let delay = backoff.after_run(started.elapsed());
            hub.link_state(LinkState::Retrying {
                attempt,
                error: format!("the plugin stopped; restarting in {} s", delay.as_secs_f32()),
            });
            reason = "auto";
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(delay) => {}
                () = self.resume.notified() => {
                    backoff.reset();
                    attempt = 0;
                    reason = "user";
                }
            }
        }
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let address = convert::address(&post.message.target)
            .map_err(|err| PostError::failed(err.to_string(), false))?;
        let Some(plugin) = self.plugin() else {
            return Err(PostError::failed("the plugin is not running", true));
        };
        let caps = self.state().capabilities.clone();
        let text = post.message.body.text_str();
        let pieces = wire::split_text(text, caps.text_units(), caps.count_utf16);
        let reply_context = match &post.message.target.reply_to {
            Some(id) => json!({ "message_id": id.as_str() }),
            None => json!({}),
        };
        let mut held = false;
        for (i, piece) in pieces.iter().enumerate() {
            let params = SendTextParams {
                address: address.clone(),
                text: piece.clone(),
                reply_context: reply_context.clone(),
            };
            let params = serde_json::to_value(params).unwrap_or_default();
            self.remember_send(&address.chat, piece);
            let answer = plugin.request(method::SEND_TEXT, params, self.config.send_timeout).await;
            let posted_before = i > 0;
            let result = match answer {
                Ok(value) => serde_json::from_value::<SendResult>(value).map_err(|err| {
                    PostError::unknown(format!("unreadable send_text result: {err}"))
                })?,
                // Never resent: it may have reached the platform.
                Err(err @ PluginError::Timeout { .. }) => {
                    return Err(PostError::unknown(err.to_string()));
                }
                Err(err @ PluginError::Gone(_)) => return Err(PostError::unknown(err.to_string())),
                Err(err) if posted_before => {
                    return Err(PostError::unknown(format!(
                        "part {} of {}: {err}",
                        i + 1,
                        pieces.len()
                    )));
                }
                Err(err) => return Err(PostError::failed(err.to_string(), false)),
            };
            match result.outcome {
                Outcome::Sent => {}
                Outcome::Held => held = true,
                Outcome::Failed => {
                    let error = result.error.unwrap_or_else(|| "the plugin reported failed".into());
                    return Err(if posted_before {
                        PostError::unknown(format!(
                            "part {} of {} failed: {error}",
                            i + 1,
                            pieces.len()
                        ))
                    } else {
                        PostError::failed(error, false)
                    });
                }
            }
        }
        Ok(DeliveryReceipt {
            channel: self.config.channel.clone(),
            message_id: self.receipt_id(held),
            target: post.message.target.clone(),
            timestamp_ms: None,
        })
    }

    async fn effect(&self, request: EffectRequest) -> Result<(), EffectError> {
        let Effect::Typing { active } = request.effect else {
            return Err(EffectError::Unsupported);
        };
        let address: Address = convert::address(&request.target)
            .map_err(|err| EffectError::Failed(err.to_string()))?;
        let Some(plugin) = self.plugin() else {
            return Err(EffectError::Failed("the plugin is not running".into()));
        };
        // A plugin without typing gets none: typing is live progress, dropped quietly.
        if self.state().capabilities.supports_typing {
            let params =
                serde_json::to_value(SetTypingParams { address, on: active }).unwrap_or_default();
            plugin.notify(method::SET_TYPING, params).await;
        }
        Ok(())
    }

    async fn operator_action(&self, request: OperatorAction) -> Result<Value, OperatorActionError> {
        match request.name.as_str() {
            RESUME => {
                let running = self.plugin().is_some();
                info!(running, "operator asked to resume the plugin");
                self.resume.notify_one();
                Ok(json!({ "restarted": running, "reason": "user" }))
            }
            LOGIN => {
                let Some(plugin) = self.plugin() else {
                    return Err(OperatorActionError::Failed(
                        "the plugin is not running; run channelctl resume first".into(),
                    ));
                };
                let params = json!({ "name": LOGIN, "args": request.args });
                let timeout = wire::method_timeout(method::ACTION);
                match plugin.request(method::ACTION, params, timeout).await {
                    Ok(result) => Ok(result),
                    Err(err) => Err(OperatorActionError::Failed(err.to_string())),
                }
            }
            _ => Err(OperatorActionError::Unsupported),
        }
    }
}
