//! The exec agent contract `channeld.agent/v1` (PROTOCOL.md, "Agent contract"): one agent
//! process per run, the envelope on stdin, JSON lines or plain text on stdout, time and
//! output limits, the process group killed when the run ends. Shared by the hub's `exec`
//! runtime and `channeld-worker` (which runs the same contract on another machine for the
//! hub's `amqp` runtime); it holds no state and no storage.

use std::collections::BTreeMap;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use channeld_protocol::Id;
use channeld_protocol::ext::ToolReport;
use channeld_protocol::framing::{LineEvent, LineFramer};
use channeld_protocol::types::{Choice, Command, CommandAnswer, Effect, Metadata};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

#[cfg(feature = "amqp")]
pub mod amqp;

/// The `version` field of the envelope written to an agent's stdin.
pub const AGENT_ENVELOPE_VERSION: &str = "channeld.agent/v1";

/// Environment variables passed through to agents; everything else is cleared.
pub const PASS_THROUGH_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER"];

/// The prefix of inbound metadata keys a driver passes to its agents as environment.
pub const METADATA_ENV_PREFIX: &str = "env.";

/// How long a cancelled run's agent has between SIGTERM and SIGKILL.
pub const CANCEL_GRACE: Duration = Duration::from_secs(3);

/// The environment namespace of a driver family: `bcn` → `BCN_`.
pub fn env_namespace(family: &str) -> String {
    family
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' })
        .chain(std::iter::once('_'))
        .collect()
}

/// Whether `name=value` may reach an agent of a `namespace` family from inbound metadata.
fn env_allowed(namespace: &str, name: &str, value: &str) -> bool {
    name.len() > namespace.len()
        && name.len() <= 128
        && name.starts_with(namespace)
        && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        && !value.contains('\0')
}

/// Whether `name=value` may reach an agent of a `family` driver, from inbound metadata or a
/// driver's `agent_env`: the name in the family's namespace (see [`metadata_env`]), the
/// value without NUL.
pub fn env_entry_allowed(family: &str, name: &str, value: &str) -> bool {
    env_allowed(&env_namespace(family), name, value)
}

/// The environment a run gets from its inbound's metadata: each `env.<NAME>` entry whose
/// `NAME` is in the driver family's namespace (`<FAMILY>_…` in capitals, e.g. `BCN_BOT_UUID`
/// for a `bcn` instance; only `A-Z`, `0-9`, `_`) and whose value has no NUL. Anything else is
/// left out, so a driver cannot set `PATH`, `LD_PRELOAD` or the `CHANNELD_*` variables; the
/// runtime's own `env` and the `CHANNELD_*` variables are applied after and win.
pub fn metadata_env<'a>(family: &str, metadata: &'a Metadata) -> Vec<(&'a str, &'a str)> {
    let namespace = env_namespace(family);
    metadata
        .iter()
        .filter_map(|(key, value)| {
            let name = key.strip_prefix(METADATA_ENV_PREFIX)?;
            env_allowed(&namespace, name, value).then_some((name, value.as_str()))
        })
        .collect()
}

/// How much of an agent's stderr is kept for the log line of a failed run.
const STDERR_TAIL: usize = 2048;

/// How long output is still read after the agent exited: enough for what it wrote before
/// exiting, short enough that a background process holding the pipe does not hold the run.
const EXIT_DRAIN_GRACE: Duration = Duration::from_millis(250);

/// How the agent's stdin is used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdinMode {
    /// One envelope line, then end of file. The agent may read stdin to the end.
    #[default]
    Envelope,
    /// The envelope line, then one line per command result; closed when the agent exits.
    /// Needed for agents that ask for input, approval or a choice.
    Stream,
}

/// How to run an agent: the command and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    /// argv, no shell.
    pub command: Vec<String>,
    /// Extra environment for the agent.
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    pub max_output_bytes: usize,
    pub stdin: StdinMode,
}

/// One run as the agent sees it: the envelope (written to its stdin as one line) and the
/// fields of it that also become environment variables.
#[derive(Debug, Clone)]
pub struct AgentRun {
    pub run_id: String,
    pub instance: String,
    /// The driver family (`instance` up to its first `.`).
    pub family: String,
    /// The inbound's locator (`CHANNELD_LOCATOR`; empty when the envelope has none).
    pub locator: String,
    pub session: String,
    pub capabilities: Vec<String>,
    pub control_socket: String,
    pub redelivered: bool,
    /// Environment from the inbound's metadata (see [`metadata_env`]); not in the envelope,
    /// which may be body-free.
    metadata_env: BTreeMap<String, String>,
    envelope: serde_json::Map<String, serde_json::Value>,
}

/// Why an envelope is not a `channeld.agent/v1` envelope.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("the envelope is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the envelope is not a JSON object")]
    NotAnObject,
    #[error("the envelope's version is {0:?}, not {AGENT_ENVELOPE_VERSION:?}")]
    Version(String),
    #[error("the envelope has no valid {0:?}")]
    Field(&'static str),
}

impl AgentRun {
    /// Reads the fields the contract needs from an envelope (as the hub wrote it).
    pub fn from_envelope(envelope: serde_json::Value) -> Result<Self, EnvelopeError> {
        let serde_json::Value::Object(envelope) = envelope else {
            return Err(EnvelopeError::NotAnObject);
        };
        let text = |name: &'static str| -> Result<String, EnvelopeError> {
            envelope
                .get(name)
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
                .ok_or(EnvelopeError::Field(name))
        };
        let version = text("version")?;
        if version != AGENT_ENVELOPE_VERSION {
            return Err(EnvelopeError::Version(version));
        }
        let capabilities = envelope
            .get("capabilities")
            .and_then(serde_json::Value::as_array)
            .ok_or(EnvelopeError::Field("capabilities"))?
            .iter()
            .map(|cap| cap.as_str().map(str::to_owned).ok_or(EnvelopeError::Field("capabilities")))
            .collect::<Result<Vec<_>, _>>()?;
        let redelivered = envelope
            .get("redelivered")
            .and_then(serde_json::Value::as_bool)
            .ok_or(EnvelopeError::Field("redelivered"))?;
        let run_id = text("run_id")?;
        if run_id.is_empty() {
            return Err(EnvelopeError::Field("run_id"));
        }
        let instance = text("instance")?;
        let family = match envelope.get("family").and_then(serde_json::Value::as_str) {
            Some(family) => family.to_owned(),
            None => instance.split('.').next().unwrap_or_default().to_owned(),
        };
        let locator = envelope
            .get("locator")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned();
        Ok(Self {
            run_id,
            instance,
            family,
            locator,
            metadata_env: BTreeMap::new(),
            session: text("session")?,
            control_socket: text("control_socket")?,
            capabilities,
            redelivered,
            envelope,
        })
    }

    /// Parses an envelope line.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        Self::from_envelope(serde_json::from_slice(bytes)?)
    }

    /// Sets the environment a driver gives the run (the inbound's metadata, then the hub's
    /// `agent_env`; a later entry wins): entries outside the family's namespace (see
    /// [`metadata_env`]) are dropped, whoever built them.
    pub fn set_metadata_env<'a>(&mut self, env: impl IntoIterator<Item = (&'a str, &'a str)>) {
        let namespace = env_namespace(&self.family);
        self.metadata_env = env
            .into_iter()
            .filter(|(name, value)| env_allowed(&namespace, name, value))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
    }

    /// The environment from the inbound's metadata.
    pub fn metadata_env(&self) -> &BTreeMap<String, String> {
        &self.metadata_env
    }

    /// Flags the run as started again (in the envelope and `CHANNELD_REDELIVERED`).
    pub fn mark_redelivered(&mut self) {
        self.redelivered = true;
        self.envelope.insert("redelivered".into(), serde_json::Value::Bool(true));
    }

    /// The envelope as written to stdin (one line, no newline).
    pub fn envelope_line(&self) -> Vec<u8> {
        serde_json::to_vec(&self.envelope).expect("a JSON map serializes")
    }
}

/// The live side of a run: effects go out at once, commands wait for their result.
pub trait RunIo: Send + Sync {
    /// Sends a live effect.
    fn effect(&self, effect: Effect);

    /// Presents a command and waits for the answer. Timeouts and disconnects answer
    /// `rejected`: commands fail closed.
    fn command(
        &self,
        command_id: Id,
        command: Command,
    ) -> impl Future<Output = CommandAnswer> + Send;

    /// Passes one step of the output on, in order (extension `stream`: to drivers that
    /// negotiated it; dropped for the others).
    fn stream(&self, item: StreamItem) -> impl Future<Output = ()> + Send;
}

/// One step of a run's output as it is produced (extension `stream`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// A piece of the reply (`{"type":"delta","text":…}`).
    Delta(String),
    /// A tool call report (`{"type":"tool","name":…,"status":…}`).
    Tool(ToolReport),
}

/// Why an agent run produced no output.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("agent could not be started: {0}")]
    Spawn(std::io::Error),
    #[error("agent exceeded its time limit of {0} s")]
    Timeout(u64),
    #[error("agent output exceeded {0} bytes")]
    OutputTooLarge(usize),
    #[error("agent exited with {status}{}", stderr_suffix(.stderr))]
    Failed { status: String, stderr: String },
    #[error("agent i/o failed: {0}")]
    Io(std::io::Error),
    /// The run was cancelled (extension `cancel`, control op `cancel`).
    #[error("the run was cancelled")]
    Aborted,
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.is_empty() { String::new() } else { format!(": {stderr}") }
}

impl ExecError {
    /// The wire code of the `error` frame sent to the driver.
    pub fn code(&self) -> &'static str {
        match self {
            ExecError::Timeout(_) => "agent_timeout",
            ExecError::OutputTooLarge(_) => "agent_output_too_large",
            ExecError::Aborted => "aborted",
            ExecError::Spawn(_) | ExecError::Failed { .. } | ExecError::Io(_) => "agent_failed",
        }
    }

    /// What a driver (and so possibly the platform) may be told: never stderr.
    pub fn public_message(&self) -> String {
        match self {
            ExecError::Failed { status, .. } => format!("agent exited with {status}"),
            other => other.to_string(),
        }
    }
}

/// What a run produced: its reply text, if it has one (nothing, only whitespace or only
/// actions is no reply).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecOutput {
    pub reply: Option<String>,
    /// The reply's metadata (an agent's `reply` line may carry it): goes to the driver in
    /// the reply's `message.metadata`.
    pub metadata: Metadata,
}

/// One line of agent output that is a JSON object with a known `type`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum AgentLine {
    Reply {
        text: String,
        /// Passed to the driver in the reply's metadata.
        #[serde(default)]
        metadata: Option<serde_json::Map<String, serde_json::Value>>,
    },
    /// A piece of the reply as it is produced (extension `stream`).
    Delta {
        text: String,
    },
    /// A tool call report (extension `stream`).
    Tool(ToolReport),
    Typing {
        active: bool,
    },
    Preview {
        text: String,
    },
    Effect {
        effect: Effect,
    },
    RequestInput {
        prompt: String,
        command_id: Option<Id>,
    },
    RequestApproval {
        tool: String,
        arguments: serde_json::Value,
        command_id: Option<Id>,
    },
    RequestChoice {
        question: String,
        choices: Vec<Choice>,
        #[serde(default)]
        multiple: bool,
        command_id: Option<Id>,
    },
    Notify {
        level: String,
        text: String,
        command_id: Option<Id>,
    },
    Invoke {
        name: String,
        payload: serde_json::Value,
        command_id: Option<Id>,
    },
}

/// What one line of agent output is (see PROTOCOL.md, "Agent contract").
#[derive(Debug)]
enum Output {
    /// Reply text: anything that is not a JSON object with a string `type`.
    Text,
    /// An action the hub carries out.
    Action(AgentLine),
    /// A JSON object with a string `type` the hub does not know, or a known one with missing
    /// or invalid fields: logged and ignored, never shown to the user.
    Unusable { kind: String, error: String },
}

/// Just the `type` of a JSON object line.
#[derive(Deserialize)]
struct Tagged {
    #[serde(rename = "type")]
    kind: String,
}

fn classify(line: &str) -> Output {
    let trimmed = line.trim();
    if !trimmed.starts_with('{') {
        return Output::Text;
    }
    match serde_json::from_str::<AgentLine>(trimmed) {
        Ok(action) => Output::Action(action),
        Err(err) => match serde_json::from_str::<Tagged>(trimmed) {
            Ok(Tagged { kind }) => Output::Unusable { kind, error: err.to_string() },
            Err(_) => Output::Text,
        },
    }
}

#[derive(Serialize)]
struct CommandResultLine<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    command_id: &'a str,
    result: &'a channeld_protocol::types::CommandResult,
    responder: Option<&'a channeld_protocol::types::Participant>,
}

/// Runs one agent process for `run` under `spec`, talking back through `io`; `cancel`
/// stops it ([`ExecError::Aborted`]: SIGTERM to its process group, SIGKILL after
/// [`CANCEL_GRACE`]).
pub async fn run(
    spec: &ExecSpec,
    run: &AgentRun,
    io: &impl RunIo,
    cancel: &CancellationToken,
) -> Result<ExecOutput, ExecError> {
    if cancel.is_cancelled() {
        return Err(ExecError::Aborted);
    }
    let mut child = spawn(spec, run).map_err(ExecError::Spawn)?;
    let pid = child.id();
    // A cancel stops reading the agent at once (nothing it writes afterwards is carried
    // out), then ends its process group.
    let result = tokio::select! {
        result = tokio::time::timeout(spec.timeout, converse(spec, run, io, &mut child, pid)) => {
            Some(result)
        }
        () = cancel.cancelled() => None,
    };
    match result {
        Some(Ok(Ok(output))) => Ok(output),
        Some(Ok(Err(err))) => {
            kill_group(pid, &mut child).await;
            Err(err)
        }
        Some(Err(_)) => {
            kill_group(pid, &mut child).await;
            Err(ExecError::Timeout(spec.timeout.as_secs()))
        }
        None => {
            terminate_group(pid, &mut child).await;
            Err(ExecError::Aborted)
        }
    }
}

/// A cancelled run's agent: SIGTERM to its process group, SIGKILL to the group once the
/// agent exited or [`CANCEL_GRACE`] passed (whatever it left behind goes too).
async fn terminate_group(pid: Option<u32>, child: &mut Child) {
    signal_group_with(pid, libc::SIGTERM);
    if tokio::time::timeout(CANCEL_GRACE, child.wait()).await.is_err() {
        debug!(?pid, "the agent outlived its grace period; killed");
    }
    kill_group(pid, child).await;
}

fn spawn(spec: &ExecSpec, run: &AgentRun) -> std::io::Result<Child> {
    let (program, args) = spec.command.split_first().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty agent command")
    })?;
    let mut command = tokio::process::Command::new(program);
    command.args(args).env_clear();
    for name in PASS_THROUGH_ENV {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
    let caps = run.capabilities.join(",");
    let socket = run.control_socket.as_str();
    command
        .envs(&run.metadata_env)
        .envs(&spec.env)
        .env("CHANNELD_CHANNEL_ID", &run.instance)
        .env("CHANNELD_SESSION", &run.session)
        .env("CHANNELD_RUN_ID", &run.run_id)
        .env("CHANNELD_CAPS", &caps)
        .env("CHANNELD_CONTROL_SOCKET", socket)
        .env("CHANNELD_REDELIVERED", if run.redelivered { "1" } else { "0" })
        .env("CHANNELD_LOCATOR", &run.locator)
        .env("CTX_CHANNEL_ID", &run.instance)
        .env("CTX_CHANNEL_SESSION", &run.session)
        .env("CTX_CHANNEL_CAPS", &caps)
        .env("CTX_CHANNEL_SOCKET", socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    // SAFETY: prctl and restore_in_child are async-signal-safe and touch no memory of the
    // parent.
    unsafe {
        command.pre_exec(|| {
            // The agent dies with its parent, even on SIGKILL: no run outlives it.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The agent runs under the policy the hub was started with.
            channeld_link::sched::restore_in_child()
        });
    }
    command.spawn()
}

async fn kill_group(pid: Option<u32>, child: &mut Child) {
    signal_group(pid);
    let _ = child.kill().await;
}

/// SIGKILL to the agent's process group (`pid` is its leader's, recorded at spawn: the
/// group outlives the leader, and the kernel does not reuse a pid while its group exists).
fn signal_group(pid: Option<u32>) {
    signal_group_with(pid, libc::SIGKILL);
}

fn signal_group_with(pid: Option<u32>, signal: i32) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: plain syscall; the group was created for this agent by process_group(0).
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

async fn converse(
    spec: &ExecSpec,
    run: &AgentRun,
    io: &impl RunIo,
    child: &mut Child,
    pid: Option<u32>,
) -> Result<ExecOutput, ExecError> {
    let mut stdin = child.stdin.take();
    let stdout = child.stdout.take().ok_or_else(|| ExecError::Io(missing("stdout")))?;
    let stderr = child.stderr.take().ok_or_else(|| ExecError::Io(missing("stderr")))?;
    // Read concurrently (a full stderr pipe would stall the agent); aborted if the run ends
    // early, so the reader never outlives its run.
    let stderr_task = AbortOnDropHandle::new(tokio::spawn(read_tail(stderr, STDERR_TAIL)));

    let mut line = run.envelope_line();
    line.push(b'\n');
    if let Some(pipe) = stdin.as_mut() {
        // An agent that never reads its stdin is allowed: ignore a broken pipe.
        if let Err(err) = pipe.write_all(&line).await {
            debug!(run_id = %run.run_id, error = %err, "agent did not read its envelope");
        }
    }
    if spec.stdin == StdinMode::Envelope {
        stdin = None;
    }

    let mut transcript = Transcript::default();
    let mut framer = LineFramer::new(spec.max_output_bytes.saturating_add(1).max(2));
    let mut reader = stdout;
    let mut total = 0usize;
    let mut commands = 0u32;
    // The run ends when the agent process exits, not when its stdout closes: a process it
    // left in the background may hold the pipe open for as long as it lives. What is already
    // written is read for up to `EXIT_DRAIN_GRACE` after the exit.
    let mut exited: Option<(ExitStatus, Instant)> = None;
    loop {
        while let Some(event) = framer.next_line() {
            let LineEvent::Line(raw) = event else {
                return Err(ExecError::OutputTooLarge(spec.max_output_bytes));
            };
            let text = String::from_utf8_lossy(raw).into_owned();
            handle_line(&text, run, io, &mut transcript, &mut stdin, &mut commands).await;
        }
        let drained_by = exited.map(|(_, at)| at + EXIT_DRAIN_GRACE);
        let read = tokio::select! {
            read = reader.read_buf(framer.buffer_for_read()) => read.map_err(ExecError::Io)?,
            status = child.wait(), if exited.is_none() => {
                exited = Some((status.map_err(ExecError::Io)?, Instant::now()));
                continue;
            }
            () = sleep_until(drained_by.unwrap_or_else(Instant::now)), if drained_by.is_some() => {
                debug!(run_id = %run.run_id, "the agent exited; a process it left behind still holds its stdout");
                break;
            }
        };
        if read == 0 {
            break;
        }
        total += read;
        if total > spec.max_output_bytes {
            return Err(ExecError::OutputTooLarge(spec.max_output_bytes));
        }
    }
    if let Some(rest) = framer.take_remainder() {
        let text = String::from_utf8_lossy(&rest).into_owned();
        handle_line(&text, run, io, &mut transcript, &mut stdin, &mut commands).await;
    }
    drop(stdin);
    let status = match exited {
        Some((status, _)) => status,
        None => child.wait().await.map_err(ExecError::Io)?,
    };
    // Whatever the agent left running ends with its run (and so releases its pipes).
    signal_group(pid);
    let stderr =
        tokio::time::timeout(EXIT_DRAIN_GRACE, stderr_task).await.ok().and_then(Result::ok);
    let stderr = stderr.unwrap_or_default();
    if !status.success() {
        return Err(ExecError::Failed { status: status.to_string(), stderr });
    }
    let metadata = std::mem::take(&mut transcript.metadata);
    Ok(ExecOutput { reply: transcript.reply(), metadata })
}

fn missing(what: &str) -> std::io::Error {
    std::io::Error::other(format!("agent {what} was not captured"))
}

/// Most bytes of reply metadata (as JSON) a run may carry; keys beyond are dropped.
const MAX_METADATA_BYTES: usize = 8 * 1024;

#[derive(Default)]
struct Transcript {
    replies: Vec<String>,
    plain: Vec<String>,
    metadata: Metadata,
}

impl Transcript {
    /// Adds a reply line's metadata: a string value as it is, any other as its JSON text;
    /// a later line's key wins. Keys that would take the whole past
    /// [`MAX_METADATA_BYTES`] are dropped.
    fn add_metadata(&mut self, run_id: &str, metadata: serde_json::Map<String, serde_json::Value>) {
        for (key, value) in metadata {
            let value = match value {
                serde_json::Value::String(text) => text,
                other => other.to_string(),
            };
            let mut next = self.metadata.clone();
            next.insert(key.clone(), value);
            if serde_json::to_vec(&next).map_or(usize::MAX, |json| json.len()) > MAX_METADATA_BYTES
            {
                warn!(run_id, %key, "reply metadata over {MAX_METADATA_BYTES} bytes; key dropped");
                continue;
            }
            self.metadata = next;
        }
    }
}

impl Transcript {
    /// Explicit `reply` lines win; otherwise the plain text lines are the reply.
    fn reply(self) -> Option<String> {
        let text = if self.replies.is_empty() {
            self.plain.join("\n").trim_end().to_owned()
        } else {
            self.replies.join("\n")
        };
        (!text.trim().is_empty()).then_some(text)
    }
}

async fn handle_line(
    line: &str,
    run: &AgentRun,
    io: &impl RunIo,
    transcript: &mut Transcript,
    stdin: &mut Option<ChildStdin>,
    commands: &mut u32,
) {
    let parsed = match classify(line) {
        Output::Text => {
            transcript.plain.push(line.trim_end_matches('\r').to_owned());
            return;
        }
        Output::Action(parsed) => parsed,
        Output::Unusable { kind, error } => {
            warn!(run_id = %run.run_id, action = %kind, %error, "agent wrote an action the hub does not understand; ignored");
            return;
        }
    };
    let (command, command_id) = match parsed {
        AgentLine::Reply { text, metadata } => {
            transcript.replies.push(text);
            if let Some(metadata) = metadata {
                transcript.add_metadata(&run.run_id, metadata);
            }
            return;
        }
        AgentLine::Delta { text } => return io.stream(StreamItem::Delta(text)).await,
        AgentLine::Tool(report) => return io.stream(StreamItem::Tool(report)).await,
        AgentLine::Typing { active } => return io.effect(Effect::Typing { active }),
        AgentLine::Preview { text } => return io.effect(Effect::Preview { text }),
        AgentLine::Effect { effect } => return io.effect(effect),
        AgentLine::RequestInput { prompt, command_id } => {
            (Command::RequestInput { prompt }, command_id)
        }
        AgentLine::RequestApproval { tool, arguments, command_id } => {
            (Command::RequestApproval { tool, arguments }, command_id)
        }
        AgentLine::RequestChoice { question, choices, multiple, command_id } => {
            (Command::RequestChoice { question, choices, multiple }, command_id)
        }
        AgentLine::Notify { level, text, command_id } => {
            (Command::Notify { level, text }, command_id)
        }
        AgentLine::Invoke { name, payload, command_id } => {
            (Command::Invoke { name, payload }, command_id)
        }
    };
    *commands += 1;
    let command_id = command_id.unwrap_or_else(|| {
        Id::new(format!("{}-c{}", run.run_id, commands)).expect("run ids are short")
    });
    let needs_answer = !matches!(command, Command::Notify { .. });
    if needs_answer && stdin.is_none() {
        warn!(
            run_id = %run.run_id,
            command = command.kind(),
            "agent asked for a command but its runtime has stdin = \"envelope\"; rejected"
        );
        return;
    }
    let answer: CommandAnswer = io.command(command_id.clone(), command).await;
    if let Some(pipe) = stdin.as_mut() {
        let line = CommandResultLine {
            kind: "command_result",
            command_id: command_id.as_str(),
            result: &answer.result,
            responder: answer.responder.as_ref(),
        };
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        if pipe.write_all(&bytes).await.is_err() {
            debug!(run_id = %run.run_id, "agent closed stdin before its command result");
        }
    }
}

async fn read_tail(mut pipe: impl AsyncRead + Unpin, keep: usize) -> String {
    let mut tail: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                tail.extend_from_slice(&chunk[..n]);
                if tail.len() > keep {
                    tail.drain(..tail.len() - keep);
                }
            }
        }
    }
    String::from_utf8_lossy(&tail).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The agent stdout parser: any line is text, an action or an unusable object, without
        /// panicking; a line that does not start with `{` (after spaces) is always text.
        #[test]
        fn fuzz_any_agent_line_is_classified(
            line in "\\PC{0,200}|\\{\"type\":\"(reply|typing|preview|effect|request_input|request_approval|delta|x)\"(,\"[a-z_]{1,10}\":(\"\\PC{0,20}\"|true|1|null|\\{\\}|\\[\\]))*\\}?"
        ) {
            let output = classify(&line);
            if !line.trim().starts_with('{') {
                proptest::prop_assert!(matches!(output, Output::Text));
            }
        }
    }

    #[test]
    fn only_json_objects_with_a_string_type_are_actions() {
        assert!(matches!(classify("hello"), Output::Text));
        assert!(matches!(classify("{\"answer\":42}"), Output::Text));
        assert!(matches!(classify("{\"type\":7}"), Output::Text));
        assert!(matches!(classify("{not json"), Output::Text));
        assert!(matches!(classify("[1,2]"), Output::Text));
        assert!(matches!(
            classify(" {\"type\":\"reply\",\"text\":\"hi\"}\r"),
            Output::Action(AgentLine::Reply { .. })
        ));
        match classify("{\"type\":\"thought\",\"text\":\"x\"}") {
            Output::Unusable { kind, .. } => assert_eq!(kind, "thought"),
            other => panic!("{other:?}"),
        }
        // A known type without its fields is no reply: it is reported, not shown.
        match classify("{\"type\":\"reply\"}") {
            Output::Unusable { kind, error } => {
                assert_eq!(kind, "reply");
                assert!(error.contains("text"), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn explicit_replies_win_and_blank_output_is_no_reply() {
        let mut transcript = Transcript::default();
        transcript.plain.push("thinking".into());
        transcript.replies.push("answer".into());
        assert_eq!(transcript.reply().as_deref(), Some("answer"));
        let blank = Transcript {
            replies: vec![],
            plain: vec!["   ".into(), String::new()],
            ..Transcript::default()
        };
        assert_eq!(blank.reply(), None);
        let empty_reply = Transcript {
            replies: vec![" ".into()],
            plain: vec!["x".into()],
            ..Transcript::default()
        };
        assert_eq!(empty_reply.reply(), None);
    }

    #[test]
    fn only_the_family_namespace_becomes_environment() {
        let metadata: Metadata = [
            ("env.BCN_BOT_UUID", "bot-1"),
            ("env.BCN_", "empty name"),
            ("env.PATH", "/evil"),
            ("env.LD_PRELOAD", "/evil.so"),
            ("env.CHANNELD_RUN_ID", "forged"),
            ("env.BCN_lower", "x"),
            ("env.BCN_NUL", "a\0b"),
            ("bcn.group_id", "grp"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(metadata_env("bcn", &metadata), [("BCN_BOT_UUID", "bot-1")]);
        assert!(metadata_env("mqtt", &metadata).is_empty());
    }

    #[test]
    fn a_run_keeps_only_its_family_environment_and_reads_the_locator() {
        let envelope = serde_json::json!({
            "version": AGENT_ENVELOPE_VERSION, "run_id": "r1", "redelivered": false,
            "instance": "bcn.main", "family": "bcn", "session": "s", "locator": "loc-1",
            "capabilities": [], "control_socket": "/run/x.sock",
        });
        let mut run = AgentRun::from_envelope(envelope).unwrap();
        assert_eq!((run.family.as_str(), run.locator.as_str()), ("bcn", "loc-1"));
        run.set_metadata_env([("BCN_BOT_UUID", "bot-1"), ("PATH", "/evil"), ("MQTT_X", "y")]);
        let env: Vec<_> = run.metadata_env().iter().collect();
        assert_eq!(env, [(&"BCN_BOT_UUID".to_owned(), &"bot-1".to_owned())]);
    }

    #[test]
    fn deltas_tools_and_reply_metadata_are_actions() {
        assert!(matches!(
            classify(r#"{"type":"delta","text":"Hel"}"#),
            Output::Action(AgentLine::Delta { text }) if text == "Hel"
        ));
        match classify(r#"{"type":"tool","name":"search","status":"done","took_ms":5}"#) {
            Output::Action(AgentLine::Tool(report)) => {
                assert_eq!((report.name.as_str(), report.status.as_str()), ("search", "done"));
                assert_eq!(report.rest.get("took_ms"), Some(&serde_json::json!(5)));
                assert!(!report.rest.contains_key("type"));
            }
            other => panic!("{other:?}"),
        }
        let line = r#"{"type":"reply","text":"ok","metadata":{"routing":{"to":"b"},"tag":"x"}}"#;
        let Output::Action(AgentLine::Reply { metadata: Some(metadata), .. }) = classify(line)
        else {
            panic!("a reply with metadata");
        };
        let mut transcript = Transcript::default();
        transcript.add_metadata("run-1", metadata);
        assert_eq!(transcript.metadata.get("routing").map(String::as_str), Some(r#"{"to":"b"}"#));
        assert_eq!(transcript.metadata.get("tag").map(String::as_str), Some("x"));
        let mut big = serde_json::Map::new();
        big.insert("huge".into(), serde_json::Value::String("x".repeat(MAX_METADATA_BYTES)));
        transcript.add_metadata("run-1", big);
        assert!(!transcript.metadata.contains_key("huge"));
    }
}
