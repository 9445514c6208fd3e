//! `channeld`: the hub daemon, and `channeld demo`, the one-command local chat.

use std::path::PathBuf;
use std::process::ExitCode;

use channeld_hub::config::{HubConfig, Overrides};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tracing::error;

/// Default configuration file.
const DEFAULT_CONFIG: &str = "/etc/channeld/channeld.toml";

#[derive(Debug, Parser)]
#[command(
    name = "channeld",
    version,
    about = "Connects messaging-platform drivers to an agent runtime"
)]
struct Cli {
    /// Configuration file.
    #[arg(long, short, global = true, default_value = DEFAULT_CONFIG, env = "CHANNELD_CONFIG")]
    config: PathBuf,
    /// Directory for the sockets (overrides hub.runtime_dir).
    #[arg(long, global = true, env = "CHANNELD_RUNTIME_DIR")]
    runtime_dir: Option<PathBuf>,
    /// Directory for durable state, the ledger (overrides hub.state_dir; systemd's
    /// StateDirectory= sets STATE_DIRECTORY).
    #[arg(long, global = true, env = "STATE_DIRECTORY")]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the hub (the default).
    Run,
    /// Chat with the echo runtime through a console driver; no config, no credentials.
    Demo,
    /// Validate the configuration and exit.
    Check,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let demo = matches!(cli.command, Some(Cmd::Demo));
    init_logging(if demo { "warn" } else { "info" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            error!(error = %err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let overrides =
            Overrides { runtime_dir: cli.runtime_dir.clone(), state_dir: cli.state_dir.clone() };
        match cli.command.unwrap_or(Cmd::Run) {
            Cmd::Demo => demo_main().await,
            Cmd::Check => match HubConfig::load(&cli.config, &overrides) {
                Ok(config) => {
                    println!(
                        "{}: {} instance(s), configuration is valid",
                        cli.config.display(),
                        config.instances.len()
                    );
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("channeld: {err}");
                    ExitCode::from(78)
                }
            },
            Cmd::Run => run_main(&cli.config, &overrides).await,
        }
    })
}

async fn run_main(path: &std::path::Path, overrides: &Overrides) -> ExitCode {
    let config = match HubConfig::load(path, overrides) {
        Ok(config) => config,
        Err(err) => {
            error!(error = %err, "invalid configuration");
            return ExitCode::from(78);
        }
    };
    let ledger = match channeld_hub::open_ledger(&config) {
        Ok(ledger) => ledger,
        Err(err) => {
            error!(error = %err, "cannot open the ledger");
            return ExitCode::FAILURE;
        }
    };
    let listeners = match channeld_hub::bind(&config) {
        Ok(listeners) => listeners,
        Err(err) => {
            error!(error = %err, "cannot bind sockets");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    match channeld_hub::run(config, ledger, listeners, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!(error = %err, "hub failed");
            ExitCode::FAILURE
        }
    }
}

async fn demo_main() -> ExitCode {
    let Some(console) = channeld_hub::demo::find_console() else {
        eprintln!(
            "channeld demo: channeld-console was not found next to channeld or on PATH (build it with `cargo build --workspace`)"
        );
        return ExitCode::FAILURE;
    };
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    match channeld_hub::demo::run(console, shutdown).await {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            eprintln!("channeld demo: {err}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CHANNELD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: under systemd stderr is the journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

fn spawn_signal_handler(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) =
            (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        token.cancel();
    });
}

/// Async worker threads: `CHANNELD_WORKER_THREADS`, else one per CPU, but a single worker on
/// machines with two CPUs or fewer, where a second worker costs more in cross-CPU wake-ups
/// than it gains (measured with channeld-bench). Agents and the ledger have their own threads.
fn worker_threads() -> usize {
    if let Some(n) = std::env::var("CHANNELD_WORKER_THREADS").ok().and_then(|v| v.parse().ok()) {
        return usize::max(n, 1);
    }
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    if cpus <= 2 { 1 } else { cpus }
}
