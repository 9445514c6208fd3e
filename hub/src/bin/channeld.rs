//! `channeld`: the hub daemon, and `channeld demo`, the one-command local chat.
//!
//! Exit status: 0 stopped (SIGTERM, SIGINT); 1 failed (a socket or the ledger could not be
//! opened, the hub failed); 74 the state directory or the ledger database cannot be used
//! (not writable, corrupted, from a newer channeld: the message names the path and what to
//! do; restarting cannot help); 75 another hub uses the state directory (the message names
//! its pid) or listens on a socket; 78 invalid configuration.
//!
//! `channeld ledger check|backup PATH|vacuum`: 0 done (check: the database is whole);
//! 1 the check found problems, or the command failed; 74 the ledger cannot be opened;
//! 75 vacuum while a hub uses the state directory; 78 invalid configuration or no state
//! directory.

use std::path::PathBuf;
use std::process::ExitCode;

use std::sync::Arc;

use channeld_hub::Hub;
use channeld_hub::config::{CpuScheduling, HubConfig, Overrides};
use channeld_hub::ledger::LedgerError;
use channeld_hub::listen::HubError;
use clap::{Parser, Subcommand};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// The hub's allocator: mimalloc, not glibc's malloc, which took a fifth of the hub's time
/// at 256 sends in flight (`malloc`, `free` and `malloc_consolidate`); see BENCHMARKS.md,
/// "eighth round". Built without transparent huge pages: with them the hub held 392 MiB with
/// 9,872 idle drivers, not 266 (glibc: 258).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Default configuration file.
const DEFAULT_CONFIG: &str = "/etc/channeld/channeld.toml";

/// Exit status: another hub uses this state directory or listens on one of the sockets
/// (`EX_TEMPFAIL`: it may be gone soon, e.g. an old hub still draining; try again later).
const EXIT_IN_USE: u8 = 75;
/// Exit status: the state directory or the ledger database cannot be used as it is
/// (`EX_IOERR`; an operator must act, restarting cannot help).
const EXIT_STATE: u8 = 74;
/// Exit status: the configuration is invalid (`EX_CONFIG`; restarting cannot help).
const EXIT_CONFIG: u8 = 78;

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
    /// Operator tools on the ledger database in the state directory.
    #[command(subcommand)]
    Ledger(LedgerCmd),
}

#[derive(Debug, Subcommand)]
enum LedgerCmd {
    /// Run SQLite's integrity check and show the schema version (read-only; safe while the
    /// hub runs).
    Check,
    /// Copy the database to PATH with SQLite's online backup API (safe while the hub runs;
    /// PATH must not exist).
    Backup {
        /// The backup file to write.
        path: PathBuf,
    },
    /// Compact the database (VACUUM); refused while a hub uses the state directory.
    Vacuum,
}

fn main() -> ExitCode {
    // The one crypto provider for the rustls the amqp runtime links (amqps:// brokers).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let demo = matches!(cli.command, Some(Cmd::Demo));
    channeld_link::process::init_logging(if demo { "warn" } else { "info" });
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
                    for warning in config.warnings() {
                        eprintln!("channeld: warning: {warning}");
                    }
                    println!(
                        "{}: {} instance(s), configuration is valid",
                        cli.config.display(),
                        config.instances.len()
                    );
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("channeld: {err}");
                    ExitCode::from(EXIT_CONFIG)
                }
            },
            Cmd::Run => run_main(&cli.config, &overrides).await,
            Cmd::Ledger(cmd) => ledger_main(&cli.config, &overrides, &cmd),
        }
    })
}

async fn run_main(path: &std::path::Path, overrides: &Overrides) -> ExitCode {
    // First of all: from here on SIGHUP reloads (once the hub serves) instead of killing it.
    let hangups = match signal(SignalKind::hangup()) {
        Ok(hangups) => hangups,
        Err(err) => {
            error!(error = %err, "cannot install the SIGHUP handler");
            return ExitCode::FAILURE;
        }
    };
    // And SIGTERM/SIGINT stop it gracefully from here on, even while it is still starting.
    let shutdown = CancellationToken::new();
    drop(channeld_link::process::spawn_stop_handler(shutdown.clone(), false));
    let config = match HubConfig::load(path, overrides) {
        Ok(config) => config,
        Err(err) => {
            error!(error = %err, "invalid configuration");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    check_fd_limit(config.instances.len());
    apply_cpu_scheduling(config.cpu_scheduling);
    // First the state directory's lock: a second hub must not touch the ledger (it would
    // start the first one's runs again) nor the sockets.
    let ledger = match channeld_hub::open_ledger(&config) {
        Ok(ledger) => ledger,
        Err(err @ LedgerError::InUse { .. }) => {
            error!(error = %err, "not starting: another hub uses this state directory");
            return ExitCode::from(EXIT_IN_USE);
        }
        Err(err @ LedgerError::Unusable { .. }) => {
            error!(error = %err, "not starting: the ledger cannot be used");
            return ExitCode::from(EXIT_STATE);
        }
        Err(err) => {
            error!(error = %err, "cannot open the ledger");
            return ExitCode::FAILURE;
        }
    };
    let listeners = match channeld_hub::bind(&config) {
        Ok(listeners) => listeners,
        Err(err @ HubError::InUse(_)) => {
            error!(error = %err, "not starting: another hub is serving");
            return ExitCode::from(EXIT_IN_USE);
        }
        Err(err) => {
            error!(error = %err, "cannot bind sockets");
            return ExitCode::FAILURE;
        }
    };
    let hub = Hub::new(config, ledger, shutdown);
    let reloads =
        tokio::spawn(reload_on_hangup(hub.clone(), hangups, path.to_owned(), overrides.clone()));
    let result = channeld_hub::run_hub(hub, listeners).await;
    let _ = reloads.await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!(error = %err, "hub failed");
            ExitCode::FAILURE
        }
    }
}

/// Moves the hub's threads to `SCHED_BATCH` unless `hub.cpu_scheduling = "inherit"` (early:
/// the ledger's threads, started later, inherit it). The hub runs on if it cannot.
fn apply_cpu_scheduling(scheduling: CpuScheduling) {
    use channeld_link::sched::{Batched, batch_threads};
    if scheduling == CpuScheduling::Inherit {
        return;
    }
    match batch_threads() {
        Ok(Batched::Moved { threads }) => {
            info!(threads, "hub threads run under SCHED_BATCH (hub.cpu_scheduling)");
        }
        Ok(Batched::LeftAsStarted { policy }) => info!(
            policy,
            "hub started under a scheduling policy other than the default; hub.cpu_scheduling leaves it"
        ),
        Err(err) => warn!(error = %err, "cannot move the hub's threads to SCHED_BATCH"),
    }
}

/// Descriptors the hub needs besides two per instance: the control socket and its
/// connections, the ledger, the metrics listener, agents' pipes, reloads.
const FD_MARGIN: u64 = 256;

/// Raises the soft open-file limit to the hard one (the soft default of 1,024 would end a
/// hub at about 500 instances: each holds its socket and its driver's connection), and warns
/// when even the hard limit is short of what the configured instances need.
fn check_fd_limit(instances: usize) {
    let needed = 2 * instances as u64 + FD_MARGIN;
    match channeld_link::process::raise_fd_limit() {
        Ok(limit) if limit.now < needed => warn!(
            limit = limit.now,
            instances,
            needed,
            "the open-file limit is too low for every instance to have its driver connected; raise LimitNOFILE="
        ),
        Ok(limit) => info!(before = limit.before, limit = limit.now, "open-file limit"),
        Err(err) => warn!(error = %err, "cannot raise the open-file limit"),
    }
}

/// `channeld ledger …`: the state directory comes from `--state-dir` (`STATE_DIRECTORY`) when
/// given, so it works without a configuration file, else from the configuration.
fn ledger_main(path: &std::path::Path, overrides: &Overrides, cmd: &LedgerCmd) -> ExitCode {
    use channeld_hub::ledger::ops;
    let dir = match &overrides.state_dir {
        Some(dir) => dir.clone(),
        None => match HubConfig::load(path, overrides) {
            Ok(HubConfig { state_dir: Some(dir), .. }) => dir,
            Ok(_) => {
                eprintln!(
                    "channeld: the ledger is off: {} sets no hub.state_dir (or pass --state-dir)",
                    path.display()
                );
                return ExitCode::from(EXIT_CONFIG);
            }
            Err(err) => {
                eprintln!("channeld: {err}");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
    };
    let failed = |err: LedgerError| {
        eprintln!("channeld: {err}");
        match err {
            LedgerError::Unusable { .. } | LedgerError::Open { .. } => ExitCode::from(EXIT_STATE),
            LedgerError::InUse { .. } => ExitCode::from(EXIT_IN_USE),
            _ => ExitCode::FAILURE,
        }
    };
    let report = |report: &ops::CheckReport| {
        println!(
            "{}: schema version {} (this channeld writes {})",
            report.path.display(),
            report.schema_version,
            report.known_version
        );
        if report.schema_version > report.known_version {
            println!("written by a newer channeld: this one refuses to run on it");
        }
        if report.problems.is_empty() {
            println!("integrity check: ok");
        } else {
            println!("integrity check: {} problem(s)", report.problems.len());
            for problem in &report.problems {
                println!("  {problem}");
            }
        }
        if report.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
    };
    match cmd {
        LedgerCmd::Check => ops::check(&dir).map_or_else(failed, |r| report(&r)),
        LedgerCmd::Backup { path } => match ops::backup(&dir, path) {
            Ok(r) => {
                println!("backup written to {}", path.display());
                report(&r)
            }
            Err(err) => failed(err),
        },
        LedgerCmd::Vacuum => match ops::vacuum(&dir) {
            Ok(sizes) => {
                println!(
                    "{}: {} bytes before, {} after",
                    dir.join(channeld_hub::ledger::DB_FILE).display(),
                    sizes.before,
                    sizes.after
                );
                ExitCode::SUCCESS
            }
            Err(err) => failed(err),
        },
    }
}

/// Each SIGHUP re-reads the configuration file, once the hub serves; a SIGHUP during startup
/// is applied when it is ready, one during shutdown is ignored. Ends with the hub.
async fn reload_on_hangup(hub: Arc<Hub>, mut hangups: Signal, path: PathBuf, overrides: Overrides) {
    tokio::select! {
        () = hub.ready.cancelled() => {}
        () = hub.shutdown.cancelled() => return,
    }
    loop {
        tokio::select! {
            received = hangups.recv() => if received.is_none() { return },
            () = hub.shutdown.cancelled() => return,
        }
        info!(config = %path.display(), "SIGHUP: reloading the configuration");
        channeld_hub::reload::reload_from(&hub, &path, &overrides).await;
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
    drop(channeld_link::process::spawn_stop_handler(shutdown.clone(), true));
    match channeld_hub::demo::run(console, shutdown).await {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            eprintln!("channeld demo: {err}");
            ExitCode::FAILURE
        }
    }
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
