//! ACECode's channel platform plugin protocol (`acecode.channel-platform.v1`): the manifest
//! and its validation, and the stdio JSONL frames between ACECode (the host) and a plugin.
//!
//! Both bridges use these types: `channeld-acecode` hosts a plugin (it plays ACECode), and
//! the SDK's `--acecode` transport makes any driver a plugin (it plays the plugin). Pure: the
//! manifest check takes the "is this a regular file" question as a function, so this crate
//! still does no I/O.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The manifest's `schema`.
pub const MANIFEST_SCHEMA: &str = "acecode.channel-platform.v1";
/// The manifest's file name in its connector directory.
pub const MANIFEST_FILE: &str = "channel-platform.json";
/// The plugin protocol version `initialize` carries.
pub const PROTOCOL_VERSION: u64 = 1;
/// The longest line either side may write, newline included (1 MiB).
pub const MAX_LINE_BYTES: usize = 1024 * 1024;
/// At most this many `args`.
pub const MAX_ARGS: usize = 32;
/// `${manifest_dir}` in `args` becomes the manifest directory's absolute path.
pub const MANIFEST_DIR_VAR: &str = "${manifest_dir}";
/// The feature that enables group chat delegation.
pub const FEATURE_WATCHED_GROUPS: &str = "watched_groups";

/// Default, lowest and highest `max_text_units`.
pub const DEFAULT_MAX_TEXT_UNITS: u64 = 4000;
pub const MIN_TEXT_UNITS: u64 = 64;
pub const MAX_TEXT_UNITS: u64 = 65536;

/// A validated manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub name: String,
    pub label: String,
    /// The program, absolute.
    pub command: PathBuf,
    /// The arguments, `${manifest_dir}` substituted.
    pub args: Vec<String>,
    /// The manifest's directory, absolute: the plugin's working directory.
    pub dir: PathBuf,
    /// `features` lists `watched_groups`.
    pub watched_groups: bool,
}

/// The manifest rule a manifest broke; the message names the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest is not a JSON object: {0}")]
    NotAnObject(String),
    #[error("schema must be {MANIFEST_SCHEMA:?}, found {0}")]
    Schema(String),
    #[error("name must match ^[a-z][a-z0-9-]{{1,31}}$, found {0}")]
    Name(String),
    #[error("label must be 1-64 bytes of text, found {0}")]
    Label(String),
    #[error("command must be a non-empty string (relative to the manifest directory, or absolute)")]
    CommandMissing,
    #[error("command {0} is not an existing regular file")]
    CommandNotAFile(String),
    #[error("args must be an array of at most {MAX_ARGS} strings: {0}")]
    Args(String),
    #[error("account must be \"self\", found {0}")]
    Account(String),
    #[error("features must be an array of strings: {0}")]
    Features(String),
    #[error("the manifest directory must be an absolute path: {0}")]
    Dir(String),
}

/// Whether `name` fits `^[a-z][a-z0-9-]{1,31}$`.
pub fn valid_platform_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    (2..=32).contains(&bytes.len())
        && bytes[0].is_ascii_lowercase()
        && bytes[1..].iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

fn shown(value: Option<&Value>) -> String {
    match value {
        None => "nothing".to_owned(),
        Some(value) => {
            let text = value.to_string();
            match text.char_indices().nth(80) {
                Some((at, _)) => format!("{}…", &text[..at]),
                None => text,
            }
        }
    }
}

impl Manifest {
    /// Checks a manifest's text against the rules, one at a time in field order. `dir` is the
    /// manifest's directory (absolute); `is_regular_file` answers for the resolved command.
    pub fn validate(
        text: &str,
        dir: &Path,
        is_regular_file: impl Fn(&Path) -> bool,
    ) -> Result<Self, ManifestError> {
        if !dir.is_absolute() {
            return Err(ManifestError::Dir(dir.display().to_string()));
        }
        let value: Value = serde_json::from_str(text)
            .map_err(|err| ManifestError::NotAnObject(err.to_string()))?;
        let Value::Object(object) = value else {
            return Err(ManifestError::NotAnObject(shown(Some(&value))));
        };
        let field = |name: &str| object.get(name);
        if field("schema").and_then(Value::as_str) != Some(MANIFEST_SCHEMA) {
            return Err(ManifestError::Schema(shown(field("schema"))));
        }
        let name = match field("name").and_then(Value::as_str) {
            Some(name) if valid_platform_name(name) => name.to_owned(),
            _ => return Err(ManifestError::Name(shown(field("name")))),
        };
        let label = match field("label").and_then(Value::as_str) {
            Some(label) if (1..=64).contains(&label.len()) => label.to_owned(),
            _ => return Err(ManifestError::Label(shown(field("label")))),
        };
        let command = match field("command").and_then(Value::as_str) {
            Some(command) if !command.is_empty() => command,
            _ => return Err(ManifestError::CommandMissing),
        };
        let command = dir.join(command);
        if !is_regular_file(&command) {
            return Err(ManifestError::CommandNotAFile(command.display().to_string()));
        }
        let dir_text = dir.to_string_lossy();
        let args = match field("args") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) if items.len() <= MAX_ARGS => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(|arg| arg.replace(MANIFEST_DIR_VAR, &dir_text))
                        .ok_or_else(|| ManifestError::Args(format!("{item} is not a string")))
                })
                .collect::<Result<_, _>>()?,
            Some(Value::Array(items)) => {
                return Err(ManifestError::Args(format!("found {} of them", items.len())));
            }
            other => return Err(ManifestError::Args(shown(other))),
        };
        if field("account").and_then(Value::as_str) != Some("self") {
            return Err(ManifestError::Account(shown(field("account"))));
        }
        let watched_groups = match field("features") {
            None | Some(Value::Null) => false,
            Some(Value::Array(items)) => {
                let mut watched = false;
                for item in items {
                    match item.as_str() {
                        Some(FEATURE_WATCHED_GROUPS) => watched = true,
                        // Unknown features are ignored, so manifests can grow.
                        Some(_) => {}
                        None => {
                            return Err(ManifestError::Features(format!("{item} is not a string")));
                        }
                    }
                }
                watched
            }
            other => return Err(ManifestError::Features(shown(other))),
        };
        Ok(Self { name, label, command, args, dir: dir.to_path_buf(), watched_groups })
    }
}

/// The manifest a channeld driver binary needs to run as a plugin (`--acecode`), as JSON.
pub fn driver_manifest(name: &str, label: &str, command: &Path) -> Value {
    serde_json::json!({
        "schema": MANIFEST_SCHEMA,
        "name": name,
        "label": label,
        "command": command.to_string_lossy(),
        "args": ["--acecode"],
        "account": "self",
        "features": [],
    })
}

/// How long the host waits for each method's response.
pub fn method_timeout(method: &str) -> Duration {
    Duration::from_secs(match method {
        method::INITIALIZE => 30,
        method::CONFIGURE => 10,
        method::SEND_TEXT => 60,
        method::SEND_FILE | method::DOWNLOAD | method::ACTION => 120,
        method::SHUTDOWN => 3,
        _ => 30,
    })
}

/// Method names (host → plugin).
pub mod method {
    pub const INITIALIZE: &str = "initialize";
    pub const CONFIGURE: &str = "configure";
    pub const SEND_TEXT: &str = "send_text";
    pub const SEND_FILE: &str = "send_file";
    pub const DOWNLOAD: &str = "download";
    pub const ACTION: &str = "action";
    pub const SHUTDOWN: &str = "shutdown";
    /// A notification: no response.
    pub const SET_TYPING: &str = "set_typing";
}

/// Event names (plugin → host).
pub mod event {
    pub const STATUS: &str = "status";
    pub const INBOUND: &str = "inbound";
}

/// A request (host → plugin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    pub method: String,
    #[serde(default = "empty_object")]
    pub params: Value,
}

/// A notification (host → plugin, no response).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    pub method: String,
    #[serde(default = "empty_object")]
    pub params: Value,
}

/// A response (plugin → host): `ok` with a `result`, or not with an `error` reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn ok(id: u64, result: Value) -> Self {
        Self { id, ok: true, result: Some(result), error: None }
    }

    pub fn err(id: u64, error: impl Into<String>) -> Self {
        Self { id, ok: false, result: None, error: Some(error.into()) }
    }
}

/// An event (plugin → host).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub event: String,
    #[serde(default = "empty_object")]
    pub params: Value,
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// Why a line is not a frame. Any of these from a plugin stops it (the host restarts it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("line is not a JSON object: {0}")]
    NotAnObject(String),
    #[error("malformed {kind}: {reason}")]
    Malformed { kind: &'static str, reason: String },
}

/// A line a plugin wrote.
#[derive(Debug, Clone, PartialEq)]
pub enum PluginLine {
    Response(Response),
    Event(Event),
    /// A JSON object that is neither (ignored, so plugins may grow).
    Other,
}

/// A line the host wrote.
#[derive(Debug, Clone, PartialEq)]
pub enum HostLine {
    Request(Request),
    Notification(Notification),
    Other,
}

fn object(line: &[u8]) -> Result<Map<String, Value>, LineError> {
    match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(LineError::NotAnObject(shown(Some(&other)))),
        Err(err) => Err(LineError::NotAnObject(err.to_string())),
    }
}

fn parse<T: serde::de::DeserializeOwned>(
    kind: &'static str,
    map: Map<String, Value>,
) -> Result<T, LineError> {
    serde_json::from_value(Value::Object(map))
        .map_err(|err| LineError::Malformed { kind, reason: err.to_string() })
}

/// Reads one line from a plugin.
pub fn parse_plugin_line(line: &[u8]) -> Result<PluginLine, LineError> {
    let map = object(line)?;
    if map.contains_key("id") && map.contains_key("ok") {
        Ok(PluginLine::Response(parse("response", map)?))
    } else if map.contains_key("event") {
        Ok(PluginLine::Event(parse("event", map)?))
    } else {
        Ok(PluginLine::Other)
    }
}

/// Reads one line from the host.
pub fn parse_host_line(line: &[u8]) -> Result<HostLine, LineError> {
    let map = object(line)?;
    match (map.contains_key("method"), map.contains_key("id")) {
        (true, true) => Ok(HostLine::Request(parse("request", map)?)),
        (true, false) => Ok(HostLine::Notification(parse("notification", map)?)),
        _ => Ok(HostLine::Other),
    }
}

/// `settings`: what the user configured for the platform.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// Group ids whose messages the plugin emits; others it drops.
    #[serde(default)]
    pub watched_groups: Vec<String>,
}

/// `initialize` params.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitializeParams {
    pub protocol_version: u64,
    pub platform: String,
    /// `user` (the user just turned the card on) or `auto` (startup, restart after failure).
    pub reason: String,
    #[serde(default)]
    pub settings: Settings,
}

/// `configure` params.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigureParams {
    #[serde(default)]
    pub settings: Settings,
}

/// `initialize` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeResult {
    pub protocol_version: u64,
    #[serde(default)]
    pub capabilities: PluginCapabilities,
}

/// The plugin's capabilities (the field names of ACECode's `im::Capabilities`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginCapabilities {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_text_units: Option<u64>,
    /// Text length is counted in UTF-16 code units (otherwise in characters).
    #[serde(default)]
    pub count_utf16: bool,
    #[serde(default)]
    pub batch_turn_output: bool,
    #[serde(default)]
    pub supports_typing: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_upload_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_download_bytes: Option<u64>,
}

impl PluginCapabilities {
    /// `max_text_units` within 64–65536, 4000 when absent.
    pub fn text_units(&self) -> u64 {
        self.max_text_units.unwrap_or(DEFAULT_MAX_TEXT_UNITS).clamp(MIN_TEXT_UNITS, MAX_TEXT_UNITS)
    }
}

/// Where a message comes from or goes to. ACECode fills `platform` and `account` itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Address {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// `private` or `group`.
    pub kind: String,
    pub chat: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
}

/// `kind` of a private chat (`chat` equals `sender`).
pub const KIND_PRIVATE: &str = "private";
/// `kind` of a group chat.
pub const KIND_GROUP: &str = "group";

/// `send_text` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendTextParams {
    pub address: Address,
    /// Markdown.
    pub text: String,
    #[serde(default = "empty_object")]
    pub reply_context: Value,
}

/// `send_file` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendFileParams {
    pub address: Address,
    pub path: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub mime_type: Option<String>,
    #[serde(default = "empty_object")]
    pub reply_context: Value,
}

/// The result of `send_text` / `send_file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendResult {
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a send ended on the plugin's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Sent,
    /// The plugin took the message and holds it (it has not reached the platform yet).
    Held,
    Failed,
}

/// `action` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionParams {
    pub name: String,
    #[serde(default = "empty_object")]
    pub args: Value,
}

/// `set_typing` params.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetTypingParams {
    pub address: Address,
    pub on: bool,
}

/// The `status` event.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusParams {
    /// `connecting`, `connected`, `retrying`, `failed` or `stopped`.
    pub state: String,
    #[serde(default)]
    pub detail: String,
    #[serde(default)]
    pub retry_stopped: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default)]
    pub extra: StatusExtra,
}

/// `status.extra`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusExtra {
    /// The user must sign in again; the host does not retry by itself.
    #[serde(default)]
    pub login_required: bool,
}

/// The `inbound` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboundParams {
    pub address: Address,
    pub message_id: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub mentioned: bool,
    #[serde(default)]
    pub from_self: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quote_text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Value>,
    #[serde(default = "empty_object")]
    pub reply_context: Value,
}

/// Whether an id fits the protocol: letters, digits and `- _ . : @ + / = $`, 1–128 bytes.
pub fn valid_plugin_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:@+/=$".contains(&b))
}

/// Splits `text` into pieces of at most `max_units`, counted in UTF-16 code units when
/// `utf16`, else in characters; never inside a character, preferring a line break (then a
/// space) in the last quarter of a piece. Pure.
pub fn split_text(text: &str, max_units: u64, utf16: bool) -> Vec<String> {
    let max = usize::try_from(max_units.max(1)).unwrap_or(usize::MAX);
    let units = |c: char| if utf16 { c.len_utf16() } else { 1 };
    let mut pieces = Vec::new();
    let mut rest = text;
    loop {
        let mut used = 0;
        let mut cut = rest.len();
        for (at, c) in rest.char_indices() {
            if used + units(c) > max {
                cut = at;
                break;
            }
            used += units(c);
        }
        if cut == rest.len() {
            if !rest.is_empty() || pieces.is_empty() {
                pieces.push(rest.to_owned());
            }
            return pieces;
        }
        let head = &rest[..cut];
        let mut floor = head.len() - head.len() / 4;
        while !head.is_char_boundary(floor) {
            floor += 1;
        }
        let at = head[floor..]
            .rfind('\n')
            .or_else(|| head[floor..].rfind(' '))
            .map_or(cut, |i| floor + i + 1);
        let at = if at == 0 { cut } else { at };
        pieces.push(rest[..at].to_owned());
        rest = &rest[at..];
        if rest.is_empty() {
            return pieces;
        }
    }
}

#[cfg(test)]
mod tests;
