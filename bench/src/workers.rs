//! Runs over RabbitMQ: the hub's `amqp` runtime with `channeld-worker`s on a real broker.
//!
//! - `channeld-bench workers`: throughput with 1, 2 and 4 workers (fixed `--concurrency`) on
//!   an agent that sleeps, then answers. One RabbitMQ for all rows; per row a fresh hub
//!   (ledger on) and fresh queues, inbound pushed through one driver connection with twice
//!   the workers' total concurrency in flight. Prints runs/s, p50/p99 run latency and the
//!   speed-up against one worker; it never judges the numbers.
//! - `channeld-bench cluster-run`: the 1,000-run check of `tests/tests/scale.rs` against a
//!   broker (or cluster) given by `$CHANNELD_AMQP_URL` (comma-separated node URLs), running a
//!   command (stopping a node) mid-stream; prints answered / lost / repeated and the elapsed
//!   time. `scripts/rabbitmq-cluster` runs it against a three-node cluster.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use channeld_link::split_unix;
use channeld_protocol::frame::{HealthResponse, Hello, Inbound, Lifecycle, Receipt};
use channeld_protocol::types::{
    Capabilities, DeliveryReceipt, Health, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_protocol::{ChannelId, Frame, Id};
use serde::Serialize;
use tokio::net::UnixStream;
use tokio::sync::Semaphore;

use crate::broker::RabbitMq;
use crate::hub::HubProc;
use crate::procs::{Proc, binary, wait_until};
use crate::stats::percentile_us;

/// The instance both modes drive.
const INSTANCE: &str = "bench.remote";
/// The environment variable the hub's runtime reads its broker URL(s) from.
const HUB_URL_ENV: &str = "CHANNELD_BENCH_AMQP_URL";
/// Where `cluster-run` takes the broker URL(s) from (never from argv: a URL holds a password).
pub const CLUSTER_URL_ENV: &str = "CHANNELD_AMQP_URL";

/// `channeld-bench workers` settings.
#[derive(Debug, Clone)]
pub struct WorkersArgs {
    pub bin_dir: PathBuf,
    /// Worker counts, one row each.
    pub workers: Vec<usize>,
    /// Each worker's `--concurrency`.
    pub concurrency: u16,
    /// How long the agent sleeps before it answers.
    pub sleep: Duration,
    /// Runs per row = this × the row's worker count (so every row lasts about as long).
    pub runs_per_worker: usize,
    /// Where the JSON goes.
    pub json: PathBuf,
}

/// One row of the throughput table.
#[derive(Debug, Clone, Serialize)]
pub struct WorkersRow {
    pub workers: usize,
    pub concurrency: u16,
    /// Inbound kept in flight by the driver.
    pub window: usize,
    pub runs: usize,
    pub answered: usize,
    pub failed: usize,
    /// Completions per second between the 10th and the 90th percentile completion (the
    /// ramp-up and the drain left out).
    pub runs_per_s: f64,
    /// What the workers could do at most: workers × concurrency / sleep.
    pub ideal_per_s: f64,
    /// This row's rate over the one-worker row's.
    pub speedup: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub elapsed_s: f64,
}

#[derive(Debug, Serialize)]
struct WorkersReport {
    schema: &'static str,
    sleep_ms: u64,
    load_before: String,
    load_after: String,
    rows: Vec<WorkersRow>,
}

/// An agent that sleeps, then answers `done <event id>`; with `log`, it first appends
/// `<run id> <redelivered flag>` to it (as the scale test's agent).
fn write_agent(dir: &Path, sleep: Duration, log: Option<&Path>) -> Result<PathBuf> {
    let path = dir.join("agent.sh");
    let record = log
        .map(|log| {
            format!("echo \"$CHANNELD_RUN_ID $CHANNELD_REDELIVERED\" >> '{}'\n", log.display())
        })
        .unwrap_or_default();
    let text = format!(
        "#!/bin/sh\n\
         IFS= read -r line\n\
         id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
         {record}sleep {:.3}\n\
         echo \"done $id\"\n",
        sleep.as_secs_f64()
    );
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

fn hub_config(queue: &str, max_inflight: usize, max_queued: usize) -> String {
    format!(
        "[runtime.remote]\nkind = \"amqp\"\nurl = \"env:{HUB_URL_ENV}\"\n\
         queue = \"{queue}\"\nreply_queue = \"{queue}.replies\"\ntimeout_secs = 120\n\
         [instance.\"{INSTANCE}\"]\nallow_all = true\nruntime = \"remote\"\n\
         max_inflight = {max_inflight}\nmax_queued = {max_queued}\n"
    )
}

/// Starts a `channeld-worker` on `queue` and waits until it consumes.
fn start_worker(
    bin_dir: &Path,
    dir: &Path,
    name: &str,
    url: &str,
    queue: &str,
    concurrency: u16,
    agent: &Path,
) -> Result<Proc> {
    let worker =
        binary(bin_dir, "channeld-worker", "build it with `cargo build -p channeld-worker`")?;
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log)?;
    let child = Command::new(&worker)
        .args(["--queue", queue, "--concurrency", &concurrency.to_string()])
        .args(["--timeout-secs", "60", "--health-interval-secs", "3600", "--"])
        .arg(agent)
        .env(CLUSTER_URL_ENV, url)
        .env("RUST_LOG", "info,lapin=warn")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {}", worker.display()))?;
    let mut proc = Proc::new(format!("channeld-worker {name}"), child, Some(log.clone()));
    wait_until(&mut proc, Duration::from_secs(60), "connect and consume", || {
        std::fs::read_to_string(&log).is_ok_and(|text| text.contains("worker ready"))
    })?;
    Ok(proc)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `channeld-bench workers`.
pub fn workers_bench(args: &WorkersArgs) -> Result<()> {
    binary(&args.bin_dir, "channeld-worker", "build it with `cargo build -p channeld-worker`")?;
    let dir = tempfile::Builder::new().prefix("channeld-bench-workers-").tempdir()?;
    let load_before = load_average();
    let rabbit_dir = dir.path().join("rabbitmq");
    std::fs::create_dir_all(&rabbit_dir)?;
    eprintln!("channeld-bench workers: starting RabbitMQ");
    let rabbit = RabbitMq::start(&rabbit_dir)?;
    let url = rabbit.guest_url();
    let agent = write_agent(dir.path(), args.sleep, None)?;
    let rt = runtime()?;
    let mut rows: Vec<WorkersRow> = Vec::new();
    for &workers in &args.workers {
        let row_dir = dir.path().join(format!("w{workers}"));
        std::fs::create_dir_all(&row_dir)?;
        let queue = format!("bench.runs.w{workers}");
        let window = 2 * workers * usize::from(args.concurrency);
        let runs = args.runs_per_worker * workers;
        let mut hub = HubProc::start_config(
            &args.bin_dir,
            &row_dir,
            &hub_config(&queue, window, 4 * window + runs),
            true,
            &[(HUB_URL_ENV, url.as_str())],
        )?;
        let mut procs = Vec::new();
        for n in 0..workers {
            let name = format!("worker-{n}");
            procs.push(start_worker(
                &args.bin_dir,
                &row_dir,
                &name,
                &url,
                &queue,
                args.concurrency,
                &agent,
            )?);
        }
        let socket = hub.socket(INSTANCE);
        let drive = rt
            .block_on(drive(&socket, runs, window, Duration::from_secs(60), None))
            .with_context(|| format!("{workers} workers{}", hub.proc.log_tail()))?;
        for proc in &mut procs {
            proc.stop(Duration::from_secs(10))?;
        }
        hub.proc.stop(Duration::from_secs(15))?;
        if let Some(why) = &drive.stalled {
            bail!("{workers} workers: {why}{}", hub.proc.log_tail());
        }
        let mut latencies = drive.latencies.clone();
        latencies.sort_unstable();
        let row = WorkersRow {
            workers,
            concurrency: args.concurrency,
            window,
            runs,
            answered: drive.replies.len(),
            failed: drive.failed.len(),
            runs_per_s: steady_rate(&drive.completions),
            ideal_per_s: (workers * usize::from(args.concurrency)) as f64
                / args.sleep.as_secs_f64().max(1e-3),
            speedup: 0.0,
            p50_ms: percentile_us(&latencies, 0.50) / 1000.0,
            p99_ms: percentile_us(&latencies, 0.99) / 1000.0,
            elapsed_s: drive.elapsed.as_secs_f64(),
        };
        eprintln!(
            "channeld-bench workers: {workers} worker(s): {:.1} runs/s, p50 {:.0} ms, p99 {:.0} ms, {} failed",
            row.runs_per_s, row.p50_ms, row.p99_ms, row.failed
        );
        rows.push(row);
    }
    drop(rabbit);
    let base = rows.first().map(|row| row.runs_per_s).unwrap_or(0.0);
    for row in &mut rows {
        row.speedup = if base > 0.0 { row.runs_per_s / base } else { 0.0 };
    }
    let report = WorkersReport {
        schema: "channeld-bench-workers/1",
        sleep_ms: args.sleep.as_millis() as u64,
        load_before,
        load_after: load_average(),
        rows,
    };
    println!("{}", workers_markdown(&report));
    if let Some(parent) = args.json.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("write {}", args.json.display()))?;
    eprintln!("channeld-bench workers: results written to {}", args.json.display());
    Ok(())
}

fn workers_markdown(report: &WorkersReport) -> String {
    let mut out = format!(
        "Runs over RabbitMQ: agent sleeps {} ms; load average before {} / after {}\n\n\
         | workers × concurrency | in flight | runs | runs/s | ideal runs/s | speed-up vs 1 | p50 run ms | p99 run ms | failed |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        report.sleep_ms, report.load_before, report.load_after
    );
    for row in &report.rows {
        out.push_str(&format!(
            "| {} × {} | {} | {} | {:.1} | {:.0} | {:.2}× | {:.0} | {:.0} | {} |\n",
            row.workers,
            row.concurrency,
            row.window,
            row.runs,
            row.runs_per_s,
            row.ideal_per_s,
            row.speedup,
            row.p50_ms,
            row.p99_ms,
            row.failed
        ));
    }
    out
}

/// Completions per second between the 10th and the 90th percentile completion time
/// (`completions` in order); over the whole run when there are too few to cut.
pub fn steady_rate(completions: &[Duration]) -> f64 {
    let n = completions.len();
    if n < 2 {
        return 0.0;
    }
    let (lo, hi) = if n >= 20 { (n / 10, n - 1 - n / 10) } else { (0, n - 1) };
    let span = completions[hi].saturating_sub(completions[lo]).as_secs_f64();
    if span <= 0.0 { 0.0 } else { (hi - lo) as f64 / span }
}

/// `channeld-bench cluster-run` settings.
#[derive(Debug, Clone)]
pub struct ClusterArgs {
    pub bin_dir: PathBuf,
    pub runs: usize,
    pub workers: usize,
    pub concurrency: u16,
    pub sleep: Duration,
    /// After this many answers, `stop_command` runs (through `sh -c`).
    pub stop_after: usize,
    pub stop_command: Option<String>,
    /// Longest wait for one frame before the rest count as lost.
    pub quiet: Duration,
}

/// What a cluster run found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    pub answered: usize,
    pub lost: usize,
    pub failed: usize,
    /// Events answered more than once (the driver saw a second reply).
    pub answered_twice: usize,
    /// Agent starts beyond the first per run id.
    pub repeated_starts: usize,
    /// Repeated starts not flagged `CHANNELD_REDELIVERED=1`.
    pub unflagged_repeats: usize,
    /// Run ids started at all.
    pub runs_started: usize,
}

impl Verdict {
    /// Nothing lost, nothing failed, nothing answered twice, every repeat flagged.
    pub fn clean(&self) -> bool {
        self.lost == 0
            && self.failed == 0
            && self.answered_twice == 0
            && self.unflagged_repeats == 0
    }
}

/// Judges a run from the replies per event and the agents' log (`run_id flag` lines).
pub fn verdict(
    runs: usize,
    replies: &HashMap<String, Vec<String>>,
    failed: usize,
    agent_log: &str,
) -> Verdict {
    let answered = replies.len();
    let answered_twice = replies.values().filter(|texts| texts.len() > 1).count();
    let mut starts: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in agent_log.lines() {
        let (run, flag) = line.split_once(' ').unwrap_or((line, ""));
        starts.entry(run).or_default().push(flag);
    }
    let mut repeated_starts = 0;
    let mut unflagged_repeats = 0;
    for flags in starts.values() {
        repeated_starts += flags.len() - 1;
        unflagged_repeats += flags[1..].iter().filter(|flag| **flag != "1").count();
    }
    Verdict {
        answered,
        lost: runs.saturating_sub(answered + failed),
        failed,
        answered_twice,
        repeated_starts,
        unflagged_repeats,
        runs_started: starts.len(),
    }
}

/// `channeld-bench cluster-run`: returns whether the run was clean.
pub fn cluster_run(args: &ClusterArgs) -> Result<bool> {
    let url = std::env::var(CLUSTER_URL_ENV)
        .ok()
        .filter(|url| !url.trim().is_empty())
        .with_context(|| {
            format!("set ${CLUSTER_URL_ENV} to the broker URL(s), comma-separated for a cluster")
        })?;
    let dir = tempfile::Builder::new().prefix("channeld-bench-cluster-").tempdir()?;
    let agent_log = dir.path().join("runs.log");
    let agent = write_agent(dir.path(), args.sleep, Some(&agent_log))?;
    let queue = format!("cluster.runs.{}", std::process::id());
    let mut hub = HubProc::start_config(
        &args.bin_dir,
        dir.path(),
        &hub_config(&queue, 32, 2 * args.runs),
        true,
        &[(HUB_URL_ENV, url.as_str())],
    )?;
    let mut procs = Vec::new();
    for n in 0..args.workers {
        let name = format!("worker-{n}");
        procs.push(start_worker(
            &args.bin_dir,
            dir.path(),
            &name,
            &url,
            &queue,
            args.concurrency,
            &agent,
        )?);
    }
    let midway = args.stop_command.clone().map(|command| {
        let action: Box<dyn FnOnce() -> String + Send> = Box::new(move || {
            let started = Instant::now();
            match Command::new("sh").arg("-c").arg(&command).stdin(Stdio::null()).status() {
                Ok(status) => format!(
                    "`{command}` exited with {status} after {:.1} s",
                    started.elapsed().as_secs_f64()
                ),
                Err(err) => format!("`{command}` could not run: {err}"),
            }
        });
        (args.stop_after, action)
    });
    eprintln!(
        "channeld-bench cluster-run: {} runs over {} workers (concurrency {}), agent sleeps {} ms",
        args.runs,
        args.workers,
        args.concurrency,
        args.sleep.as_millis()
    );
    let drive = runtime()?.block_on(drive(
        &hub.socket(INSTANCE),
        args.runs,
        args.runs,
        args.quiet,
        midway,
    ))?;
    for proc in &mut procs {
        proc.stop(Duration::from_secs(10))?;
    }
    hub.proc.stop(Duration::from_secs(15))?;
    let log = std::fs::read_to_string(&agent_log).unwrap_or_default();
    let verdict = verdict(args.runs, &drive.replies, drive.failed.len(), &log);
    if let Some(midway) = &drive.midway {
        println!("mid-stream: {midway}");
    }
    if let Some(why) = &drive.stalled {
        println!("stalled: {why}");
    }
    if let Some((event, why)) = drive.failed.iter().next() {
        println!("first failure: {event}: {why}");
    }
    println!(
        "runs {}: answered {}, lost {}, failed {}, answered twice {}; agent starts: {} runs, \
         {} repeated ({} not flagged redelivered); elapsed {:.1} s",
        args.runs,
        verdict.answered,
        verdict.lost,
        verdict.failed,
        verdict.answered_twice,
        verdict.runs_started,
        verdict.repeated_starts,
        verdict.unflagged_repeats,
        drive.elapsed.as_secs_f64()
    );
    if !verdict.clean() {
        let keep = dir.keep();
        println!("logs kept in {}", keep.display());
    }
    Ok(verdict.clean())
}

/// What one drive saw.
#[derive(Debug, Default)]
pub struct Drive {
    /// Reply texts by event id (a second entry is a repeat).
    pub replies: HashMap<String, Vec<String>>,
    /// Failed events (an `error` frame for them): event id → code and message.
    pub failed: BTreeMap<String, String>,
    /// First answer latency per answered event.
    pub latencies: Vec<Duration>,
    /// First answers' times since the first send, in order.
    pub completions: Vec<Duration>,
    pub elapsed: Duration,
    /// Why the drive ended before every event was answered.
    pub stalled: Option<String>,
    /// The mid-stream action's report.
    pub midway: Option<String>,
}

/// The answer to the hub's `health_request`: ready.
fn health(request_id: Id) -> Frame {
    Frame::HealthResponse(HealthResponse { request_id, health: Health::ready() })
}

fn id(value: &str) -> Result<Id> {
    Id::new(value).with_context(|| format!("invalid id {value:?}"))
}

/// Connects as the instance's driver, sends `count` inbound (one conversation each) keeping
/// `window` unanswered, acknowledges every reply with a receipt, and runs `midway` (on a
/// blocking thread, while reading goes on) once `at` events were answered.
async fn drive(
    socket: &Path,
    count: usize,
    window: usize,
    quiet: Duration,
    midway: Option<(usize, Box<dyn FnOnce() -> String + Send>)>,
) -> Result<Drive> {
    let stream = UnixStream::connect(socket)
        .await
        .with_context(|| format!("connect {}", socket.display()))?;
    let (mut reader, sink, _writer) = split_unix(stream, 1024)?;
    let channel = ChannelId::new(INSTANCE).context("channel id")?;
    let mut capabilities = Capabilities::default();
    capabilities.set("receive", true);
    capabilities.set("send", true);
    sink.send(&Frame::Hello(Hello {
        request_id: id("bench-hello")?,
        channel: channel.clone(),
        capabilities,
        actions: Default::default(),
        // A hello with extensions gets a `hello_ack` (a reference hello gets none).
        extensions: vec!["accepted".to_owned()],
        operator_actions: Vec::new(),
    }))
    .await?;
    sink.send(&Frame::Start(Lifecycle { request_id: id("bench-start")? })).await?;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), reader.next()).await {
            Ok(Ok(Some(Ok(Frame::HelloAck(_))))) => break,
            Ok(Ok(Some(Ok(Frame::HealthRequest(request))))) => {
                sink.send(&health(request.request_id)).await?;
            }
            Ok(Ok(Some(Ok(Frame::Event(_) | Frame::Health(_) | Frame::Accepted(_))))) => {}
            other => bail!("the hub did not acknowledge hello: {other:?}"),
        }
    }
    let started: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let room = Arc::new(Semaphore::new(window.max(1)));
    let t0 = Instant::now();
    let sender = {
        let (started, room, sink, channel) = (started.clone(), room.clone(), sink.clone(), channel);
        tokio::spawn(async move {
            for n in 0..count {
                let permit = room.acquire().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                permit.forget();
                let event = format!("e-{n}");
                let message = InboundMessage {
                    id: id(&event)?,
                    target: MessageTarget::new(channel.clone(), id(&format!("c{n}"))?),
                    sender: Participant::new(id("bench-user")?),
                    body: MessageBody::text("work")?,
                    timestamp_ms: None,
                    metadata: Default::default(),
                };
                started
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(event.clone(), Instant::now());
                sink.send(&Frame::Inbound(Inbound { event_id: id(&event)?, message })).await?;
            }
            anyhow::Ok(())
        })
    };
    let mut out = Drive::default();
    let mut midway = midway;
    let mut midway_task = None;
    let mut done = 0;
    let receipt = |delivery: &channeld_protocol::frame::Delivery| {
        Frame::Receipt(Receipt {
            request_id: delivery.request_id.clone(),
            receipt: DeliveryReceipt {
                channel: delivery.message.target.channel.clone(),
                message_id: delivery.request_id.clone(),
                target: delivery.message.target.clone(),
                timestamp_ms: None,
            },
        })
    };
    while done < count {
        let frame = match tokio::time::timeout(quiet, reader.next()).await {
            Ok(Ok(Some(Ok(frame)))) => frame,
            Ok(Ok(Some(Err(err)))) => bail!("undecodable frame from the hub: {err}"),
            Ok(Ok(None)) => {
                out.stalled =
                    Some(format!("the hub closed the connection after {done} of {count}"));
                break;
            }
            Ok(Err(err)) => bail!("reading from the hub: {err}"),
            Err(_) => {
                out.stalled = Some(format!("no frame for {quiet:?} after {done} of {count} ended"));
                break;
            }
        };
        match frame {
            Frame::Deliver(delivery) => {
                sink.send(&receipt(&delivery)).await?;
                let event = delivery.request_id.to_string();
                let texts = out.replies.entry(event.clone()).or_default();
                texts.push(delivery.message.body.text_str().to_owned());
                if texts.len() > 1 || out.failed.contains_key(&event) {
                    continue;
                }
                let now = Instant::now();
                if let Some(sent) = started.lock().unwrap_or_else(|p| p.into_inner()).get(&event) {
                    out.latencies.push(now.duration_since(*sent));
                }
                out.completions.push(now.duration_since(t0));
                room.add_permits(1);
                done += 1;
            }
            Frame::Error(err) => {
                let Some(event) = err.request_id.as_ref().map(|r| r.to_string()) else {
                    eprintln!("channeld-bench: hub error: {}: {}", err.code, err.message);
                    continue;
                };
                if out.replies.contains_key(&event) || out.failed.contains_key(&event) {
                    continue;
                }
                out.failed.insert(event, format!("{}: {}", err.code, err.message));
                room.add_permits(1);
                done += 1;
            }
            Frame::HealthRequest(request) => {
                sink.send(&health(request.request_id)).await?;
                continue;
            }
            _ => continue,
        }
        if let Some((at, _)) = &midway
            && done >= *at
            && let Some((_, action)) = midway.take()
        {
            eprintln!("channeld-bench: {done} answered: running the mid-stream action");
            midway_task = Some(tokio::task::spawn_blocking(action));
        }
    }
    out.elapsed = t0.elapsed();
    // Anything owed arrives now: a second reply to an event would be a repeat.
    let settle = Instant::now() + Duration::from_secs(1);
    while let Ok(Ok(Some(Ok(frame)))) =
        tokio::time::timeout_at(tokio::time::Instant::from_std(settle), reader.next()).await
    {
        if let Frame::HealthRequest(request) = frame {
            sink.send(&health(request.request_id)).await?;
        } else if let Frame::Deliver(delivery) = frame {
            sink.send(&receipt(&delivery)).await?;
            out.replies
                .entry(delivery.request_id.to_string())
                .or_default()
                .push(delivery.message.body.text_str().to_owned());
        }
    }
    if out.stalled.is_none() {
        sender.await.context("the sender task")??;
    } else {
        sender.abort();
    }
    if let Some(task) = midway_task {
        out.midway = Some(task.await.context("the mid-stream action")?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steady_rate_leaves_out_ramp_and_drain() {
        let even: Vec<Duration> = (1..=100).map(|n| Duration::from_millis(10 * n)).collect();
        assert!((steady_rate(&even) - 100.0).abs() < 1e-6);
        assert_eq!(steady_rate(&[Duration::from_secs(1)]), 0.0);
        let few = [Duration::from_secs(1), Duration::from_secs(3)];
        assert!((steady_rate(&few) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_verdict_counts_lost_repeated_and_unflagged_runs() {
        let mut replies = HashMap::new();
        replies.insert("e-0".to_owned(), vec!["done e-0".to_owned()]);
        replies.insert("e-1".to_owned(), vec!["done e-1".to_owned(), "done e-1".to_owned()]);
        let log = "r0 0\nr1 0\nr1 1\nr2 0\nr2 0\n";
        let v = verdict(4, &replies, 1, log);
        assert_eq!(
            v,
            Verdict {
                answered: 2,
                lost: 1,
                failed: 1,
                answered_twice: 1,
                repeated_starts: 2,
                unflagged_repeats: 1,
                runs_started: 3,
            }
        );
        assert!(!v.clean());
        let clean =
            verdict(1, &HashMap::from([("e-0".into(), vec!["x".into()])]), 0, "r0 0\nr0 1\n");
        assert!(clean.clean(), "{clean:?}");
    }
}
