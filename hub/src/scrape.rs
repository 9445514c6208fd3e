//! Serves `/metrics` on `hub.metrics_listen` (TCP or a Unix socket) with axum: at each scrape
//! the state gauges are set from the hub as it is now (driver connected, supervised process,
//! health, outbox depth from the ledger, ledger queue), then the registry is encoded —
//! OpenMetrics when the scraper asks for it (Prometheus does), else the Prometheus text
//! format 0.0.4. Exposition is `prometheus-client`'s own encoder.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use channeld_protocol::types::{HealthState, UnavailableReason};
use prometheus_client::encoding::{prometheus_text, text};
use tracing::{info, warn};

use crate::hub::Hub;
use crate::ledger::state::OUTBOX_STATES;
use crate::listen::MetricsListener;
use crate::metrics::{InstanceLabel, ReasonLabels, StateLabels};

/// The OpenMetrics text content type.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long a scrape waits for the ledger's outbox counts before it serves without them.
const LEDGER_WAIT: Duration = Duration::from_secs(2);

struct Scrape {
    hub: Arc<Hub>,
    /// One scrape sets the state gauges at a time.
    refreshing: tokio::sync::Mutex<()>,
}

/// Serves `/metrics` until the hub shuts down.
pub(crate) async fn serve(hub: Arc<Hub>, listener: MetricsListener) {
    let address = listener.describe();
    let state = Arc::new(Scrape { hub: hub.clone(), refreshing: tokio::sync::Mutex::new(()) });
    let router = Router::new().route("/metrics", get(metrics)).with_state(state);
    let stop = hub.shutdown.clone().cancelled_owned();
    info!(listen = %address, "serving /metrics");
    let served = match listener {
        MetricsListener::Tcp(listener) => {
            axum::serve(listener, router).with_graceful_shutdown(stop).await
        }
        MetricsListener::Unix(listener) => {
            axum::serve(listener, router).with_graceful_shutdown(stop).await
        }
    };
    if let Err(err) = served {
        warn!(listen = %address, error = %err, "the metrics listener failed");
    }
}

async fn metrics(State(scrape): State<Arc<Scrape>>, headers: HeaderMap) -> Response {
    let refreshing = scrape.refreshing.lock().await;
    refresh(&scrape.hub).await;
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|accept| accept.to_str().ok())
        .is_some_and(|accept| accept.contains("application/openmetrics-text"));
    let registry = scrape.hub.metrics.registry();
    let mut body = String::with_capacity(16 * 1024);
    let (encoded, content_type) = if openmetrics {
        (text::encode(&mut body, registry), OPENMETRICS)
    } else {
        (prometheus_text::encode(&mut body, registry), prometheus_text::CONTENT_TYPE)
    };
    drop(refreshing);
    match encoded {
        Ok(()) => {
            ([(header::CONTENT_TYPE, HeaderValue::from_static(content_type))], body).into_response()
        }
        Err(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "metrics could not be encoded\n").into_response()
        }
    }
}

/// The wire name of a health state as a label value (lower case, as labels go).
fn state_label(state: HealthState) -> &'static str {
    match state {
        HealthState::Ready => "ready",
        HealthState::Degraded => "degraded",
        HealthState::Unavailable => "unavailable",
    }
}

/// Sets the state gauges from the hub as it is now. Instances a reload removed vanish.
async fn refresh(hub: &Hub) {
    let metrics = &hub.metrics;
    let instances = hub.instances.snapshot();
    if let Some(sends) = &hub.amqp_sends {
        metrics.amqp_sends_connected.set(i64::from(sends.connected()));
    }
    metrics.driver_connected.clear();
    metrics.driver_process_up.clear();
    metrics.health_state.clear();
    metrics.health_reason.clear();
    for inst in instances.values() {
        let id = inst.config.id.to_string();
        let label = InstanceLabel { channel: id.clone() };
        metrics.driver_connected.get_or_create(&label).set(i64::from(inst.live().is_some()));
        if let Some(process) = inst.process() {
            let up = process.state == crate::instance::ProcessState::Running;
            metrics.driver_process_up.get_or_create(&label).set(i64::from(up));
        }
        let health = inst.health().health;
        for state in [HealthState::Ready, HealthState::Degraded, HealthState::Unavailable] {
            let labels = StateLabels { channel: id.clone(), state: state_label(state) };
            metrics.health_state.get_or_create(&labels).set(i64::from(health.state == state));
        }
        let reason = health
            .status
            .as_ref()
            .and_then(|status| status.reason.as_deref())
            .filter(|_| health.state == HealthState::Unavailable);
        for known in UnavailableReason::ALL {
            let labels = ReasonLabels { channel: id.clone(), reason: known.as_str() };
            let current = reason == Some(known.as_str());
            metrics.health_reason.get_or_create(&labels).set(i64::from(current));
        }
    }
    metrics.ledger_queue_depth.set(hub.ledger.queue_depth() as i64);
    if !hub.ledger.is_on() {
        return;
    }
    match tokio::time::timeout(LEDGER_WAIT, hub.ledger.outbox_counts()).await {
        Ok(Ok(counts)) => {
            metrics.outbox_records.clear();
            for inst in instances.values() {
                for state in OUTBOX_STATES {
                    let labels =
                        StateLabels { channel: inst.config.id.to_string(), state: state.as_str() };
                    metrics.outbox_records.get_or_create(&labels).set(0);
                }
            }
            for (instance, state, count) in counts {
                if instances.contains_key(instance.as_str()) {
                    let labels = StateLabels { channel: instance, state: state.as_str() };
                    metrics.outbox_records.get_or_create(&labels).set(count as i64);
                }
            }
        }
        // The previous values stay: a slow ledger shows in the commit latency instead.
        Ok(Err(err)) => warn!(error = %err, "outbox counts not read for /metrics"),
        Err(_) => warn!("outbox counts not read for /metrics: the ledger did not answer in time"),
    }
}
