//! "Typing…" in the user's chat while a run goes: a ticket from `getconfig` (cached per user
//! for a day), `sendtyping` status 1 refreshed every interval, status 2 at the end.
//!
//! A user's indicator starts when the hub accepts one of their messages (or on a `typing`
//! effect) and ends when every run it was started for has been answered (or on a `typing`
//! effect with `active: false`), after the typing maximum at the latest. A reply that starts
//! before the acceptance is seen (a reference hub resolves an inbound by its reply) marks its
//! event answered, so no indicator starts after it. Typing is a live effect: when more than
//! [`MAX_ACTIVE`] users are typing at once, new indicators are dropped.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::client::IlinkClient;
use crate::config::WechatConfig;
use crate::ilink::{TYPING_OFF, TYPING_ON};
use crate::session::Session;
use crate::store::{ContextFor, Store};

/// A typing ticket is fetched again after this long (the official client keeps it a day).
pub const TICKET_TTL: Duration = Duration::from_secs(24 * 3600);
/// Users with an indicator at once; beyond, new indicators are dropped.
pub const MAX_ACTIVE: usize = 256;
/// Tickets cached; beyond, expired ones and then the oldest are dropped.
pub const MAX_TICKETS: usize = 10_000;
/// Longest wait for a "stopped typing" answer.
pub const TYPING_OFF_TIMEOUT: Duration = Duration::from_secs(3);
/// Answered events remembered so a late acceptance does not start an indicator.
const MAX_ANSWERED: usize = 1024;
/// The reason an indicator was started without an event (a `typing` effect).
const EFFECT: &str = "";

#[derive(Debug)]
struct Active {
    generation: u64,
    /// Events (or [`EFFECT`]) the indicator is shown for.
    reasons: HashSet<String>,
    stop: CancellationToken,
}

#[derive(Debug, Default)]
struct State {
    active: HashMap<String, Active>,
    answered: HashSet<String>,
    answered_order: VecDeque<String>,
    tickets: HashMap<String, (String, Instant)>,
    generation: u64,
}

/// The typing indicators of every user.
#[derive(Debug)]
pub struct Typing {
    client: IlinkClient,
    session: Arc<Session>,
    store: Arc<Store>,
    config: Arc<WechatConfig>,
    state: Mutex<State>,
    tracker: TaskTracker,
}

impl Typing {
    pub fn new(
        client: IlinkClient,
        session: Arc<Session>,
        store: Arc<Store>,
        config: Arc<WechatConfig>,
    ) -> Self {
        Self {
            client,
            session,
            store,
            config,
            state: Mutex::new(State::default()),
            tracker: TaskTracker::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The hub accepted `event_id` from `user`: show typing until it is answered.
    pub fn run_started(self: &Arc<Self>, user: &str, event_id: &str) {
        if self.lock().answered.contains(event_id) {
            return;
        }
        self.show(user, event_id);
    }

    /// A `typing` effect with `active: true`.
    pub fn effect_on(self: &Arc<Self>, user: &str) {
        self.show(user, EFFECT);
    }

    /// A `typing` effect with `active: false`: the indicator ends whatever it was for.
    pub fn effect_off(&self, user: &str) {
        if let Some(active) = self.lock().active.remove(user) {
            active.stop.cancel();
        }
    }

    /// A reply to `event_id` is about to be posted: no indicator may start for it any more.
    pub fn reply_started(&self, event_id: &str) {
        let mut state = self.lock();
        if state.answered.insert(event_id.to_owned()) {
            state.answered_order.push_back(event_id.to_owned());
            while state.answered_order.len() > MAX_ANSWERED {
                if let Some(old) = state.answered_order.pop_front() {
                    state.answered.remove(&old);
                }
            }
        }
    }

    /// A message reached `user` (the reply to `event_id`, if any): the indicator ends once no
    /// run it is shown for is left. A proactive message ends one shown for an effect.
    pub fn answered(&self, user: &str, event_id: Option<&str>) {
        let mut state = self.lock();
        let Some(active) = state.active.get_mut(user) else { return };
        active.reasons.remove(event_id.unwrap_or(EFFECT));
        if event_id.is_some() {
            active.reasons.remove(EFFECT);
        }
        if active.reasons.is_empty()
            && let Some(active) = state.active.remove(user)
        {
            active.stop.cancel();
        }
    }

    /// Lets indicators start again (`run` is called again after the hub refused the driver
    /// and then took it back).
    pub fn open(&self) {
        self.tracker.reopen();
    }

    /// Ends every indicator and waits for their "stop typing" calls.
    pub async fn stop_all(&self) {
        for (_, active) in self.lock().active.drain() {
            active.stop.cancel();
        }
        self.tracker.close();
        self.tracker.wait().await;
    }

    fn show(self: &Arc<Self>, user: &str, reason: &str) {
        let mut state = self.lock();
        if let Some(active) = state.active.get_mut(user) {
            active.reasons.insert(reason.to_owned());
            return;
        }
        if state.active.len() >= MAX_ACTIVE {
            debug!(user, "too many typing indicators at once; this one is dropped");
            return;
        }
        if self.tracker.is_closed() {
            return;
        }
        state.generation += 1;
        let generation = state.generation;
        let stop = CancellationToken::new();
        state.active.insert(
            user.to_owned(),
            Active { generation, reasons: HashSet::from([reason.to_owned()]), stop: stop.clone() },
        );
        drop(state);
        let this = self.clone();
        let user = user.to_owned();
        self.tracker.spawn(async move { this.indicate(user, generation, stop).await });
    }

    /// Sends "typing" every interval until stopped or the maximum passes, then "stopped".
    async fn indicate(self: Arc<Self>, user: String, generation: u64, stop: CancellationToken) {
        let started = Instant::now();
        let mut shown_with: Option<String> = None;
        while !stop.is_cancelled() && started.elapsed() < self.config.typing_max {
            if let Some(ticket) = self.ticket(&user).await {
                if self.send(&user, &ticket, TYPING_ON).await {
                    shown_with = Some(ticket);
                } else {
                    self.lock().tickets.remove(&user);
                }
            }
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(self.config.typing_interval) => {}
            }
        }
        if let Some(ticket) = shown_with {
            self.send(&user, &ticket, TYPING_OFF).await;
        }
        let mut state = self.lock();
        if state.active.get(&user).is_some_and(|a| a.generation == generation) {
            state.active.remove(&user);
        }
    }

    async fn send(&self, user: &str, ticket: &str, status: i64) -> bool {
        let Some(credentials) = self.session.current() else { return false };
        // "Stopped" also goes out while the driver drains: it must not hold the drain up.
        let timeout = match status {
            TYPING_OFF => self.config.request_timeout.min(TYPING_OFF_TIMEOUT),
            _ => self.config.request_timeout,
        };
        let sent = self
            .client
            .send_typing(&credentials.base_url, &credentials.token, user, ticket, status, timeout)
            .await;
        match sent {
            Ok(()) => true,
            Err(err) => {
                if err.session_expired() {
                    self.session.expired(&credentials.token);
                }
                debug!(user, status, error = %err, "typing indicator not sent");
                false
            }
        }
    }

    /// The user's cached ticket, or a new one from `getconfig`.
    async fn ticket(&self, user: &str) -> Option<String> {
        if let Some((ticket, at)) = self.lock().tickets.get(user)
            && at.elapsed() < TICKET_TTL
        {
            return Some(ticket.clone());
        }
        let credentials = self.session.current()?;
        let context = match self.store.context_for(user) {
            ContextFor::Token(token) => Some(token),
            _ => None,
        };
        let fetched = self
            .client
            .get_config(
                &credentials.base_url,
                &credentials.token,
                user,
                context.as_deref(),
                self.config.request_timeout,
            )
            .await;
        match fetched {
            Ok(ticket) => {
                let mut state = self.lock();
                if state.tickets.len() >= MAX_TICKETS {
                    state.tickets.retain(|_, (_, at)| at.elapsed() < TICKET_TTL);
                    if state.tickets.len() >= MAX_TICKETS
                        && let Some(oldest) = state
                            .tickets
                            .iter()
                            .min_by_key(|(_, (_, at))| *at)
                            .map(|(u, _)| u.clone())
                    {
                        state.tickets.remove(&oldest);
                    }
                }
                state.tickets.insert(user.to_owned(), (ticket.clone(), Instant::now()));
                Some(ticket)
            }
            Err(err) => {
                if err.session_expired() {
                    self.session.expired(&credentials.token);
                }
                debug!(user, error = %err, "no typing ticket");
                None
            }
        }
    }
}
