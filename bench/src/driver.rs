//! The minimal SDK driver (`channeld-bench driver`, a process of its own): declares receive
//! and send, answers every post with a receipt at once, and on command injects inbound
//! messages and times each until its `deliver` comes back. [`DriverProc`] is the bench's
//! handle on that process.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use channeld_driver_sdk::protocol::types::{
    DeliveryReceipt, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, DriverLaunchConfig, Hub, Post,
    PostError, PostKind,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::payload;
use crate::procs::Proc;
use crate::stats::{Meter, Plan, Sample};

/// Commands queued between the stdin thread and the driver.
const COMMAND_QUEUE: usize = 4;

/// A command on the driver's stdin (one JSON line).
#[derive(Debug, Serialize, Deserialize)]
struct InboundCommand {
    plan: Plan,
    /// Event ids are `<prefix>-<seq>`: unique across repetitions, so the ledger never
    /// treats a new message as a redelivery.
    prefix: String,
}

/// The answer on the driver's stdout.
#[derive(Debug, Serialize, Deserialize)]
struct InboundResult {
    sample: Option<Sample>,
    error: Option<String>,
}

/// `channeld-bench driver`: runs the bench driver under the SDK's `main`.
pub fn driver_main() -> std::process::ExitCode {
    channeld_driver_sdk::main(|launch| async move { BenchDriver::new(launch) })
}

/// One inbound workload in progress.
#[derive(Debug)]
struct Workload {
    prefix: String,
    meter: Mutex<Meter>,
    window: Semaphore,
    idle: Notify,
}

impl Workload {
    fn meter(&self) -> MutexGuard<'_, Meter> {
        self.meter.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records the outcome of `seq` and frees its window slot.
    fn complete(&self, seq: u64, outcome: Result<(), String>) {
        let idle = {
            let mut meter = self.meter();
            meter.complete(seq, Instant::now(), outcome);
            meter.in_flight() == 0
        };
        self.window.add_permits(1);
        if idle {
            self.idle.notify_one();
        }
    }
}

#[derive(Debug)]
struct BenchDriver {
    channel: ChannelId,
    commands: Mutex<Option<mpsc::Receiver<String>>>,
    current: Mutex<Option<Arc<Workload>>>,
}

impl BenchDriver {
    fn new(launch: DriverLaunchConfig) -> Result<Self, DriverError> {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        // A thread, not tokio's stdin: an idle blocking read must not keep the runtime from
        // shutting down. It ends at end of input, which ends the driver.
        std::thread::Builder::new()
            .name("commands".into())
            .spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    if tx.blocking_send(line).is_err() {
                        break;
                    }
                }
            })
            .map_err(|err| DriverError::Platform(format!("cannot read stdin: {err}")))?;
        Ok(Self {
            channel: launch.channel,
            commands: Mutex::new(Some(rx)),
            current: Mutex::new(None),
        })
    }

    fn workload(&self) -> Option<Arc<Workload>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn run_inbound(&self, hub: &Hub, command: InboundCommand) -> Result<Sample, String> {
        let plan = command.plan;
        let workload = Arc::new(Workload {
            prefix: command.prefix,
            meter: Mutex::new(Meter::new(plan)),
            window: Semaphore::new(plan.window),
            idle: Notify::new(),
        });
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(workload.clone());
        let text = MessageBody::text(payload::text()).map_err(|e| e.to_string())?;
        // One conversation per window slot: a conversation's runs are sequential in the hub,
        // so the window spreads over as many conversations as it holds messages.
        let rooms: Vec<MessageTarget> = (0..plan.window.max(1))
            .map(|n| {
                let room = Id::new(format!("room-{n}")).expect("valid id");
                MessageTarget::new(self.channel.clone(), room)
            })
            .collect();
        let sender = Participant::new(Id::new("bench-user").expect("valid id"));
        loop {
            let permit = workload.window.acquire().await.map_err(|e| e.to_string())?;
            permit.forget();
            let seq = {
                let mut meter = workload.meter();
                let now = Instant::now();
                if !meter.may_issue(now) {
                    drop(meter);
                    workload.window.add_permits(1);
                    break;
                }
                meter.issue(now)
            };
            let message = InboundMessage {
                id: Id::new(format!("{}-{seq}", workload.prefix)).map_err(|e| e.to_string())?,
                target: rooms[seq as usize % rooms.len()].clone(),
                sender: sender.clone(),
                body: text.clone(),
                timestamp_ms: None,
                metadata: Default::default(),
            };
            let ticket = match hub.inbound(message).await {
                Ok(ticket) => ticket,
                Err(err) => {
                    workload.complete(seq, Err(err.to_string()));
                    continue;
                }
            };
            // As a platform driver would before acknowledging: learn whether the hub took it.
            let watched = workload.clone();
            tokio::spawn(async move {
                match ticket.outcome().await {
                    Acceptance::Accepted { .. } => {}
                    Acceptance::Rejected { code, message } => {
                        watched.complete(seq, Err(format!("{code}: {message}")))
                    }
                    Acceptance::Unresolved => watched.complete(seq, Err("unresolved".into())),
                }
            });
        }
        let drained = async {
            loop {
                if workload.meter().finished(Instant::now()) {
                    return;
                }
                workload.idle.notified().await;
            }
        };
        let stall = crate::control::stall_limit(plan);
        if tokio::time::timeout(stall, drained).await.is_err() {
            let in_flight = workload.meter().in_flight();
            return Err(format!("{in_flight} inbound messages got no deliver within {stall:?}"));
        }
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let mut meter = workload.meter();
        if let Some(err) = meter.first_error() {
            eprintln!("channeld-bench driver: inbound errors, first: {err}");
        }
        Ok(meter.sample())
    }
}

impl Driver for BenchDriver {
    fn declaration(&self) -> Declaration {
        let mut declaration = Declaration::default();
        declaration.capabilities.receive = true;
        declaration.capabilities.send = true;
        declaration
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let Some(mut commands) = self.commands.lock().unwrap_or_else(|p| p.into_inner()).take()
        else {
            return Err(DriverError::Platform("run called twice".into()));
        };
        loop {
            let line = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                line = commands.recv() => match line {
                    Some(line) => line,
                    None => return Ok(()),
                },
            };
            let result = match serde_json::from_str::<InboundCommand>(&line) {
                Ok(command) => match self.run_inbound(&hub, command).await {
                    Ok(sample) => InboundResult { sample: Some(sample), error: None },
                    Err(err) => InboundResult { sample: None, error: Some(err) },
                },
                Err(err) => {
                    InboundResult { sample: None, error: Some(format!("bad command: {err}")) }
                }
            };
            let mut out = std::io::stdout().lock();
            let written = serde_json::to_writer(&mut out, &result)
                .map_err(std::io::Error::other)
                .and_then(|()| out.write_all(b"\n"))
                .and_then(|()| out.flush());
            if let Err(err) = written {
                return Err(DriverError::Platform(format!("cannot write the result: {err}")));
            }
        }
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        if let PostKind::Reply { event_id } = &post.kind
            && let Some(workload) = self.workload()
            && let Some(seq) = event_id
                .as_str()
                .strip_prefix(workload.prefix.as_str())
                .and_then(|rest| rest.strip_prefix('-'))
                .and_then(|seq| seq.parse().ok())
        {
            workload.complete(seq, Ok(()));
        }
        let message_id = match &post.kind {
            PostKind::Reply { event_id } => event_id.clone(),
            PostKind::Proactive { request_id } => request_id.clone(),
        };
        let target = post.message.target;
        Ok(DeliveryReceipt {
            channel: target.channel.clone(),
            message_id,
            target,
            timestamp_ms: None,
        })
    }
}

/// The bench's handle on a driver process: started with the SDK's launch variables, told
/// what to do on stdin, answering on stdout; stopped by PID.
#[derive(Debug)]
pub struct DriverProc {
    pub proc: Proc,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl DriverProc {
    /// Starts `channeld-bench driver` for `instance` on `socket`, logging to `log`.
    pub fn start(instance: &str, socket: &Path, log: &Path) -> Result<Self> {
        let exe = std::env::current_exe().context("locate channeld-bench")?;
        let mut child = Command::new(exe)
            .arg("driver")
            .env("CHANNELD_CHANNEL_ID", instance)
            .env("CHANNELD_SOCKET", socket)
            .env("CHANNELD_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .context("start the bench driver")?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("driver stdout")?);
        Ok(Self { proc: Proc::new("bench driver", child, Some(log.to_owned())), stdin, stdout })
    }

    /// Injects inbound messages under `plan` and returns what the driver measured.
    pub fn inbound(&mut self, plan: Plan, prefix: &str) -> Result<Sample> {
        let command = InboundCommand { plan, prefix: prefix.to_owned() };
        let stdin = self.stdin.as_mut().context("driver stdin is closed")?;
        let mut line = serde_json::to_vec(&command)?;
        line.push(b'\n');
        stdin.write_all(&line).context("write to the bench driver")?;
        stdin.flush()?;
        let mut answer = String::new();
        if self.stdout.read_line(&mut answer)? == 0 {
            bail!("the bench driver exited{}", self.proc.log_tail());
        }
        let result: InboundResult = serde_json::from_str(&answer).context("driver result")?;
        match (result.sample, result.error) {
            (Some(sample), _) => Ok(sample),
            (None, error) => bail!("inbound run failed: {}", error.unwrap_or_default()),
        }
    }

    /// Ends the driver's input (it drains and exits 0); stops it by PID if it does not.
    pub fn stop(&mut self) -> Result<()> {
        drop(self.stdin.take());
        if self.proc.wait_exit(Duration::from_secs(15))?.is_none() {
            self.proc.stop(Duration::from_secs(5))?;
        }
        Ok(())
    }
}
