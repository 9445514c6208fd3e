//! The state of a driver's platform link, and the one rule that turns it into the `Health`
//! the hub shows: transient trouble is `Degraded` (the driver retries by itself); a condition
//! only an operator can fix is `Unavailable` with a machine-readable `reason`.
//!
//! A driver reports its link with [`Hub::link_state`](crate::Hub::link_state) whenever it
//! changes; the SDK sends the health to the hub and answers the hub's probes with it.

use std::time::Duration;

use channeld_protocol::types::{Health, HealthState, HealthStatus, UnavailableReason};

/// Where the platform link stands. `detail` and `error` texts are shown to operators: never
/// put a secret in them (name the host, not the URL with its password).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    /// Opening the platform connection; `attempt` counts the failed attempts before this one.
    Connecting { attempt: u32 },
    /// Connected and working; `detail` may say what it serves (`consuming queue inbox`).
    Up { detail: Option<String> },
    /// The connection failed or dropped for a reason that may pass (network, platform
    /// outage, rate limit); the driver retries with backoff.
    Retrying { attempt: u32, error: String },
    /// Connected, but the platform has been silent past the driver's idle limit (a half-open
    /// connection, a stuck long poll); the driver is about to reconnect.
    Stalled { idle: Duration },
    /// The platform refused the credentials. Retrying cannot help until an operator fixes
    /// them; the driver retries slowly.
    AuthRejected { detail: String },
    /// The credentials expired (a session that needs a new login or QR scan).
    AuthExpired { detail: String },
    /// Another client took the bot's single connection (the platform displaced this one).
    Fenced { detail: String },
    /// The platform refused the driver's setup for another reason an operator must fix (a
    /// resource declared with other arguments, a missing permission).
    SetupRefused { detail: String },
}

impl LinkState {
    /// Connected and working.
    pub fn up() -> Self {
        LinkState::Up { detail: None }
    }

    /// Connected and working, saying what it serves.
    pub fn up_as(detail: impl Into<String>) -> Self {
        LinkState::Up { detail: Some(detail.into()) }
    }

    /// The operator-only condition behind this state, if it is one.
    pub fn unavailable_reason(&self) -> Option<UnavailableReason> {
        match self {
            LinkState::AuthRejected { .. } => Some(UnavailableReason::AuthRejected),
            LinkState::AuthExpired { .. } => Some(UnavailableReason::AuthExpired),
            LinkState::Fenced { .. } => Some(UnavailableReason::Fenced),
            LinkState::SetupRefused { .. } => Some(UnavailableReason::SetupRefused),
            LinkState::Connecting { .. }
            | LinkState::Up { .. }
            | LinkState::Retrying { .. }
            | LinkState::Stalled { .. } => None,
        }
    }

    /// The health report for this state: `Ready` when up, `Unavailable` with a `reason` for
    /// operator-only conditions, `Degraded` for everything else.
    pub fn health(&self) -> Health {
        let status = |transport: &str| HealthStatus {
            transport: Some(transport.to_owned()),
            ..HealthStatus::default()
        };
        let (state, detail, status) = match self {
            LinkState::Up { detail } => (
                HealthState::Ready,
                detail.clone(),
                HealthStatus { auth: Some("ok".into()), ..status("connected") },
            ),
            LinkState::Connecting { attempt } => (
                HealthState::Degraded,
                Some(match attempt {
                    0 => "connecting to the platform".to_owned(),
                    n => format!("connecting to the platform (attempt {})", n + 1),
                }),
                HealthStatus { attempt: Some(*attempt), ..status("connecting") },
            ),
            LinkState::Retrying { attempt, error } => (
                HealthState::Degraded,
                Some(format!("platform unreachable, retrying: {error}")),
                HealthStatus { attempt: Some(*attempt), ..status("disconnected") },
            ),
            LinkState::Stalled { idle } => (
                HealthState::Degraded,
                Some(format!("no traffic from the platform for {}s, reconnecting", idle.as_secs())),
                HealthStatus { idle_seconds: Some(idle.as_secs()), ..status("stalled") },
            ),
            LinkState::AuthRejected { detail }
            | LinkState::AuthExpired { detail }
            | LinkState::Fenced { detail }
            | LinkState::SetupRefused { detail } => {
                let reason = self.unavailable_reason().map(UnavailableReason::as_str);
                let auth = match self {
                    LinkState::AuthRejected { .. } => Some("rejected".to_owned()),
                    LinkState::AuthExpired { .. } => Some("expired".to_owned()),
                    _ => None,
                };
                (
                    HealthState::Unavailable,
                    Some(detail.clone()),
                    HealthStatus {
                        auth,
                        reason: reason.map(str::to_owned),
                        ..status("disconnected")
                    },
                )
            }
        };
        Health { state, detail, status: Some(status) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_trouble_is_degraded_and_operator_conditions_unavailable_with_a_reason() {
        let transient = [
            LinkState::Connecting { attempt: 0 },
            LinkState::Retrying { attempt: 3, error: "connection refused".into() },
            LinkState::Stalled { idle: Duration::from_secs(95) },
        ];
        for state in transient {
            let health = state.health();
            assert_eq!(health.state, HealthState::Degraded, "{state:?}");
            assert_eq!(health.status.unwrap().reason, None, "{state:?}");
            assert!(health.detail.is_some_and(|d| !d.is_empty()), "{state:?} explains itself");
        }
        let operator = [
            (LinkState::AuthRejected { detail: "bad password".into() }, "auth_rejected"),
            (LinkState::AuthExpired { detail: "session expired".into() }, "auth_expired"),
            (LinkState::Fenced { detail: "another client connected".into() }, "fenced"),
            (LinkState::SetupRefused { detail: "queue exists".into() }, "setup_refused"),
        ];
        for (state, reason) in operator {
            let health = state.health();
            assert_eq!(health.state, HealthState::Unavailable, "{state:?}");
            assert_eq!(health.status.unwrap().reason.as_deref(), Some(reason));
        }
        let up = LinkState::up().health();
        assert_eq!(up.state, HealthState::Ready);
        assert_eq!(
            LinkState::up_as("consuming queue q").health().detail.as_deref(),
            Some("consuming queue q")
        );
        assert_eq!(up.status.unwrap().transport.as_deref(), Some("connected"));
    }

    #[test]
    fn the_structured_status_carries_attempts_idle_time_and_auth() {
        let retrying = LinkState::Retrying { attempt: 4, error: "timeout".into() }.health();
        assert_eq!(retrying.detail.as_deref(), Some("platform unreachable, retrying: timeout"));
        assert_eq!(retrying.status.unwrap().attempt, Some(4));
        let stalled = LinkState::Stalled { idle: Duration::from_secs(95) }.health();
        assert_eq!(stalled.status.unwrap().idle_seconds, Some(95));
        let rejected = LinkState::AuthRejected { detail: "x".into() }.health();
        assert_eq!(rejected.status.unwrap().auth.as_deref(), Some("rejected"));
    }
}
