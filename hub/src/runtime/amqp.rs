//! The `amqp` runtime: each run is handed to `channeld-worker`s through a RabbitMQ run queue
//! and answered on this hub's reply queue (PROTOCOL.md, "Runs over RabbitMQ").
//!
//! A run is recorded in the ledger before it starts (as every run); it is then published
//! with publisher confirms — persistent, `message_id` = `correlation_id` = run id, `reply_to`
//! = the reply queue — and counts as handed over only once the broker confirmed it. A nack
//! or a lost connection is retried under the same run id until the runtime's
//! `timeout_secs`. The reply queue's consumer routes each record to the run waiting for it:
//! effects and commands are carried out as for the exec runtime (a command's answer goes to
//! the worker's command queue), and the first final record ends the run. A run is taken
//! once: a second final record (a redelivered run finished twice) and one that arrives after
//! the run timed out are logged and ignored. A cancelled run is cancelled on the workers too
//! (the stream `<queue>.cancels`, which a worker reads from its start before it takes a
//! run): the one running it stops its agent, one that picks it later — connected before the
//! cancel or after it — skips it, and a `started` record of a run cancelled earlier (a cancel
//! that could not be published) is answered with the cancel again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use channeld_agent_exec::AgentRun;
use channeld_agent_exec::amqp::{
    CANCEL_TYPE, COMMAND_RESULT_TYPE, CancelRun, CommandReply, ENV_HEADER, Outcome, PublishError,
    RUN_MESSAGE_TYPE, Record, cancel_stream_name, confirm_channel, connect_first,
    declare_cancel_stream, declare_reply_queue, declare_run_queue, env_header, json_properties,
    publish_confirmed,
};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until, timeout_at};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use super::{RunError, RunIo, RunOutput, RunRequest, StreamItem, exec};
use crate::config::{AmqpTarget, RuntimeConfig};

/// Pause between broker reconnects (doubling up to the maximum).
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// Records buffered per waiting run.
const RUN_RECORDS: usize = 64;
/// Reply-queue messages in flight to this hub.
const REPLY_PREFETCH: u16 = 256;
/// Ended runs remembered to tell a duplicate or late result from an unknown one.
const REMEMBERED: usize = 16_384;
/// How long a cancel may take to reach the broker.
const CANCEL_SEND_TIMEOUT: Duration = Duration::from_secs(5);

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `amqp` runtimes' broker clients, one per runtime binding (made on first use).
#[derive(Debug, Default)]
pub struct Remote {
    clients: Mutex<HashMap<String, Arc<Client>>>,
}

impl Remote {
    fn client(&self, name: &str, target: &AmqpTarget) -> Arc<Client> {
        let mut clients = lock(&self.clients);
        if let Some(client) = clients.get(name).filter(|c| c.target == *target) {
            return client.clone();
        }
        // New, or changed by a reload: the old client stays with the runs that hold it.
        let client = Client::start(name, target.clone());
        clients.insert(name.to_owned(), client.clone());
        client
    }
}

/// How a run that is no longer waited for ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Taken,
    TimedOut,
    Cancelled,
}

#[derive(Debug, Default)]
struct Memory {
    order: VecDeque<String>,
    ended: HashMap<String, Ended>,
}

/// One runtime's broker side: the publisher and the reply queue's consumer.
#[derive(Debug)]
struct Client {
    name: String,
    target: AmqpTarget,
    waiting: Mutex<HashMap<String, mpsc::Sender<Record>>>,
    memory: Mutex<Memory>,
    publisher: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    consumer: Mutex<Option<AbortOnDropHandle<()>>>,
}

impl Client {
    fn start(name: &str, target: AmqpTarget) -> Arc<Self> {
        let client = Arc::new(Self {
            name: name.to_owned(),
            target,
            waiting: Mutex::default(),
            memory: Mutex::default(),
            publisher: tokio::sync::Mutex::new(None),
            consumer: Mutex::new(None),
        });
        let task = tokio::spawn(consume(Arc::downgrade(&client)));
        *lock(&client.consumer) = Some(AbortOnDropHandle::new(task));
        client
    }

    async fn connect(&self, role: &str) -> lapin::Result<Connection> {
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(format!("channeld {role} {}", self.name)));
        connect_first(self.target.url.expose(), properties).await
    }

    /// The confirm-mode channel, connecting (and declaring the queues) when there is none.
    async fn publisher(&self) -> Result<Channel, lapin::Error> {
        let mut publisher = self.publisher.lock().await;
        if let Some((connection, channel)) = publisher.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let connection = self.connect("runs").await?;
        let channel = confirm_channel(&connection).await?;
        declare_run_queue(&channel, &self.target.queue).await?;
        declare_reply_queue(&channel, &self.target.reply_queue).await?;
        declare_cancel_stream(&channel, &self.target.queue).await?;
        *publisher = Some((connection, channel.clone()));
        Ok(channel)
    }

    async fn forget_publisher(&self) {
        if let Some((connection, _)) = self.publisher.lock().await.take() {
            let _ = connection.close(200, "reconnecting".into()).await;
        }
    }

    /// Publishes the run until the broker confirms it, under the same run id each time.
    async fn hand_over(&self, run: &AgentRun, deadline: Instant) -> Result<(), RunError> {
        let mut body = run.envelope_line();
        let mut headers = FieldTable::default();
        if !run.metadata_env().is_empty() {
            headers.insert(
                ShortString::from(ENV_HEADER),
                AMQPValue::FieldTable(env_header(run.metadata_env())),
            );
        }
        let properties = json_properties(RUN_MESSAGE_TYPE, &run.run_id)
            .with_message_id(run.run_id.as_str().into())
            .with_reply_to(self.target.reply_queue.as_str().into())
            .with_headers(headers);
        let mut pause = RECONNECT_MIN;
        loop {
            let attempt = async {
                let channel = self.publisher().await?;
                publish_confirmed(&channel, &self.target.queue, &body, properties.clone()).await
            };
            match timeout_at(deadline, attempt).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(err)) => {
                    warn!(run_id = %run.run_id, error = %err, "run not handed over; retrying under the same run id");
                    self.forget_publisher().await;
                    // The broker may have taken the lost attempt: a second copy is flagged.
                    let mut again = run.clone();
                    again.mark_redelivered();
                    body = again.envelope_line();
                }
                Err(_) => break,
            }
            if timeout_at(deadline, tokio::time::sleep(pause)).await.is_err() {
                break;
            }
            pause = (pause * 2).min(RECONNECT_MAX);
        }
        Err(RunError::Unavailable("the run was not handed over before its timeout".into()))
    }

    /// Sends a command's answer to the worker that asked.
    async fn answer(&self, queue: &str, reply: &CommandReply) {
        let body = serde_json::to_vec(reply).expect("command replies serialize");
        let properties = json_properties(COMMAND_RESULT_TYPE, reply.command_id.as_str());
        let sent = match self.publisher().await {
            Ok(channel) => publish_confirmed(&channel, queue, &body, properties)
                .await
                .map_err(|e| e.to_string()),
            Err(err) => Err(err.to_string()),
        };
        if let Err(err) = sent {
            // The worker's wait ends in `rejected`: commands fail closed.
            warn!(run_id = %reply.run_id, command_id = %reply.command_id, error = %err, "command answer not sent to the worker");
        }
    }

    /// Tells every worker of the run queue that `run_id` was cancelled: the one running it
    /// stops its agent, one that picks it later does not run it. Best effort, bounded by
    /// [`CANCEL_SEND_TIMEOUT`]; the hub ignores the run's result either way.
    async fn cancel_remote(&self, run_id: &str) {
        let body = serde_json::to_vec(&CancelRun { run_id: run_id.to_owned() })
            .expect("cancels serialize");
        let stream = cancel_stream_name(&self.target.queue);
        let send = async {
            let channel = self.publisher().await.map_err(PublishError::from)?;
            let properties = json_properties(CANCEL_TYPE, run_id);
            publish_confirmed(&channel, &stream, &body, properties).await
        };
        match tokio::time::timeout(CANCEL_SEND_TIMEOUT, send).await {
            Ok(Ok(())) => debug!(runtime = %self.name, %run_id, "cancel sent to the workers"),
            Ok(Err(err)) => {
                warn!(runtime = %self.name, %run_id, error = %err, "cancel not sent to the workers; its result will be ignored")
            }
            Err(_) => {
                warn!(runtime = %self.name, %run_id, "cancel not sent to the workers in time; its result will be ignored")
            }
        }
    }

    fn wait_for(self: &Arc<Self>, run_id: &str) -> (Waiting, mpsc::Receiver<Record>) {
        let (tx, rx) = mpsc::channel(RUN_RECORDS);
        lock(&self.waiting).insert(run_id.to_owned(), tx);
        lock(&self.memory).ended.remove(run_id);
        (Waiting { client: self.clone(), run_id: run_id.to_owned(), ended: Ended::TimedOut }, rx)
    }

    fn remember(&self, run_id: String, ended: Ended) {
        let mut memory = lock(&self.memory);
        if memory.ended.insert(run_id.clone(), ended).is_none() {
            memory.order.push_back(run_id);
        }
        while memory.order.len() > REMEMBERED {
            if let Some(old) = memory.order.pop_front() {
                memory.ended.remove(&old);
            }
        }
    }

    /// Hands a record to the run waiting for it, or logs why nobody takes it.
    async fn route(&self, record: Record) {
        let waiting = lock(&self.waiting).get(record.run_id()).cloned();
        let record = match waiting {
            Some(tx) => match tx.send(record).await {
                Ok(()) => return,
                Err(mpsc::error::SendError(record)) => record,
            },
            None => record,
        };
        let ended = lock(&self.memory).ended.get(record.run_id()).copied();
        match (&record, ended) {
            (Record::Started { run_id, worker }, Some(Ended::Cancelled)) => {
                // A worker picked the run without having read its cancel (the cancel could not
                // be published, or raced the pick).
                info!(runtime = %self.name, %run_id, %worker, "a cancelled run was picked by a worker; cancelling it again");
                self.cancel_remote(run_id).await;
            }
            (Record::Final { run_id, worker, redelivered, .. }, Some(Ended::Taken)) => {
                warn!(runtime = %self.name, %run_id, %worker, redelivered, "duplicate result of a run already taken; ignored");
            }
            (Record::Final { run_id, worker, .. }, Some(Ended::TimedOut)) => {
                warn!(runtime = %self.name, %run_id, %worker, "late result of a run that timed out; ignored");
            }
            (Record::Final { run_id, worker, .. }, Some(Ended::Cancelled)) => {
                info!(runtime = %self.name, %run_id, %worker, "result of a cancelled run; ignored");
            }
            (Record::Final { run_id, worker, .. }, None) => {
                warn!(runtime = %self.name, %run_id, %worker, "result of a run this hub is not waiting for (from before a restart?); ignored");
            }
            (other, _) => {
                debug!(runtime = %self.name, run_id = %other.run_id(), kind = other.kind(), "record of a run no longer waited for; ignored");
            }
        }
    }
}

/// A run's place among the waiting ones; leaving it (however the run ends) remembers how.
struct Waiting {
    client: Arc<Client>,
    run_id: String,
    ended: Ended,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        lock(&self.client.waiting).remove(&self.run_id);
        self.client.remember(std::mem::take(&mut self.run_id), self.ended);
    }
}

/// The reply queue's consumer, reconnecting for as long as the client lives.
async fn consume(client: std::sync::Weak<Client>) {
    let mut pause = RECONNECT_MIN;
    loop {
        let Some(strong) = client.upgrade() else { return };
        match consume_once(&strong, &mut pause).await {
            Ok(()) => {
                warn!(runtime = %strong.name, "the broker cancelled the reply queue's consumer; resubscribing")
            }
            Err(err) => {
                warn!(runtime = %strong.name, error = %err, "reply queue connection lost; reconnecting")
            }
        }
        drop(strong);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

async fn consume_once(client: &Client, pause: &mut Duration) -> lapin::Result<()> {
    let connection = client.connect("replies").await?;
    let channel = connection.create_channel().await?;
    declare_reply_queue(&channel, &client.target.reply_queue).await?;
    channel.basic_qos(REPLY_PREFETCH, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            client.target.reply_queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    info!(runtime = %client.name, queue = %client.target.reply_queue, "reply queue consumer ready");
    *pause = RECONNECT_MIN;
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        match serde_json::from_slice::<Record>(&delivery.data) {
            Ok(record) => client.route(record).await,
            Err(err) => {
                warn!(runtime = %client.name, error = %err, "unreadable record on the reply queue; dropped")
            }
        }
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

/// Runs `request` on the workers behind `config`'s run queue. A cancel ends the wait
/// (`RunError::Aborted`) once the cancel was sent to the workers (`<queue>.cancels`): the
/// worker running the run stops its agent, one that picks it later does not start it, and
/// the hub ignores whatever result still comes.
pub(super) async fn run(
    remote: &Remote,
    config: &RuntimeConfig,
    request: &RunRequest,
    io: &impl RunIo,
    cancel: &CancellationToken,
) -> Result<RunOutput, RunError> {
    let target = config
        .amqp
        .as_ref()
        .ok_or_else(|| RunError::Unavailable("the runtime has no broker settings".into()))?;
    let deadline = Instant::now() + config.timeout;
    let client = remote.client(&config.name, target);
    let run = exec::agent_run(config, request)?;
    let (mut waiting, records) = client.wait_for(&run.run_id);
    let result = tokio::select! {
        result = follow(&client, config, &run, io, records, deadline) => result,
        () = cancel.cancelled() => Err(RunError::Aborted),
    };
    if matches!(result, Err(RunError::Aborted)) {
        // Remembered as cancelled first: a worker that starts it now is told again.
        waiting.ended = Ended::Cancelled;
        drop(waiting);
        client.cancel_remote(&run.run_id).await;
        return result;
    }
    waiting.ended = match &result {
        Err(RunError::Aborted) => Ended::Cancelled,
        Err(RunError::Timeout(_) | RunError::Unavailable(_)) => Ended::TimedOut,
        _ => Ended::Taken,
    };
    result
}

/// Hands the run over, then carries out its records until the final one.
async fn follow(
    client: &Client,
    config: &RuntimeConfig,
    run: &AgentRun,
    io: &impl RunIo,
    mut records: mpsc::Receiver<Record>,
    deadline: Instant,
) -> Result<RunOutput, RunError> {
    client.hand_over(run, deadline).await?;
    debug!(queue = %client.target.queue, "run handed over");
    loop {
        let record = tokio::select! {
            record = records.recv() => record,
            () = sleep_until(deadline) => None,
        };
        let Some(record) = record else {
            return Err(RunError::Timeout(config.timeout.as_secs()));
        };
        match record {
            Record::Started { worker, .. } => debug!(%worker, "run started on a worker"),
            Record::Effect { effect, .. } => io.effect(effect),
            Record::Delta { text, .. } => io.stream(StreamItem::Delta(text)).await,
            Record::Tool { tool, .. } => io.stream(StreamItem::Tool(tool)).await,
            Record::Command { command_id, command, reply_to, .. } => {
                let answer = tokio::select! {
                    answer = io.command(command_id.clone(), command) => answer,
                    () = sleep_until(deadline) => return Err(RunError::Timeout(config.timeout.as_secs())),
                };
                client.answer(&reply_to, &CommandReply::new(&run.run_id, command_id, answer)).await;
            }
            Record::Final { worker, redelivered, outcome, .. } => {
                info!(%worker, redelivered, "result taken from a worker");
                return match outcome {
                    Outcome::Reply { reply, metadata } => Ok(RunOutput { reply, metadata }),
                    Outcome::Failed { code, message } => Err(RunError::Remote { code, message }),
                };
            }
        }
    }
}
