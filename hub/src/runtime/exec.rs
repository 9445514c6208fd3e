//! The exec runtime: one agent process per run on the hub's machine, under the agent contract
//! of `channeld-agent-exec` (PROTOCOL.md, "Agent contract"). The envelope (full or body-free,
//! by the runtime's `wake`) and the environment from the inbound's metadata are built here,
//! once, for this runtime and the `amqp` one.

use std::path::Path;

use channeld_agent_exec::{AgentRun, ExecSpec};
use channeld_protocol::Id;
use channeld_protocol::types::Participant;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{
    AGENT_ENVELOPE_VERSION, RunError, RunInput, RunIo, RunOutput, RunRequest, metadata_env,
};
use crate::config::{RuntimeConfig, Wake};

#[derive(Serialize)]
struct Envelope<'a> {
    version: &'static str,
    run_id: &'a str,
    redelivered: bool,
    instance: &'a str,
    family: &'a str,
    session: &'a str,
    event_id: &'a str,
    locator: &'a str,
    #[serde(flatten)]
    body: Body<'a>,
    capabilities: Vec<&'static str>,
    actions: Vec<&'static str>,
    control_socket: &'a Path,
}

/// What the envelope says about the inbound, by the runtime's `wake`.
#[derive(Serialize)]
#[serde(untagged)]
enum Body<'a> {
    /// The whole message or event and its sender.
    Full {
        #[serde(flatten)]
        input: &'a RunInput,
        sender: Option<&'a Participant>,
    },
    /// Structural ids only: nothing a sender wrote reaches the agent's prompt unmarked.
    BodyFree {
        wake: &'static str,
        kind: &'static str,
        conversation: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        thread: Option<&'a str>,
        sender: Option<SenderId<'a>>,
    },
}

/// A sender as a body-free envelope names it: the platform id, no names.
#[derive(Serialize)]
struct SenderId<'a> {
    id: &'a str,
}

fn body(wake: Wake, request: &RunRequest) -> Body<'_> {
    match wake {
        Wake::Full => Body::Full { input: &request.input, sender: request.sender.as_ref() },
        Wake::BodyFree => {
            let (kind, target) = match &request.input {
                RunInput::Message { message } => ("message", &message.target),
                RunInput::Event { event } => ("event", &event.context().target),
            };
            Body::BodyFree {
                wake: "body_free",
                kind,
                conversation: target.conversation.as_str(),
                thread: target.thread.as_ref().map(Id::as_str),
                sender: request.sender.as_ref().map(|p| SenderId { id: p.id.as_str() }),
            }
        }
    }
}

/// The `channeld.agent/v1` envelope of `request` under `config`'s `wake`, with the
/// environment from the inbound's metadata.
pub(super) fn agent_run(
    config: &RuntimeConfig,
    request: &RunRequest,
) -> Result<AgentRun, RunError> {
    let locator = request.locator.encode();
    let envelope = Envelope {
        version: AGENT_ENVELOPE_VERSION,
        run_id: &request.run_id,
        redelivered: request.redelivered,
        instance: request.instance.as_str(),
        family: request.instance.family(),
        session: request.session.as_str(),
        event_id: request.event_id.as_str(),
        locator: &locator,
        body: body(config.wake, request),
        capabilities: request.capabilities.enabled(),
        actions: request.actions.enabled(),
        control_socket: &request.control_socket,
    };
    let value =
        serde_json::to_value(&envelope).map_err(|err| RunError::Envelope(err.to_string()))?;
    let mut run =
        AgentRun::from_envelope(value).map_err(|err| RunError::Envelope(err.to_string()))?;
    let from_metadata = match &request.input {
        RunInput::Message { message } => metadata_env(request.instance.family(), &message.metadata),
        _ => Vec::new(),
    };
    // The driver's `agent_env` over the inbound's metadata: later entries win.
    let from_driver = request.agent_env.iter().map(|(name, value)| (name.as_str(), value.as_str()));
    run.set_metadata_env(from_metadata.into_iter().chain(from_driver));
    Ok(run)
}

/// The command and limits of an exec runtime.
pub(super) fn spec(config: &RuntimeConfig) -> ExecSpec {
    ExecSpec {
        command: config.command.clone(),
        env: config.env.clone(),
        timeout: config.timeout,
        max_output_bytes: config.max_output_bytes,
        stdin: config.stdin,
    }
}

pub(super) async fn run(
    config: &RuntimeConfig,
    request: &RunRequest,
    io: &impl RunIo,
    cancel: &CancellationToken,
) -> Result<RunOutput, RunError> {
    let run = agent_run(config, request)?;
    let output = channeld_agent_exec::run(&spec(config), &run, io, cancel).await?;
    Ok(RunOutput { reply: output.reply, metadata: output.metadata })
}
