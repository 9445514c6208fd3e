//! What a run produced (serialised as the JSON file) and its markdown rendering, including
//! the targets, checked against the numbers (printed, never asserted).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::stats::Sample;

/// Which round trip a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathKind {
    /// Control client → hub → driver → receipt → hub → control client.
    Send,
    /// Driver → hub (`inbound`, echo runtime) → `deliver` back to the driver.
    Inbound,
    /// Client → mosquitto → responder → mosquitto → client, QoS 1 both ways, Nagle off.
    Mosquitto,
    /// The same with mosquitto's default configuration: Nagle on.
    MosquittoNagle,
    /// Reference: client → echo process → client over a Unix socket, JSONL.
    Echo,
    /// Reference: client → relay process → echo process and back (the two-hop ceiling).
    EchoTwoHop,
}

impl PathKind {
    fn label(self) -> &'static str {
        match self {
            PathKind::Send => "send → receipt (hub)",
            PathKind::Inbound => "inbound → deliver (hub, echo)",
            PathKind::Mosquitto => "mosquitto QoS 1 round trip (Nagle off)",
            PathKind::MosquittoNagle => "mosquitto QoS 1 round trip (Nagle on)",
            PathKind::Echo => "reference: one-hop JSONL echo",
            PathKind::EchoTwoHop => "reference: two-hop JSONL relay",
        }
    }

    /// A hub row (compared against the others).
    fn is_hub(self) -> bool {
        matches!(self, PathKind::Send | PathKind::Inbound)
    }
}

/// One row: a path at one concurrency, the median over repetitions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub path: PathKind,
    /// Whether the hub kept its durable ledger; `None` for mosquitto.
    pub ledger: Option<bool>,
    pub window: usize,
    pub median: Sample,
    pub reps: Vec<Sample>,
}

/// CPU time the hub spent per message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpuRow {
    pub connected: usize,
    /// `one` (every send to one driver) or `spread` (round robin over every connected driver).
    pub traffic: String,
    pub messages: u64,
    pub hub_cpu_us_per_message: f64,
    pub rate_per_s: f64,
}

/// Hub memory and CPU with many connected drivers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Scale {
    /// `(connected drivers, hub VmRSS KiB)`.
    pub hub_rss_kib: Vec<(usize, u64)>,
    pub cpu: Vec<CpuRow>,
    /// `(connected drivers, hub VmRSS KiB)` after the CPU runs (the heap grown by traffic).
    #[serde(default)]
    pub hub_rss_after_traffic_kib: Option<(usize, u64)>,
    pub instances_configured: usize,
    /// `status` paged through every instance with the most drivers connected.
    #[serde(default)]
    pub status_listing: Option<StatusListing>,
}

/// Every instance listed a `status` page at a time, as `channelctl status` does.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatusListing {
    pub instances: usize,
    pub connected: usize,
    pub pages: usize,
    pub millis: f64,
}

/// Everything measured under one CPU setting.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    /// `pinned` (every process on CPU 0) or `unpinned`.
    pub mode: String,
    pub cpus: String,
    pub rows: Vec<Row>,
    pub scale: Scale,
    /// Median 4 KiB append + fdatasync in the phase's temp dir, µs.
    #[serde(default)]
    pub fsync_us: f64,
    /// `/proc/loadavg` when the phase ended.
    #[serde(default)]
    pub load: String,
}

/// Resident size of one idle driver process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DriverMemory {
    pub family: String,
    pub binary: String,
    pub rss_kib: Option<u64>,
    /// Threads of the process (each may hold its own allocator arena and stack).
    #[serde(default)]
    pub threads: Option<u64>,
    /// The anonymous part of the resident size (heap, stacks); the rest is mapped files,
    /// mostly the binary's own code.
    #[serde(default)]
    pub rss_anon_kib: Option<u64>,
    /// Why it was not measured, or what it was connected to.
    pub note: String,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub quick: bool,
    pub machine: Machine,
    pub settings: Settings,
    pub phases: Vec<Phase>,
    pub idle_drivers: Vec<DriverMemory>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub kernel: String,
    pub mosquitto: String,
    /// `/proc/loadavg` before and after the run: other work on the machine skews the numbers.
    #[serde(default)]
    pub load_before: String,
    #[serde(default)]
    pub load_after: String,
    /// The kernel's CPU idle driver and, under `haltpoll`, how long an idle CPU polls before
    /// it halts: on a virtual machine that halts at once, every wake-up of an idle CPU (an
    /// fsync's completion, a peer on the other CPU) goes through the hypervisor.
    #[serde(default)]
    pub cpu_idle: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    pub payload_bytes: usize,
    pub repetitions: usize,
    pub measure_ms: u64,
    pub windows: Vec<usize>,
    /// `hub.max_inflight` in the bench's hub config (default 4).
    pub hub_max_inflight: usize,
    pub ledger_durability: String,
}

impl Report {
    /// The better of the two mosquitto rows (Nagle off, on) at `row`'s phase and window.
    fn mosquitto(phase: &Phase, window: usize) -> Option<&Row> {
        Self::find(phase, window, &[PathKind::Mosquitto, PathKind::MosquittoNagle])
    }

    /// The fastest row of `kinds` at `window`.
    fn find<'a>(phase: &'a Phase, window: usize, kinds: &[PathKind]) -> Option<&'a Row> {
        phase
            .rows
            .iter()
            .filter(|r| kinds.contains(&r.path) && r.window == window)
            .max_by(|a, b| a.median.rate_per_s.total_cmp(&b.median.rate_per_s))
    }

    /// The hub row of `path` with the ledger on or off at `window`.
    fn hub_row(phase: &Phase, path: PathKind, ledger: bool, window: usize) -> Option<&Row> {
        phase.rows.iter().find(|r| r.path == path && r.ledger == Some(ledger) && r.window == window)
    }

    /// `row`'s rate ÷ `peer`'s.
    fn over(row: &Row, peer: Option<&Row>) -> Option<f64> {
        let peer = peer?;
        (peer.median.rate_per_s > 0.0).then(|| row.median.rate_per_s / peer.median.rate_per_s)
    }

    /// The lowest and highest rate among `row`'s repetitions (its median's when it has none).
    fn rate_range(row: &Row) -> (f64, f64) {
        let rates = row.reps.iter().map(|rep| rep.rate_per_s);
        let low = rates.clone().fold(f64::INFINITY, f64::min);
        let high = rates.fold(f64::NEG_INFINITY, f64::max);
        if low.is_finite() { (low, high) } else { (row.median.rate_per_s, row.median.rate_per_s) }
    }

    /// How far `row` ÷ `peer` moves across their repetitions: the lowest of the row's rates
    /// over the highest of the peer's, and the other way round. `None` without a peer rate.
    fn over_range(row: &Row, peer: Option<&Row>) -> Option<(f64, f64)> {
        let (low, high) = Self::rate_range(row);
        let (peer_low, peer_high) = Self::rate_range(peer?);
        (peer_low > 0.0).then(|| (low / peer_high, high / peer_low))
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let s = &self.settings;
        let _ = writeln!(
            out,
            "## channeld vs mosquitto{}\n\n{} CPUs, {}, {}; load average {} before, {} after; CPU idle: {}. \
             Payload {} bytes; median of {} repetitions of {} ms each. \
             Hub config: `hub.max_inflight = {}` (default 4) so 256 inbound runs fit in flight; ledger durability `{}`.\n\n\
             Paths: *send → receipt*: control client → hub → SDK driver (posts at once) → receipt → hub → client. \
             *inbound → deliver*: SDK driver `inbound` → hub (echo runtime) → `deliver` → driver. \
             *mosquitto*: rumqttc client → broker → responder process → broker → client, QoS 1 both ways, \
             with Nagle off (`set_tcp_nodelay true`, TCP_NODELAY in the clients) and on (the default); hub rows are compared with the better of the two. \
             *reference*: the same JSONL envelope over a Unix socket to an echo process (one hop) and through a relay process to it (two hops), \
             each side parsing and serialising every line and writing what one read produced in one write. \
             *pinned*: every process on CPU 0 (`taskset -c 0`). Ratios are hub round trips/s ÷ the other row's at the same pinning and concurrency; \
             *fsyncs* is a ledger-on row's p50 in units of the fsync measured in the same phase.\n",
            if self.quick { " (--quick: smoke run, numbers are not meaningful)" } else { "" },
            self.machine.cpus,
            self.machine.kernel,
            self.machine.mosquitto,
            self.machine.load_before,
            self.machine.load_after,
            self.machine.cpu_idle,
            s.payload_bytes,
            s.repetitions,
            s.measure_ms,
            s.hub_max_inflight,
            s.ledger_durability,
        );
        for phase in &self.phases {
            let _ = writeln!(
                out,
                "{}: fsync (4 KiB append + fdatasync) {:.1} µs; load average at the end of the phase {}.",
                phase.mode, phase.fsync_us, phase.load
            );
        }
        out.push_str(
            "\n| CPUs | path | ledger | in flight | round trips/s | repetitions rt/s | p50 µs | p99 µs | p50 fsyncs | best mosquitto rt/s | hub/mosquitto | two-hop rt/s | hub/two-hop | errors |\n\
             |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for phase in &self.phases {
            for row in &phase.rows {
                let (peer_rate, ratio, hop_rate, hop_ratio) = if row.path.is_hub() {
                    let peer = Self::mosquitto(phase, row.window);
                    let hop = Self::find(phase, row.window, &[PathKind::EchoTwoHop]);
                    let ratio = |r: Option<f64>| r.map_or(String::new(), |r| format!("{r:.2}×"));
                    (
                        peer.map_or(String::new(), |p| fmt_rate(p.median.rate_per_s)),
                        ratio(Self::over(row, peer)),
                        hop.map_or(String::new(), |p| fmt_rate(p.median.rate_per_s)),
                        ratio(Self::over(row, hop)),
                    )
                } else {
                    Default::default()
                };
                let fsyncs = match row.ledger {
                    Some(true) if phase.fsync_us > 0.0 => {
                        format!("{:.2}", row.median.p50_us / phase.fsync_us)
                    }
                    _ => String::new(),
                };
                let (low, high) = Self::rate_range(row);
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {}–{} | {:.1} | {:.1} | {fsyncs} | {} | {} | {hop_rate} | {hop_ratio} | {} |",
                    phase.mode,
                    row.path.label(),
                    match row.ledger {
                        Some(true) => "on",
                        Some(false) => "off",
                        None => "–",
                    },
                    row.window,
                    fmt_rate(row.median.rate_per_s),
                    fmt_rate(low),
                    fmt_rate(high),
                    row.median.p50_us,
                    row.median.p99_us,
                    peer_rate,
                    ratio,
                    row.median.errors,
                );
            }
        }
        out.push_str("\n### Hub with many idle drivers\n\n");
        out.push_str("| CPUs | connected drivers | hub RSS MiB |\n|---|---:|---:|\n");
        for phase in &self.phases {
            for (connected, kib) in &phase.scale.hub_rss_kib {
                let _ = writeln!(out, "| {} | {} | {:.1} |", phase.mode, connected, mib(*kib));
            }
            if let Some((connected, kib)) = phase.scale.hub_rss_after_traffic_kib {
                let _ = writeln!(
                    out,
                    "| {} | {} (after the CPU runs) | {:.1} |",
                    phase.mode,
                    connected,
                    mib(kib)
                );
            }
        }
        for phase in &self.phases {
            if let Some(listing) = &phase.scale.status_listing {
                let _ = writeln!(
                    out,
                    "\n`status` over {} instances ({} connected, {}): {} pages in {:.0} ms.",
                    listing.instances, listing.connected, phase.mode, listing.pages, listing.millis
                );
            }
        }
        out.push_str(
            "\n| CPUs | connected drivers | traffic | messages | hub CPU µs/message | sends/s |\n|---|---:|---|---:|---:|---:|\n",
        );
        for phase in &self.phases {
            for cpu in &phase.scale.cpu {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {:.2} | {} |",
                    phase.mode,
                    cpu.connected,
                    cpu.traffic,
                    cpu.messages,
                    cpu.hub_cpu_us_per_message,
                    fmt_rate(cpu.rate_per_s)
                );
            }
        }
        out.push_str(
            "\n### Idle driver processes\n\n| family | RSS MiB | of which anonymous MiB | threads | note |\n|---|---:|---:|---:|---|\n",
        );
        for driver in &self.idle_drivers {
            let rss =
                driver.rss_kib.map_or("not measured".to_owned(), |k| format!("{:.1}", mib(k)));
            let threads = driver.threads.map_or(String::new(), |t| t.to_string());
            let anon = driver.rss_anon_kib.map_or(String::new(), |k| format!("{:.1}", mib(k)));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                driver.family, rss, anon, threads, driver.note
            );
        }
        out.push_str("\n### Targets\n\n");
        for line in self.targets() {
            let _ = writeln!(out, "- {line}");
        }
        out
    }

    /// Each target of the issue with the measured numbers and whether it is met.
    pub fn targets(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
        for phase in &self.phases {
            let mode = &phase.mode;
            for path in [PathKind::Send, PathKind::Inbound] {
                let name = path.label();
                // A ratio of medians, with how far it moves across the two rows' repetitions.
                let line = |ledger: bool,
                            window: usize,
                            what: &str,
                            (row, peer): (&Row, Option<&Row>),
                            goal: f64| {
                    let value = Self::over(row, peer)?;
                    let (low, high) = Self::over_range(row, peer)?;
                    let ledger = if ledger { "on" } else { "off" };
                    Some(format!(
                        "{mode} {name}, ledger {ledger}, {window} in flight: {what} {value:.2} \
                         (repetitions {low:.2}–{high:.2}; target ≥ {goal}): {}",
                        verdict(value >= goal)
                    ))
                };
                if let Some(row) = Self::hub_row(phase, path, false, 1)
                    && path == PathKind::Send
                {
                    let peer = Self::mosquitto(phase, 1);
                    lines.extend(line(false, 1, "÷ best mosquitto", (row, peer), 1.25));
                }
                if let Some(row) = Self::hub_row(phase, path, false, 16) {
                    let peer = Self::mosquitto(phase, 16);
                    lines.extend(line(false, 16, "÷ best mosquitto", (row, peer), 5.0));
                }
                if let Some(row) = Self::hub_row(phase, path, false, 256) {
                    let hop = Self::find(phase, 256, &[PathKind::EchoTwoHop]);
                    lines.extend(line(false, 256, "÷ two-hop ceiling", (row, hop), 0.5));
                }
                if let Some(row) = Self::hub_row(phase, path, true, 1)
                    && phase.fsync_us > 0.0
                {
                    let fsyncs = row.median.p50_us / phase.fsync_us;
                    lines.push(format!(
                        "{mode} {name}, ledger on, sequential: p50 {:.1} µs = {fsyncs:.2} fsyncs of {:.1} µs (target ≤ 1.5): {}",
                        row.median.p50_us,
                        phase.fsync_us,
                        verdict(fsyncs <= 1.5)
                    ));
                }
                if let Some(row) = Self::hub_row(phase, path, true, 16) {
                    let peer = Self::mosquitto(phase, 16);
                    lines.extend(line(true, 16, "÷ best mosquitto", (row, peer), 1.5));
                }
                if let Some(row) = Self::hub_row(phase, path, true, 256) {
                    let off = Self::hub_row(phase, path, false, 256);
                    lines.extend(line(true, 256, "÷ ledger off", (row, off), 0.5));
                }
            }
        }
        for driver in &self.idle_drivers {
            if let Some(kib) = driver.rss_kib {
                lines.push(format!(
                    "idle {} driver: {:.1} MiB (target ≤ 10 MiB): {}",
                    driver.family,
                    mib(kib),
                    verdict(mib(kib) <= 10.0)
                ));
            }
        }
        for phase in &self.phases {
            let top = phase.scale.hub_rss_kib.iter().map(|(c, _)| *c).max().unwrap_or(0);
            let reported = phase.scale.hub_rss_kib.iter().filter(|(c, _)| *c == 1000 || *c == top);
            for (connected, kib) in reported {
                let per_driver = *kib as f64 / (*connected).max(1) as f64;
                lines.push(if *connected <= 1000 {
                    format!(
                        "{}: hub with {connected} idle drivers: {:.1} MiB (target ≤ 100 MiB at 1,000): {}",
                        phase.mode,
                        mib(*kib),
                        verdict(mib(*kib) <= 100.0)
                    )
                } else {
                    format!(
                        "{}: hub with {connected} idle drivers: {:.1} MiB, {per_driver:.1} KiB per driver (reported)",
                        phase.mode,
                        mib(*kib),
                    )
                });
            }
            let one = phase.scale.cpu.iter().find(|c| c.connected == 1);
            if let Some(one) = one
                && phase.mode == "pinned"
            {
                lines.push(format!(
                    "pinned: hub CPU per message with 1 driver {:.2} µs (target ≤ 6 µs): {}",
                    one.hub_cpu_us_per_message,
                    verdict(one.hub_cpu_us_per_message <= 6.0)
                ));
            }
            for many in phase.scale.cpu.iter().filter(|c| c.connected > 1) {
                if let Some(one) = one {
                    let ratio = many.hub_cpu_us_per_message / one.hub_cpu_us_per_message.max(1e-9);
                    let goal = if many.traffic == "one" { 1.2 } else { 1.5 };
                    lines.push(format!(
                        "{}: hub CPU per message {:.2} µs at 1 driver, {:.2} µs at {} ({} traffic) = {ratio:.2}× (target ≤ {goal}×): {}",
                        phase.mode,
                        one.hub_cpu_us_per_message,
                        many.hub_cpu_us_per_message,
                        many.connected,
                        many.traffic,
                        verdict(ratio <= goal),
                    ));
                }
            }
        }
        lines
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// A rate with thousands separators, no decimals.
pub fn fmt_rate(rate: f64) -> String {
    let whole = rate.round() as u64;
    let digits = whole.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: PathKind, ledger: Option<bool>, window: usize, rates: &[f64]) -> Row {
        let sample = |rate_per_s| Sample { rate_per_s, ..Sample::default() };
        let reps: Vec<Sample> = rates.iter().copied().map(sample).collect();
        Row { path, ledger, window, median: reps[reps.len() / 2], reps }
    }

    fn report(rows: Vec<Row>) -> Report {
        Report {
            schema: String::new(),
            quick: false,
            machine: Machine {
                cpus: 2,
                kernel: String::new(),
                mosquitto: String::new(),
                load_before: String::new(),
                load_after: String::new(),
                cpu_idle: "haltpoll, guest_halt_poll_ns 0".into(),
            },
            settings: Settings {
                payload_bytes: 64,
                repetitions: 3,
                measure_ms: 1000,
                windows: vec![16],
                hub_max_inflight: 512,
                ledger_durability: "full".into(),
            },
            phases: vec![Phase {
                mode: "unpinned".into(),
                cpus: String::new(),
                rows,
                scale: Scale::default(),
                fsync_us: 0.0,
                load: String::new(),
            }],
            idle_drivers: Vec::new(),
        }
    }

    #[test]
    fn a_ratio_says_how_far_it_moves_across_the_repetitions() {
        let report = report(vec![
            row(PathKind::Send, Some(false), 16, &[50_000.0, 60_000.0, 70_000.0]),
            row(PathKind::Mosquitto, None, 16, &[10_000.0, 12_000.0, 14_000.0]),
            // The slower mosquitto configuration is not the one compared with.
            row(PathKind::MosquittoNagle, None, 16, &[9_000.0, 11_000.0, 20_000.0]),
        ]);
        let targets = report.targets();
        assert_eq!(
            targets,
            ["unpinned send → receipt (hub), ledger off, 16 in flight: ÷ best mosquitto 5.00 \
              (repetitions 3.57–7.00; target ≥ 5): met"],
        );
        let table = report.markdown();
        assert!(table.contains("| 60,000 | 50,000–70,000 |"), "{table}");
        assert!(table.contains("| 12,000 | 10,000–14,000 |"), "{table}");
        assert!(table.contains("; CPU idle: haltpoll, guest_halt_poll_ns 0."), "{table}");
    }

    #[test]
    fn rates_get_thousands_separators() {
        assert_eq!(fmt_rate(0.4), "0");
        assert_eq!(fmt_rate(999.0), "999");
        assert_eq!(fmt_rate(28_123.6), "28,124");
        assert_eq!(fmt_rate(1_234_567.0), "1,234,567");
    }
}
