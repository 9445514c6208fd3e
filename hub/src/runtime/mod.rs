//! Runtimes: who answers an inbound run. `echo` is built in; `exec` runs an agent command.
//!
//! A runtime sees a [`RunRequest`] and talks back through [`RunIo`] (live effects and
//! commands, routed to the connection that carried the inbound); its result is the reply.

mod echo;
mod exec;

use std::future::Future;
use std::path::PathBuf;

use channeld_protocol::ext::ToolReport;
use channeld_protocol::types::{
    Actions, Capabilities, Command, Effect, InboundMessage, IncomingEvent, Metadata, Participant,
};
use channeld_protocol::{ChannelId, Id};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{RuntimeConfig, RuntimeKind};

pub use channeld_protocol::types::CommandAnswer;
pub use exec::AGENT_ENVELOPE_VERSION;

/// What a run answers.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RunInput {
    Message { message: InboundMessage },
    Event { event: IncomingEvent },
}

/// One run of a runtime for one inbound.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub instance: ChannelId,
    pub run_id: String,
    pub session: String,
    pub event_id: Id,
    pub input: RunInput,
    pub sender: Option<Participant>,
    pub capabilities: Capabilities,
    pub actions: Actions,
    /// True when this run was cut off by a crash and is being started again.
    pub redelivered: bool,
    pub control_socket: PathBuf,
    /// The inbound's locator (for `read`, `respond`, `complete`).
    pub locator: String,
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunOutput {
    /// The reply text, if the run has one.
    pub reply: Option<String>,
    /// The reply's metadata (an agent's `reply` line may carry it): goes to the driver in
    /// the reply's `message.metadata`.
    pub metadata: Metadata,
}

/// One step of a run's output as it is produced (extension `stream`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// A piece of the reply (`{"type":"delta","text":…}`).
    Delta(String),
    /// A tool call report (`{"type":"tool","name":…,"status":…}`).
    Tool(ToolReport),
}

/// The live side of a run: effects go out at once, commands wait for their result.
pub trait RunIo: Send + Sync {
    /// Sends a live effect (gated by the driver's declared actions; undeclared progress is
    /// dropped).
    fn effect(&self, effect: Effect);

    /// Presents a command on the originating connection and waits for the answer. Timeouts
    /// and disconnects answer `rejected`: commands fail closed.
    fn command(
        &self,
        command_id: Id,
        command: Command,
    ) -> impl Future<Output = CommandAnswer> + Send;

    /// Passes one step of the output on, in order (to drivers that negotiated `stream`;
    /// dropped for the others).
    fn stream(&self, item: StreamItem) -> impl Future<Output = ()> + Send;
}

/// Why a run produced no reply.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
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
    /// The run ended without reply text (nothing, only whitespace, a `reply` without text).
    #[error("agent produced no reply")]
    EmptyReply,
    /// The run was cancelled (extension `cancel`, control op `cancel`).
    #[error("the run was cancelled")]
    Aborted,
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.is_empty() { String::new() } else { format!(": {stderr}") }
}

impl RunError {
    /// The wire code of the `error` frame sent to the driver.
    pub fn code(&self) -> &'static str {
        match self {
            RunError::Timeout(_) => "agent_timeout",
            RunError::OutputTooLarge(_) => "agent_output_too_large",
            RunError::EmptyReply => "empty_reply",
            RunError::Aborted => "aborted",
            RunError::Spawn(_) | RunError::Failed { .. } | RunError::Io(_) => "agent_failed",
        }
    }
}

/// Runs `request` on the configured runtime; `cancel` stops it (`RunError::Aborted`).
pub async fn run(
    config: &RuntimeConfig,
    request: &RunRequest,
    io: &impl RunIo,
    cancel: &CancellationToken,
) -> Result<RunOutput, RunError> {
    if cancel.is_cancelled() {
        return Err(RunError::Aborted);
    }
    match config.kind {
        RuntimeKind::Echo => Ok(echo::run(request)),
        RuntimeKind::Exec => exec::run(config, request, io, cancel).await,
    }
}
