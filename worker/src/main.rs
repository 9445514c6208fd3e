//! `channeld-worker`: takes runs from a hub's `amqp` runtime queue on RabbitMQ and runs the
//! agent command for each under the exec contract (`channeld-agent-exec`), streaming the
//! agent's effects and commands to the hub's reply queue and ending each run with one final
//! record. A run message is acknowledged only after its final record was confirmed by the
//! broker, so a worker that dies mid-run leaves the run to RabbitMQ, which redelivers it to
//! another worker (`redelivered`, `CHANNELD_REDELIVERED=1`). A run the hub cancels (the
//! stream `<queue>.cancels`, read from its start at every connect before any run is taken,
//! then followed) has its agent's process group stopped as the exec runtime does it, or —
//! not started yet — is never run; either ends with an `aborted` final record. See README
//! "Scaling out".

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use channeld_agent_exec::amqp::{
    self, CANCEL_SYNC_TYPE, CancelSync, CommandReply, OnCancelStream, Outcome, Record,
    cancel_stream_from_start, cancel_stream_name, confirm_channel, declare_cancel_stream,
    declare_run_queue, json_properties, publish_confirmed,
};
use channeld_agent_exec::{AgentRun, ExecSpec, RunIo, StdinMode, StreamItem};
use channeld_protocol::Id;
use channeld_protocol::types::{Command, CommandAnswer, Effect};
use clap::Parser;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, LongString};
use lapin::{Channel, ConnectionProperties};
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{debug, error, info, warn};

/// `$CREDENTIALS_DIRECTORY/amqp-url`, then `CHANNELD_AMQP_URL`: the broker URL (a secret,
/// never an argument), or a cluster's node URLs separated by commas, tried in order.
const CREDENTIAL_URL: &str = "amqp-url";
const ENV_URL: &str = "CHANNELD_AMQP_URL";
/// Pause between reconnects to the broker (doubling up to the maximum).
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// Deliveries of the cancel stream on their way at once (a stream consumer needs a prefetch).
const CANCEL_PREFETCH: u16 = 256;
/// How long reading the cancel stream up to this connection's marker may take.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Parser)]
#[command(
    name = "channeld-worker",
    version,
    about = "Runs a channeld hub's agents from a RabbitMQ run queue"
)]
struct Args {
    /// The run queue (the hub's `[runtime.NAME] queue`).
    #[arg(long, env = "CHANNELD_WORKER_QUEUE")]
    queue: String,
    /// Runs at once (the consumer's prefetch).
    #[arg(long, default_value_t = 1, env = "CHANNELD_WORKER_CONCURRENCY")]
    concurrency: u16,
    /// An agent run's time limit; its process group is killed after it.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Most stdout an agent run may write.
    #[arg(long, default_value_t = 1024 * 1024)]
    max_output_bytes: usize,
    /// `envelope` (stdin closes after the envelope) or `stream` (command results follow).
    #[arg(long, default_value = "envelope", value_parser = parse_stdin)]
    stdin: StdinMode,
    /// Extra environment for the agent, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// On SIGTERM, how long running runs may finish before they are handed back.
    #[arg(long, default_value_t = 30)]
    stop_timeout_secs: u64,
    /// How often the health line is logged.
    #[arg(long, default_value_t = 60)]
    health_interval_secs: u64,
    /// The agent command (argv, no shell), after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn parse_stdin(value: &str) -> Result<StdinMode, String> {
    match value {
        "envelope" => Ok(StdinMode::Envelope),
        "stream" => Ok(StdinMode::Stream),
        other => Err(format!("{other:?} is neither envelope nor stream")),
    }
}

fn parse_env(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_owned(), value.to_owned())),
        _ => Err("expected NAME=VALUE".to_owned()),
    }
}

/// Why the worker cannot run.
#[derive(Debug, thiserror::Error)]
enum WorkerError {
    #[error("no broker URL: set ${ENV_URL} or the credential {CREDENTIAL_URL}")]
    NoUrl,
    #[error("credential {CREDENTIAL_URL}: {0}")]
    Credential(String),
    #[error("--concurrency must be at least 1")]
    Concurrency,
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker cancelled the {0} consumer")]
    Cancelled(&'static str),
    #[error("the cancel stream: {0}")]
    CancelStream(#[from] amqp::PublishError),
    #[error(
        "the cancel stream was not read up to this connection's marker within {CATCH_UP_LIMIT:?}"
    )]
    CatchUp,
    #[error("cannot watch for SIGTERM/SIGINT: {0}")]
    Signals(std::io::Error),
}

/// The broker URL, from the credential file or the environment; never logged.
fn broker_url() -> Result<String, WorkerError> {
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        let path = std::path::Path::new(&dir).join(CREDENTIAL_URL);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let url = text.trim_end_matches(['\n', '\r']).to_owned();
                if amqp::broker_urls(&url).is_empty() {
                    return Err(WorkerError::Credential("is empty".into()));
                }
                return Ok(url);
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(WorkerError::Credential(format!("could not be read: {err}"))),
        }
    }
    std::env::var(ENV_URL)
        .ok()
        .filter(|url| !amqp::broker_urls(url).is_empty())
        .ok_or(WorkerError::NoUrl)
}

/// What every run of this worker shares.
struct Worker {
    name: String,
    queue: String,
    url: String,
    concurrency: u16,
    spec: ExecSpec,
    stop_timeout: Duration,
    health_interval: Duration,
    completed: AtomicU64,
    failed: AtomicU64,
    redelivered: AtomicU64,
    cancelled: AtomicU64,
    /// Random per process: with the connection count it names this connection's marker on
    /// the cancel stream, which no other worker's may equal (two containers can share a
    /// host name and a pid).
    nonce: u64,
    /// Connections made so far.
    sessions: AtomicU64,
    /// Survives reconnects: a cancel heard before a connection was lost still counts.
    cancels: Arc<Mutex<Cancels>>,
    /// Records published without holding a run up (started, effects), at most
    /// [`ASIDE_RECORDS`] at once.
    aside: TaskTracker,
    aside_slots: Arc<Semaphore>,
}

/// Records published aside at once; beyond that one is dropped (live progress only).
const ASIDE_RECORDS: usize = 256;
/// How long a stopping worker waits for the records still on their way.
const ASIDE_DRAIN: Duration = Duration::from_secs(2);

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("name", &self.name).field("queue", &self.queue).finish()
    }
}

/// Command answers awaited by runs, by `run_id` + command id.
type Waiters = Arc<Mutex<HashMap<(String, String), oneshot::Sender<CommandAnswer>>>>;

/// Cancelled run ids remembered so that a run cancelled before it was picked is not run.
const REMEMBERED_CANCELS: usize = 4096;

/// The runs this worker runs (their cancel handles) and the runs the hub cancelled lately.
#[derive(Debug, Default)]
struct Cancels {
    running: HashMap<String, CancellationToken>,
    cancelled: HashSet<String>,
    order: VecDeque<String>,
}

impl Cancels {
    /// The cancel handle of a run about to start, or `None` when it was cancelled already.
    fn start(&mut self, run_id: &str) -> Option<CancellationToken> {
        if self.cancelled.contains(run_id) {
            return None;
        }
        let token = CancellationToken::new();
        self.running.insert(run_id.to_owned(), token.clone());
        Some(token)
    }

    fn finish(&mut self, run_id: &str) {
        self.running.remove(run_id);
    }

    /// Cancels the run if it runs here, and remembers it (bounded) in case it is picked later.
    fn cancel(&mut self, run_id: &str) -> bool {
        if self.cancelled.insert(run_id.to_owned()) {
            self.order.push_back(run_id.to_owned());
        }
        while self.order.len() > REMEMBERED_CANCELS {
            if let Some(old) = self.order.pop_front() {
                self.cancelled.remove(&old);
            }
        }
        match self.running.get(run_id) {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=warn")),
        )
        .with_writer(std::io::stdout)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            error!(error = %err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(start(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!(error = %err, "worker stopped");
            ExitCode::FAILURE
        }
    }
}

async fn start(args: Args) -> Result<(), WorkerError> {
    if args.concurrency == 0 {
        return Err(WorkerError::Concurrency);
    }
    let url = broker_url()?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "worker".into());
    let worker = Arc::new(Worker {
        name: format!("{host}:{}", std::process::id()),
        queue: args.queue,
        url,
        concurrency: args.concurrency,
        spec: ExecSpec {
            command: args.command,
            env: args.env.into_iter().collect::<BTreeMap<_, _>>(),
            timeout: Duration::from_secs(args.timeout_secs.max(1)),
            max_output_bytes: args.max_output_bytes.max(1),
            stdin: args.stdin,
        },
        stop_timeout: Duration::from_secs(args.stop_timeout_secs),
        health_interval: Duration::from_secs(args.health_interval_secs.max(1)),
        completed: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        redelivered: AtomicU64::new(0),
        cancelled: AtomicU64::new(0),
        nonce: {
            use std::hash::{BuildHasher, Hasher};
            // std seeds each `RandomState` from the OS's random source.
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        },
        sessions: AtomicU64::new(0),
        cancels: Arc::default(),
        aside: TaskTracker::new(),
        aside_slots: Arc::new(Semaphore::new(ASIDE_RECORDS)),
    });
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    // Installed before the first run is taken: a SIGTERM from then on is a graceful stop.
    let signal = |kind| tokio::signal::unix::signal(kind).map_err(WorkerError::Signals);
    let mut term = signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = signal(tokio::signal::unix::SignalKind::interrupt())?;
    let _signals = AbortOnDropHandle::new(tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping"),
            _ = int.recv() => info!("SIGINT: stopping"),
        }
        on_signal.cancel();
    }));
    let mut pause = RECONNECT_MIN;
    loop {
        match session(&worker, &stop).await {
            Ok(()) => {
                // The last effects and started records get a moment to reach the broker.
                worker.aside.close();
                let _ = tokio::time::timeout(ASIDE_DRAIN, worker.aside.wait()).await;
                info!("worker stopped");
                return Ok(());
            }
            Err(err) => {
                warn!(error = %err, "broker connection lost; running runs are left to redelivery; reconnecting");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = stop.cancelled() => {
                info!("worker stopped while disconnected");
                return Ok(());
            }
        }
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// One connection's life: consumes runs until stopped (`Ok`) or the connection fails
/// (`Err`; runs in progress are dropped, their agents killed, and RabbitMQ redelivers their
/// messages).
async fn session(worker: &Arc<Worker>, stop: &CancellationToken) -> Result<(), WorkerError> {
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("channeld-worker {}", worker.name)));
    let connection = amqp::connect_first(&worker.url, properties).await?;
    let consume = connection.create_channel().await?;
    declare_run_queue(&consume, &worker.queue).await?;
    consume.basic_qos(worker.concurrency, BasicQosOptions::default()).await?;
    let publish = confirm_channel(&connection).await?;
    // Every cancel published before this connection is read before the first run is taken.
    let Some(mut cancels_in) = follow_cancels(worker, &connection, &publish, stop).await? else {
        let _ = connection.close(200, "worker stopping".into()).await;
        return Ok(());
    };
    // Command answers for this worker's runs: a private queue that goes with the connection.
    let commands = connection.create_channel().await?;
    let private = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
    let command_queue =
        commands.queue_declare("".into(), private, FieldTable::default()).await?.name().to_string();
    let mut answers = commands
        .basic_consume(
            command_queue.as_str().into(),
            "".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        )
        .await?;
    let tag = format!("channeld-worker-{}", worker.name);
    let mut consumer = consume
        .basic_consume(
            worker.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    info!(queue = %worker.queue, concurrency = worker.concurrency, worker = %worker.name, "worker ready");
    let waiters: Waiters = Arc::default();
    let cancels = worker.cancels.clone();
    let mut runs = JoinSet::new();
    let mut health = tokio::time::interval(worker.health_interval);
    let connection_lost = loop {
        tokio::select! {
            () = stop.cancelled() => break None,
            delivery = consumer.next() => match delivery {
                Some(Ok(delivery)) => {
                    let run = Run {
                        worker: worker.clone(),
                        publish: publish.clone(),
                        command_queue: command_queue.clone(),
                        waiters: waiters.clone(),
                        cancels: cancels.clone(),
                    };
                    runs.spawn(run.handle(delivery));
                }
                Some(Err(err)) => break Some(WorkerError::Broker(err)),
                None => break Some(WorkerError::Cancelled("run queue's")),
            },
            answer = answers.next() => match answer {
                Some(Ok(delivery)) => answer_command(&waiters, &delivery),
                Some(Err(err)) => break Some(WorkerError::Broker(err)),
                None => break Some(WorkerError::Cancelled("command answers'")),
            },
            cancel = cancels_in.next() => match cancel {
                Some(Ok(delivery)) => {
                    on_cancel_stream(&cancels, &delivery).await;
                }
                Some(Err(err)) => break Some(WorkerError::Broker(err)),
                None => break Some(WorkerError::Cancelled("cancel stream's")),
            },
            Some(_) = runs.join_next() => {}
            _ = health.tick() => log_health(worker, runs.len(), true),
        }
    };
    if let Some(err) = connection_lost {
        runs.abort_all();
        return Err(err);
    }
    // Graceful stop: no new runs; the running ones may finish, then are handed back.
    info!(running = runs.len(), "stopping: no new runs; waiting for the running ones");
    if let Err(err) = consume.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await
    {
        debug!(error = %err, "cancelling the consumer failed");
    }
    let deadline = tokio::time::Instant::now() + worker.stop_timeout;
    while !runs.is_empty() {
        tokio::select! {
            _ = runs.join_next() => {}
            answer = answers.next() => {
                if let Some(Ok(delivery)) = answer { answer_command(&waiters, &delivery) }
            }
            cancel = cancels_in.next() => {
                if let Some(Ok(delivery)) = cancel { on_cancel_stream(&cancels, &delivery).await; }
            }
            () = tokio::time::sleep_until(deadline) => {
                warn!(running = runs.len(), "stop timeout: handing the running runs back to the queue");
                runs.abort_all();
                while runs.join_next().await.is_some() {}
            }
        }
    }
    // Closing the channels requeues whatever is unacknowledged (runs handed back).
    let _ = connection.close(200, "worker stopping".into()).await;
    log_health(worker, 0, false);
    Ok(())
}

fn log_health(worker: &Worker, running: usize, connected: bool) {
    info!(
        connected,
        running,
        completed = worker.completed.load(Ordering::Relaxed),
        failed = worker.failed.load(Ordering::Relaxed),
        redelivered = worker.redelivered.load(Ordering::Relaxed),
        cancelled = worker.cancelled.load(Ordering::Relaxed),
        "worker health"
    );
}

/// Follows the run queue's cancel stream from its start: publishes this connection's marker
/// and reads (and applies) every cancel up to it, so a run cancelled before this worker
/// connected is known as cancelled before any run is taken. `None` when the worker was
/// stopped meanwhile.
async fn follow_cancels(
    worker: &Worker,
    connection: &lapin::Connection,
    publish: &Channel,
    stop: &CancellationToken,
) -> Result<Option<lapin::Consumer>, WorkerError> {
    let channel = connection.create_channel().await?;
    declare_cancel_stream(&channel, &worker.queue).await?;
    channel.basic_qos(CANCEL_PREFETCH, BasicQosOptions::default()).await?;
    let stream = cancel_stream_name(&worker.queue);
    let mut consumer = channel
        .basic_consume(
            stream.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            cancel_stream_from_start(),
        )
        .await?;
    let session = worker.sessions.fetch_add(1, Ordering::Relaxed);
    let marker = CancelSync { sync: format!("{}#{:016x}-{session}", worker.name, worker.nonce) };
    let body = serde_json::to_vec(&marker).expect("markers serialize");
    publish_confirmed(publish, &stream, &body, json_properties(CANCEL_SYNC_TYPE, &marker.sync))
        .await?;
    let read_up_to_marker = async {
        while let Some(delivery) = consumer.next().await {
            let delivery = delivery?;
            if on_cancel_stream(&worker.cancels, &delivery).await == Some(marker.clone()) {
                return Ok(());
            }
        }
        Err(WorkerError::Cancelled("cancel stream's"))
    };
    tokio::select! {
        read = tokio::time::timeout(CATCH_UP_LIMIT, read_up_to_marker) => {
            read.map_err(|_| WorkerError::CatchUp)??;
            debug!(marker = %marker.sync, "cancel stream read up to this connection's marker");
            Ok(Some(consumer))
        }
        () = stop.cancelled() => Ok(None),
    }
}

/// A message on the cancel stream: a cancel is applied (the run stopped if it runs here,
/// remembered either way); a worker's marker is returned.
async fn on_cancel_stream(cancels: &Mutex<Cancels>, delivery: &Delivery) -> Option<CancelSync> {
    // A stream consumer's acks only return credit; the message stays in the stream.
    if let Err(err) = delivery.acker.ack(BasicAckOptions::default()).await {
        debug!(error = %err, "cancel stream ack failed");
    }
    let kind = delivery.properties.kind().as_ref().map(|kind| kind.as_str());
    match OnCancelStream::read(kind, &delivery.data) {
        OnCancelStream::Cancel(cancel) => {
            if lock(cancels).cancel(&cancel.run_id) {
                info!(run_id = %cancel.run_id, "run cancelled by the hub: stopping its agent");
            } else {
                debug!(run_id = %cancel.run_id, "cancel of a run not running here (remembered)");
            }
            None
        }
        OnCancelStream::Sync(marker) => Some(marker),
        OnCancelStream::Other => {
            debug!(?kind, "message on the cancel stream skipped");
            None
        }
    }
}

fn answer_command(waiters: &Waiters, delivery: &Delivery) {
    match serde_json::from_slice::<CommandReply>(&delivery.data) {
        Ok(reply) => {
            let key = (reply.run_id.clone(), reply.command_id.to_string());
            match lock(waiters).remove(&key) {
                Some(waiter) => {
                    let _ = waiter.send(reply.answer());
                }
                None => {
                    debug!(run_id = %key.0, command_id = %key.1, "answer for a command no run waits for")
                }
            }
        }
        Err(err) => warn!(error = %err, "unreadable command answer ignored"),
    }
}

/// One run message being worked on.
struct Run {
    worker: Arc<Worker>,
    publish: Channel,
    command_queue: String,
    waiters: Waiters,
    cancels: Arc<Mutex<Cancels>>,
}

impl Run {
    async fn handle(self, delivery: Delivery) {
        let properties = &delivery.properties;
        let reply_to = properties.reply_to().as_ref().map(|q| q.to_string());
        let parsed = AgentRun::from_slice(&delivery.data);
        let (mut agent_run, reply_to) = match (parsed, reply_to) {
            (Ok(run), Some(reply_to)) if !reply_to.is_empty() => (run, reply_to),
            (parsed, reply_to) => {
                // Not a run this worker can answer: dead-lettered, never retried.
                let reason = match parsed {
                    Err(err) => err.to_string(),
                    Ok(_) => format!("no reply_to ({reply_to:?})"),
                };
                error!(%reason, "run message refused (dead-lettered)");
                let _ = delivery.acker.reject(BasicRejectOptions { requeue: false }).await;
                return;
            }
        };
        if delivery.redelivered {
            agent_run.mark_redelivered();
        }
        // The environment from the inbound's metadata, filtered again by the run's family.
        let env = amqp::env_from_headers(properties.headers().as_ref());
        agent_run.set_metadata_env(env.iter().map(|(name, value)| (name.as_str(), value.as_str())));
        let run_id = agent_run.run_id.clone();
        if agent_run.redelivered {
            self.worker.redelivered.fetch_add(1, Ordering::Relaxed);
        }
        let io = WorkerIo { run: &self, run_id: &run_id, reply_to: &reply_to };
        // A run the hub cancelled before it was picked is answered `aborted` without its
        // agent ever starting.
        let cancel = lock(&self.cancels).start(&run_id);
        let result = match cancel {
            Some(cancel) => {
                info!(%run_id, redelivered = agent_run.redelivered, "run started");
                io.started();
                let result =
                    channeld_agent_exec::run(&self.worker.spec, &agent_run, &io, &cancel).await;
                lock(&self.cancels).finish(&run_id);
                result
            }
            None => {
                info!(%run_id, "run cancelled by the hub before it started: not run");
                Err(channeld_agent_exec::ExecError::Aborted)
            }
        };
        let outcome = match result {
            Ok(output) => Outcome::Reply { reply: output.reply, metadata: output.metadata },
            Err(channeld_agent_exec::ExecError::Aborted) => {
                self.worker.cancelled.fetch_add(1, Ordering::Relaxed);
                let err = channeld_agent_exec::ExecError::Aborted;
                Outcome::Failed { code: err.code().to_owned(), message: err.public_message() }
            }
            Err(err) => {
                warn!(%run_id, error = %err, "agent run failed");
                self.worker.failed.fetch_add(1, Ordering::Relaxed);
                Outcome::Failed { code: err.code().to_owned(), message: err.public_message() }
            }
        };
        let record = Record::Final {
            run_id: run_id.clone(),
            worker: self.worker.name.clone(),
            redelivered: agent_run.redelivered,
            outcome,
        };
        let body = serde_json::to_vec(&record).expect("records serialize");
        let properties = json_properties(record.kind(), &run_id);
        match publish_confirmed(&self.publish, &reply_to, &body, properties).await {
            Ok(()) => {
                if let Err(err) = delivery.acker.ack(BasicAckOptions::default()).await {
                    warn!(%run_id, error = %err, "run finished but its ack failed; it will be redelivered");
                } else {
                    self.worker.completed.fetch_add(1, Ordering::Relaxed);
                    info!(%run_id, "run finished");
                }
            }
            Err(err) => {
                warn!(%run_id, error = %err, "final record not confirmed; the run goes back to the queue");
                let _ = delivery
                    .acker
                    .nack(BasicNackOptions { requeue: true, ..Default::default() })
                    .await;
            }
        }
    }
}

/// A run's live side: effects and commands go to the hub's reply queue.
struct WorkerIo<'a> {
    run: &'a Run,
    run_id: &'a str,
    reply_to: &'a str,
}

impl WorkerIo<'_> {
    /// Tells the hub the run starts here (not waited for: the hub needs it only for a run it
    /// cancelled before this worker heard of the cancel).
    fn started(&self) {
        let record = Record::Started {
            run_id: self.run_id.to_owned(),
            worker: self.run.worker.name.clone(),
        };
        self.publish_aside(&record, "started");
    }

    /// Publishes `record` without waiting for it: tracked, and at most [`ASIDE_RECORDS`] of
    /// the worker's at once — one more is dropped (logged), as one lost with the connection.
    fn publish_aside(&self, record: &Record, what: &'static str) {
        let worker = &self.run.worker;
        let Ok(slot) = worker.aside_slots.clone().try_acquire_owned() else {
            debug!(run_id = %self.run_id, what, "too many records on their way; dropped");
            return;
        };
        let body = serde_json::to_vec(record).expect("records serialize");
        let properties = json_properties(record.kind(), self.run_id);
        let (channel, queue) = (self.run.publish.clone(), self.reply_to.to_owned());
        worker.aside.spawn(async move {
            let _slot = slot;
            if let Err(err) = publish_confirmed(&channel, &queue, &body, properties).await {
                debug!(error = %err, what, "record not sent");
            }
        });
    }

    async fn send(&self, record: &Record) -> Result<(), amqp::PublishError> {
        let body = serde_json::to_vec(record).expect("records serialize");
        let properties = json_properties(record.kind(), self.run_id);
        publish_confirmed(&self.run.publish, self.reply_to, &body, properties).await
    }
}

impl RunIo for WorkerIo<'_> {
    fn effect(&self, effect: Effect) {
        // Live progress: sent without holding the run up; one lost with the connection is
        // not retried.
        let record = Record::Effect { run_id: self.run_id.to_owned(), effect };
        self.publish_aside(&record, "effect");
    }

    async fn stream(&self, item: StreamItem) {
        // Deltas and tool reports go in order: each is confirmed before the next line is read.
        let run_id = self.run_id.to_owned();
        let record = match item {
            StreamItem::Delta(text) => Record::Delta { run_id, text },
            StreamItem::Tool(tool) => Record::Tool { run_id, tool },
        };
        if let Err(err) = self.send(&record).await {
            debug!(run_id = %self.run_id, error = %err, "stream record not sent");
        }
    }

    async fn command(&self, command_id: Id, command: Command) -> CommandAnswer {
        let key = (self.run_id.to_owned(), command_id.to_string());
        let (tx, rx) = oneshot::channel();
        lock(&self.run.waiters).insert(key.clone(), tx);
        let record = Record::Command {
            run_id: self.run_id.to_owned(),
            command_id,
            command,
            reply_to: self.run.command_queue.clone(),
        };
        let answer = match self.send(&record).await {
            Err(err) => {
                CommandAnswer::rejected(format!("the command could not reach the hub: {err}"))
            }
            // The hub answers within its command timeout; the run's own limit bounds the wait.
            Ok(()) => match tokio::time::timeout(self.run.worker.spec.timeout, rx).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) | Err(_) => CommandAnswer::rejected("no answer from the hub in time"),
            },
        };
        lock(&self.run.waiters).remove(&key);
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_stops_a_running_run_and_keeps_a_later_pick_from_running() {
        let mut cancels = Cancels::default();
        let running = cancels.start("run-1").expect("not cancelled");
        assert!(cancels.cancel("run-1"));
        assert!(running.is_cancelled());
        cancels.finish("run-1");
        assert!(!cancels.cancel("run-2"), "run-2 does not run here");
        assert!(cancels.start("run-2").is_none(), "a cancelled run is not started");
        assert!(cancels.start("run-3").is_some());
    }

    #[test]
    fn remembered_cancels_are_bounded() {
        let mut cancels = Cancels::default();
        for n in 0..REMEMBERED_CANCELS + 10 {
            cancels.cancel(&format!("run-{n}"));
        }
        assert_eq!(cancels.cancelled.len(), REMEMBERED_CANCELS);
        assert!(cancels.start("run-0").is_some(), "the oldest were forgotten");
        assert!(cancels.start(&format!("run-{}", REMEMBERED_CANCELS + 9)).is_none());
    }
}
