//! A protocol-faithful fake Slack on 127.0.0.1: the Web API methods the Slack driver uses and
//! Socket Mode, controlled from a test through [`FakeSlack`].
//!
//! * Web API (`web`): `apps.connections.open` (app token only; returns a single-use
//!   `ws://…/link/?ticket=…` URL), `auth.test`, `chat.postMessage`, `chat.update`,
//!   `chat.delete`, `reactions.add`/`remove`, `conversations.open`,
//!   `assistant.threads.setStatus`, `users.info` (form arguments only, like Slack). Errors are
//!   HTTP 200 `{"ok":false,"error":…}`; faults add 429 + `Retry-After`, delays, hangs, 5xx.
//! * Socket Mode (`socket`): `hello` first, `events_api` / `interactive` envelopes to one live
//!   socket at a time (round robin, so two sockets during a refresh both deliver),
//!   acknowledgements matched per socket, unacknowledged events redelivered with a new
//!   envelope id and `retry_attempt + 1`, `disconnect` (`warning`, `refresh_requested`,
//!   `link_disabled`, `too_many_websockets`), abrupt close, silent half-open sockets.
//! * The workspace: people's posts produce the events an app subscribed to `message.im`,
//!   `message.channels`, `message.groups` and `app_mention` gets (a channel @mention arrives
//!   twice); the bot's own posts, edits and deletions come back as `message` events too.
//!
//! Everything is recorded ([`Record`]); [`FakeSlack::wait_for`] waits for a condition on it.

mod events;
mod socket;
mod state;
#[cfg(test)]
mod tests;
mod web;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::{any, get};
use channeld_driver_sdk::CancellationToken;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use events::{channel_type, dm_channel, file};
pub use state::{
    AckRecord, ApiCall, EnvelopeRecord, Fault, Record, SocketEnd, SocketRecord, StatusRecord,
    StoredMessage,
};
pub use web::MAX_TEXT_CHARS;

use state::{FaultRule, Outstanding, SocketCommand, State};

/// How often unacknowledged envelopes are checked for redelivery.
const REDELIVERY_TICK: Duration = Duration::from_millis(20);

/// How the fake workspace behaves. `Default` gives Slack's values, except the redelivery
/// interval, which tests shorten.
#[derive(Debug, Clone)]
pub struct FakeSlackOptions {
    pub app_token: String,
    pub bot_token: String,
    pub team_id: String,
    pub app_id: String,
    pub bot_user_id: String,
    pub bot_id: String,
    /// An unacknowledged `events_api` envelope is delivered again after this long (Slack:
    /// a few seconds).
    pub redeliver_after: Duration,
    /// Redeliveries before Slack gives up on an event (Slack: 3).
    pub max_retries: u32,
    /// After `refresh_requested`, the old socket is closed by the fake this much later.
    pub refresh_grace: Duration,
    /// WebSocket pings from the fake (Slack pings its clients); `None` sends none.
    pub ping_interval: Option<Duration>,
    /// Sockets an app may hold at once (Slack: 10); one more gets `too_many_websockets`.
    pub max_sockets: usize,
    /// `hello.debug_info.approximate_connection_time`, in seconds.
    pub approximate_connection_time_secs: u64,
    /// Send the app `message` events for its own posts, edits and deletions, as Slack does.
    pub echo_bot_messages: bool,
    /// Event subscriptions: `message.im`, `message.channels`, `message.groups`, `app_mention`.
    pub subscriptions: Vec<String>,
    /// Enforce `chat.postMessage`'s special limit: more than this many posts to one channel
    /// within a second get HTTP 429 with `Retry-After: 1`. `None` enforces nothing.
    pub posts_per_channel_second: Option<usize>,
}

impl Default for FakeSlackOptions {
    fn default() -> Self {
        Self {
            app_token: "xapp-1-A0FAKE-1-fakeapptoken".into(),
            bot_token: "xoxb-1-fakebottoken".into(),
            team_id: "T0FAKE".into(),
            app_id: "A0FAKE".into(),
            bot_user_id: "U0BOT".into(),
            bot_id: "B0BOT".into(),
            redeliver_after: Duration::from_secs(3),
            max_retries: 3,
            refresh_grace: Duration::from_secs(10),
            ping_interval: Some(Duration::from_secs(5)),
            max_sockets: 10,
            approximate_connection_time_secs: 18_060,
            echo_bot_messages: true,
            subscriptions: ["message.im", "message.channels", "message.groups", "app_mention"]
                .map(str::to_owned)
                .to_vec(),
            posts_per_channel_second: None,
        }
    }
}

/// What one person's post produced.
#[derive(Debug, Clone)]
pub struct Said {
    pub channel: String,
    pub ts: String,
    /// The Events API `event_id`s pushed for it (two for a channel @mention).
    pub event_ids: Vec<String>,
}

/// State shared by the handle, the HTTP handlers and the socket tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub options: FakeSlackOptions,
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    state: Mutex<State>,
    version: watch::Sender<u64>,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wakes [`FakeSlack::wait_for`] callers.
    pub fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Changes the state and wakes waiters.
    pub fn update<R>(&self, change: impl FnOnce(&mut State) -> R) -> R {
        let result = change(&mut self.lock());
        self.changed();
        result
    }

    pub fn dispatch(&self) {
        socket::dispatch(self);
    }

    fn push(&self, kind: &'static str, payload: Value, event_id: Option<String>) {
        self.push_attempt(kind, payload, event_id, 0);
    }

    fn push_attempt(
        &self,
        kind: &'static str,
        payload: Value,
        event_id: Option<String>,
        attempts: u32,
    ) {
        self.update(|state| {
            if let Some(id) = &event_id {
                state.payloads.insert(id.clone(), payload.clone());
            }
            state.outstanding.push_back(Outstanding {
                kind,
                payload,
                event_id,
                attempts,
                envelope_id: None,
                socket: None,
                due: None,
            });
        });
        self.dispatch();
    }

    /// Wraps `event` in an `event_callback` and queues it; returns its `event_id`.
    pub fn push_events_api(&self, event: Value) -> String {
        let event_id = {
            let mut state = self.lock();
            format!("Ev{:010}", state.next())
        };
        let event_time = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let payload = events::event_callback(&self.options, event, &event_id, event_time);
        self.push("events_api", payload, Some(event_id.clone()));
        event_id
    }

    fn subscribed(&self, name: &str) -> bool {
        self.options.subscriptions.iter().any(|s| s == name)
    }

    fn sockets(&self) -> Vec<tokio::sync::mpsc::Sender<SocketCommand>> {
        let state = self.lock();
        state
            .live
            .iter()
            .filter(|h| state.record.sockets.iter().any(|s| s.id == h.id && s.is_live()))
            .map(|h| h.commands.clone())
            .collect()
    }
}

/// The fake Slack. Dropping it stops the server and closes every socket.
#[derive(Debug)]
pub struct FakeSlack {
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl FakeSlack {
    /// Starts a fake with default options on 127.0.0.1 (a free port).
    pub async fn start() -> Self {
        Self::start_with(FakeSlackOptions::default()).await
    }

    pub async fn start_with(options: FakeSlackOptions) -> Self {
        let listener =
            tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the fake Slack");
        let addr = listener.local_addr().expect("fake Slack address");
        let shared = Arc::new(Shared {
            options,
            addr,
            shutdown: CancellationToken::new(),
            state: Mutex::new(State::default()),
            version: watch::Sender::new(0),
        });
        let app = Router::new()
            .route("/api/{method}", any(web::api))
            .route("/link/", get(socket::link))
            .with_state(shared.clone());
        let mut tasks = JoinSet::new();
        let stop = shared.shutdown.clone();
        tasks.spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
        let ticker = shared.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(REDELIVERY_TICK);
            loop {
                tokio::select! {
                    () = ticker.shutdown.cancelled() => return,
                    _ = tick.tick() => ticker.dispatch(),
                }
            }
        });
        Self { shared, tasks }
    }

    pub fn options(&self) -> &FakeSlackOptions {
        &self.shared.options
    }

    /// The Web API base for `CHANNELD_SLACK_API_URL` (`http://127.0.0.1:P/api/`).
    pub fn api_url(&self) -> String {
        format!("http://{}/api/", self.shared.addr)
    }

    /// A snapshot of everything recorded so far.
    pub fn record(&self) -> Record {
        self.shared.lock().record.clone()
    }

    /// Waits until `check` finds what it wants in the record; panics after `within`, naming
    /// `what` and showing the record.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        within: Duration,
        mut check: impl FnMut(&Record) -> Option<T>,
    ) -> T {
        super::wait_until(
            "Slack",
            what,
            within,
            self.shared.version.subscribe(),
            || check(&self.shared.lock().record),
            || format!("record: {:#?}", self.record()),
        )
        .await
    }

    /// Adds a person `users.info` knows.
    pub fn add_user(&self, id: &str, real_name: &str, display_name: &str) {
        let user = json!({
            "id": id,
            "team_id": self.shared.options.team_id,
            "name": display_name.to_lowercase(),
            "deleted": false,
            "real_name": real_name,
            "is_bot": false,
            "profile": {"real_name": real_name, "display_name": display_name},
        });
        self.shared.update(|state| state.users.insert(id.to_owned(), user));
    }

    /// A person posts `text` in `channel` (a thread reply when `thread_ts` is set) with
    /// `files`; the app gets the events it subscribed to.
    pub fn user_posts(
        &self,
        channel: &str,
        user: &str,
        text: &str,
        thread_ts: Option<&str>,
        files: &[Value],
    ) -> Said {
        let options = &self.shared.options;
        let message = self.shared.update(|state| {
            let message = StoredMessage {
                channel: channel.to_owned(),
                ts: state.next_ts(),
                thread_ts: thread_ts.map(str::to_owned),
                user: user.to_owned(),
                by_bot: false,
                text: text.to_owned(),
                blocks: None,
                edits: Vec::new(),
                deleted: false,
                reactions: Vec::new(),
            };
            state.record.messages.push(message.clone());
            message
        });
        let subscription = match channel_type(channel) {
            "im" => "message.im",
            "group" => "message.groups",
            _ => "message.channels",
        };
        let mut event_ids = Vec::new();
        let mention = format!("<@{}>", options.bot_user_id);
        if channel_type(channel) != "im"
            && text.contains(&mention)
            && self.shared.subscribed("app_mention")
        {
            event_ids.push(
                self.shared.push_events_api(events::app_mention_event(options, &message, files)),
            );
        }
        if self.shared.subscribed(subscription) {
            event_ids.push(
                self.shared.push_events_api(events::user_message_event(options, &message, files)),
            );
        }
        Said { channel: message.channel, ts: message.ts, event_ids }
    }

    /// A person posts in the DM with the app.
    pub fn user_dms(&self, user: &str, text: &str) -> Said {
        self.user_posts(&dm_channel(user), user, text, None, &[])
    }

    /// Queues any event (wrapped in `event_callback`); returns its `event_id`.
    pub fn push_event(&self, event: Value) -> String {
        self.shared.push_events_api(event)
    }

    /// Delivers `event_id` again with a new envelope id and the next `retry_attempt`, as Slack
    /// does when an acknowledgement was lost; redelivered until acknowledged.
    pub fn redeliver(&self, event_id: &str) {
        let (payload, attempts) = {
            let state = self.shared.lock();
            let payload = state
                .payloads
                .get(event_id)
                .cloned()
                .unwrap_or_else(|| panic!("no event {event_id}"));
            let attempts = state.record.deliveries_of(event_id).len() as u32;
            (payload, attempts)
        };
        self.shared.push_attempt("events_api", payload, Some(event_id.to_owned()), attempts);
    }

    /// Queues an `interactive` envelope with `payload`.
    pub fn push_interactive(&self, payload: Value) {
        self.shared.push("interactive", payload, None);
    }

    /// `user` clicks the button `action_id` on the bot's message `channel`/`ts` (or submits
    /// `value` in the input `action_id`); panics if the message has no such element.
    pub fn click(&self, user: &str, channel: &str, ts: &str, action_id: &str, value: Option<&str>) {
        let payload = {
            let state = self.shared.lock();
            let message = state
                .record
                .messages
                .iter()
                .find(|m| m.channel == channel && m.ts == ts && !m.deleted)
                .unwrap_or_else(|| panic!("no message {channel}/{ts} to click on"));
            let blocks = message.blocks.clone().unwrap_or(Value::Null);
            let (block_id, element) = events::find_element(&blocks, action_id)
                .unwrap_or_else(|| panic!("message {channel}/{ts} has no element {action_id}"));
            let mut action = json!({
                "action_id": action_id,
                "block_id": block_id,
                "type": element.get("type").cloned().unwrap_or(Value::Null),
                "action_ts": format!("{}.5", ts),
            });
            if let Some(text) = element.get("text") {
                action["text"] = text.clone();
            }
            match value {
                Some(typed) => action["value"] = json!(typed),
                None => action["value"] = element.get("value").cloned().unwrap_or(Value::Null),
            }
            events::block_actions(&self.shared.options, user, message, action)
        };
        self.push_interactive(payload);
    }

    /// Sends `disconnect` with `reason` on every live socket, closing each `close_after`
    /// later (kept open when `None`).
    pub async fn disconnect(&self, reason: &str, close_after: Option<Duration>) {
        for commands in self.shared.sockets() {
            let _ = commands
                .send(SocketCommand::Disconnect { reason: reason.to_owned(), close_after })
                .await;
        }
    }

    /// A routine recycle: `refresh_requested` now, the old sockets closed after
    /// `refresh_grace`.
    pub async fn refresh(&self) {
        self.disconnect("refresh_requested", Some(self.shared.options.refresh_grace)).await;
    }

    /// Socket Mode switched off: every socket gets `disconnect` `link_disabled` and is closed;
    /// new connections get the same until [`enable_link`](Self::enable_link).
    pub async fn disable_link(&self) {
        self.shared.update(|state| state.link_disabled = true);
        self.disconnect("link_disabled", Some(Duration::ZERO)).await;
    }

    pub fn enable_link(&self) {
        self.shared.update(|state| state.link_disabled = false);
    }

    /// Drops every live socket without a close frame.
    pub async fn close_abruptly(&self) {
        for commands in self.shared.sockets() {
            let _ = commands.send(SocketCommand::Abrupt).await;
        }
    }

    /// Closes every live socket with a close frame.
    pub async fn close(&self) {
        for commands in self.shared.sockets() {
            let _ = commands.send(SocketCommand::Close).await;
        }
    }

    /// Every live socket goes half-open: no reads, no writes, no pongs, no close. Waits for
    /// a socket that said hello first (a driver may report Ready to the hub before its socket
    /// is up, and silencing nothing would test nothing), and returns once every socket it
    /// silenced is recorded silent.
    pub async fn go_silent(&self) {
        let within = Duration::from_secs(10);
        self.wait_for("a live socket to silence", within, |r| {
            r.sockets.iter().any(|s| s.is_live()).then_some(())
        })
        .await;
        let sockets = self.shared.sockets();
        for commands in &sockets {
            let _ = commands.send(SocketCommand::Silent).await;
        }
        self.wait_for("the sockets silent", within, |r| {
            (r.sockets.iter().filter(|s| s.silent).count() >= sockets.len()).then_some(())
        })
        .await;
    }

    /// Applies `fault` to the next `times` calls of `method` (every call when `None`).
    pub fn fail(&self, method: &str, fault: Fault, times: Option<u32>) {
        assert_ne!(times, Some(0), "a fault for zero calls does nothing");
        self.shared.update(|state| {
            state
                .faults
                .entry(method.to_owned())
                .or_default()
                .push_back(FaultRule { fault, remaining: times });
        });
    }

    pub fn clear_faults(&self) {
        self.shared.update(|state| state.faults.clear());
    }

    /// Posts to `channel` fail with `code` (`channel_not_found`, `not_in_channel`…).
    pub fn fail_channel(&self, channel: &str, code: &str) {
        self.shared
            .update(|state| state.channel_errors.insert(channel.to_owned(), code.to_owned()));
    }

    /// Every token is (or is no longer) refused with `invalid_auth`.
    pub fn revoke_tokens(&self, revoked: bool) {
        self.shared.update(|state| state.tokens_revoked = revoked);
    }
}

impl Drop for FakeSlack {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        self.tasks.abort_all();
    }
}
