//! The reference rows: what two processes on this machine reach over a Unix socket with
//! JSONL request/response and nothing else. `channeld-bench echo-server` answers each line
//! with the same envelope (parsed and serialised again, as any peer reading JSON would);
//! `channeld-bench echo-relay` stands between the client and the server and forwards each
//! line, parsed and serialised, both ways (the two-hop ceiling: the hub's own position).
//! Both write every line their read produced in one write, as a buffered writer flushed when
//! the input is drained would.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use channeld_protocol::framing::{LineEvent, LineFramer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::payload;
use crate::procs::{Proc, wait_until};
use crate::stats::{Meter, Plan, Sample};

/// Longest line either side accepts.
const MAX_LINE: usize = 64 * 1024;

/// `channeld-bench echo-server --listen PATH` or, with `--upstream`, `echo-relay`: serves
/// until killed.
pub fn serve_main(listen: &Path, upstream: Option<&Path>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("echo: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(listen, upstream)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("echo: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(listen: &Path, upstream: Option<&Path>) -> Result<()> {
    let listener =
        UnixListener::bind(listen).with_context(|| format!("listen on {}", listen.display()))?;
    println!("ready");
    loop {
        let (stream, _) = listener.accept().await?;
        let upstream = upstream.map(Path::to_owned);
        tokio::spawn(async move {
            let served = match upstream {
                None => {
                    let (read, write) = stream.into_split();
                    forward(read, write).await
                }
                Some(path) => relay(stream, &path).await,
            };
            if let Err(err) = served {
                eprintln!("echo: connection ended: {err:#}");
            }
        });
    }
}

/// Two-way forwarding through this process: client → upstream and back.
async fn relay(client: UnixStream, upstream: &Path) -> Result<()> {
    let server = UnixStream::connect(upstream)
        .await
        .with_context(|| format!("connect {}", upstream.display()))?;
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::try_join!(forward(client_read, server_write), forward(server_read, client_write))?;
    Ok(())
}

/// Reads lines from `read`, parses and serialises each, writes what one read produced in
/// one write; ends at end of input.
async fn forward(
    mut read: impl AsyncReadExt + Unpin,
    mut write: impl AsyncWriteExt + Unpin,
) -> Result<()> {
    let mut framer = LineFramer::new(MAX_LINE);
    let mut out = Vec::with_capacity(64 * 1024);
    loop {
        if read.read_buf(framer.buffer_for_read()).await? == 0 {
            return Ok(());
        }
        out.clear();
        while let Some(event) = framer.next_line() {
            let LineEvent::Line(line) = event else { bail!("oversize line") };
            let envelope: payload::Envelope = serde_json::from_slice(line)?;
            serde_json::to_writer(&mut out, &envelope)?;
            out.push(b'\n');
        }
        if !out.is_empty() {
            write.write_all(&out).await?;
        }
    }
}

/// A running echo server or relay, stopped by PID on drop.
#[derive(Debug)]
pub struct EchoProc {
    pub proc: Proc,
    pub socket: PathBuf,
}

impl EchoProc {
    /// Starts an echo server on `dir/<name>.sock`, or a relay to `upstream`.
    pub fn start(dir: &Path, name: &str, upstream: Option<&Path>) -> Result<Self> {
        let exe = std::env::current_exe().context("locate channeld-bench")?;
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let mut command = Command::new(exe);
        match upstream {
            None => command.arg("echo-server"),
            Some(path) => command.arg("echo-relay").arg("--upstream").arg(path),
        };
        let mut child = command
            .arg("--listen")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("start the echo process")?;
        let stdout = child.stdout.take().context("echo stdout")?;
        let mut proc = Proc::new(name, child, Some(log));
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            proc.check_alive()?;
            bail!("{name} did not get ready{}", proc.log_tail());
        }
        wait_until(&mut proc, Duration::from_secs(5), "listen", || socket.exists())?;
        Ok(Self { proc, socket })
    }
}

/// One repetition: `plan.window` envelopes in flight on a new connection to `socket`.
pub async fn round_trips(socket: &Path, plan: Plan) -> Result<Sample> {
    let stream = UnixStream::connect(socket)
        .await
        .with_context(|| format!("connect {}", socket.display()))?;
    let (mut read, mut write) = stream.into_split();
    let mut meter = Meter::new(plan);
    let mut framer = LineFramer::new(MAX_LINE);
    let mut out = Vec::with_capacity(64 * 1024);
    // The envelope of request 0, its zero-padded id overwritten per request: the client's
    // own cost stays as small as the control client's.
    let template = payload::envelope(0);
    let id_at = template
        .windows(20)
        .position(|w| w == [b'0'; 20])
        .context("the envelope holds its zero-padded id")?;
    let deadline = Instant::now() + plan.measure + crate::control::stall_limit(plan);
    loop {
        let now = Instant::now();
        out.clear();
        while meter.may_issue(now) {
            let seq = meter.issue(now);
            let start = out.len();
            out.extend_from_slice(&template);
            out[start + id_at..start + id_at + 20].copy_from_slice(format!("{seq:020}").as_bytes());
            out.push(b'\n');
        }
        if !out.is_empty() {
            write.write_all(&out).await.context("write to the echo socket")?;
        }
        if meter.finished(now) {
            break;
        }
        if now > deadline {
            bail!("echo answers stalled with {} in flight", meter.in_flight());
        }
        let read_now =
            tokio::time::timeout(Duration::from_secs(30), read.read_buf(framer.buffer_for_read()));
        match read_now.await {
            Ok(Ok(0)) => bail!("the echo peer closed the connection"),
            Ok(Ok(_)) => {}
            Ok(Err(err)) => return Err(err).context("read from the echo socket"),
            Err(_) => bail!("no echo answer for 30 s with {} in flight", meter.in_flight()),
        }
        let now = Instant::now();
        while let Some(event) = framer.next_line() {
            let LineEvent::Line(line) = event else { bail!("oversize echo answer") };
            let seq = payload::envelope_seq(line).context("echo answer without an envelope")?;
            meter.complete(seq, now, Ok(()));
        }
    }
    Ok(meter.sample())
}
