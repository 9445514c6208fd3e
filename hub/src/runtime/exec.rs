//! The exec runtime: one agent process per run on the hub's machine, under the agent contract
//! of `channeld-agent-exec` (PROTOCOL.md, "Agent contract"). The envelope is built here,
//! once, for this runtime and the `amqp` one.

use std::path::Path;

use channeld_agent_exec::{AgentRun, ExecSpec};
use channeld_protocol::types::Participant;
use serde::Serialize;

use super::{AGENT_ENVELOPE_VERSION, RunError, RunInput, RunIo, RunOutput, RunRequest};
use crate::config::RuntimeConfig;

#[derive(Serialize)]
struct Envelope<'a> {
    version: &'static str,
    run_id: &'a str,
    redelivered: bool,
    instance: &'a str,
    family: &'a str,
    session: &'a str,
    event_id: &'a str,
    #[serde(flatten)]
    input: &'a RunInput,
    sender: Option<&'a Participant>,
    capabilities: Vec<&'static str>,
    actions: Vec<&'static str>,
    control_socket: &'a Path,
}

/// The `channeld.agent/v1` envelope of `request`.
pub(super) fn agent_run(request: &RunRequest) -> Result<AgentRun, RunError> {
    let envelope = Envelope {
        version: AGENT_ENVELOPE_VERSION,
        run_id: &request.run_id,
        redelivered: request.redelivered,
        instance: request.instance.as_str(),
        family: request.instance.family(),
        session: &request.session,
        event_id: request.event_id.as_str(),
        input: &request.input,
        sender: request.sender.as_ref(),
        capabilities: request.capabilities.enabled(),
        actions: request.actions.enabled(),
        control_socket: &request.control_socket,
    };
    let value =
        serde_json::to_value(&envelope).map_err(|err| RunError::Envelope(err.to_string()))?;
    AgentRun::from_envelope(value).map_err(|err| RunError::Envelope(err.to_string()))
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
) -> Result<RunOutput, RunError> {
    let run = agent_run(request)?;
    let output = channeld_agent_exec::run(&spec(config), &run, io).await?;
    Ok(RunOutput { reply: output.reply })
}
