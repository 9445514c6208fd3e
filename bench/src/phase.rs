//! One phase of the bench, run in a process of its own under one CPU setting (the parent
//! starts it under `taskset`, and every process it starts inherits the affinity): the
//! throughput rows for the hub (ledger off and on) and mosquitto, then the scaling rows.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use channeld_protocol::ChannelId;
use tokio::runtime::Runtime;

use crate::broker::Mosquitto;
use crate::control;
use crate::driver::DriverProc;
use crate::echo::{self, EchoProc};
use crate::hub::{HubProc, HubSpec, MAIN_INSTANCE, any_health};
use crate::mqtt::{self, Responder};
use crate::peers::Peers;
use crate::procs::cpu_time;
use crate::report::{CpuRow, PathKind, Phase, Row, Scale};
use crate::stats::{Plan, Sample, median_sample};

/// How much a phase measures.
#[derive(Debug, Clone)]
pub struct Budget {
    pub quick: bool,
    pub repetitions: usize,
    pub measure: Duration,
    pub windows: Vec<usize>,
    /// Connected drivers at the top of the scaling rows.
    pub max_drivers: usize,
    /// Measuring time of each CPU-per-message run.
    pub cpu_measure: Duration,
}

impl Budget {
    pub fn new(quick: bool) -> Self {
        if quick {
            Self {
                quick,
                repetitions: 1,
                measure: Duration::from_millis(50),
                windows: vec![1, 16, 256],
                max_drivers: 20,
                cpu_measure: Duration::from_millis(100),
            }
        } else {
            Self {
                quick,
                repetitions: 5,
                measure: Duration::from_secs(1),
                windows: vec![1, 16, 256],
                max_drivers: TOP_DRIVERS,
                cpu_measure: Duration::from_secs(3),
            }
        }
    }

    pub fn plan(&self, window: usize) -> Plan {
        let warmup = if self.quick { 20 } else { 200 + 2 * window as u64 };
        Plan { window, warmup, measure: self.measure }
    }
}

/// Everything a phase needs from its parent.
#[derive(Debug, Clone)]
pub struct PhaseArgs {
    pub mode: String,
    pub cpus: String,
    pub bin_dir: PathBuf,
    pub budget: Budget,
}

fn runtime() -> Result<Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn progress(mode: &str, what: &str, sample: &Sample) {
    eprintln!(
        "channeld-bench [{mode}] {what}: {}/s p50 {:.1} µs p99 {:.1} µs{}",
        crate::report::fmt_rate(sample.rate_per_s),
        sample.p50_us,
        sample.p99_us,
        if sample.errors > 0 { format!(" ({} errors)", sample.errors) } else { String::new() }
    );
}

pub fn run_phase(args: &PhaseArgs) -> Result<Phase> {
    let rt = runtime()?;
    let dir = tempfile::Builder::new().prefix("channeld-bench-").tempdir()?;
    let budget = &args.budget;
    let mut rows = Vec::new();

    for ledger in [false, true] {
        let hub_dir = dir.path().join(if ledger { "hub-ledger" } else { "hub" });
        std::fs::create_dir_all(&hub_dir)?;
        let spec = HubSpec {
            ledger,
            extra_instances: Vec::new(),
            durability_normal: false,
            metrics: false,
        };
        let mut hub = HubProc::start(&args.bin_dir, &hub_dir, &spec)?;
        let mut driver = DriverProc::start(
            MAIN_INSTANCE,
            &hub.socket(MAIN_INSTANCE),
            &hub_dir.join("driver.log"),
        )?;
        hub.wait_connected(&[MAIN_INSTANCE], Duration::from_secs(20), any_health)?;
        let instances = vec![MAIN_INSTANCE.to_owned()];
        let ledger_name = if ledger { "on" } else { "off" };
        for &window in &budget.windows {
            let plan = budget.plan(window);
            let mut sends = Vec::new();
            let mut inbound = Vec::new();
            for rep in 0..budget.repetitions {
                let sample = rt
                    .block_on(control::send_round_trips(&hub.control_socket(), &instances, plan))
                    .with_context(|| format!("send, ledger {ledger_name}, {window} in flight"))?;
                progress(
                    &args.mode,
                    &format!("send ledger={ledger_name} window={window} rep {rep}"),
                    &sample,
                );
                sends.push(sample);
                let prefix = format!("{}-{ledger_name}-{window}-{rep}", args.mode);
                let sample = driver.inbound(plan, &prefix).with_context(|| {
                    format!("inbound, ledger {ledger_name}, {window} in flight")
                })?;
                progress(
                    &args.mode,
                    &format!("inbound ledger={ledger_name} window={window} rep {rep}"),
                    &sample,
                );
                inbound.push(sample);
            }
            rows.push(row(PathKind::Send, Some(ledger), window, sends));
            rows.push(row(PathKind::Inbound, Some(ledger), window, inbound));
        }
        driver.stop()?;
        hub.proc.stop(Duration::from_secs(15))?;
    }

    rows.extend(echo_rows(args, &rt, dir.path())?);

    for nagle in [false, true] {
        let kind = if nagle { PathKind::MosquittoNagle } else { PathKind::Mosquitto };
        let name = if nagle { "mosquitto-nagle" } else { "mosquitto" };
        let broker_dir = dir.path().join(name);
        std::fs::create_dir_all(&broker_dir)?;
        let mut broker = Mosquitto::start(&broker_dir, nagle)?;
        let prefix = format!("{}-{}-{name}", args.mode, std::process::id());
        let log = broker_dir.join("responder.log");
        let mut responder = Responder::start(broker.port, &prefix, nagle, &log)?;
        for &window in &budget.windows {
            let plan = budget.plan(window);
            let mut samples = Vec::new();
            for rep in 0..budget.repetitions {
                let client = format!("{prefix}-{window}-{rep}");
                let sample = rt
                    .block_on(mqtt::round_trips(broker.port, &prefix, &client, nagle, plan))
                    .with_context(|| format!("{name}, {window} in flight"))?;
                progress(&args.mode, &format!("{name} window={window} rep {rep}"), &sample);
                samples.push(sample);
            }
            rows.push(row(kind, None, window, samples));
        }
        responder.proc.stop(Duration::from_secs(5))?;
        broker.proc.stop(Duration::from_secs(5))?;
    }
    let fsync_us = fsync_cost(dir.path(), if budget.quick { 10 } else { 200 })?;
    eprintln!("channeld-bench [{}] fsync (4 KiB append + fdatasync): {fsync_us:.1} µs", args.mode);

    let scale = scale(args, &rt, dir.path(), &ScaleOptions::default())?;
    let load = crate::load_average();
    Ok(Phase { mode: args.mode.clone(), cpus: args.cpus.clone(), rows, scale, fsync_us, load })
}

/// The reference rows: one-hop echo and two-hop relay, every window.
fn echo_rows(args: &PhaseArgs, rt: &Runtime, dir: &Path) -> Result<Vec<Row>> {
    let budget = &args.budget;
    let echo_dir = dir.join("echo");
    std::fs::create_dir_all(&echo_dir)?;
    let mut server = EchoProc::start(&echo_dir, "echo-server", None)?;
    let mut relay = EchoProc::start(&echo_dir, "echo-relay", Some(&server.socket))?;
    let mut rows = Vec::new();
    for &window in &budget.windows {
        let plan = budget.plan(window);
        for (kind, socket) in
            [(PathKind::Echo, &server.socket), (PathKind::EchoTwoHop, &relay.socket)]
        {
            let mut samples = Vec::new();
            for rep in 0..budget.repetitions {
                let sample = rt
                    .block_on(echo::round_trips(socket, plan))
                    .with_context(|| format!("{kind:?}, {window} in flight"))?;
                progress(&args.mode, &format!("{kind:?} window={window} rep {rep}"), &sample);
                samples.push(sample);
            }
            rows.push(row(kind, None, window, samples));
        }
    }
    relay.proc.stop(Duration::from_secs(5))?;
    server.proc.stop(Duration::from_secs(5))?;
    Ok(rows)
}

/// The median time of `count` 4 KiB appends each followed by `fdatasync`, in µs, on the file
/// system holding `dir` (where the hub's ledger lives in the bench): the unit a durable commit
/// pays.
fn fsync_cost(dir: &Path, count: usize) -> Result<f64> {
    use std::io::Write as _;
    let path = dir.join("fsync-probe");
    let mut file = std::fs::File::create(&path).context("create the fsync probe")?;
    let block = [0x5a_u8; 4096];
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        let began = std::time::Instant::now();
        file.write_all(&block)?;
        file.sync_data()?;
        times.push(began.elapsed().as_secs_f64() * 1e6);
    }
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(crate::stats::median(&times))
}

/// What `channeld-bench soak` runs.
#[derive(Debug, Clone, Copy)]
pub struct SoakOptions<'a> {
    /// `send` or `inbound`.
    pub path: &'a str,
    pub window: usize,
    pub measure: Duration,
    pub ledger: bool,
    pub durability_normal: bool,
    /// A wrapper the hub is started under (e.g. valgrind).
    pub wrap: Option<&'a str>,
    /// A pause between printing the PIDs and the first message.
    pub start_after: Duration,
}

/// `channeld-bench soak`: one path at one window for `measure`, reporting what it got.
pub fn soak(bin_dir: &Path, options: &SoakOptions<'_>) -> Result<()> {
    let SoakOptions { path, window, measure, ledger, durability_normal, wrap, start_after } =
        *options;
    let rt = runtime()?;
    let dir = tempfile::Builder::new().prefix("channeld-bench-soak-").tempdir()?;
    let spec = HubSpec { ledger, extra_instances: Vec::new(), durability_normal, metrics: false };
    let mut hub = HubProc::start_wrapped(bin_dir, dir.path(), &spec, wrap)?;
    let mut driver = DriverProc::start(
        MAIN_INSTANCE,
        &hub.socket(MAIN_INSTANCE),
        &dir.path().join("driver.log"),
    )?;
    hub.wait_connected(&[MAIN_INSTANCE], Duration::from_secs(120), any_health)?;
    eprintln!("channeld-bench soak: hub pid {}, driver pid {}", hub.pid(), driver.proc.pid());
    std::thread::sleep(start_after);
    let plan = Plan { window, warmup: 0, measure };
    let hub_before = cpu_time(hub.pid())?;
    let driver_before = cpu_time(driver.proc.pid())?;
    let sample = match path {
        "send" => rt.block_on(control::send_round_trips(
            &hub.control_socket(),
            &[MAIN_INSTANCE.to_owned()],
            plan,
        ))?,
        "inbound" => driver.inbound(plan, &format!("soak-{}", std::process::id()))?,
        other => anyhow::bail!("unknown path {other:?}: send or inbound"),
    };
    let per_message = |spent: Duration| spent.as_secs_f64() * 1e6 / sample.total.max(1) as f64;
    let hub_cpu = per_message(cpu_time(hub.pid())? - hub_before);
    let driver_cpu = per_message(cpu_time(driver.proc.pid())? - driver_before);
    progress("soak", &format!("{path} window={window}"), &sample);
    eprintln!(
        "channeld-bench [soak] CPU per message: hub {hub_cpu:.2} µs, driver {driver_cpu:.2} µs ({} messages)",
        sample.total
    );
    driver.stop()?;
    hub.proc.stop(Duration::from_secs(60))?;
    Ok(())
}

fn row(path: PathKind, ledger: Option<bool>, window: usize, reps: Vec<Sample>) -> Row {
    Row { path, ledger, window, median: median_sample(&reps), reps }
}

/// Connected drivers the scaling rows aim for at the top.
pub const TOP_DRIVERS: usize = 10_000;

/// Descriptors the hub and the bench keep besides those of the drivers.
const FD_MARGIN: usize = 256;

/// Descriptors the scaling rows' top needs: two per driver in the hub, and the margin.
pub const TOP_FDS: u64 = (2 * TOP_DRIVERS + FD_MARGIN) as u64;

/// Raises the hard open-file limit (and the soft one with it) to `wanted` when it is lower:
/// allowed to a privileged process (`CAP_SYS_RESOURCE`, up to `fs.nr_open`); unprivileged,
/// it fails and the limits stay as they were (the scaling rows then connect fewer drivers
/// and say so).
pub fn raise_hard_fd_limit(wanted: u64) -> std::io::Result<()> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_max >= wanted {
        return Ok(());
    }
    let raised = libc::rlimit { rlim_cur: wanted, rlim_max: wanted };
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The most drivers this process can connect to one hub: the hub holds two descriptors per
/// driver (its instance socket and the connection), the bench one; both run under the soft
/// limit the bench raised to the hard one at start (inherited by the hub).
pub fn drivers_within_fd_limit(wanted: usize) -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return wanted.min(500);
    }
    let soft = usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX);
    wanted.min(soft.saturating_sub(FD_MARGIN) / 2)
}

/// What a scaling run measures besides the rows (`channeld-bench scale`).
#[derive(Debug, Clone, Default)]
pub struct ScaleOptions {
    /// Record the hub with `perf record -g` during the spread row over the most drivers,
    /// into this file.
    pub perf_out: Option<PathBuf>,
}

/// Hub memory with 0, 1, 100, 1,000 and `max_drivers` connected drivers, and the hub's CPU
/// time per send with one driver, and with 1,000 and `max_drivers` connected (traffic to one
/// of them, and spread over all of them).
pub fn scale(args: &PhaseArgs, rt: &Runtime, dir: &Path, options: &ScaleOptions) -> Result<Scale> {
    let budget = &args.budget;
    let max = drivers_within_fd_limit(budget.max_drivers);
    if max < budget.max_drivers {
        eprintln!(
            "channeld-bench [{}] the open-file limit allows {max} drivers, not {}",
            args.mode, budget.max_drivers
        );
    }
    let idle: Vec<String> = (1..max).map(|i| format!("bench.d{i:05}")).collect();
    let hub_dir = dir.join("hub-scale");
    std::fs::create_dir_all(&hub_dir)?;
    let spec = HubSpec {
        ledger: false,
        extra_instances: idle.clone(),
        durability_normal: false,
        metrics: false,
    };
    let mut hub = HubProc::start(&args.bin_dir, &hub_dir, &spec)?;
    let mut result = Scale { instances_configured: max, ..Scale::default() };
    result.hub_rss_kib.push((0, crate::procs::rss_kib(hub.pid())?));

    let mut driver =
        DriverProc::start(MAIN_INSTANCE, &hub.socket(MAIN_INSTANCE), &hub_dir.join("driver.log"))?;
    // `health`, not `status`: a status of thousands of instances outgrows a control line.
    hub.wait_driver(MAIN_INSTANCE, Duration::from_secs(20))?;
    let main = vec![MAIN_INSTANCE.to_owned()];
    result.hub_rss_kib.push((1, crate::procs::rss_kib(hub.pid())?));
    let fds_with_one = hub.open_fds()?;

    // Resident sizes first, before any traffic grows the heap; then the CPU rows at 1,000
    // and at the top.
    let mut peers = Peers::spawn()?;
    let sockets: Vec<(ChannelId, PathBuf)> = idle
        .iter()
        .map(|name| Ok((ChannelId::new(name)?, hub.socket(name))))
        .collect::<Result<_>>()?;
    let mut rest = sockets.as_slice();
    for step in [100, 1000, max] {
        let take = step.saturating_sub(1 + peers.connected()).min(rest.len());
        if take == 0 {
            continue;
        }
        let (now, later) = rest.split_at(take);
        peers.connect(now.to_vec())?;
        rest = later;
        let connected = 1 + peers.connected();
        result.hub_rss_kib.push((connected, crate::procs::rss_kib(hub.pid())?));
        if connected == max {
            result.status_listing = Some(hub.list_status(max)?);
        }
        if (connected == 1000 && max > 1000) || connected == max {
            result.cpu.push(cpu_per_message(args, rt, &hub, &main, connected, "one", None)?);
            let all: Vec<String> = std::iter::once(MAIN_INSTANCE.to_owned())
                .chain(idle[..connected - 1].iter().cloned())
                .collect();
            let perf = options.perf_out.as_deref().filter(|_| connected == max);
            result.cpu.push(cpu_per_message(args, rt, &hub, &all, connected, "spread", perf)?);
        }
    }
    let connected = 1 + peers.connected();
    result.hub_rss_after_traffic_kib = Some((connected, crate::procs::rss_kib(hub.pid())?));

    drop(peers);
    hub.wait_fds_at_most(fds_with_one, Duration::from_secs(60))?;
    result.cpu.insert(0, cpu_per_message(args, rt, &hub, &main, 1, "one", None)?);
    driver.stop()?;
    hub.proc.stop(Duration::from_secs(15))?;
    Ok(result)
}

/// `channeld-bench scale`: the scaling rows alone, printed.
pub fn scale_main(args: &PhaseArgs, options: &ScaleOptions) -> Result<()> {
    let rt = runtime()?;
    let dir = tempfile::Builder::new().prefix("channeld-bench-scale-").tempdir()?;
    let scale = scale(args, &rt, dir.path(), options)?;
    for (connected, kib) in &scale.hub_rss_kib {
        eprintln!(
            "channeld-bench [scale] hub RSS with {connected} connected: {:.1} MiB",
            *kib as f64 / 1024.0
        );
    }
    if let Some((connected, kib)) = scale.hub_rss_after_traffic_kib {
        eprintln!(
            "channeld-bench [scale] hub RSS with {connected} connected after the CPU rows: {:.1} MiB",
            kib as f64 / 1024.0
        );
    }
    if let Some(listing) = &scale.status_listing {
        eprintln!(
            "channeld-bench [scale] status over {} instances ({} connected): {} pages in {:.0} ms",
            listing.instances, listing.connected, listing.pages, listing.millis
        );
    }
    let one = scale.cpu.first().map(|row| row.hub_cpu_us_per_message);
    for row in &scale.cpu {
        eprintln!(
            "channeld-bench [scale] {} connected, {}: {:.2} µs/message ({:.2}× one driver), {:.0} sends/s",
            row.connected,
            row.traffic,
            row.hub_cpu_us_per_message,
            one.map_or(f64::NAN, |one| row.hub_cpu_us_per_message / one),
            row.rate_per_s
        );
    }
    eprintln!("channeld-bench [scale] load average {}", crate::load_average());
    Ok(())
}

/// Sends with 16 in flight for the CPU measuring time and divides the hub's CPU time by the
/// sends completed meanwhile.
fn cpu_per_message(
    args: &PhaseArgs,
    rt: &Runtime,
    hub: &HubProc,
    instances: &[String],
    connected: usize,
    traffic: &str,
    perf_out: Option<&Path>,
) -> Result<CpuRow> {
    let budget = &args.budget;
    let warm =
        Plan { window: 16, warmup: 0, measure: budget.measure.min(Duration::from_millis(300)) };
    rt.block_on(control::send_round_trips(&hub.control_socket(), instances, warm))?;
    let plan = Plan { window: 16, warmup: 0, measure: budget.cpu_measure };
    let perf = perf_out.map(|out| Perf::record(hub.pid(), out)).transpose()?;
    let before = cpu_time(hub.pid())?;
    let sample = rt.block_on(control::send_round_trips(&hub.control_socket(), instances, plan))?;
    let spent = cpu_time(hub.pid())? - before;
    if let Some(perf) = perf {
        perf.finish()?;
    }
    let messages = sample.total.max(1);
    let row = CpuRow {
        connected,
        traffic: traffic.to_owned(),
        messages: sample.total,
        hub_cpu_us_per_message: spent.as_secs_f64() * 1e6 / messages as f64,
        rate_per_s: sample.rate_per_s,
    };
    eprintln!(
        "channeld-bench [{}] hub CPU with {connected} connected ({traffic}): {:.2} µs/message over {} sends (load {})",
        args.mode,
        row.hub_cpu_us_per_message,
        row.messages,
        crate::load_average()
    );
    Ok(row)
}

/// `perf record -g` attached to the hub for one row; stopped with SIGINT so it writes its
/// file.
struct Perf {
    proc: crate::procs::Proc,
}

impl Perf {
    fn record(pid: i32, out: &Path) -> Result<Self> {
        let perf = crate::procs::find_program("perf", &["/usr/bin/perf"])
            .context("perf is not installed (linux-perf)")?;
        let child = std::process::Command::new(perf)
            .args(["record", "-g", "-F", "2000", "-o"])
            .arg(out)
            .arg("-p")
            .arg(pid.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("start perf record")?;
        // perf attaches within a moment; the row runs for seconds.
        std::thread::sleep(Duration::from_millis(300));
        Ok(Self { proc: crate::procs::Proc::new("perf", child, None) })
    }

    fn finish(mut self) -> Result<()> {
        // SAFETY: a plain syscall on a child this process started and has not reaped.
        unsafe { libc::kill(self.proc.pid(), libc::SIGINT) };
        if self.proc.wait_exit(Duration::from_secs(30))?.is_none() {
            self.proc.stop(Duration::from_secs(5))?;
        }
        Ok(())
    }
}
