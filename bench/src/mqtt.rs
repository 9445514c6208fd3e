//! The mosquitto side of the comparison, with rumqttc at its best (a large inflight window;
//! TCP_NODELAY on or off like the broker): the client publishes a request at QoS 1, the responder (`channeld-bench
//! mqtt-responder`, its own process, standing where a driver would) gets it at QoS 1 and
//! publishes the reply at QoS 1, and the client times the whole round trip.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

use crate::payload;
use crate::procs::Proc;
use crate::stats::{Meter, Plan, Sample};

/// Unacknowledged QoS 1 publishes a client may have out (rumqttc's default is 100).
const INFLIGHT: u16 = 1024;
/// rumqttc's request channel; the bench never queues more than the window (≤ 256) at once.
const REQUEST_QUEUE: usize = 4096;
/// Replies handed from the client's event loop task to the measuring loop.
const REPLY_QUEUE: usize = 4096;

fn options(client_id: &str, port: u16) -> MqttOptions {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options
        .set_keep_alive(Duration::from_secs(30))
        .set_inflight(INFLIGHT)
        .set_max_packet_size(64 * 1024, 64 * 1024);
    options
}

fn connect(client_id: &str, port: u16, nagle: bool) -> (AsyncClient, EventLoop) {
    let (client, mut eventloop) = AsyncClient::new(options(client_id, port), REQUEST_QUEUE);
    let mut network = eventloop.network_options();
    network.set_tcp_nodelay(!nagle);
    eventloop.set_network_options(network);
    (client, eventloop)
}

fn request_topic(prefix: &str) -> String {
    format!("bench/{prefix}/req")
}

fn reply_topic(prefix: &str) -> String {
    format!("bench/{prefix}/resp")
}

/// `channeld-bench mqtt-responder <port> <prefix> [--nagle]`: answers every request with a reply
/// carrying the same envelope. Prints `ready` once subscribed; runs until killed.
pub fn responder_main(port: u16, prefix: &str, nagle: bool) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("mqtt-responder: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(respond(port, prefix, nagle)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("mqtt-responder: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn respond(port: u16, prefix: &str, nagle: bool) -> Result<()> {
    let (client, mut eventloop) = connect(&format!("bench-responder-{prefix}"), port, nagle);
    let requests = request_topic(prefix);
    let replies = reply_topic(prefix);
    loop {
        let event = eventloop.poll().await.context("responder connection")?;
        match event {
            Event::Incoming(Packet::ConnAck(_)) => {
                client.try_subscribe(&requests, QoS::AtLeastOnce).context("subscribe")?;
            }
            Event::Incoming(Packet::SubAck(_)) => {
                let mut out = std::io::stdout().lock();
                out.write_all(b"ready\n")?;
                out.flush()?;
            }
            Event::Incoming(Packet::Publish(publish)) => {
                // A driver reads the envelope and writes its own: parse and serialise.
                let envelope: payload::Envelope =
                    serde_json::from_slice(&publish.payload).context("request envelope")?;
                let reply = serde_json::to_vec(&envelope)?;
                client
                    .try_publish(&replies, QoS::AtLeastOnce, false, reply)
                    .context("reply publish (request queue full)")?;
            }
            _ => {}
        }
    }
}

/// A running responder process, stopped by PID on drop.
#[derive(Debug)]
pub struct Responder {
    pub proc: Proc,
}

impl Responder {
    /// Starts the responder and waits for its `ready`.
    pub fn start(port: u16, prefix: &str, nagle: bool, log: &std::path::Path) -> Result<Self> {
        let exe = std::env::current_exe().context("locate channeld-bench")?;
        let mut child = Command::new(exe)
            .arg("mqtt-responder")
            .arg(port.to_string())
            .arg(prefix)
            .args(nagle.then_some("--nagle"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .context("start the MQTT responder")?;
        let stdout = child.stdout.take().context("responder stdout")?;
        let proc = Proc::new("mqtt responder", child, Some(log.to_owned()));
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("the MQTT responder did not get ready{}", proc.log_tail());
        }
        Ok(Self { proc })
    }
}

enum FromBroker {
    Subscribed,
    Reply(Option<u64>),
    Failed(String),
}

/// One repetition: `plan.window` requests in flight through mosquitto on `port`, to the
/// responder serving `prefix`, from a new client connection named `client_id`.
pub async fn round_trips(
    port: u16,
    prefix: &str,
    client_id: &str,
    nagle: bool,
    plan: Plan,
) -> Result<Sample> {
    let (client, mut eventloop) = connect(client_id, port, nagle);
    let requests = request_topic(prefix);
    client.subscribe(reply_topic(prefix), QoS::AtLeastOnce).await?;
    let (tx, mut rx) = mpsc::channel(REPLY_QUEUE);
    let poller = tokio::spawn(async move {
        loop {
            let message = match eventloop.poll().await {
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    FromBroker::Reply(payload::envelope_seq(&publish.payload))
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => FromBroker::Subscribed,
                Ok(_) => continue,
                Err(err) => FromBroker::Failed(err.to_string()),
            };
            let failed = matches!(message, FromBroker::Failed(_));
            if tx.send(message).await.is_err() || failed {
                return;
            }
        }
    });
    let measured = measure(&client, &requests, &mut rx, plan).await;
    poller.abort();
    measured
}

async fn measure(
    client: &AsyncClient,
    requests: &str,
    rx: &mut mpsc::Receiver<FromBroker>,
    plan: Plan,
) -> Result<Sample> {
    match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
        Ok(Some(FromBroker::Subscribed)) => {}
        Ok(Some(FromBroker::Failed(err))) => bail!("MQTT client: {err}"),
        _ => bail!("MQTT client was not subscribed within 10 s"),
    }
    let mut meter = Meter::new(plan);
    let deadline = Instant::now() + plan.measure + crate::control::stall_limit(plan);
    loop {
        let now = Instant::now();
        while meter.may_issue(now) {
            let seq = meter.issue(now);
            client.publish(requests, QoS::AtLeastOnce, false, payload::envelope(seq)).await?;
        }
        if meter.finished(now) {
            break;
        }
        if now > deadline {
            bail!("MQTT replies stalled with {} in flight", meter.in_flight());
        }
        let first = match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(message)) => message,
            Ok(None) => bail!("MQTT client event loop ended"),
            Err(_) => bail!("no MQTT reply for 30 s with {} in flight", meter.in_flight()),
        };
        let now = Instant::now();
        let mut next = Some(first);
        while let Some(message) = next {
            match message {
                FromBroker::Reply(Some(seq)) => meter.complete(seq, now, Ok(())),
                FromBroker::Reply(None) => bail!("MQTT reply without a readable envelope"),
                FromBroker::Subscribed => {}
                FromBroker::Failed(err) => bail!("MQTT client: {err}"),
            }
            next = rx.try_recv().ok();
        }
    }
    Ok(meter.sample())
}
