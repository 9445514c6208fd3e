//! The driver's link state for the SDK's health rule: what the poll loop last saw, combined
//! with the token session. Pure.
//!
//! Transient trouble (server errors, an unreachable or silent server) is the SDK's Degraded;
//! an expired token (`-14`) is Unavailable `auth_expired`, no token at all or an unreadable one
//! Unavailable `auth_rejected`: only an operator can fix those.

use std::time::Duration;

use channeld_driver_sdk::LinkState;

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
    /// Several polls in a row got no answer within the client timeout, for `idle`.
    Silent { idle: Duration },
    /// Polls fail; the next try waits.
    Retrying { attempt: u32, error: String },
}

/// The link state for `link` and `auth`. Details never carry a token.
pub fn link_state(link: &Link, auth: &Auth, base_url: &str) -> LinkState {
    match auth {
        Auth::Expired { source } => LinkState::AuthExpired {
            detail: format!(
                "auth_expired: iLink refused the bot token from {} (-14); polling is paused until a new token appears: run `channeld-wechat login`, replace the credential, or `channelctl resume`",
                source.describe()
            ),
        },
        Auth::Missing => LinkState::AuthRejected {
            detail: "no bot token: run `channeld-wechat login` or install the wechat-bot-token credential"
                .to_owned(),
        },
        Auth::Unreadable(reason) => {
            LinkState::AuthRejected { detail: format!("the bot token cannot be read: {reason}") }
        }
        Auth::Usable => match link {
            Link::Starting => LinkState::Connecting { attempt: 0 },
            Link::Polling => LinkState::up_as(format!("long-polling {base_url}")),
            Link::Silent { idle } => LinkState::Stalled { idle: *idle },
            Link::Retrying { attempt, error } => {
                LinkState::Retrying { attempt: *attempt, error: error.clone() }
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::types::HealthState;

    use super::*;
    use crate::session::TokenSource;

    const BASE: &str = "https://ilinkai.weixin.qq.com";

    #[test]
    fn polling_is_ready_and_failures_are_degraded_with_the_attempt() {
        let up = link_state(&Link::Polling, &Auth::Usable, BASE).health();
        assert_eq!(up.state, HealthState::Ready);
        assert_eq!(up.detail.as_deref(), Some("long-polling https://ilinkai.weixin.qq.com"));
        let retrying = Link::Retrying { attempt: 4, error: "getupdates: HTTP 502".into() };
        let degraded = link_state(&retrying, &Auth::Usable, BASE).health();
        assert_eq!(degraded.state, HealthState::Degraded);
        assert_eq!(degraded.status.unwrap().attempt, Some(4));
        assert!(degraded.detail.unwrap().contains("getupdates: HTTP 502"));
        let silent = Link::Silent { idle: Duration::from_secs(111) };
        let stalled = link_state(&silent, &Auth::Usable, BASE).health();
        assert_eq!(stalled.state, HealthState::Degraded);
        assert_eq!(stalled.status.unwrap().idle_seconds, Some(111));
    }

    #[test]
    fn token_trouble_is_unavailable_whatever_the_link_says() {
        let expired = Auth::Expired { source: TokenSource::Login };
        let report = link_state(&Link::Polling, &expired, BASE).health();
        assert_eq!(report.state, HealthState::Unavailable);
        assert!(report.detail.as_deref().unwrap().starts_with("auth_expired"));
        let status = report.status.unwrap();
        assert_eq!(status.reason.as_deref(), Some("auth_expired"));
        assert_eq!(status.auth.as_deref(), Some("expired"));
        let missing = link_state(&Link::Starting, &Auth::Missing, BASE).health();
        assert_eq!(missing.state, HealthState::Unavailable);
        assert_eq!(missing.status.unwrap().reason.as_deref(), Some("auth_rejected"));
    }
}
