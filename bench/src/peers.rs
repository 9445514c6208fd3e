//! Lightweight idle drivers for the scaling rows: raw socket connections that say `hello`
//! (declaring every extension, as the SDK does) and `start`, then only answer what the hub
//! asks — `health_request` and, when a send is routed to them, `outbound` with a receipt.
//! They run on a thread of their own so their cost stays out of the hub process.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use channeld_link::split_unix;
use channeld_protocol::ext::Extensions;
use channeld_protocol::frame::{HealthResponse, Hello, Lifecycle, Receipt};
use channeld_protocol::types::{Capabilities, DeliveryReceipt, Health};
use channeld_protocol::{ChannelId, Frame, Id};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

/// Outgoing frames queued per idle peer.
const PEER_QUEUE: usize = 64;
/// Connect requests queued for the peer thread.
const COMMAND_QUEUE: usize = 4;

struct Connect {
    peers: Vec<(ChannelId, PathBuf)>,
    done: oneshot::Sender<Result<()>>,
}

/// A thread holding idle driver connections; dropping it closes them all.
#[derive(Debug)]
pub struct Peers {
    commands: Option<mpsc::Sender<Connect>>,
    thread: Option<std::thread::JoinHandle<()>>,
    connected: usize,
}

impl Peers {
    pub fn spawn() -> Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Connect>(COMMAND_QUEUE);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new().name("idle-peers".into()).spawn(move || {
            runtime.block_on(async move {
                while let Some(Connect { peers, done }) = rx.recv().await {
                    let _ = done.send(connect_all(peers).await);
                }
            });
        })?;
        Ok(Self { commands: Some(tx), thread: Some(thread), connected: 0 })
    }

    pub fn connected(&self) -> usize {
        self.connected
    }

    /// Connects one idle peer per `(instance, socket)` and returns once the hub has
    /// acknowledged every hello.
    pub fn connect(&mut self, peers: Vec<(ChannelId, PathBuf)>) -> Result<()> {
        let count = peers.len();
        let (done, result) = oneshot::channel();
        let commands = self.commands.as_ref().context("peer thread stopped")?;
        commands
            .blocking_send(Connect { peers, done })
            .map_err(|_| anyhow!("peer thread stopped"))?;
        result.blocking_recv().map_err(|_| anyhow!("peer thread stopped"))??;
        self.connected += count;
        Ok(())
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        drop(self.commands.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn connect_all(peers: Vec<(ChannelId, PathBuf)>) -> Result<()> {
    let mut ready = Vec::with_capacity(peers.len());
    for (channel, socket) in peers {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let outcome = peer(channel.clone(), socket, tx).await;
            if let Err(err) = outcome {
                eprintln!("channeld-bench: idle peer {channel}: {err:#}");
            }
        });
        ready.push(rx);
    }
    for rx in ready {
        match tokio::time::timeout(Duration::from_secs(30), rx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(err))) => bail!("idle peer handshake: {err}"),
            Ok(Err(_)) => bail!("idle peer ended before its handshake"),
            Err(_) => bail!("no hello_ack within 30 s"),
        }
    }
    Ok(())
}

async fn peer(
    channel: ChannelId,
    socket: PathBuf,
    ready: oneshot::Sender<Result<(), String>>,
) -> Result<()> {
    let stream = match UnixStream::connect(&socket).await {
        Ok(stream) => stream,
        Err(err) => {
            let _ = ready.send(Err(format!("connect {}: {err}", socket.display())));
            return Ok(());
        }
    };
    let (mut reader, sink, _writer) = split_unix(stream, PEER_QUEUE)?;
    let id = |suffix: &str| Id::new(format!("{channel}-{suffix}")).expect("short id");
    let capabilities = Capabilities { receive: true, send: true, ..Capabilities::default() };
    let hello = Frame::Hello(Hello {
        request_id: id("hello"),
        channel: channel.clone(),
        capabilities,
        actions: Default::default(),
        extensions: Extensions::all().names(),
        operator_actions: Vec::new(),
    });
    sink.send(&hello).await?;
    sink.send(&Frame::Start(Lifecycle { request_id: id("start") })).await?;
    let mut ready = Some(ready);
    while let Some(item) = reader.next().await? {
        let frame = match item {
            Ok(frame) => frame,
            Err(err) => bail!("bad frame from the hub: {err}"),
        };
        match frame {
            Frame::HelloAck(_) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(()));
                }
            }
            Frame::Error(err) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(format!("{}: {}", err.code, err.message)));
                }
            }
            Frame::HealthRequest(request) => {
                let answer = Frame::HealthResponse(HealthResponse {
                    request_id: request.request_id,
                    health: Health::ready(),
                });
                sink.send(&answer).await?;
            }
            Frame::Outbound(delivery) => {
                let target = delivery.message.target;
                let receipt = DeliveryReceipt {
                    channel: target.channel.clone(),
                    message_id: delivery.request_id.clone(),
                    target,
                    timestamp_ms: None,
                };
                sink.send(&Frame::Receipt(Receipt { request_id: delivery.request_id, receipt }))
                    .await?;
            }
            Frame::Stop(_) => break,
            _ => {}
        }
    }
    Ok(())
}
