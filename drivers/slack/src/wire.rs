//! Slack's wire formats as serde types: Socket Mode frames and acknowledgements, the Events
//! API wrapper and the events the driver reads, `block_actions` payloads, and the Web API
//! requests and responses it sends and reads. Unknown fields are ignored; fields Slack may
//! omit are optional.

use serde::{Deserialize, Serialize};
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Socket Mode

/// A frame the Socket Mode server sends.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SocketFrame {
    /// The first frame of every connection: the link is up.
    Hello(Hello),
    /// Slack is about to close (or refuses) this connection.
    Disconnect(Disconnect),
    EventsApi(Envelope),
    Interactive(Envelope),
    SlashCommands(Envelope),
    /// A frame type this driver does not handle.
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Hello {
    pub num_connections: Option<u32>,
    pub debug_info: Option<DebugInfo>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct DebugInfo {
    pub host: Option<String>,
    /// Seconds until Slack expects to recycle the connection.
    pub approximate_connection_time: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Disconnect {
    /// `warning`, `refresh_requested`, `link_disabled`, `too_many_websockets`, …
    pub reason: String,
    pub debug_info: Option<DebugInfo>,
}

/// An envelope: one event to acknowledge by its id.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Envelope {
    pub envelope_id: String,
    #[serde(default)]
    pub payload: Value,
    #[serde(default)]
    pub accepts_response_payload: bool,
    /// 0 for the first delivery; retries carry a new envelope id and the same event id.
    #[serde(default)]
    pub retry_attempt: u32,
    pub retry_reason: Option<String>,
}

/// The acknowledgement frame: `{"envelope_id": …}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ack<'a> {
    pub envelope_id: &'a str,
}

// ---------------------------------------------------------------------------------------------
// Events API

/// The `event_callback` wrapper inside an `events_api` envelope.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EventCallback {
    pub event_id: String,
    pub event_time: Option<u64>,
    pub team_id: Option<String>,
    pub event: Event,
}

/// The events the driver reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Message(MessageEvent),
    AppMention(MessageEvent),
    ReactionAdded(ReactionEvent),
    ReactionRemoved(ReactionEvent),
    AssistantThreadStarted(AssistantThreadEvent),
    AssistantThreadContextChanged(AssistantThreadEvent),
    #[serde(other)]
    Other,
}

/// A `message` (any subtype) or `app_mention` event.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct MessageEvent {
    pub subtype: Option<String>,
    pub channel: Option<String>,
    /// `im`, `channel`, `group`, `mpim` (absent on `app_mention`).
    pub channel_type: Option<String>,
    pub user: Option<String>,
    pub bot_id: Option<String>,
    pub text: Option<String>,
    pub ts: Option<String>,
    pub thread_ts: Option<String>,
    pub event_ts: Option<String>,
    #[serde(default)]
    pub files: Vec<File>,
    /// `message_changed`: the message after the edit.
    pub message: Option<Box<InnerMessage>>,
    /// `message_deleted`: the deleted message's ts.
    pub deleted_ts: Option<String>,
    pub previous_message: Option<Box<InnerMessage>>,
}

/// The message inside `message_changed` / `message_deleted`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct InnerMessage {
    pub user: Option<String>,
    pub bot_id: Option<String>,
    pub text: Option<String>,
    pub ts: Option<String>,
    pub thread_ts: Option<String>,
    #[serde(default)]
    pub files: Vec<File>,
}

/// A file shared in a message. `url_private` needs the bot token to download.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct File {
    pub id: Option<String>,
    pub name: Option<String>,
    pub title: Option<String>,
    pub mimetype: Option<String>,
    pub size: Option<u64>,
    pub url_private: Option<String>,
    /// `hosted`, `external`, `tombstone` (deleted), `hidden_by_limit`, …
    pub mode: Option<String>,
}

/// `reaction_added` / `reaction_removed`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReactionEvent {
    pub user: Option<String>,
    pub reaction: String,
    pub item: ReactionItem,
    pub event_ts: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReactionItem {
    /// `message` (reactions on files are not forwarded).
    #[serde(rename = "type")]
    pub kind: String,
    pub channel: Option<String>,
    pub ts: Option<String>,
}

/// `assistant_thread_started` / `assistant_thread_context_changed`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AssistantThreadEvent {
    pub assistant_thread: AssistantThread,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AssistantThread {
    pub user_id: Option<String>,
    pub channel_id: String,
    pub thread_ts: String,
}

// ---------------------------------------------------------------------------------------------
// Interactivity

/// An `interactive` envelope's payload, by `type`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Interaction {
    BlockActions(BlockActions),
    #[serde(other)]
    Other,
}

/// A click on a button (or an input submitted) in a message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BlockActions {
    pub user: ActionUser,
    pub container: Option<Container>,
    #[serde(default)]
    pub actions: Vec<Action>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ActionUser {
    pub id: String,
    pub username: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Container {
    pub message_ts: Option<String>,
    pub channel_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Action {
    pub action_id: String,
    pub block_id: Option<String>,
    pub value: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Web API

/// The envelope of every Web API answer: errors are HTTP 200 with `ok: false`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ApiStatus {
    pub ok: bool,
    pub error: Option<String>,
}

/// `auth.test`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AuthTest {
    pub user_id: String,
    pub bot_id: Option<String>,
    pub team_id: Option<String>,
    pub team: Option<String>,
}

/// `apps.connections.open`: a single-use WebSocket URL.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ConnectionsOpen {
    pub url: String,
}

/// `chat.postMessage`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Posted {
    pub channel: String,
    pub ts: String,
}

/// `conversations.open`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Opened {
    pub channel: OpenedChannel,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OpenedChannel {
    pub id: String,
}

/// `users.info`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct UserInfo {
    pub user: User,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct User {
    pub id: String,
    pub name: Option<String>,
    pub real_name: Option<String>,
    pub profile: Option<Profile>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Profile {
    pub display_name: Option<String>,
    pub real_name: Option<String>,
}

/// `chat.postMessage` (JSON body).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PostMessage {
    pub channel: String,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_ts: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Value>,
    /// Agent text is converted to mrkdwn; links stay as written.
    pub mrkdwn: bool,
    pub unfurl_links: bool,
}

/// `chat.update` (JSON body). Without `blocks` Slack removes the old ones (buttons go away).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateMessage {
    pub channel: String,
    pub ts: String,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Value>,
}

/// `chat.delete`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeleteMessage {
    pub channel: String,
    pub ts: String,
}

/// `reactions.add` / `reactions.remove`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reaction {
    pub channel: String,
    pub timestamp: String,
    pub name: String,
}

/// `conversations.open`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpenConversation {
    pub users: String,
}

/// `assistant.threads.setStatus`; an empty `status` clears it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SetStatus {
    pub channel_id: String,
    pub thread_ts: String,
    pub status: String,
}
