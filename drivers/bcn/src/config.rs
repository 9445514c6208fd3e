//! BCN driver settings from the launch environment (`CHANNELD_BCN_*`), validated before
//! anything connects; every error names its variable.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Url};

/// `CHANNELD_BCN_URL`: the bot endpoint, `ws://host:port/ws/bot` or `wss://…` (required).
pub const VAR_URL: &str = "BCN_URL";
/// `CHANNELD_BCN_PROTOCOL_VERSION`: the protocol version asked for in `bot.connect`, 1-3
/// (default 1).
pub const VAR_PROTOCOL_VERSION: &str = "BCN_PROTOCOL_VERSION";
/// `CHANNELD_BCN_STATE_DIR`: where the bot token is kept (file `<channel>.token`, mode
/// 0600). Default: systemd's `$STATE_DIRECTORY`; one of them is required.
pub const VAR_STATE_DIR: &str = "BCN_STATE_DIR";
/// `CHANNELD_BCN_STATUS_INTERVAL_SECONDS`: how often `bot.status` is sent, 0.1-300 (default
/// 60, the platform's recommendation; its TTL is 5 minutes). Two unanswered in a row mean a
/// dead connection.
pub const VAR_STATUS_INTERVAL: &str = "BCN_STATUS_INTERVAL_SECONDS";
/// `CHANNELD_BCN_CONNECT_TIMEOUT_SECONDS`: WebSocket handshake plus `bot.connect`, 0.1-120
/// (default 10).
pub const VAR_CONNECT_TIMEOUT: &str = "BCN_CONNECT_TIMEOUT_SECONDS";
/// `CHANNELD_BCN_RECONNECT_MAX_SECONDS`: cap of the reconnect backoff (1 s doubling,
/// jittered), 1-300 (default 30).
pub const VAR_RECONNECT_MAX: &str = "BCN_RECONNECT_MAX_SECONDS";
/// `CHANNELD_BCN_AUTH_RETRY_SECONDS`: after `unauthorized`, the first retry waits this long
/// and each further one twice as long (up to an hour), 1-3600 (default 300).
pub const VAR_AUTH_RETRY: &str = "BCN_AUTH_RETRY_SECONDS";
/// `CHANNELD_BCN_SEND_TIMEOUT_SECONDS`: how long a reply waits for a connection to BCN
/// before it is reported failed (retryable), 0.1-3600 (default 25).
pub const VAR_SEND_TIMEOUT: &str = "BCN_SEND_TIMEOUT_SECONDS";

/// systemd's state directory variable (its first entry is used).
pub const ENV_STATE_DIRECTORY: &str = "STATE_DIRECTORY";
/// The newest protocol version the driver speaks.
pub const MAX_PROTOCOL_VERSION: u32 = 3;

/// Everything the BCN driver needs.
#[derive(Debug, Clone)]
pub struct BcnConfig {
    pub channel: ChannelId,
    pub url: Url,
    pub protocol_version: u32,
    /// The file holding the bot token (mode 0600).
    pub token_file: PathBuf,
    pub status_interval: Duration,
    pub connect_timeout: Duration,
    pub reconnect_max: Duration,
    pub auth_retry: Duration,
    pub send_timeout: Duration,
}

impl BcnConfig {
    /// Reads and validates the settings. `state_directory` is systemd's `$STATE_DIRECTORY`,
    /// used when `CHANNELD_BCN_STATE_DIR` is not set.
    pub fn from_launch(
        launch: &DriverLaunchConfig,
        state_directory: Option<PathBuf>,
    ) -> Result<Self, ConfigError> {
        let url = check_url(launch.require::<Url>(VAR_URL)?)?;
        let protocol_version =
            launch.parse_within(VAR_PROTOCOL_VERSION, 1..=MAX_PROTOCOL_VERSION)?.unwrap_or(1);
        let state_dir = match launch.parse::<PathBuf>(VAR_STATE_DIR)? {
            Some(dir) => dir,
            None => state_directory.filter(|dir| !dir.as_os_str().is_empty()).ok_or_else(|| {
                invalid(
                    VAR_STATE_DIR,
                    "is not set and neither is STATE_DIRECTORY: the driver keeps the bot token there",
                )
            })?,
        };
        let token_file = state_dir.join(format!("{}.token", launch.channel));
        Ok(Self {
            channel: launch.channel.clone(),
            url,
            protocol_version,
            token_file,
            status_interval: seconds(launch, VAR_STATUS_INTERVAL, 0.1..=300.0, 60.0)?,
            connect_timeout: seconds(launch, VAR_CONNECT_TIMEOUT, 0.1..=120.0, 10.0)?,
            reconnect_max: seconds(launch, VAR_RECONNECT_MAX, 1.0..=300.0, 30.0)?,
            auth_retry: seconds(launch, VAR_AUTH_RETRY, 1.0..=3600.0, 300.0)?,
            send_timeout: seconds(launch, VAR_SEND_TIMEOUT, 0.1..=3600.0, 25.0)?,
        })
    }
}

fn invalid(name: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(name), reason)
}

/// `ws://` or `wss://` with a host and no credentials; the path and query are kept.
fn check_url(url: Url) -> Result<Url, ConfigError> {
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(invalid(VAR_URL, "expected ws://host:port/ws/bot or wss://…"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(VAR_URL, "credentials do not belong in the URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(VAR_URL, "the host is missing"));
    }
    Ok(url)
}

/// A duration setting (seconds, fractions or units allowed) within `range` seconds.
fn seconds(
    launch: &DriverLaunchConfig,
    name: &str,
    range: RangeInclusive<f64>,
    default: f64,
) -> Result<Duration, ConfigError> {
    let range = Duration::from_secs_f64(*range.start())..=Duration::from_secs_f64(*range.end());
    Ok(launch.parse_within(name, range)?.unwrap_or(Duration::from_secs_f64(default)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("bcn.lab").unwrap(), "/tmp/x.sock")
            .with_var(VAR_URL, "ws://127.0.0.1:9000/ws/bot")
    }

    #[test]
    fn defaults_follow_the_platform() {
        let config = BcnConfig::from_launch(&launch(), Some("/var/lib/x".into())).unwrap();
        assert_eq!(config.url.as_str(), "ws://127.0.0.1:9000/ws/bot");
        assert_eq!(config.protocol_version, 1);
        assert_eq!(config.token_file, PathBuf::from("/var/lib/x/bcn.lab.token"));
        assert_eq!(config.status_interval, Duration::from_secs(60));
        assert_eq!(config.reconnect_max, Duration::from_secs(30));
    }

    #[test]
    fn the_state_dir_setting_wins_and_one_is_required() {
        let config = BcnConfig::from_launch(
            &launch().with_var(VAR_STATE_DIR, "/srv/bcn"),
            Some("/var/lib/x".into()),
        )
        .unwrap();
        assert_eq!(config.token_file, PathBuf::from("/srv/bcn/bcn.lab.token"));
        let err = BcnConfig::from_launch(&launch(), None).unwrap_err().to_string();
        assert!(err.starts_with("CHANNELD_BCN_STATE_DIR is invalid"), "{err}");
        assert!(err.contains("STATE_DIRECTORY"), "{err}");
    }

    #[test]
    fn errors_name_the_variable() {
        let state = Some(PathBuf::from("/tmp"));
        let bare = DriverLaunchConfig::for_socket(ChannelId::new("bcn.lab").unwrap(), "/x");
        assert_eq!(
            BcnConfig::from_launch(&bare, state.clone()).unwrap_err().to_string(),
            "CHANNELD_BCN_URL is not set"
        );
        for url in ["http://host/ws/bot", "ws://user:pw@host/ws/bot", "ws://"] {
            let err = BcnConfig::from_launch(&bare.clone().with_var(VAR_URL, url), state.clone())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("CHANNELD_BCN_URL is invalid"), "{url}: {err}");
            assert!(!err.contains("pw"), "{err}");
        }
        let cases = [
            (VAR_PROTOCOL_VERSION, "0"),
            (VAR_PROTOCOL_VERSION, "4"),
            (VAR_PROTOCOL_VERSION, "two"),
            (VAR_STATUS_INTERVAL, "0"),
            (VAR_RECONNECT_MAX, "301"),
            (VAR_AUTH_RETRY, "0.5"),
            (VAR_SEND_TIMEOUT, "-1"),
        ];
        for (var, value) in cases {
            let err = BcnConfig::from_launch(&launch().with_var(var, value), state.clone())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("CHANNELD_{var} is invalid")), "{var}={value}: {err}");
            assert!(!err.contains("pw"), "{err}");
        }
        let v3 =
            BcnConfig::from_launch(&launch().with_var(VAR_PROTOCOL_VERSION, "3"), state).unwrap();
        assert_eq!(v3.protocol_version, 3);
    }
}
