//! `channeld-bench`: channeld against mosquitto side by side on this machine, memory per idle
//! driver, and the hub with up to 1,000 connected drivers. Prints a markdown table and writes
//! the numbers as JSON. It prints numbers; it never judges them by failing.
//!
//! The default command orchestrates: it runs one `phase` process per CPU setting under
//! `taskset` (every process a phase starts inherits the affinity), then a `memory` process,
//! and merges their results. `driver` and `mqtt-responder` are the processes standing where
//! a platform driver would.

mod broker;
mod control;
mod driver;
mod echo;
mod hub;
mod memory;
mod metrics_cost;
mod mqtt;
mod payload;
mod peers;
mod phase;
mod procs;
mod report;
mod stats;
mod workers;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use crate::phase::{Budget, PhaseArgs};
use crate::report::{Machine, Phase, Report, Settings};

/// The allocator of every process this binary runs (the SDK driver, the clients, the
/// relays, the MQTT responder): mimalloc, as the hub and the project's drivers use.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "channeld-bench", about = "Benchmark channeld against mosquitto on this machine")]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Tiny counts and one repetition: checks that everything runs, in seconds.
    #[arg(long, global = true)]
    quick: bool,
    /// Also measure the idle AMQP driver (starts RabbitMQ, which takes ~11 s to boot).
    #[arg(long, global = true)]
    amqp: bool,
    /// Where to write the JSON results.
    #[arg(long, global = true, default_value = "target/bench.json")]
    out: PathBuf,
    /// Directory holding `channeld` and the driver binaries (default: next to this binary).
    #[arg(long, global = true)]
    bin_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the whole benchmark (the default).
    Run,
    /// Internal: one CPU setting's throughput and scaling rows.
    #[command(hide = true)]
    Phase {
        #[arg(long)]
        mode: String,
        #[arg(long)]
        cpus: String,
        #[arg(long)]
        result: PathBuf,
    },
    /// Internal: resident size of idle drivers.
    #[command(hide = true)]
    Memory {
        #[arg(long)]
        result: PathBuf,
    },
    /// Runs one path against a hub for a while and prints the PIDs, for profiling:
    /// `perf record -e cpu-clock -g -p <hub pid>` or `valgrind --tool=callgrind` on the hub.
    Soak {
        /// `send` (control socket → driver → receipt) or `inbound` (driver → echo → deliver).
        #[arg(long, default_value = "send")]
        path: String,
        #[arg(long, default_value_t = 256)]
        window: usize,
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Keep the durable ledger.
        #[arg(long)]
        ledger: bool,
        /// With `--ledger`: `hub.durability = "normal"` (no fsync per commit).
        #[arg(long)]
        durability_normal: bool,
        /// Start the hub under this wrapper (e.g. "valgrind --tool=callgrind").
        #[arg(long)]
        wrap: Option<String>,
        /// Wait this long between printing the PIDs and the first message, for a counter to
        /// attach first (`scripts/alloc-count`).
        #[arg(long, default_value_t = 0)]
        start_after_ms: u64,
    },
    /// Only the scaling rows (hub RSS and CPU per message with many connected drivers), under
    /// this process's CPU affinity; prints them.
    Scale {
        /// Connected drivers at the top (bounded by the open-file limit).
        #[arg(long, default_value_t = phase::TOP_DRIVERS)]
        drivers: usize,
        /// Seconds each CPU-per-message row measures.
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        /// Record the hub with `perf record -g` into this file during the spread row over
        /// the most drivers.
        #[arg(long)]
        perf: Option<PathBuf>,
    },
    /// The hub's CPU per inbound message with metrics off and on (`hub.metrics_listen`),
    /// ledger off and on; prints a table of medians.
    MetricsCost {
        /// Pairs of runs (off, on) per ledger setting.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Seconds each run measures.
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
    /// Runs over RabbitMQ: throughput of the hub's `amqp` runtime with 1, 2 and 4
    /// `channeld-worker`s on an agent that sleeps (starts RabbitMQ; `scripts/bench --workers`).
    Workers {
        /// Worker counts, one row each.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        workers: Vec<usize>,
        /// Each worker's `--concurrency`.
        #[arg(long, default_value_t = 4)]
        concurrency: u16,
        /// How long the agent sleeps before answering.
        #[arg(long, default_value_t = 200)]
        sleep_ms: u64,
        /// Runs per row: this times the row's worker count (`--quick`: 10).
        #[arg(long, default_value_t = 120)]
        runs_per_worker: usize,
        /// Where the JSON goes.
        #[arg(long, default_value = "target/bench-workers.json")]
        json: PathBuf,
    },
    /// The 1,000-run check against the broker(s) in `$CHANNELD_AMQP_URL` (comma-separated
    /// node URLs), running `--stop-command` mid-stream; prints answered / lost / repeated.
    /// Exits 1 unless every run was answered once and every repeat was flagged.
    /// `scripts/rabbitmq-cluster` runs it against a three-node cluster.
    ClusterRun {
        #[arg(long, default_value_t = 1000)]
        runs: usize,
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, default_value_t = 8)]
        concurrency: u16,
        /// How long the agent sleeps before answering.
        #[arg(long, default_value_t = 20)]
        sleep_ms: u64,
        /// After this many answers, run `--stop-command`.
        #[arg(long, default_value_t = 300)]
        stop_after: usize,
        /// A shell command run mid-stream (e.g. stopping one broker node).
        #[arg(long)]
        stop_command: Option<String>,
        /// Seconds without any frame before the missing runs count as lost.
        #[arg(long, default_value_t = 90)]
        quiet_secs: u64,
    },
    /// Internal: the minimal SDK driver (launch settings from the environment).
    #[command(hide = true)]
    Driver,
    /// Internal: the MQTT responder standing where a driver would.
    #[command(hide = true)]
    MqttResponder {
        port: u16,
        prefix: String,
        /// Leave Nagle on (mosquitto's default) instead of setting TCP_NODELAY.
        #[arg(long)]
        nagle: bool,
    },
    /// Internal: the reference rows' echo server (one hop).
    #[command(hide = true)]
    EchoServer {
        #[arg(long)]
        listen: PathBuf,
    },
    /// Internal: the reference rows' relay in front of the echo server (two hops).
    #[command(hide = true)]
    EchoRelay {
        #[arg(long)]
        listen: PathBuf,
        #[arg(long)]
        upstream: PathBuf,
    },
}

fn main() -> ExitCode {
    // Thousands of driver connections in the scaling rows: the soft open-file limit goes to
    // the hard one here, and every process the bench starts (the hub too) inherits it. A
    // privileged bench first lifts a hard limit too low for the top row (`ulimit -Hn` is
    // often 20,000 in containers: room for 9,872 drivers); unprivileged, the row
    // connects as many as the limit allows and says so.
    let _ = phase::raise_hard_fd_limit(phase::TOP_FDS);
    if let Err(err) = channeld_link::process::raise_fd_limit() {
        eprintln!("channeld-bench: cannot raise the open-file limit: {err}");
    }
    let cli = Cli::parse();
    let outcome = match cli.command.unwrap_or(Cmd::Run) {
        Cmd::Driver => return driver::driver_main(),
        Cmd::MqttResponder { port, prefix, nagle } => {
            return mqtt::responder_main(port, &prefix, nagle);
        }
        Cmd::EchoServer { listen } => return echo::serve_main(&listen, None),
        Cmd::EchoRelay { listen, upstream } => return echo::serve_main(&listen, Some(&upstream)),
        Cmd::Run => run_all(&cli.run),
        Cmd::Phase { mode, cpus, result } => bin_dir(&cli.run).and_then(|bin_dir| {
            let args = PhaseArgs { mode, cpus, bin_dir, budget: Budget::new(cli.run.quick) };
            write_json(&result, &phase::run_phase(&args)?)
        }),
        Cmd::Soak { path, window, seconds, ledger, durability_normal, wrap, start_after_ms } => {
            bin_dir(&cli.run).and_then(|bin_dir| {
                let options = phase::SoakOptions {
                    path: &path,
                    window,
                    measure: std::time::Duration::from_secs(seconds),
                    ledger,
                    durability_normal,
                    wrap: wrap.as_deref(),
                    start_after: std::time::Duration::from_millis(start_after_ms),
                };
                phase::soak(&bin_dir, &options)
            })
        }
        Cmd::Scale { drivers, seconds, perf } => bin_dir(&cli.run).and_then(|bin_dir| {
            let mut budget = Budget::new(cli.run.quick);
            budget.max_drivers = drivers.max(1);
            budget.cpu_measure = std::time::Duration::from_secs(seconds.max(1));
            let args = PhaseArgs { mode: "scale".into(), cpus: String::new(), bin_dir, budget };
            let options = phase::ScaleOptions { perf_out: perf };
            phase::scale_main(&args, &options)
        }),
        Cmd::MetricsCost { reps, seconds } => bin_dir(&cli.run).and_then(|bin_dir| {
            let measure = std::time::Duration::from_secs(seconds);
            metrics_cost::metrics_cost(&bin_dir, reps.max(1), measure)
        }),
        Cmd::Workers { workers, concurrency, sleep_ms, runs_per_worker, json } => bin_dir(&cli.run)
            .and_then(|bin_dir| {
                workers::workers_bench(&workers::WorkersArgs {
                    bin_dir,
                    workers,
                    concurrency: concurrency.max(1),
                    sleep: std::time::Duration::from_millis(sleep_ms),
                    runs_per_worker: if cli.run.quick { 10 } else { runs_per_worker.max(1) },
                    json,
                })
            }),
        Cmd::ClusterRun {
            runs,
            workers,
            concurrency,
            sleep_ms,
            stop_after,
            stop_command,
            quiet_secs,
        } => {
            let args = bin_dir(&cli.run).map(|bin_dir| workers::ClusterArgs {
                bin_dir,
                runs,
                workers: workers.max(1),
                concurrency: concurrency.max(1),
                sleep: std::time::Duration::from_millis(sleep_ms),
                stop_after,
                stop_command,
                quiet: std::time::Duration::from_secs(quiet_secs.max(1)),
            });
            match args.and_then(|args| workers::cluster_run(&args)) {
                Ok(true) => return ExitCode::SUCCESS,
                Ok(false) => return ExitCode::FAILURE,
                Err(err) => Err(err),
            }
        }
        Cmd::Memory { result } => bin_dir(&cli.run).and_then(|bin_dir| {
            let drivers = memory::run_memory(&bin_dir, cli.run.quick, cli.run.amqp)?;
            write_json(&result, &drivers)
        }),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("channeld-bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn bin_dir(args: &RunArgs) -> Result<PathBuf> {
    match &args.bin_dir {
        Some(dir) => Ok(dir.clone()),
        None => {
            let exe = std::env::current_exe().context("locate channeld-bench")?;
            Ok(exe.parent().context("channeld-bench has no directory")?.to_owned())
        }
    }
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
}

/// The 1-, 5- and 15-minute load averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The CPU idle driver (`/sys/devices/system/cpu/cpuidle`), with the guest's halt-polling
/// window when the driver is `haltpoll`.
fn cpu_idle() -> String {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    describe_cpu_idle(
        read("/sys/devices/system/cpu/cpuidle/current_driver").as_deref(),
        read("/sys/module/haltpoll/parameters/guest_halt_poll_ns").as_deref(),
    )
}

/// How the report names the CPU idle setting, from the two files' contents: the halt-polling
/// window counts only under `haltpoll` (`0`: an idle CPU halts at once, and its next
/// wake-up exits to the hypervisor).
fn describe_cpu_idle(driver: Option<&str>, poll_ns: Option<&str>) -> String {
    match (driver.map(str::trim), poll_ns.map(str::trim)) {
        (None, _) => "unknown".into(),
        (Some("haltpoll"), Some(ns)) => format!("haltpoll, guest_halt_poll_ns {ns}"),
        (Some(driver), _) => driver.to_owned(),
    }
}

fn run_all(args: &RunArgs) -> Result<()> {
    let bin_dir = bin_dir(args)?;
    procs::binary(&bin_dir, "channeld", "build it with `cargo build --release -p channeld-hub`")?;
    broker::mosquitto_binary()?;
    let taskset = procs::find_program("taskset", &["/usr/bin/taskset"])
        .context("taskset is not installed (util-linux): it pins the processes to one CPU")?;
    let exe = std::env::current_exe().context("locate channeld-bench")?;
    // Every online CPU, not this process's affinity (the caller may itself be pinned).
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let all_cpus = format!("0-{}", cpus - 1);
    let scratch = tempfile::Builder::new().prefix("channeld-bench-run-").tempdir()?;
    let load_before = load_average();

    let child = |subcommand: &[&str], cpu_list: &str| -> Result<()> {
        let mut command = Command::new(&taskset);
        command.arg("-c").arg(cpu_list).arg(&exe).args(subcommand);
        command.arg("--bin-dir").arg(&bin_dir);
        if args.quick {
            command.arg("--quick");
        }
        if args.amqp {
            command.arg("--amqp");
        }
        let status = command.status().with_context(|| format!("start {}", exe.display()))?;
        if !status.success() {
            bail!("`channeld-bench {}` failed ({status})", subcommand.join(" "));
        }
        Ok(())
    };

    let mut phases: Vec<Phase> = Vec::new();
    for (mode, cpu_list) in [("pinned", "0"), ("unpinned", all_cpus.as_str())] {
        let result = scratch.path().join(format!("{mode}.json"));
        let result_arg = result.to_string_lossy().into_owned();
        child(&["phase", "--mode", mode, "--cpus", cpu_list, "--result", &result_arg], cpu_list)?;
        phases.push(read_json(&result)?);
    }
    let result = scratch.path().join("memory.json");
    child(&["memory", "--result", &result.to_string_lossy()], &all_cpus)?;
    let idle_drivers = read_json(&result)?;

    let budget = Budget::new(args.quick);
    let report = Report {
        schema: "channeld-bench/1".into(),
        quick: args.quick,
        machine: Machine {
            cpus,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| format!("Linux {}", s.trim()))
                .unwrap_or_else(|_| "Linux".into()),
            mosquitto: broker::mosquitto_version().unwrap_or_else(|| "mosquitto".into()),
            load_before,
            load_after: load_average(),
            cpu_idle: cpu_idle(),
        },
        settings: Settings {
            payload_bytes: payload::PAYLOAD_BYTES,
            repetitions: budget.repetitions,
            measure_ms: budget.measure.as_millis() as u64,
            windows: budget.windows.clone(),
            hub_max_inflight: hub::BENCH_MAX_INFLIGHT,
            ledger_durability: "full (default)".into(),
        },
        phases,
        idle_drivers,
    };
    write_json(&args.out, &report)?;
    println!("{}", report.markdown());
    eprintln!("channeld-bench: results written to {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::describe_cpu_idle;

    #[test]
    fn the_cpu_idle_setting_names_halt_polling_only_under_haltpoll() {
        assert_eq!(
            describe_cpu_idle(Some("haltpoll\n"), Some("0\n")),
            "haltpoll, guest_halt_poll_ns 0"
        );
        // A module loaded but not the idle driver in use says nothing about idling.
        assert_eq!(describe_cpu_idle(Some("intel_idle\n"), Some("200000\n")), "intel_idle");
        assert_eq!(describe_cpu_idle(Some("haltpoll"), None), "haltpoll");
        assert_eq!(describe_cpu_idle(None, Some("0")), "unknown");
    }
}
