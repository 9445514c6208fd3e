//! `channelctl`: talks to a running hub over its control socket.
//!
//! Exit status: 0 success; 1 unexpected error; 2 usage; 3 hub unreachable (no socket, or the
//! hub refused this process or has no room for another control connection); 4 refused
//! (unknown instance, driver offline, capability not declared, invalid input, no such outbox
//! record, a record that cannot be retried); 5 outcome
//! unknown (handed to the driver, no receipt in time); 6 the driver reported a failed send;
//! 7 queued (the driver is offline; the hub sends it when the driver connects); 8 conflict
//! (the idempotency key was already used for a different message); 9 `health`: the
//! instance is Unavailable (no driver, or it does not answer); 10 storage full (the hub's
//! ledger has no space left: nothing was recorded or sent; retry once space returns).
//! `replies retry` exits 0 once the
//! reply is pending again, 4 when there is no such reply or it cannot be retried.
//! `action`/`resume`: 4 refused by the hub (no driver connected, name not declared), 6 the
//! driver answered it failed, 5 no answer in time. `history`: 4 when the instance keeps no
//! history (`history_off`) or is unknown. `cancel`: 0 cancelled or already ended (the output
//! says which), 4 unknown event.
//!
//! With `--amqp URL|env:NAME`, `send` goes through the hub's RabbitMQ send queue instead
//! (`amqp.rs`) and exits alike; 3 then means the broker or the queue is unreachable, 5 no
//! outcome in time (the send stays queued: repeat it with the same `--key`).
//!
//! It depends on `channeld-control` (the protocol types) and lapin, never on the hub: it
//! links no SQLite.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use channeld_control::{Op, Request, Response, SendArgs, StatusResult, code};
use channeld_protocol::framing::{LineEvent, LineFramer};
use clap::{Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

mod amqp;
mod manifest;
mod mcp;
mod print;

use print::print_text;

#[derive(Debug, Parser)]
#[command(name = "channelctl", version, about = "Control a running channeld hub")]
struct Cli {
    /// The hub's control socket.
    #[arg(long, global = true, env = "CHANNELD_CONTROL_SOCKET")]
    socket: Option<PathBuf>,
    /// Print the hub's JSON result instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// `send` through the hub's RabbitMQ send queue instead of its control socket:
    /// `env:NAME` (the URL in that variable; keeps the password out of the process list) or
    /// an amqp:// URL.
    #[arg(long, global = true, value_name = "URL|env:NAME")]
    amqp: Option<String>,
    /// The hub's send queue (`[hub.amqp_sends] queue`).
    #[arg(long, global = true, default_value = channeld_control::DEFAULT_SEND_QUEUE)]
    amqp_queue: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum OutboxCmd {
    /// Send an `unknown` or `failed` record again (it may post a second copy) and print
    /// where it ended; exits as `send` would.
    Retry { id: i64 },
}

#[derive(Debug, Subcommand)]
enum RepliesCmd {
    /// Send an `unknown`, `failed` or `expired` reply again, as soon as its conversation
    /// allows (it may post a second copy of an `unknown` one).
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
        /// The key may only repeat the same message; another one is a conflict (exit 8).
        #[arg(long)]
        key: Option<String>,
        /// The message text.
        text: String,
    },
    /// List outbox records (newest first, text cut to a preview), show one in full, or
    /// retry one.
    Outbox {
        /// Only this instance.
        #[arg(long)]
        instance: Option<String>,
        /// Only this state: queued, sent, receipted, failed, unknown.
        #[arg(long)]
        state: Option<String>,
        /// Records per page (at most 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only records older than this id (the next page: the id a listing points to).
        #[arg(long, value_name = "ID")]
        before: Option<i64>,
        /// Show this one record with its whole text and error.
        #[arg(long, value_name = "ID", conflicts_with_all = ["instance", "state", "before"])]
        full: Option<i64>,
        #[command(subcommand)]
        action: Option<OutboxCmd>,
    },
    /// List replies and where their delivery stands (newest first, text cut to a preview),
    /// or retry one.
    #[command(args_conflicts_with_subcommands = true)]
    Replies {
        /// Only this instance.
        instance: Option<String>,
        /// Only this state: pending, handed, posted, failed_retryable, failed, unknown,
        /// expired.
        #[arg(long)]
        state: Option<String>,
        /// Replies per page (at most 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only replies older than this id (the next page: the id a listing points to).
        #[arg(long, value_name = "ID")]
        before: Option<i64>,
        #[command(subcommand)]
        action: Option<RepliesCmd>,
    },
    /// Ask an instance's driver for its health (exit 9 when it is Unavailable).
    Health { instance: String },
    /// Instances in id order: connection, health, in-flight runs, counters, last error.
    /// Every instance (fetched a page at a time) unless --limit or --after asks for one page.
    Status {
        /// Only this instance (`slack.primary`) or this family's instances (`slack`).
        instance: Option<String>,
        /// One page of at most this many instances (at most 1000).
        #[arg(long)]
        limit: Option<usize>,
        /// One page of the instances whose id sorts after this one (the id a listing
        /// points to).
        #[arg(long, value_name = "INSTANCE")]
        after: Option<String>,
    },
    /// Driver families this build knows.
    Catalog,
    /// Ask an instance's connected driver to perform an operator action (extension
    /// `operator_action`), e.g. `login`; refused without contacting the driver when it did
    /// not declare the name.
    Action {
        instance: String,
        /// The action's name, e.g. `resume` or `login`.
        name: String,
        /// The action's arguments, a JSON object.
        #[arg(long, value_name = "JSON", default_value = "{}")]
        args: String,
        /// Seconds to wait for the driver's answer.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Cancel the run started by an inbound (by its event id): a queued run leaves the queue,
    /// a running agent is stopped. Prints what was cancelled (nothing if it had ended).
    Cancel { instance: String, event_id: String },
    /// A conversation's history: the newest entries (inbound texts the hub admitted, replies
    /// posted), oldest first.
    History {
        instance: String,
        conversation: String,
        /// Only this thread's entries (default: the conversation outside threads).
        #[arg(long)]
        thread: Option<String>,
        /// At most this many entries (1-1000).
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// The operator action `resume`: take the platform session back after a pause that only
    /// an operator may end (a displaced session, a new login).
    Resume {
        instance: String,
        /// Seconds to wait for the driver's answer.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// The agent's inbox: admitted messages newest first, each with its locator, whether it
    /// was answered and handled (no text: `read` shows it).
    Inbox {
        /// Only this instance.
        instance: Option<String>,
        /// Only items not handled yet.
        #[arg(long)]
        unhandled: bool,
        /// Items per page (at most 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only items older than this entry id (the next page).
        #[arg(long, value_name = "ENTRY")]
        before: Option<i64>,
    },
    /// One item by its locator and up to N entries before it in its conversation (thread),
    /// marked untrusted, and whether it was handled.
    Read {
        locator: String,
        /// Previous entries to show (at most 50).
        #[arg(long, default_value_t = 10)]
        limit: usize,
    },
    /// Reply to an item in its conversation (thread) and mark it handled. Never posts twice:
    /// a repeat prints the first reply's outcome.
    Respond { locator: String, text: String },
    /// Mark an item handled without replying.
    Complete { locator: String },
    /// Serve the Model Context Protocol on stdin/stdout (tools channel_inbox, channel_read,
    /// channel_respond, channel_complete, channel_send, channel_status) for an agent, using
    /// this process's access to the control socket.
    Mcp,
    /// Write DIR/channel-platform.json so ACECode runs the driver binary channeld-FAMILY as
    /// a channel platform plugin (`--acecode`). Does not talk to the hub.
    AcecodeManifest {
        /// The driver family, e.g. `slack` (the binary is `channeld-<family>`).
        family: String,
        /// The connector directory ACECode scans (`<data_dir>/connectors/<name>`).
        dir: PathBuf,
        /// The driver binary (default: channeld-FAMILY next to channelctl).
        #[arg(long)]
        binary: Option<PathBuf>,
    },
}

const EXIT_UNEXPECTED: u8 = 1;
const EXIT_UNREACHABLE: u8 = 3;
const EXIT_REFUSED: u8 = 4;
const EXIT_UNKNOWN: u8 = 5;
const EXIT_FAILED: u8 = 6;
const EXIT_QUEUED: u8 = 7;
const EXIT_CONFLICT: u8 = 8;
const EXIT_UNAVAILABLE: u8 = 9;
const EXIT_STORAGE_FULL: u8 = 10;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Cmd::AcecodeManifest { family, dir, binary } = &cli.command {
        return match manifest::write(family, dir, binary.as_deref()) {
            Ok(path) => {
                println!("wrote {}", path.display());
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("channelctl: {err}");
                ExitCode::from(EXIT_REFUSED)
            }
        };
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let socket = cli.socket.clone().unwrap_or_else(default_socket);
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("channelctl: {err}");
            return ExitCode::from(EXIT_UNEXPECTED);
        }
    };
    if let Cmd::Mcp = &cli.command {
        return match runtime.block_on(mcp::serve(socket)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("channelctl mcp: {err}");
                ExitCode::from(EXIT_UNEXPECTED)
            }
        };
    }
    let (op, wait_budget) = match &cli.command {
        Cmd::Send { instance, conversation, thread, no_wait, timeout, key, text } => (
            Op::Send(SendArgs {
                instance: instance.clone(),
                conversation: conversation.clone(),
                thread: thread.clone(),
                text: text.clone(),
                metadata: Default::default(),
                wait: !no_wait,
                timeout_ms: Some(timeout.saturating_mul(1000)),
                idempotency_key: key.clone(),
            }),
            Duration::from_secs(timeout + 10),
        ),
        Cmd::Health { instance } => {
            (Op::Health { instance: instance.clone() }, Duration::from_secs(60))
        }
        Cmd::Status { instance, limit, after } => (
            Op::Status { instance: instance.clone(), after: after.clone(), limit: *limit },
            Duration::from_secs(10),
        ),
        Cmd::Catalog => (Op::Catalog, Duration::from_secs(10)),
        Cmd::Action { instance, name, args, timeout } => {
            let args = match serde_json::from_str::<serde_json::Value>(args) {
                Ok(args) if args.is_object() => args,
                _ => {
                    eprintln!("channelctl: --args must be a JSON object");
                    return ExitCode::from(2);
                }
            };
            (
                Op::Action {
                    instance: instance.clone(),
                    name: name.clone(),
                    args,
                    timeout_ms: Some(timeout.saturating_mul(1000)),
                },
                Duration::from_secs(timeout + 10),
            )
        }
        Cmd::Resume { instance, timeout } => (
            Op::Action {
                instance: instance.clone(),
                name: "resume".into(),
                args: serde_json::json!({}),
                timeout_ms: Some(timeout.saturating_mul(1000)),
            },
            Duration::from_secs(timeout + 10),
        ),
        Cmd::AcecodeManifest { .. } | Cmd::Mcp => unreachable!("handled before connecting"),
        Cmd::Inbox { instance, unhandled, limit, before } => (
            Op::Inbox {
                instance: instance.clone(),
                unhandled: *unhandled,
                limit: Some(*limit),
                before: *before,
            },
            Duration::from_secs(10),
        ),
        Cmd::Read { locator, limit } => {
            (Op::Read { locator: locator.clone(), limit: Some(*limit) }, Duration::from_secs(10))
        }
        // The hub waits for the receipt (`hub.receipt_timeout_secs`) and the handled effect.
        Cmd::Respond { locator, text } => {
            (Op::Respond { locator: locator.clone(), text: text.clone() }, Duration::from_secs(300))
        }
        Cmd::Complete { locator } => {
            (Op::Complete { locator: locator.clone() }, Duration::from_secs(30))
        }
        Cmd::Cancel { instance, event_id } => (
            Op::Cancel { instance: instance.clone(), event_id: event_id.clone() },
            Duration::from_secs(60),
        ),
        Cmd::History { instance, conversation, thread, limit } => (
            Op::History {
                instance: instance.clone(),
                conversation: conversation.clone(),
                thread: thread.clone(),
                limit: Some(*limit),
            },
            Duration::from_secs(10),
        ),
        Cmd::Outbox { action: Some(OutboxCmd::Retry { id }), .. } => {
            (Op::OutboxRetry { outbox_id: *id }, Duration::from_secs(120))
        }
        Cmd::Outbox { full: Some(id), action: None, .. } => {
            (Op::OutboxGet { outbox_id: *id }, Duration::from_secs(10))
        }
        Cmd::Replies { action: Some(RepliesCmd::Retry { id }), .. } => {
            (Op::RepliesRetry { reply_id: *id }, Duration::from_secs(10))
        }
        Cmd::Replies { instance, state, limit, before, action: None } => (
            Op::Replies {
                instance: instance.clone(),
                state: state.clone(),
                limit: Some(*limit),
                before: *before,
            },
            Duration::from_secs(10),
        ),
        Cmd::Outbox { instance, state, limit, before, full: None, action: None } => (
            Op::Outbox {
                instance: instance.clone(),
                state: state.clone(),
                limit: Some(*limit),
                before: *before,
            },
            Duration::from_secs(10),
        ),
    };
    let answer = match cli.amqp.as_deref() {
        Some(broker) => {
            let Op::Send(mut send) = op else {
                eprintln!("channelctl: --amqp works with send only");
                return ExitCode::from(2);
            };
            send.idempotency_key = Some(send.idempotency_key.unwrap_or_else(amqp::fresh_key));
            runtime.block_on(send_over_amqp(broker, &cli.amqp_queue, &send, wait_budget))
        }
        None => {
            let answer = match op {
                Op::Status { instance, after: None, limit: None } => {
                    runtime.block_on(every_status_page(&socket, instance, wait_budget))
                }
                op => runtime.block_on(call(&socket, Request { id: 1, op }, wait_budget)),
            };
            answer.map_err(|err| {
                eprintln!("channelctl: {err}");
                err.exit_code()
            })
        }
    };
    let response = match answer {
        Ok(response) => response,
        Err(status) => return ExitCode::from(status),
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
    let state = result.get("state").and_then(|s| s.as_str()).unwrap_or_default();
    let success = match &cli.command {
        Cmd::Send { .. } if state == "queued" => ExitCode::from(EXIT_QUEUED),
        // Waited, and still no receipt: unknown to this caller (the record settles later).
        Cmd::Send { no_wait: false, .. } if state == "handed" => {
            if !cli.json {
                let record = result.get("outbox_id").and_then(serde_json::Value::as_i64);
                let record = record.map_or_else(String::new, |id| format!(" (outbox record {id})"));
                eprintln!(
                    "channelctl: no receipt within the wait; the send is still waiting for it{record}: it may or may not be posted"
                );
            }
            ExitCode::from(EXIT_UNKNOWN)
        }
        Cmd::Outbox { action: Some(OutboxCmd::Retry { .. }), .. } => {
            ExitCode::from(retried_exit_code(state))
        }
        Cmd::Health { .. } if result["health"]["state"] == "Unavailable" => {
            ExitCode::from(EXIT_UNAVAILABLE)
        }
        _ => ExitCode::SUCCESS,
    };
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

/// `send` over the broker, answered as the control socket would answer it; `Err` is the exit
/// status (the reason is printed).
async fn send_over_amqp(
    broker: &str,
    queue: &str,
    send: &SendArgs,
    budget: Duration,
) -> Result<Response, u8> {
    let (broker, argv_password) = amqp::BrokerUrl::resolve(broker).map_err(|err| {
        eprintln!("channelctl: {err}");
        2
    })?;
    if argv_password {
        eprintln!(
            "channelctl: warning: the --amqp URL holds a password that the process list shows to every user; put the URL in a variable and pass --amqp env:NAME"
        );
    }
    match amqp::send(&broker, queue, send, budget).await {
        Ok(outcome) => Ok(Response {
            id: 1,
            ok: outcome.ok,
            result: outcome.result.map(|result| serde_json::to_value(result).unwrap_or_default()),
            error: outcome.error,
        }),
        Err(err) => {
            eprintln!("channelctl: {err}");
            Err(match err {
                amqp::AmqpError::NoVariable(_) | amqp::AmqpError::NotAUrl => 2,
                amqp::AmqpError::Unreachable(_) | amqp::AmqpError::NoQueue(_) => EXIT_UNREACHABLE,
                amqp::AmqpError::Timeout { .. } => EXIT_UNKNOWN,
                _ => EXIT_UNEXPECTED,
            })
        }
    }
}

/// The exit status for a hub's error code.
fn exit_code(error_code: &str) -> u8 {
    match error_code {
        code::OUTCOME_UNKNOWN => EXIT_UNKNOWN,
        code::CONFLICT => EXIT_CONFLICT,
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
        code::NOT_FOUND
        | code::NOT_RETRYABLE
        | code::HISTORY_OFF
        | code::UNKNOWN_EVENT
        | code::INVALID_LOCATOR => EXIT_REFUSED,
        code::ACTION_FAILED => EXIT_FAILED,
        code::ACTION_TIMEOUT => EXIT_UNKNOWN,
        code::STORAGE_FULL => EXIT_STORAGE_FULL,
        _ => EXIT_UNEXPECTED,
    }
}

/// The exit status of `outbox retry`, from the state the record reached: as `send` would
/// have exited for it.
fn retried_exit_code(state: &str) -> u8 {
    match state {
        "receipted" => 0,
        "queued" => EXIT_QUEUED,
        "failed" => EXIT_FAILED,
        _ => EXIT_UNKNOWN,
    }
}

fn default_socket() -> PathBuf {
    let dir = std::env::var_os("CHANNELD_RUNTIME_DIR")
        .map_or_else(|| PathBuf::from("/run/channeld"), PathBuf::from);
    dir.join("control.sock")
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
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

/// `status` page after page, merged into one answer (the instance list may change between
/// pages: each page is the hub's state when it was asked).
async fn every_status_page(
    socket: &std::path::Path,
    instance: Option<String>,
    budget: Duration,
) -> Result<Response, CallError> {
    let mut after: Option<String> = None;
    let mut merged: Option<StatusResult> = None;
    loop {
        let op = Op::Status { instance: instance.clone(), after: after.clone(), limit: None };
        let response = call(socket, Request { id: 1, op }, budget).await?;
        let page = match (&response.result, response.ok) {
            (Some(result), true) => serde_json::from_value::<StatusResult>(result.clone())
                .map_err(|err| CallError::Decode(err.to_string()))?,
            _ => return Ok(response),
        };
        let next = page.next_after.clone();
        match &mut merged {
            Some(all) => all.instances.extend(page.instances),
            None => merged = Some(page),
        }
        match next {
            // The cursor only moves forward; a hub that repeats one would loop forever.
            Some(next) if after.as_ref().is_none_or(|after| next > *after) => after = Some(next),
            Some(next) => {
                return Err(CallError::Decode(format!("status page cursor {next} went back")));
            }
            None => break,
        }
    }
    let mut all = merged.ok_or(CallError::NoAnswer)?;
    all.next_after = None;
    let result = serde_json::to_value(&all).map_err(|err| CallError::Decode(err.to_string()))?;
    Ok(Response { id: 1, ok: true, result: Some(result), error: None })
}

pub(crate) async fn call(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_peers_and_a_full_hub_exit_as_unreachable_and_known_codes_keep_their_status() {
        assert_eq!(exit_code("peer_not_allowed"), EXIT_UNREACHABLE);
        assert_eq!(exit_code("too_many_connections"), EXIT_UNREACHABLE);
        assert_eq!(exit_code("outcome_unknown"), EXIT_UNKNOWN);
        assert_eq!(exit_code("send_failed"), EXIT_FAILED);
        assert_eq!(exit_code("conflict"), EXIT_CONFLICT);
        for refused in ["unknown_instance", "driver_offline", "not_declared", "invalid_target"] {
            assert_eq!(exit_code(refused), EXIT_REFUSED, "{refused}");
        }
        assert_eq!(exit_code("invalid_request"), EXIT_REFUSED);
        assert_eq!(exit_code("too_large"), EXIT_REFUSED);
        assert_eq!(exit_code("ledger_unavailable"), EXIT_UNEXPECTED);
    }
}
