//! The driver's health: the poll loop's link state and the token session's auth state,
//! mapped to one report. Pure.

use channeld_driver_sdk::protocol::types::{Health, HealthState, HealthStatus};

use crate::session::Auth;

/// Client-side poll timeouts in a row after which the server is called silent.
pub const SILENT_AFTER: u32 = 3;

/// What the poll loop last saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    /// No poll answered yet.
    Starting,
    /// The last poll was answered.
    Polling,
    /// Several polls in a row got no answer within the client timeout.
    Silent { polls: u32 },
    /// Polls fail; the next try waits.
    Retrying { attempt: u32, error: String },
}

/// The health for `link` and `auth`. Details never carry a token.
pub fn health(link: &Link, auth: &Auth, base_url: &str) -> Health {
    let status = |transport: &str, auth: Option<&str>, attempt: Option<u32>| HealthStatus {
        transport: Some(transport.to_owned()),
        auth: auth.map(str::to_owned),
        attempt,
        ..HealthStatus::default()
    };
    let (state, detail, status) = match auth {
        Auth::Expired { source } => (
            HealthState::Unavailable,
            format!(
                "auth_expired: iLink refused the bot token from {} (-14); polling is paused until a new token appears: run `channeld-wechat login`, replace the credential, or `channelctl resume`",
                source.describe()
            ),
            status("paused", Some("expired"), None),
        ),
        Auth::Missing => (
            HealthState::Unavailable,
            "auth_missing: no bot token: run `channeld-wechat login` or install the wechat-bot-token credential".to_owned(),
            status("paused", Some("missing"), None),
        ),
        Auth::Unreadable(reason) => (
            HealthState::Unavailable,
            format!("auth_unreadable: {reason}"),
            status("paused", Some("unreadable"), None),
        ),
        Auth::Usable => match link {
            Link::Starting => (
                HealthState::Degraded,
                format!("connecting to {base_url}"),
                status("connecting", None, Some(0)),
            ),
            Link::Polling => {
                return Health {
                    state: HealthState::Ready,
                    detail: Some(format!("long-polling {base_url}")),
                    status: Some(status("connected", Some("ok"), Some(0))),
                };
            }
            Link::Silent { polls } => (
                HealthState::Degraded,
                format!("{base_url} has not answered {polls} long polls in a row"),
                status("silent", None, Some(*polls)),
            ),
            Link::Retrying { attempt, error } => (
                HealthState::Degraded,
                format!("{error} (attempt {attempt})"),
                status("disconnected", None, Some(*attempt)),
            ),
        },
    };
    Health { state, detail: Some(detail), status: Some(status) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::TokenSource;

    const BASE: &str = "https://ilinkai.weixin.qq.com";

    #[test]
    fn polling_is_ready_and_failures_are_degraded_with_the_attempt() {
        assert_eq!(health(&Link::Polling, &Auth::Usable, BASE).state, HealthState::Ready);
        let retrying = Link::Retrying { attempt: 4, error: "getupdates: HTTP 502".into() };
        let degraded = health(&retrying, &Auth::Usable, BASE);
        assert_eq!(degraded.state, HealthState::Degraded);
        assert_eq!(degraded.status.unwrap().attempt, Some(4));
        assert_eq!(degraded.detail.as_deref(), Some("getupdates: HTTP 502 (attempt 4)"));
        let silent = health(&Link::Silent { polls: 3 }, &Auth::Usable, BASE);
        assert_eq!(silent.state, HealthState::Degraded);
    }

    #[test]
    fn an_expired_token_is_unavailable_whatever_the_link_says() {
        let expired = Auth::Expired { source: TokenSource::Login };
        let report = health(&Link::Polling, &expired, BASE);
        assert_eq!(report.state, HealthState::Unavailable);
        assert!(report.detail.as_deref().unwrap().starts_with("auth_expired"));
        assert_eq!(report.status.unwrap().auth.as_deref(), Some("expired"));
        let missing = health(&Link::Starting, &Auth::Missing, BASE);
        assert_eq!(missing.state, HealthState::Unavailable);
    }
}
