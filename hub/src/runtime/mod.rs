//! Runtimes: who answers an inbound run. `echo` is built in; `exec` runs an agent command.
//!
//! A runtime sees a [`RunRequest`] and talks back through [`RunIo`] (live effects and
//! commands, routed to the connection that carried the inbound); its result is the reply.

mod amqp;
mod echo;
mod exec;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use channeld_protocol::types::{
    Actions, Capabilities, InboundMessage, IncomingEvent, Metadata, Participant,
};
use channeld_protocol::{ChannelId, Id};
use serde::Serialize;

use crate::cancels::RunCancel;
use crate::config::{RuntimeConfig, RuntimeKind};
use crate::locator::Unspelled;

pub use amqp::Remote;
pub use channeld_agent_exec::{
    AGENT_ENVELOPE_VERSION, CANCEL_GRACE, ExecError, METADATA_ENV_PREFIX, RunIo, StreamItem,
    metadata_env,
};
pub use channeld_protocol::types::CommandAnswer;

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
    pub session: Id,
    pub event_id: Id,
    pub input: RunInput,
    pub sender: Option<Participant>,
    pub capabilities: Capabilities,
    pub actions: Actions,
    /// True when this run was cut off by a crash and is being started again.
    pub redelivered: bool,
    /// The hub's control socket, one copy shared by every run.
    pub control_socket: Arc<Path>,
    /// The inbound's locator (for `read`, `respond`, `complete`), spelled by the runtimes
    /// that hand it to an agent.
    pub locator: Unspelled,
    /// The environment the instance's driver gave its runs (extension `agent_env`), checked
    /// when it was set; over the inbound's metadata environment.
    pub agent_env: Arc<BTreeMap<String, String>>,
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

/// Why a run produced no reply.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The agent process (exec runtime) failed.
    #[error(transparent)]
    Exec(ExecError),
    /// The run ended without reply text (nothing, only whitespace, a `reply` without text).
    #[error("agent produced no reply")]
    EmptyReply,
    /// The run's envelope could not be built.
    #[error("run envelope: {0}")]
    Envelope(String),
    /// A worker ran the agent and reported this failure (`code` is the exec error code).
    #[error("{message}")]
    Remote { code: String, message: String },
    /// The run could not be handed to the run queue before its deadline.
    #[error("the run queue is unavailable: {0}")]
    Unavailable(String),
    /// No worker reported a result before the runtime's `timeout_secs`.
    #[error("no result from a worker within {0} s")]
    Timeout(u64),
    /// The run was cancelled (extension `cancel`, control op `cancel`).
    #[error("the run was cancelled")]
    Aborted,
}

impl From<ExecError> for RunError {
    fn from(err: ExecError) -> Self {
        match err {
            ExecError::Aborted => RunError::Aborted,
            other => RunError::Exec(other),
        }
    }
}

impl RunError {
    /// The wire code of the `error` frame sent to the driver.
    pub fn code(&self) -> &str {
        match self {
            RunError::Exec(err) => err.code(),
            RunError::EmptyReply => "empty_reply",
            RunError::Remote { code, .. } => code,
            RunError::Timeout(_) => "agent_timeout",
            RunError::Aborted => "aborted",
            RunError::Envelope(_) | RunError::Unavailable(_) => "agent_failed",
        }
    }

    /// What the driver (and so possibly the platform) is told: no stderr.
    pub fn public_message(&self) -> String {
        match self {
            RunError::Exec(err) => err.public_message(),
            other => other.to_string(),
        }
    }
}

/// Runs `request` on the configured runtime; `cancel` stops it (`RunError::Aborted`). Only
/// a runtime that waits asks for its token.
pub async fn run(
    remote: &Remote,
    config: &RuntimeConfig,
    request: &RunRequest,
    io: &impl RunIo,
    cancel: &RunCancel,
) -> Result<RunOutput, RunError> {
    if cancel.is_cancelled() {
        return Err(RunError::Aborted);
    }
    // Boxed: inline, their state machines (kilobytes) would size every run's task, echo runs
    // included, and spawning copies a task's whole future several times (measured: a sixth
    // of the hub's CPU per inbound went to those copies). A box per agent process or broker
    // round trip costs nothing next to the run itself.
    match config.kind {
        RuntimeKind::Echo => Ok(echo::run(request)),
        RuntimeKind::Exec => Box::pin(exec::run(config, request, io, cancel.token())).await,
        RuntimeKind::Amqp => Box::pin(amqp::run(remote, config, request, io, cancel.token())).await,
    }
}
