//! The application side of send → receipt: a pipelined `channeld.control/v1` client that keeps
//! a fixed number of `send` requests (with `"wait":true`) in flight on one connection and
//! times each until its answer.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use channeld_protocol::framing::{LineEvent, LineFramer};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::payload;
use crate::stats::{Meter, Plan, Sample};

/// The fields of an answer the bench looks at.
#[derive(Debug, Deserialize)]
struct Answer {
    id: u64,
    ok: bool,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

/// Runs one repetition against the control socket at `control`: `send` requests to the
/// instances in `instances` (round robin), `plan.window` of them in flight.
pub async fn send_round_trips(control: &Path, instances: &[String], plan: Plan) -> Result<Sample> {
    let stream = UnixStream::connect(control)
        .await
        .with_context(|| format!("connect {}", control.display()))?;
    let (mut read, mut write) = stream.into_split();
    let requests: Vec<(String, String)> = instances
        .iter()
        .map(|instance| {
            let tail = format!(
                ",\"op\":\"send\",\"instance\":\"{instance}\",\"conversation\":\"room-1\",\"text\":\"{}\",\"wait\":true}}\n",
                payload::text()
            );
            ("{\"id\":".to_owned(), tail)
        })
        .collect();
    let mut meter = Meter::new(plan);
    let mut framer = LineFramer::new(1 << 20);
    let mut out = Vec::with_capacity(64 * 1024);
    let deadline = Instant::now() + plan.measure + stall_limit(plan);
    loop {
        let now = Instant::now();
        out.clear();
        while meter.may_issue(now) {
            let seq = meter.issue(now);
            let (head, tail) = &requests[(seq % requests.len() as u64) as usize];
            out.extend_from_slice(head.as_bytes());
            // The id is the meter's sequence number plus one: the hub answers id 0 to lines
            // it cannot parse, which then never match a request.
            out.extend_from_slice((seq + 1).to_string().as_bytes());
            out.extend_from_slice(tail.as_bytes());
        }
        if !out.is_empty() {
            write.write_all(&out).await.context("write to the control socket")?;
        }
        if meter.finished(now) {
            break;
        }
        if now > deadline {
            bail!("control answers stalled with {} requests in flight", meter.in_flight());
        }
        let read_now =
            tokio::time::timeout(Duration::from_secs(30), read.read_buf(framer.buffer_for_read()));
        match read_now.await {
            Ok(Ok(0)) => bail!("the hub closed the control connection"),
            Ok(Ok(_)) => {}
            Ok(Err(err)) => return Err(err).context("read from the control socket"),
            Err(_) => bail!("no control answer for 30 s with {} in flight", meter.in_flight()),
        }
        let now = Instant::now();
        while let Some(event) = framer.next_line() {
            let LineEvent::Line(line) = event else { bail!("oversize control answer") };
            let answer: Answer = serde_json::from_slice(line).context("control answer")?;
            let outcome = if answer.ok {
                Ok(())
            } else {
                Err(answer.error.map_or_else(|| "error".to_owned(), |e| e.to_string()))
            };
            meter.complete(answer.id.wrapping_sub(1), now, outcome);
        }
    }
    let sample = meter.sample();
    if let Some(err) = meter.first_error() {
        eprintln!("channeld-bench: send: {} errors, first: {err}", sample.errors);
    }
    Ok(sample)
}

/// How long a repetition may overrun its measuring time before the bench gives up on it.
pub fn stall_limit(plan: Plan) -> Duration {
    Duration::from_secs(60) + plan.measure
}
