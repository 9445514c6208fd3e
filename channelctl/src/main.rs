//! `channelctl`: talks to a running hub over its control socket.
//!
//! Exit status: 0 success; 1 unexpected error; 2 usage; 3 hub unreachable (no socket, or the
//! hub refused this process or has no room for another control connection); 4 refused
//! (unknown instance, driver offline, capability not declared, invalid input); 5 outcome
//! unknown (handed to the driver, no receipt in time); 6 the driver reported a failed send;
//! 7 queued (the driver is offline; the hub sends it when the driver connects).
//!
//! It depends on `channeld-control` (the protocol types) only, never on the hub: it links
//! no SQLite.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use channeld_control::{
    CatalogResult, HealthResult, InstanceStatus, Op, OutboxEntry, OutboxResult, Request, Response,
    SendResult, StatusResult, code,
};
use channeld_protocol::framing::{LineEvent, LineFramer};
use channeld_protocol::types::Health;
use clap::{Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

#[derive(Debug, Parser)]
#[command(name = "channelctl", version, about = "Control a running channeld hub")]
struct Cli {
    /// The hub's control socket.
    #[arg(long, global = true, env = "CHANNELD_CONTROL_SOCKET")]
    socket: Option<PathBuf>,
    /// Print the hub's JSON result instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum OutboxCmd {
    /// Send an `unknown` or `failed` record again (it may post a second copy).
    Retry { id: i64 },
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Send a proactive message and print its receipt.
    Send {
        /// Channel instance, e.g. slack.primary.
        instance: String,
        #[arg(long)]
        conversation: String,
        #[arg(long)]
        thread: Option<String>,
        /// Return once the driver has the message instead of waiting for the receipt.
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait for the receipt.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// Sending again with the same key never posts twice: the first send's record answers.
        #[arg(long)]
        key: Option<String>,
        /// The message text.
        text: String,
    },
    /// List outbox records (newest first), or retry one.
    Outbox {
        /// Only this instance.
        #[arg(long)]
        instance: Option<String>,
        /// Only this state: queued, sent, receipted, failed, unknown.
        #[arg(long)]
        state: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[command(subcommand)]
        action: Option<OutboxCmd>,
    },
    /// Ask an instance's driver for its health.
    Health { instance: String },
    /// Every instance: connection, health, in-flight runs, counters, last error.
    Status,
    /// Driver families this build knows.
    Catalog,
}

const EXIT_UNEXPECTED: u8 = 1;
const EXIT_UNREACHABLE: u8 = 3;
const EXIT_REFUSED: u8 = 4;
const EXIT_UNKNOWN: u8 = 5;
const EXIT_FAILED: u8 = 6;
const EXIT_QUEUED: u8 = 7;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let socket = cli.socket.clone().unwrap_or_else(default_socket);
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("channelctl: {err}");
            return ExitCode::from(EXIT_UNEXPECTED);
        }
    };
    let (op, wait_budget) = match &cli.command {
        Cmd::Send { instance, conversation, thread, no_wait, timeout, key, text } => (
            Op::Send {
                instance: instance.clone(),
                conversation: conversation.clone(),
                thread: thread.clone(),
                text: text.clone(),
                metadata: Default::default(),
                wait: !no_wait,
                timeout_ms: Some(timeout.saturating_mul(1000)),
                idempotency_key: key.clone(),
            },
            Duration::from_secs(timeout + 10),
        ),
        Cmd::Health { instance } => {
            (Op::Health { instance: instance.clone() }, Duration::from_secs(60))
        }
        Cmd::Status => (Op::Status, Duration::from_secs(10)),
        Cmd::Catalog => (Op::Catalog, Duration::from_secs(10)),
        Cmd::Outbox { action: Some(OutboxCmd::Retry { id }), .. } => {
            (Op::OutboxRetry { id: *id }, Duration::from_secs(60))
        }
        Cmd::Outbox { instance, state, limit, action: None } => (
            Op::Outbox { instance: instance.clone(), state: state.clone(), limit: Some(*limit) },
            Duration::from_secs(10),
        ),
    };
    let response = match runtime.block_on(call(&socket, Request { id: 1, op }, wait_budget)) {
        Ok(response) => response,
        Err(err) => {
            eprintln!("channelctl: {err}");
            return ExitCode::from(err.exit_code());
        }
    };
    if !response.ok {
        let error = response.error.unwrap_or_else(|| channeld_control::ErrorBody {
            code: "unknown".into(),
            message: "the hub gave no reason".into(),
            request_id: None,
        });
        if cli.json {
            println!("{}", serde_json::json!({ "ok": false, "error": error }));
        } else {
            eprintln!("channelctl: {} ({})", error.message, error.code);
        }
        return ExitCode::from(exit_code(&error.code));
    }
    let result = response.result.unwrap_or(serde_json::Value::Null);
    let queued = matches!(cli.command, Cmd::Send { .. })
        && result.get("state").and_then(|s| s.as_str()) == Some("queued");
    let success = if queued { ExitCode::from(EXIT_QUEUED) } else { ExitCode::SUCCESS };
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&result).unwrap_or_default());
        return success;
    }
    match print_text(&cli.command, result) {
        Ok(()) => success,
        Err(err) => {
            eprintln!("channelctl: unexpected answer from the hub: {err}");
            ExitCode::from(EXIT_UNEXPECTED)
        }
    }
}

/// The exit status for a hub's error code.
fn exit_code(error_code: &str) -> u8 {
    match error_code {
        code::OUTCOME_UNKNOWN => EXIT_UNKNOWN,
        code::SEND_FAILED => EXIT_FAILED,
        code::UNKNOWN_INSTANCE
        | code::DRIVER_OFFLINE
        | code::NOT_DECLARED
        | code::INVALID_TARGET
        | code::INVALID_REQUEST
        | code::TOO_LARGE => EXIT_REFUSED,
        // The hub is there but will not serve this process (now): as unreachable as a socket
        // whose file mode refuses it.
        code::PEER_NOT_ALLOWED | code::TOO_MANY_CONNECTIONS => EXIT_UNREACHABLE,
        _ => EXIT_UNEXPECTED,
    }
}

fn default_socket() -> PathBuf {
    let dir = std::env::var_os("CHANNELD_RUNTIME_DIR")
        .map_or_else(|| PathBuf::from("/run/channeld"), PathBuf::from);
    dir.join("control.sock")
}

#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("cannot reach the hub at {path}: {source}")]
    Unreachable { path: String, source: std::io::Error },
    #[error("connection to the hub failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the hub closed the connection without answering")]
    NoAnswer,
    #[error("no answer from the hub within {0} s")]
    Timeout(u64),
    #[error("unreadable answer from the hub: {0}")]
    Decode(String),
}

impl CallError {
    fn exit_code(&self) -> u8 {
        match self {
            CallError::Unreachable { .. } => EXIT_UNREACHABLE,
            CallError::Timeout(_) => EXIT_UNKNOWN,
            _ => EXIT_UNEXPECTED,
        }
    }
}

async fn call(
    socket: &std::path::Path,
    request: Request,
    budget: Duration,
) -> Result<Response, CallError> {
    let mut stream = UnixStream::connect(socket)
        .await
        .map_err(|source| CallError::Unreachable { path: socket.display().to_string(), source })?;
    let mut line =
        serde_json::to_vec(&request).map_err(|err| CallError::Decode(err.to_string()))?;
    line.push(b'\n');
    // A hub that refuses this process answers before reading and closes, so the write may
    // fail with a broken pipe: the refusal is still there to read, and it says more.
    let written = stream.write_all(&line).await;
    let read = async {
        let mut framer = LineFramer::new(channeld_control::MAX_CONTROL_LINE);
        loop {
            if let Some(event) = framer.next_line() {
                return match event {
                    LineEvent::Line(line) => serde_json::from_slice::<Response>(line)
                        .map_err(|err| CallError::Decode(err.to_string())),
                    LineEvent::TooLong => Err(CallError::Decode("answer too long".into())),
                };
            }
            if stream.read_buf(framer.buffer_for_read()).await? == 0 {
                return Err(CallError::NoAnswer);
            }
        }
    };
    let answer = tokio::time::timeout(budget, read)
        .await
        .map_err(|_| CallError::Timeout(budget.as_secs()))?;
    match (answer, written) {
        (Ok(response), _) => Ok(response),
        (Err(_), Err(err)) => Err(CallError::Io(err)),
        (Err(err), Ok(())) => Err(err),
    }
}

fn print_text(command: &Cmd, result: serde_json::Value) -> Result<(), serde_json::Error> {
    match command {
        Cmd::Send { .. } => {
            let sent: SendResult = serde_json::from_value(result)?;
            match sent.receipt {
                Some(receipt) => {
                    println!("receipted {} (request {})", receipt.message_id, sent.request_id)
                }
                None => println!("{} (request {})", sent.state, sent.request_id),
            }
        }
        Cmd::Health { .. } => {
            let health: HealthResult = serde_json::from_value(result)?;
            match health_reason(&health.health).as_str() {
                "" => println!("{} {}", health.instance, health.health.state.as_str()),
                reason => {
                    println!("{} {}: {reason}", health.instance, health.health.state.as_str())
                }
            }
        }
        Cmd::Status => print_status(&serde_json::from_value::<StatusResult>(result)?),
        Cmd::Outbox { action: Some(_), .. } => {
            let entry: OutboxEntry = serde_json::from_value(result)?;
            println!("{} {} ({})", entry.id, entry.state, entry.request_id);
        }
        Cmd::Outbox { action: None, .. } => {
            let list: OutboxResult = serde_json::from_value(result)?;
            println!(
                "{:>6} {:<20} {:<10} {:<20} {:<24} TEXT",
                "ID", "INSTANCE", "STATE", "CONVERSATION", "RECEIPT / ERROR"
            );
            for r in list.records {
                let detail = match (&r.receipt, &r.error) {
                    (Some(receipt), _) => receipt.message_id.to_string(),
                    (None, Some(error)) => error.clone(),
                    _ => String::new(),
                };
                let text: String = r.text.chars().take(40).collect();
                println!(
                    "{:>6} {:<20} {:<10} {:<20} {:<24} {}",
                    r.id, r.instance, r.state, r.conversation, detail, text
                );
            }
        }
        Cmd::Catalog => {
            let catalog: CatalogResult = serde_json::from_value(result)?;
            println!("{:<10} {:<18} {:<10} TRANSPORT", "FAMILY", "BINARY", "INSTALLED");
            for family in catalog.families {
                let installed = if family.installed { "yes" } else { "no" };
                println!(
                    "{:<10} {:<18} {:<10} {}",
                    family.family, family.binary, installed, family.transport
                );
            }
        }
    }
    Ok(())
}

fn print_status(status: &StatusResult) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    println!("{} (pid {}), up {}", status.hub, status.pid, ago(now, status.started_ms));
    println!(
        "{:<20} {:<8} {:<10} {:<12} {:>4} {:>8} {:>8} {:>7} {:>6}  REASON / LAST ERROR",
        "INSTANCE",
        "FAMILY",
        "CONNECTED",
        "HEALTH",
        "RUNS",
        "INBOUND",
        "OUTBOUND",
        "DENIED",
        "ERRORS"
    );
    for row in &status.instances {
        let connected =
            row.connected_since_ms.map_or_else(|| "-".to_owned(), |since| ago(now, since));
        let reason = match process_note(row) {
            Some(note) => format!("{note}; {}", health_reason(&row.health)),
            None => health_reason(&row.health),
        };
        let last =
            row.last_error.as_deref().map(|e| format!(" | last error: {e}")).unwrap_or_default();
        println!(
            "{:<20} {:<8} {:<10} {:<12} {:>4} {:>8} {:>8} {:>7} {:>6}  {}{}",
            row.instance,
            row.family,
            connected,
            row.health.state.as_str(),
            row.in_flight,
            row.counters.inbound,
            row.counters.outbound,
            row.counters.denied,
            row.counters.errors,
            reason,
            last
        );
    }
}

/// What an operator must know about a supervised driver process that is not running.
fn process_note(row: &InstanceStatus) -> Option<String> {
    let process = row.driver_process.as_ref()?;
    match process.state.as_str() {
        "running" => None,
        state => Some(match &process.last_exit {
            Some(exit) => format!("driver process {state} ({exit})"),
            None => format!("driver process {state}"),
        }),
    }
}

/// The driver's free-text detail, then its structured status (extension `health_status`)
/// when it sent one, e.g. `broker unreachable [transport=connecting auth=ok idle=42s]`.
fn health_reason(health: &Health) -> String {
    let mut fields = Vec::new();
    if let Some(status) = &health.status {
        if let Some(transport) = &status.transport {
            fields.push(format!("transport={transport}"));
        }
        if let Some(auth) = &status.auth {
            fields.push(format!("auth={auth}"));
        }
        if let Some(idle) = status.idle_seconds {
            fields.push(format!("idle={idle}s"));
        }
        if let Some(backlog) = status.backlog {
            fields.push(format!("backlog={backlog}"));
        }
        if let Some(attempt) = status.attempt {
            fields.push(format!("attempt={attempt}"));
        }
    }
    let detail = health.detail.as_deref().unwrap_or_default();
    match (detail.is_empty(), fields.is_empty()) {
        (_, true) => detail.to_owned(),
        (true, false) => format!("[{}]", fields.join(" ")),
        (false, false) => format!("{detail} [{}]", fields.join(" ")),
    }
}

fn ago(now_ms: u64, then_ms: u64) -> String {
    let secs = now_ms.saturating_sub(then_ms) / 1000;
    match secs {
        0..=59 => format!("{secs}s"),
        60..=3599 => format!("{}m{}s", secs / 60, secs % 60),
        _ => format!("{}h{}m", secs / 3600, (secs % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use channeld_protocol::types::{HealthState, HealthStatus};

    use super::*;

    #[test]
    fn health_reason_shows_detail_and_structured_status() {
        let mut health = Health::new(HealthState::Degraded, Some("broker unreachable".into()));
        assert_eq!(health_reason(&health), "broker unreachable");
        health.status = Some(HealthStatus {
            transport: Some("connecting".into()),
            auth: Some("rejected".into()),
            idle_seconds: Some(42),
            backlog: Some(3),
            attempt: Some(5),
            reason: None,
        });
        assert_eq!(
            health_reason(&health),
            "broker unreachable [transport=connecting auth=rejected idle=42s backlog=3 attempt=5]"
        );
        health.detail = None;
        assert_eq!(
            health_reason(&health),
            "[transport=connecting auth=rejected idle=42s backlog=3 attempt=5]"
        );
    }

    #[test]
    fn refused_peers_and_a_full_hub_exit_as_unreachable_and_known_codes_keep_their_status() {
        assert_eq!(exit_code("peer_not_allowed"), EXIT_UNREACHABLE);
        assert_eq!(exit_code("too_many_connections"), EXIT_UNREACHABLE);
        assert_eq!(exit_code("outcome_unknown"), EXIT_UNKNOWN);
        assert_eq!(exit_code("send_failed"), EXIT_FAILED);
        for refused in ["unknown_instance", "driver_offline", "not_declared", "invalid_target"] {
            assert_eq!(exit_code(refused), EXIT_REFUSED, "{refused}");
        }
        assert_eq!(exit_code("invalid_request"), EXIT_REFUSED);
        assert_eq!(exit_code("too_large"), EXIT_REFUSED);
        assert_eq!(exit_code("ledger_unavailable"), EXIT_UNEXPECTED);
    }

    #[test]
    fn a_stopped_driver_process_is_named_in_the_status_reason() {
        let row: InstanceStatus = serde_json::from_value(serde_json::json!({
            "instance": "a.b", "family": "a", "socket": "/s", "runtime": "default",
            "connected": false, "health": {"state": "Unavailable"}, "health_updated_ms": 0,
            "in_flight": 0, "counters": {"inbound": 0, "denied": 0, "busy": 0, "replies": 0,
            "runs_failed": 0, "outbound": 0, "receipts": 0, "errors": 0},
            "driver_process": {"state": "stopped", "starts": 1, "last_exit": "exit status: 78"}
        }))
        .unwrap();
        assert_eq!(process_note(&row).as_deref(), Some("driver process stopped (exit status: 78)"));
    }
}
