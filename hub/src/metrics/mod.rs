//! The hub's Prometheus metrics: one [`Metrics`] holding every family (typed, labelled by
//! channel instance and a bounded outcome, never by sender or conversation) in one
//! `prometheus-client` registry, and [`InstanceMetrics`], the handles an instance counts with.
//!
//! The instance label is named `channel` (`channel="mqtt.lab"`): Prometheus gives every
//! scraped series an `instance` label of its own (the target's `host:port`) and would rename
//! ours to `exported_instance`.
//!
//! Counting is one atomic add on a handle resolved when the instance is created, so the hot
//! paths take no lock and hash no label. With `[hub] metrics_listen` unset the metrics are off:
//! the handles are empty and every call returns at once. Values that are state rather than
//! events (driver connected, health, outbox depth, ledger queue) are set when a scrape comes
//! (`scrape.rs`); process metrics are read from `/proc/self` then (`process.rs`).
//!
//! Imports nothing from the rest of the hub but the ledger's own histograms
//! ([`LedgerMetrics`]): the modules that count depend on it.

mod amqp_sends;
mod process;

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::ledger::LedgerMetrics;

pub use amqp_sends::{AmqpSendsState, RemoteSendOutcome};
pub use process::ProcessCollector;

/// How an inbound message was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboundOutcome {
    /// The hub took responsibility: `accepted`, then a run.
    Accepted,
    /// A redelivery: already in flight or already answered (its reply replayed).
    Duplicate,
    /// The sender is not on the allowlist.
    Denied,
    /// The connection's in-flight limit was reached (retryable).
    Busy,
    /// The event id was already used for other content.
    Conflict,
    /// Refused for another reason: wrong channel, unrecordable, an invalid frame.
    Error,
}

impl InboundOutcome {
    pub const ALL: [InboundOutcome; 6] = [
        InboundOutcome::Accepted,
        InboundOutcome::Duplicate,
        InboundOutcome::Denied,
        InboundOutcome::Busy,
        InboundOutcome::Conflict,
        InboundOutcome::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InboundOutcome::Accepted => "accepted",
            InboundOutcome::Duplicate => "duplicate",
            InboundOutcome::Denied => "denied",
            InboundOutcome::Busy => "busy",
            InboundOutcome::Conflict => "conflict",
            InboundOutcome::Error => "error",
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutcome {
    /// It produced a reply.
    Replied,
    /// It failed (agent error, timeout, empty reply); the driver got an `error`.
    Failed,
}

impl RunOutcome {
    pub const ALL: [RunOutcome; 2] = [RunOutcome::Replied, RunOutcome::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            RunOutcome::Replied => "replied",
            RunOutcome::Failed => "failed",
        }
    }
}

/// How a proactive send ended (or that it waits for its driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    Receipted,
    Failed,
    /// Handed to the driver without a receipt (timeout, disconnect, or the driver said so).
    Unknown,
    /// Put in the outbox for an offline driver.
    Queued,
}

impl SendOutcome {
    pub const ALL: [SendOutcome; 4] =
        [SendOutcome::Receipted, SendOutcome::Failed, SendOutcome::Unknown, SendOutcome::Queued];

    pub fn as_str(self) -> &'static str {
        match self {
            SendOutcome::Receipted => "receipted",
            SendOutcome::Failed => "failed",
            SendOutcome::Unknown => "unknown",
            SendOutcome::Queued => "queued",
        }
    }
}

/// How a command presented to a person ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandOutcome {
    /// The driver answered (the answer may still be a rejection).
    Answered,
    /// The driver's declaration does not allow it; never sent.
    Refused,
    /// No answer in time (fails closed).
    Timeout,
    /// The connection closed before an answer, or the command could not be sent.
    Disconnected,
}

impl CommandOutcome {
    pub const ALL: [CommandOutcome; 4] = [
        CommandOutcome::Answered,
        CommandOutcome::Refused,
        CommandOutcome::Timeout,
        CommandOutcome::Disconnected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CommandOutcome::Answered => "answered",
            CommandOutcome::Refused => "refused",
            CommandOutcome::Timeout => "timeout",
            CommandOutcome::Disconnected => "disconnected",
        }
    }
}

/// What a socket connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionKind {
    /// An instance's driver (`hello`).
    Driver,
    /// A tool on an instance socket (`control_hello`).
    Controller,
    /// A peer that never sent `hello`.
    Legacy,
    /// A client of the control socket (`channelctl`, applications).
    Control,
}

impl ConnectionKind {
    pub const ALL: [ConnectionKind; 4] = [
        ConnectionKind::Driver,
        ConnectionKind::Controller,
        ConnectionKind::Legacy,
        ConnectionKind::Control,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConnectionKind::Driver => "driver",
            ConnectionKind::Controller => "controller",
            ConnectionKind::Legacy => "legacy",
            ConnectionKind::Control => "control",
        }
    }
}

/// A channel instance (`channel="mqtt.lab"`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstanceLabel {
    pub channel: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub channel: String,
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub channel: String,
    pub state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub channel: String,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

type HistogramFamily<S> = Family<S, Histogram, fn() -> Histogram>;

fn run_buckets() -> Histogram {
    // 5 ms to about 12 minutes: echo runs to long agent runs.
    Histogram::new(exponential_buckets(0.005, 2.5, 14))
}

fn delivery_buckets() -> Histogram {
    // 0.5 ms to about 7 s: a ledger commit and a queue hand-over.
    Histogram::new(exponential_buckets(0.0005, 2.5, 12))
}

/// Every metric the hub exports, and the registry they are encoded from.
#[derive(Debug)]
pub struct Metrics {
    enabled: bool,
    registry: Registry,
    inbound: Family<OutcomeLabels, Counter>,
    runs_started: Family<InstanceLabel, Counter>,
    runs_finished: Family<OutcomeLabels, Counter>,
    run_duration: HistogramFamily<InstanceLabel>,
    reply_delivery: HistogramFamily<InstanceLabel>,
    sends: Family<OutcomeLabels, Counter>,
    commands: Family<OutcomeLabels, Counter>,
    driver_restarts: Family<InstanceLabel, Counter>,
    connections: Family<KindLabel, Gauge>,
    /// Set at each scrape.
    pub driver_connected: Family<InstanceLabel, Gauge>,
    /// Set at each scrape, for supervised drivers only.
    pub driver_process_up: Family<InstanceLabel, Gauge>,
    /// Set at each scrape: 1 for the instance's current state, 0 for the others.
    pub health_state: Family<StateLabels, Gauge>,
    /// Set at each scrape: 1 for the reason of an `Unavailable` health, 0 for the others.
    pub health_reason: Family<ReasonLabels, Gauge>,
    /// Set at each scrape (when the ledger is on).
    pub outbox_records: Family<StateLabels, Gauge>,
    /// Set at each scrape.
    pub ledger_queue_depth: Gauge,
    amqp_sends: Family<OutcomeLabel, Counter>,
    /// Set at each scrape (`[hub.amqp_sends]` set): whether the send queue is consumed.
    pub amqp_sends_connected: Gauge,
}

impl Metrics {
    /// The hub's metrics; `enabled` is whether they are served (`[hub] metrics_listen`).
    /// Disabled, nothing is counted. `ledger` is the ledger's own histograms.
    pub fn new(enabled: bool, ledger: &LedgerMetrics) -> Self {
        let mut registry = Registry::default();
        let inbound = Family::default();
        registry.register(
            "channeld_inbound",
            "Inbound messages and events from drivers, by how the hub answered",
            inbound.clone(),
        );
        let runs_started = Family::default();
        registry.register("channeld_runs_started", "Runs started", runs_started.clone());
        let runs_finished = Family::default();
        registry.register(
            "channeld_runs_finished",
            "Runs finished, by outcome",
            runs_finished.clone(),
        );
        let run_duration: HistogramFamily<InstanceLabel> =
            Family::new_with_constructor(run_buckets);
        registry.register_with_unit(
            "channeld_run_duration",
            "How long runs took, from start to reply or failure",
            Unit::Seconds,
            run_duration.clone(),
        );
        let reply_delivery: HistogramFamily<InstanceLabel> =
            Family::new_with_constructor(delivery_buckets);
        registry.register_with_unit(
            "channeld_reply_delivery",
            "From a run's end to its reply handed to the driver connection (recording included)",
            Unit::Seconds,
            reply_delivery.clone(),
        );
        let sends = Family::default();
        registry.register(
            "channeld_sends",
            "Proactive sends by outcome (queued: put in the outbox for an offline driver)",
            sends.clone(),
        );
        let commands = Family::default();
        registry.register(
            "channeld_commands",
            "Commands (input, approval, choice, ...) presented on driver connections, by outcome",
            commands.clone(),
        );
        let driver_restarts = Family::default();
        registry.register(
            "channeld_driver_restarts",
            "Restarts of supervised driver processes after they exited",
            driver_restarts.clone(),
        );
        let connections = Family::default();
        registry.register(
            "channeld_connections",
            "Open socket connections, by kind",
            connections.clone(),
        );
        let driver_connected = Family::default();
        registry.register(
            "channeld_driver_connected",
            "Whether the instance's driver is connected (1) or not (0)",
            driver_connected.clone(),
        );
        let driver_process_up = Family::default();
        registry.register(
            "channeld_driver_process_up",
            "Whether the supervised driver process runs (1) or not (0); only spawned drivers",
            driver_process_up.clone(),
        );
        let health_state = Family::default();
        registry.register(
            "channeld_health_state",
            "The instance's health: 1 for its current state (ready, degraded, unavailable)",
            health_state.clone(),
        );
        let health_reason = Family::default();
        registry.register(
            "channeld_health_unavailable_reason",
            "Why the instance is unavailable, when only an operator can fix it: 1 for the reason",
            health_reason.clone(),
        );
        let outbox_records = Family::default();
        registry.register(
            "channeld_outbox_records",
            "Outbox records by state (the ledger's outbox; final records until retention)",
            outbox_records.clone(),
        );
        let ledger_queue_depth = Gauge::default();
        registry.register(
            "channeld_ledger_queue_depth",
            "Jobs waiting for the ledger thread",
            ledger_queue_depth.clone(),
        );
        registry.register_with_unit(
            "channeld_ledger_commit_duration",
            "Ledger batch commit latency (begin to commit)",
            Unit::Seconds,
            ledger.commit_seconds.clone(),
        );
        registry.register(
            "channeld_ledger_batch_jobs",
            "Ledger calls committed per batch (group commit)",
            ledger.batch_jobs.clone(),
        );
        registry.register_with_unit(
            "channeld_ledger_sync_duration",
            "fdatasync of the ledger's write-ahead log by the log syncer",
            Unit::Seconds,
            ledger.sync_seconds.clone(),
        );
        registry.register_with_unit(
            "channeld_ledger_checkpoint_duration",
            "Checkpoint passes of the ledger's checkpointer (write-ahead log copied back)",
            Unit::Seconds,
            ledger.checkpoint_seconds.clone(),
        );
        let amqp_sends = Family::default();
        registry.register(
            "channeld_amqp_sends",
            "Messages taken from the AMQP send queue ([hub.amqp_sends]), by outcome",
            amqp_sends.clone(),
        );
        let amqp_sends_connected = Gauge::default();
        registry.register(
            "channeld_amqp_sends_connected",
            "Whether the AMQP send queue is consumed now (1) or its consumer reconnects (0)",
            amqp_sends_connected.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector::new()));
        Self {
            enabled,
            registry,
            inbound,
            runs_started,
            runs_finished,
            run_duration,
            reply_delivery,
            sends,
            commands,
            driver_restarts,
            connections,
            driver_connected,
            driver_process_up,
            health_state,
            health_reason,
            outbox_records,
            ledger_queue_depth,
            amqp_sends,
            amqp_sends_connected,
        }
    }

    /// Counts a send-queue message's outcome.
    pub fn amqp_send(&self, outcome: RemoteSendOutcome) {
        if self.enabled {
            self.amqp_sends.get_or_create(&OutcomeLabel { outcome: outcome.as_str() }).inc();
        }
    }

    /// Every send-queue outcome's series exists from the start (at 0).
    pub fn init_amqp_sends(&self) {
        if self.enabled {
            for outcome in RemoteSendOutcome::ALL {
                drop(self.amqp_sends.get_or_create(&OutcomeLabel { outcome: outcome.as_str() }));
            }
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The handles `instance` counts with. Every outcome's series exists from now on (at 0),
    /// so rates and alerts see it before its first event.
    pub fn instance(&self, instance: &str) -> InstanceMetrics {
        if !self.enabled {
            return InstanceMetrics(None);
        }
        let label = InstanceLabel { channel: instance.to_owned() };
        let outcome =
            |outcome: &'static str| OutcomeLabels { channel: instance.to_owned(), outcome };
        let handles = InstanceHandles {
            inbound: InboundOutcome::ALL
                .map(|o| self.inbound.get_or_create_owned(&outcome(o.as_str()))),
            runs_started: self.runs_started.get_or_create_owned(&label),
            runs_finished: RunOutcome::ALL
                .map(|o| self.runs_finished.get_or_create_owned(&outcome(o.as_str()))),
            run_duration: self.run_duration.get_or_create_owned(&label),
            reply_delivery: self.reply_delivery.get_or_create_owned(&label),
            sends: SendOutcome::ALL.map(|o| self.sends.get_or_create_owned(&outcome(o.as_str()))),
            commands: CommandOutcome::ALL
                .map(|o| self.commands.get_or_create_owned(&outcome(o.as_str()))),
            driver_restarts: self.driver_restarts.get_or_create_owned(&label),
        };
        InstanceMetrics(Some(Arc::new(handles)))
    }

    /// Drops the series of an instance a reload removed (its handles keep working, unseen).
    pub fn forget(&self, instance: &str) {
        let label = InstanceLabel { channel: instance.to_owned() };
        let outcome =
            |outcome: &'static str| OutcomeLabels { channel: instance.to_owned(), outcome };
        for o in InboundOutcome::ALL {
            self.inbound.remove(&outcome(o.as_str()));
        }
        for o in RunOutcome::ALL {
            self.runs_finished.remove(&outcome(o.as_str()));
        }
        for o in SendOutcome::ALL {
            self.sends.remove(&outcome(o.as_str()));
        }
        for o in CommandOutcome::ALL {
            self.commands.remove(&outcome(o.as_str()));
        }
        self.runs_started.remove(&label);
        self.run_duration.remove(&label);
        self.reply_delivery.remove(&label);
        self.driver_restarts.remove(&label);
    }

    /// Counts an open connection of `kind` until the guard is dropped.
    pub fn connection(&self, kind: ConnectionKind) -> ConnectionGuard {
        if !self.enabled {
            return ConnectionGuard(None);
        }
        let gauge = self.connections.get_or_create_owned(&KindLabel { kind: kind.as_str() });
        gauge.inc();
        ConnectionGuard(Some(gauge))
    }

    /// Every connection kind's series exists from the start (at 0).
    pub fn init_connection_kinds(&self) {
        if self.enabled {
            for kind in ConnectionKind::ALL {
                drop(self.connections.get_or_create(&KindLabel { kind: kind.as_str() }));
            }
        }
    }
}

/// Decrements its connection gauge when the connection ends.
#[derive(Debug)]
pub struct ConnectionGuard(Option<Gauge<i64, AtomicI64>>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if let Some(gauge) = &self.0 {
            gauge.dec();
        }
    }
}

#[derive(Debug)]
struct InstanceHandles {
    inbound: [Counter; 6],
    runs_started: Counter,
    runs_finished: [Counter; 2],
    run_duration: Histogram,
    reply_delivery: Histogram,
    sends: [Counter; 4],
    commands: [Counter; 4],
    driver_restarts: Counter,
}

/// What one instance counts with; empty (every call a no-op) when metrics are off.
#[derive(Debug, Clone, Default)]
pub struct InstanceMetrics(Option<Arc<InstanceHandles>>);

impl InstanceMetrics {
    /// Handles that count nothing (metrics off; tests).
    pub fn off() -> Self {
        Self(None)
    }

    /// Whether these count (metrics on): a caller reads the clock for a duration only then.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    pub fn inbound(&self, outcome: InboundOutcome) {
        if let Some(h) = &self.0 {
            h.inbound[outcome as usize].inc();
        }
    }

    pub fn run_started(&self) {
        if let Some(h) = &self.0 {
            h.runs_started.inc();
        }
    }

    pub fn run_finished(&self, outcome: RunOutcome, took: Duration) {
        if let Some(h) = &self.0 {
            h.runs_finished[outcome as usize].inc();
            h.run_duration.observe(took.as_secs_f64());
        }
    }

    pub fn reply_delivered(&self, took: Duration) {
        if let Some(h) = &self.0 {
            h.reply_delivery.observe(took.as_secs_f64());
        }
    }

    pub fn send(&self, outcome: SendOutcome) {
        if let Some(h) = &self.0 {
            h.sends[outcome as usize].inc();
        }
    }

    pub fn command(&self, outcome: CommandOutcome) {
        if let Some(h) = &self.0 {
            h.commands[outcome as usize].inc();
        }
    }

    pub fn driver_restart(&self) {
        if let Some(h) = &self.0 {
            h.driver_restarts.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(metrics: &Metrics) -> String {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, metrics.registry())
            .expect("encode");
        text
    }

    #[test]
    fn outcome_arrays_are_indexed_by_discriminant() {
        for (i, o) in InboundOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, o) in RunOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, o) in SendOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, o) in CommandOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
    }

    #[test]
    fn counts_land_on_the_instance_and_outcome_series() {
        let metrics = Metrics::new(true, &LedgerMetrics::default());
        let lab = metrics.instance("mqtt.lab");
        lab.inbound(InboundOutcome::Accepted);
        lab.inbound(InboundOutcome::Accepted);
        lab.inbound(InboundOutcome::Denied);
        lab.send(SendOutcome::Unknown);
        lab.run_finished(RunOutcome::Failed, Duration::from_millis(20));
        let text = exposition(&metrics);
        assert!(
            text.contains(r#"channeld_inbound_total{channel="mqtt.lab",outcome="accepted"} 2"#),
            "{text}"
        );
        assert!(text.contains(r#"channeld_inbound_total{channel="mqtt.lab",outcome="denied"} 1"#));
        assert!(text.contains(r#"channeld_inbound_total{channel="mqtt.lab",outcome="busy"} 0"#));
        assert!(text.contains(r#"channeld_sends_total{channel="mqtt.lab",outcome="unknown"} 1"#));
        assert!(
            text.contains(r#"channeld_runs_finished_total{channel="mqtt.lab",outcome="failed"} 1"#)
        );
        assert!(text.contains(r#"channeld_run_duration_seconds_count{channel="mqtt.lab"} 1"#));
        metrics.forget("mqtt.lab");
        assert!(!exposition(&metrics).contains("mqtt.lab"));
    }

    #[test]
    fn disabled_metrics_count_nothing() {
        let metrics = Metrics::new(false, &LedgerMetrics::default());
        let lab = metrics.instance("mqtt.lab");
        lab.inbound(InboundOutcome::Accepted);
        let _conn = metrics.connection(ConnectionKind::Driver);
        let text = exposition(&metrics);
        assert!(!text.contains("mqtt.lab"), "{text}");
        assert!(!text.contains(r#"kind="driver""#), "{text}");
    }

    #[test]
    fn connection_guards_count_open_connections() {
        let metrics = Metrics::new(true, &LedgerMetrics::default());
        metrics.init_connection_kinds();
        let first = metrics.connection(ConnectionKind::Driver);
        let _second = metrics.connection(ConnectionKind::Driver);
        drop(first);
        let text = exposition(&metrics);
        assert!(text.contains(r#"channeld_connections{kind="driver"} 1"#), "{text}");
        assert!(text.contains(r#"channeld_connections{kind="control"} 0"#), "{text}");
    }
}
