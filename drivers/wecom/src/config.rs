//! WeCom driver settings from the launch environment (`CHANNELD_WECOM_*`), validated before
//! anything connects; every error names its variable and none contains the secret.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret, Url};

use crate::wire;

/// `CHANNELD_WECOM_WS_URL`: the long-connection endpoint, `wss://…` (default
/// [`wire::DEFAULT_WS_URL`]) or `ws://…` (tests, private deployments behind a TLS proxy).
pub const VAR_WS_URL: &str = "WECOM_WS_URL";
/// `CHANNELD_WECOM_BOT_ID`: the bot's BotID from the admin console (required).
pub const VAR_BOT_ID: &str = "WECOM_BOT_ID";
/// The long-connection secret: credential [`CREDENTIAL_SECRET`] first, then
/// `CHANNELD_WECOM_SECRET` (required).
pub const VAR_SECRET: &str = "WECOM_SECRET";
/// The systemd credential (`LoadCredential=wecom-secret:…`) holding the secret.
pub const CREDENTIAL_SECRET: &str = "wecom-secret";
/// `CHANNELD_WECOM_BOT_NAME`: the bot's display name; a leading `@<name>` is stripped from
/// group messages. Without it the leading `@mention` is recognised by its shape.
pub const VAR_BOT_NAME: &str = "WECOM_BOT_NAME";
/// `CHANNELD_WECOM_PLACEHOLDER`: the first stream frame, sent as soon as the hub accepted a
/// message (WeCom shows it as the bot typing). Default `<think></think>` (WeCom's thinking
/// animation); `none` sends no placeholder.
pub const VAR_PLACEHOLDER: &str = "WECOM_PLACEHOLDER";
/// `CHANNELD_WECOM_WELCOME_TEXT`: answered to `enter_chat` (a user opening the chat), within
/// the platform's 5 s. Default: no welcome.
pub const VAR_WELCOME_TEXT: &str = "WECOM_WELCOME_TEXT";
/// `CHANNELD_WECOM_RESPONDERS`: comma-separated user ids whose card clicks answer approvals
/// and choices. Default: every clicker is passed on and the hub's allowlist decides.
pub const VAR_RESPONDERS: &str = "WECOM_RESPONDERS";
/// `CHANNELD_WECOM_PING_INTERVAL_SECONDS`: application `ping` interval, 1-300 (default 30);
/// two unanswered pings mean a dead connection.
pub const VAR_PING_INTERVAL: &str = "WECOM_PING_INTERVAL_SECONDS";
/// `CHANNELD_WECOM_ACK_TIMEOUT_SECONDS`: how long one command waits for its
/// acknowledgement, 1-60 (default 5, the official SDK's).
pub const VAR_ACK_TIMEOUT: &str = "WECOM_ACK_TIMEOUT_SECONDS";
/// `CHANNELD_WECOM_CONNECT_TIMEOUT_SECONDS`: WebSocket handshake plus subscribe, 1-120
/// (default 10).
pub const VAR_CONNECT_TIMEOUT: &str = "WECOM_CONNECT_TIMEOUT_SECONDS";
/// `CHANNELD_WECOM_STREAM_WINDOW_SECONDS`: how long a stream accepts updates after its first
/// frame, 2-3600 (default 360, the platform's 6 minutes). A reply that would land later goes
/// as a proactive message instead.
pub const VAR_STREAM_WINDOW: &str = "WECOM_STREAM_WINDOW_SECONDS";
/// `CHANNELD_WECOM_RECONNECT_MAX_SECONDS`: cap of the reconnect backoff (1 s doubling,
/// jittered), 1-300 (default 30).
pub const VAR_RECONNECT_MAX: &str = "WECOM_RECONNECT_MAX_SECONDS";
/// `CHANNELD_WECOM_AUTH_RETRY_SECONDS`: after a refused subscribe, the first retry waits this
/// long and each further one twice as long (up to an hour), 30-3600 (default 300). Subscribe
/// is rate-protected by the platform; a refused bot id or secret is not retried faster.
pub const VAR_AUTH_RETRY: &str = "WECOM_AUTH_RETRY_SECONDS";
/// `CHANNELD_WECOM_PACE_PER_MINUTE`: messages per conversation per minute, 1-30 (default 30,
/// the platform's limit; replies and proactive messages together).
pub const VAR_PACE_PER_MINUTE: &str = "WECOM_PACE_PER_MINUTE";
/// `CHANNELD_WECOM_PACE_PER_HOUR`: messages per conversation per hour, 1-1000 (default 1000).
pub const VAR_PACE_PER_HOUR: &str = "WECOM_PACE_PER_HOUR";
/// `CHANNELD_WECOM_SEND_QUEUE_SECONDS`: how long a message may wait for its conversation's
/// pace (and for the connection) before it is reported failed, 1-3600 (default 25, under the
/// hub's 30 s receipt timeout).
pub const VAR_SEND_QUEUE: &str = "WECOM_SEND_QUEUE_SECONDS";
/// `CHANNELD_WECOM_CARD_TIMEOUT_SECONDS`: how long an approval or choice card waits for a
/// click before the command is rejected, 10-86400 (default 300, the hub's command timeout).
pub const VAR_CARD_TIMEOUT: &str = "WECOM_CARD_TIMEOUT_SECONDS";

/// The default placeholder: WeCom renders it as a thinking animation.
pub const DEFAULT_PLACEHOLDER: &str = "<think></think>";

/// Messages per conversation the driver allows itself, within two sliding windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub per_minute: usize,
    pub per_hour: usize,
    /// One minute, shortened only by in-process tests.
    pub minute: Duration,
    /// One hour, shortened only by in-process tests.
    pub hour: Duration,
}

/// Everything the WeCom driver needs.
#[derive(Debug, Clone)]
pub struct WeComConfig {
    pub channel: ChannelId,
    pub ws_url: Url,
    pub bot_id: String,
    pub secret: Secret,
    pub bot_name: Option<String>,
    pub placeholder: Option<String>,
    pub welcome_text: Option<String>,
    /// Empty: every clicker answers (the hub vets them).
    pub responders: BTreeSet<String>,
    pub ping_interval: Duration,
    pub ack_timeout: Duration,
    pub connect_timeout: Duration,
    pub stream_window: Duration,
    pub reconnect_max: Duration,
    pub auth_retry: Duration,
    pub pace: Pace,
    pub send_queue: Duration,
    pub card_timeout: Duration,
}

impl WeComConfig {
    /// Reads and validates the settings.
    pub fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, ConfigError> {
        let ws_url = match launch.parse::<Url>(VAR_WS_URL)? {
            Some(url) => check_ws_url(url)?,
            None => Url::parse(wire::DEFAULT_WS_URL).expect("the default URL parses"),
        };
        let bot_id: String = launch.require(VAR_BOT_ID)?;
        let bot_id = bot_id.trim().to_owned();
        if bot_id.contains(char::is_whitespace) {
            return Err(invalid(VAR_BOT_ID, "must be the BotID without whitespace"));
        }
        let secret = launch.secret(CREDENTIAL_SECRET, VAR_SECRET)?.ok_or_else(|| {
            ConfigError::missing(format!(
                "credential {CREDENTIAL_SECRET} or {}",
                setting_var(VAR_SECRET)
            ))
        })?;
        let placeholder = match launch.var(VAR_PLACEHOLDER) {
            Some(text) if text.trim().eq_ignore_ascii_case("none") => None,
            Some(text) => Some(content(VAR_PLACEHOLDER, text)?),
            None => Some(DEFAULT_PLACEHOLDER.to_owned()),
        };
        let welcome_text =
            launch.var(VAR_WELCOME_TEXT).map(|text| content(VAR_WELCOME_TEXT, text)).transpose()?;
        let bot_name = launch
            .var(VAR_BOT_NAME)
            .map(|name| name.trim().trim_start_matches('@').to_owned())
            .filter(|name| !name.is_empty());
        let responders = match launch.var(VAR_RESPONDERS) {
            None => BTreeSet::new(),
            Some(list) => {
                let users: BTreeSet<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|user| !user.is_empty())
                    .map(str::to_owned)
                    .collect();
                if users.is_empty() {
                    return Err(invalid(VAR_RESPONDERS, "names no user id"));
                }
                users
            }
        };
        let ack_timeout = seconds(launch, VAR_ACK_TIMEOUT, 0.1..=60.0, 5.0)?;
        let stream_window = seconds(launch, VAR_STREAM_WINDOW, 1.0..=3600.0, 360.0)?;
        if stream_window <= ack_timeout {
            return Err(invalid(
                VAR_STREAM_WINDOW,
                format!("must be longer than {} ({ack_timeout:?})", setting_var(VAR_ACK_TIMEOUT)),
            ));
        }
        let per_minute = launch.parse_within(VAR_PACE_PER_MINUTE, 1..=30)?.unwrap_or(30);
        let per_hour = launch.parse_within(VAR_PACE_PER_HOUR, 1..=1000)?.unwrap_or(1000);
        Ok(Self {
            channel: launch.channel.clone(),
            ws_url,
            bot_id,
            secret,
            bot_name,
            placeholder,
            welcome_text,
            responders,
            ping_interval: seconds(launch, VAR_PING_INTERVAL, 0.1..=300.0, 30.0)?,
            ack_timeout,
            connect_timeout: seconds(launch, VAR_CONNECT_TIMEOUT, 0.1..=120.0, 10.0)?,
            stream_window,
            reconnect_max: seconds(launch, VAR_RECONNECT_MAX, 1.0..=300.0, 30.0)?,
            auth_retry: seconds(launch, VAR_AUTH_RETRY, 30.0..=3600.0, 300.0)?,
            pace: Pace {
                per_minute,
                per_hour,
                minute: Duration::from_secs(60),
                hour: Duration::from_secs(3600),
            },
            send_queue: seconds(launch, VAR_SEND_QUEUE, 0.1..=3600.0, 25.0)?,
            card_timeout: seconds(launch, VAR_CARD_TIMEOUT, 10.0..=86_400.0, 300.0)?,
        })
    }
}

fn invalid(name: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(name), reason)
}

/// `ws://` or `wss://` with a host and no credentials; the path and query are kept.
fn check_ws_url(url: Url) -> Result<Url, ConfigError> {
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(invalid(VAR_WS_URL, "expected wss://host[:port][/path] or ws://…"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(VAR_WS_URL, "credentials do not belong in the URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(VAR_WS_URL, "the host is missing"));
    }
    Ok(url)
}

/// Text the platform will show: at most [`wire::MAX_CONTENT_BYTES`], no NUL.
fn content(name: &str, text: &str) -> Result<String, ConfigError> {
    if text.len() > wire::MAX_CONTENT_BYTES || text.contains('\0') {
        return Err(invalid(
            name,
            format!("must be at most {} bytes without NUL", wire::MAX_CONTENT_BYTES),
        ));
    }
    Ok(text.to_owned())
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
        DriverLaunchConfig::for_socket(ChannelId::new("wecom.ops").unwrap(), "/tmp/x.sock")
            .with_var(VAR_BOT_ID, "aib-123")
            .with_var(VAR_SECRET, "s3cret-value")
    }

    #[test]
    fn defaults_follow_the_platform() {
        let config = WeComConfig::from_launch(&launch()).unwrap();
        assert_eq!(config.ws_url.as_str(), "wss://openws.work.weixin.qq.com/");
        assert_eq!(config.bot_id, "aib-123");
        assert_eq!(config.secret.expose(), "s3cret-value");
        assert_eq!(config.placeholder.as_deref(), Some(DEFAULT_PLACEHOLDER));
        assert_eq!(config.ping_interval, Duration::from_secs(30));
        assert_eq!(config.ack_timeout, Duration::from_secs(5));
        assert_eq!(config.stream_window, Duration::from_secs(360));
        assert_eq!(config.reconnect_max, Duration::from_secs(30));
        assert_eq!((config.pace.per_minute, config.pace.per_hour), (30, 1000));
        assert!(config.responders.is_empty() && config.welcome_text.is_none());
    }

    #[test]
    fn the_secret_comes_from_the_credential_first_and_never_prints() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CREDENTIAL_SECRET), "from-file\n").unwrap();
        let mut vars = vec![
            ("CHANNELD_CHANNEL_ID", "wecom.ops".to_owned()),
            ("CHANNELD_SOCKET", "/tmp/wecom.ops.sock".to_owned()),
            ("CHANNELD_WECOM_BOT_ID", "aib-1".to_owned()),
            ("CHANNELD_WECOM_SECRET", "from-env".to_owned()),
        ];
        let config =
            WeComConfig::from_launch(&DriverLaunchConfig::from_vars(vars.clone()).unwrap())
                .unwrap();
        assert_eq!(config.secret.expose(), "from-env");
        assert!(!format!("{config:?}").contains("from-env"), "the secret never prints");
        vars.push(("CREDENTIALS_DIRECTORY", dir.path().display().to_string()));
        let config =
            WeComConfig::from_launch(&DriverLaunchConfig::from_vars(vars).unwrap()).unwrap();
        assert_eq!(config.secret.expose(), "from-file");
    }

    #[test]
    fn a_missing_secret_or_bot_id_is_named() {
        let bare = DriverLaunchConfig::for_socket(ChannelId::new("wecom.ops").unwrap(), "/x");
        assert_eq!(
            WeComConfig::from_launch(&bare).unwrap_err().to_string(),
            "CHANNELD_WECOM_BOT_ID is not set"
        );
        let no_secret = bare.with_var(VAR_BOT_ID, "aib-1");
        let err = WeComConfig::from_launch(&no_secret).unwrap_err().to_string();
        assert_eq!(err, "credential wecom-secret or CHANNELD_WECOM_SECRET is not set");
    }

    #[test]
    fn urls_need_a_websocket_scheme_and_no_credentials() {
        let ok = WeComConfig::from_launch(&launch().with_var(VAR_WS_URL, "ws://127.0.0.1:9000"))
            .unwrap();
        assert_eq!(ok.ws_url.as_str(), "ws://127.0.0.1:9000/");
        for bad in
            ["https://x", "ws://", "wss://user:pw@host", "ws://a b", "openws.work.weixin.qq.com"]
        {
            let err = WeComConfig::from_launch(&launch().with_var(VAR_WS_URL, bad)).unwrap_err();
            assert!(
                err.to_string().starts_with("CHANNELD_WECOM_WS_URL is invalid"),
                "{bad}: {err}"
            );
            assert!(!err.to_string().contains("pw"), "{err}");
        }
    }

    #[test]
    fn errors_name_the_variable() {
        let cases = [
            (VAR_PING_INTERVAL, "0"),
            (VAR_PING_INTERVAL, "500ms-ish"),
            (VAR_ACK_TIMEOUT, "soon"),
            (VAR_STREAM_WINDOW, "1"),
            (VAR_RECONNECT_MAX, "301"),
            (VAR_AUTH_RETRY, "5"),
            (VAR_PACE_PER_MINUTE, "31"),
            (VAR_PACE_PER_HOUR, "0"),
            (VAR_SEND_QUEUE, "-1"),
            (VAR_CARD_TIMEOUT, "1"),
            (VAR_RESPONDERS, " , "),
        ];
        for (var, value) in cases {
            let err = WeComConfig::from_launch(&launch().with_var(var, value)).unwrap_err();
            assert!(err.to_string().starts_with(&format!("CHANNELD_{var} is invalid")), "{err}");
        }
        let spaced = DriverLaunchConfig::for_socket(ChannelId::new("wecom.ops").unwrap(), "/x")
            .with_var(VAR_BOT_ID, "has space");
        let err = WeComConfig::from_launch(&spaced).unwrap_err().to_string();
        assert!(err.starts_with("CHANNELD_WECOM_BOT_ID is invalid"), "{err}");
        let err = WeComConfig::from_launch(
            &launch().with_var(VAR_STREAM_WINDOW, "5").with_var(VAR_ACK_TIMEOUT, "5"),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("longer than CHANNELD_WECOM_ACK_TIMEOUT_SECONDS"),
            "{err}"
        );
    }

    #[test]
    fn optional_texts_and_responders_are_read() {
        let launch = launch()
            .with_var(VAR_PLACEHOLDER, "none")
            .with_var(VAR_WELCOME_TEXT, "Hi, ask me anything")
            .with_var(VAR_BOT_NAME, "@Ops Bot")
            .with_var(VAR_RESPONDERS, "alice, bob,alice");
        let config = WeComConfig::from_launch(&launch).unwrap();
        assert_eq!(config.placeholder, None);
        assert_eq!(config.welcome_text.as_deref(), Some("Hi, ask me anything"));
        assert_eq!(config.bot_name.as_deref(), Some("Ops Bot"));
        assert_eq!(config.responders.into_iter().collect::<Vec<_>>(), ["alice", "bob"]);
    }
}
