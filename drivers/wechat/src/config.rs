//! WeChat driver settings from the launch environment (`CHANNELD_WECHAT_*`), read with the
//! SDK's typed settings and validated before anything connects; every error names its
//! variable and none contains a secret.
//!
//! Durations are seconds and may be fractional (`0.5`, or `500ms`), so tests can shorten the
//! platform's timers without a second set of names.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_driver_sdk::config::Setting;
use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret, Url};

use crate::ilink;

/// `CHANNELD_WECHAT_BASE_URL`: the iLink API base URL. A base URL stored by `login` wins.
pub const VAR_BASE_URL: &str = "WECHAT_BASE_URL";
/// `CHANNELD_WECHAT_BOT_TOKEN`: the bot token, read only when the credential
/// [`CREDENTIAL_BOT_TOKEN`] is absent.
pub const VAR_BOT_TOKEN: &str = "WECHAT_BOT_TOKEN";
/// The systemd credential (`LoadCredential=wechat-bot-token:…`) holding the bot token.
pub const CREDENTIAL_BOT_TOKEN: &str = "wechat-bot-token";
/// `CHANNELD_WECHAT_STATE_DIR`: where cursor, dedupe set, context tokens and the login live;
/// default `$STATE_DIRECTORY` (the unit's `StateDirectory=`).
pub const VAR_STATE_DIR: &str = "WECHAT_STATE_DIR";
/// systemd's `StateDirectory=` path.
pub const ENV_STATE_DIRECTORY: &str = "STATE_DIRECTORY";
/// `CHANNELD_WECHAT_CDN_BASE_URL`: where inbound media without a `full_url` is fetched from.
pub const VAR_CDN_BASE_URL: &str = "WECHAT_CDN_BASE_URL";
/// `CHANNELD_WECHAT_ROUTE_TAG`: an `SKRouteTag` header for deployments that route by it.
pub const VAR_ROUTE_TAG: &str = "WECHAT_ROUTE_TAG";
/// `CHANNELD_WECHAT_BOT_AGENT`: `base_info.bot_agent` (`Name/Version` tokens).
pub const VAR_BOT_AGENT: &str = "WECHAT_BOT_AGENT";
/// `CHANNELD_WECHAT_POLL_TIMEOUT_SECONDS`: the `getupdates` client timeout until the server
/// names one (`longpolling_timeout_ms`).
pub const VAR_POLL_TIMEOUT: &str = "WECHAT_POLL_TIMEOUT_SECONDS";
/// `CHANNELD_WECHAT_RETRY_SECONDS`: the wait after a failed poll.
pub const VAR_RETRY: &str = "WECHAT_RETRY_SECONDS";
/// `CHANNELD_WECHAT_BACKOFF_SECONDS`: the wait once failures repeat.
pub const VAR_BACKOFF: &str = "WECHAT_BACKOFF_SECONDS";
/// `CHANNELD_WECHAT_BACKOFF_AFTER`: consecutive failures that switch to the longer wait.
pub const VAR_BACKOFF_AFTER: &str = "WECHAT_BACKOFF_AFTER";
/// `CHANNELD_WECHAT_AUTH_RETRY_SECONDS`: after `-14`, try the same token again after this
/// long (the official client's pause); `0`: only a new token or `resume` restarts polling.
pub const VAR_AUTH_RETRY: &str = "WECHAT_AUTH_RETRY_SECONDS";
/// `CHANNELD_WECHAT_SEND_TIMEOUT_SECONDS`: `sendmessage` client timeout.
pub const VAR_SEND_TIMEOUT: &str = "WECHAT_SEND_TIMEOUT_SECONDS";
/// `CHANNELD_WECHAT_REQUEST_TIMEOUT_SECONDS`: timeout of `getconfig`, `sendtyping` and the
/// `notifystart`/`notifystop` calls.
pub const VAR_REQUEST_TIMEOUT: &str = "WECHAT_REQUEST_TIMEOUT_SECONDS";
/// `CHANNELD_WECHAT_CHUNK_CHARS`: longest text in one message; longer replies are split.
pub const VAR_CHUNK_CHARS: &str = "WECHAT_CHUNK_CHARS";
/// `CHANNELD_WECHAT_TYPING_INTERVAL_SECONDS`: how often "typing" is refreshed while a run goes.
pub const VAR_TYPING_INTERVAL: &str = "WECHAT_TYPING_INTERVAL_SECONDS";
/// `CHANNELD_WECHAT_TYPING_MAX_SECONDS`: a typing indicator nobody stops ends after this.
pub const VAR_TYPING_MAX: &str = "WECHAT_TYPING_MAX_SECONDS";
/// `CHANNELD_WECHAT_DEDUPE_TTL_SECONDS`: how long a message id is remembered against replays.
pub const VAR_DEDUPE_TTL: &str = "WECHAT_DEDUPE_TTL_SECONDS";
/// `CHANNELD_WECHAT_MARKDOWN`: `simplify` (default) rewrites what WeChat does not render;
/// `keep` sends the text as it is.
pub const VAR_MARKDOWN: &str = "WECHAT_MARKDOWN";

/// The longest text item the official client sends.
pub const MAX_CHUNK_CHARS: usize = 4000;

fn invalid(var: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(var), reason)
}

/// The error when neither state directory variable is set.
fn no_state_dir() -> ConfigError {
    ConfigError::missing(format!(
        "{} (or systemd's StateDirectory=, $STATE_DIRECTORY)",
        setting_var(VAR_STATE_DIR)
    ))
}

/// What the driver does with Markdown in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Markdown {
    /// Rewrite the constructs WeChat shows as raw characters.
    Simplify,
    /// Send the text unchanged.
    Keep,
}

/// How failed polls are retried: `retry` after each failure, `backoff` once `backoff_after`
/// failures in a row have happened (the official client: 2 s, then 30 s after 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub retry: Duration,
    pub backoff: Duration,
    pub backoff_after: u32,
}

impl RetryPolicy {
    /// The wait after the `failures`-th consecutive failure (1-based).
    pub fn delay(&self, failures: u32) -> Duration {
        if failures >= self.backoff_after { self.backoff } else { self.retry }
    }
}

/// Everything the WeChat driver needs.
#[derive(Debug, Clone)]
pub struct WechatConfig {
    pub channel: ChannelId,
    /// From the environment; a base URL stored by `login` wins (see [`crate::state`]).
    pub base_url: String,
    pub cdn_base_url: String,
    /// The credentials directory, re-read when a new token is awaited.
    pub credentials_dir: Option<PathBuf>,
    /// `CHANNELD_WECHAT_BOT_TOKEN`.
    pub env_token: Option<Secret>,
    pub state_dir: PathBuf,
    pub route_tag: Option<String>,
    pub bot_agent: String,
    pub poll_timeout: Duration,
    pub retry: RetryPolicy,
    pub auth_retry: Option<Duration>,
    pub send_timeout: Duration,
    pub request_timeout: Duration,
    pub chunk_chars: usize,
    pub typing_interval: Duration,
    pub typing_max: Duration,
    pub dedupe_ttl: Duration,
    pub markdown: Markdown,
}

/// The settings `channeld-wechat login` needs: where to log in and where to store it.
#[derive(Debug, Clone)]
pub struct LoginConfig {
    pub base_url: String,
    pub state_dir: PathBuf,
    pub route_tag: Option<String>,
}

impl WechatConfig {
    /// Reads and validates the settings. `state_directory` is `$STATE_DIRECTORY`, which is not
    /// a `CHANNELD_` variable.
    pub fn from_launch(
        launch: &DriverLaunchConfig,
        state_directory: Option<&Path>,
    ) -> Result<Self, ConfigError> {
        let env_token = launch.var(VAR_BOT_TOKEN).map(|value| Secret::new(value.to_owned()));
        // Read once now so an unreadable or empty credential stops the start with a clear
        // error; the driver reads it again whenever it waits for a new token.
        if let Some(dir) = &launch.credentials_dir {
            Secret::from_credential_file(dir, CREDENTIAL_BOT_TOKEN)?;
        }
        let seconds = |var: &str, range: RangeInclusive<f64>, default: f64| {
            let range =
                Duration::from_secs_f64(*range.start())..=Duration::from_secs_f64(*range.end());
            Ok::<_, ConfigError>(
                launch.parse_within(var, range)?.unwrap_or(Duration::from_secs_f64(default)),
            )
        };
        let count = |var: &str, range: RangeInclusive<u32>, default: u32| {
            Ok::<_, ConfigError>(launch.parse_within(var, range)?.unwrap_or(default))
        };
        Ok(Self {
            channel: launch.channel.clone(),
            base_url: base_url(launch.var(VAR_BASE_URL), VAR_BASE_URL, ilink::DEFAULT_BASE_URL)?,
            cdn_base_url: base_url(
                launch.var(VAR_CDN_BASE_URL),
                VAR_CDN_BASE_URL,
                ilink::DEFAULT_CDN_BASE_URL,
            )?,
            credentials_dir: launch.credentials_dir.clone(),
            env_token,
            state_dir: state_dir(launch.var(VAR_STATE_DIR), state_directory)?,
            route_tag: route_tag(launch.var(VAR_ROUTE_TAG))?,
            bot_agent: bot_agent(launch.var(VAR_BOT_AGENT))?,
            poll_timeout: seconds(VAR_POLL_TIMEOUT, 1.0..=300.0, 35.0)?,
            retry: RetryPolicy {
                retry: seconds(VAR_RETRY, 0.05..=3600.0, 2.0)?,
                backoff: seconds(VAR_BACKOFF, 0.05..=3600.0, 30.0)?,
                backoff_after: count(VAR_BACKOFF_AFTER, 1..=100, 3)?,
            },
            auth_retry: Some(seconds(VAR_AUTH_RETRY, 0.0..=86400.0, 3600.0)?)
                .filter(|delay| !delay.is_zero()),
            send_timeout: seconds(VAR_SEND_TIMEOUT, 0.1..=300.0, 15.0)?,
            request_timeout: seconds(VAR_REQUEST_TIMEOUT, 0.1..=300.0, 10.0)?,
            chunk_chars: count(VAR_CHUNK_CHARS, 100..=MAX_CHUNK_CHARS as u32, 4000)? as usize,
            typing_interval: seconds(VAR_TYPING_INTERVAL, 0.05..=60.0, 5.0)?,
            typing_max: seconds(VAR_TYPING_MAX, 1.0..=86400.0, 600.0)?,
            dedupe_ttl: seconds(VAR_DEDUPE_TTL, 60.0..=604_800.0, 86400.0)?,
            markdown: launch.parse_or(VAR_MARKDOWN, Markdown::Simplify)?,
        })
    }
}

impl Setting for Markdown {
    const EXPECTED: &'static str = "simplify or keep";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        match raw {
            "simplify" => Ok(Markdown::Simplify),
            "keep" => Ok(Markdown::Keep),
            _ => Err("expected simplify or keep".into()),
        }
    }
}

impl LoginConfig {
    /// Reads the login settings from the process environment (`CHANNELD_WECHAT_*`), with
    /// `state_dir` (a command-line flag) winning over the variables.
    pub fn from_env(
        lookup: impl Fn(&str) -> Option<String>,
        state_dir_flag: Option<PathBuf>,
    ) -> Result<Self, ConfigError> {
        let var = |name: &str| lookup(&setting_var(name)).filter(|v| !v.is_empty());
        let state_dir = match state_dir_flag {
            Some(dir) => dir,
            None => {
                let systemd = lookup(ENV_STATE_DIRECTORY).filter(|v| !v.is_empty());
                state_dir(var(VAR_STATE_DIR).as_deref(), systemd.as_deref().map(Path::new))?
            }
        };
        Ok(Self {
            base_url: base_url(
                var(VAR_BASE_URL).as_deref(),
                VAR_BASE_URL,
                ilink::DEFAULT_BASE_URL,
            )?,
            state_dir,
            route_tag: route_tag(var(VAR_ROUTE_TAG).as_deref())?,
        })
    }
}

/// An `http(s)://host[:port][/path]` URL without credentials, query or fragment, trailing
/// slash removed.
pub fn base_url(raw: Option<&str>, var: &str, default: &str) -> Result<String, ConfigError> {
    let Some(raw) = raw.map(str::trim) else { return Ok(default.to_owned()) };
    let url = Url::parse_setting(raw).map_err(|reason| invalid(var, reason))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(invalid(var, "expected an http:// or https:// URL with a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(var, "credentials do not belong in the URL"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid(var, "expected scheme://host[:port][/path] without query"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

fn state_dir(flag: Option<&str>, systemd: Option<&Path>) -> Result<PathBuf, ConfigError> {
    match (flag, systemd) {
        (Some(dir), _) => Ok(PathBuf::from(dir)),
        // systemd may list several directories separated by colons; the unit declares one.
        (None, Some(dir)) => {
            let first = dir.to_string_lossy().split(':').next().unwrap_or_default().to_owned();
            if first.is_empty() { Err(no_state_dir()) } else { Ok(first.into()) }
        }
        (None, None) => Err(no_state_dir()),
    }
}

fn route_tag(raw: Option<&str>) -> Result<Option<String>, ConfigError> {
    match raw.map(str::trim) {
        None => Ok(None),
        Some(tag) if tag.chars().all(|c| c.is_ascii_graphic()) => Ok(Some(tag.to_owned())),
        Some(_) => Err(invalid(VAR_ROUTE_TAG, "must be printable ASCII without spaces")),
    }
}

fn bot_agent(raw: Option<&str>) -> Result<String, ConfigError> {
    match raw.map(str::trim) {
        None => Ok(format!("channeld-wechat/{}", env!("CARGO_PKG_VERSION"))),
        Some(agent) if ilink::valid_bot_agent(agent) => Ok(agent.to_owned()),
        Some(_) => Err(invalid(
            VAR_BOT_AGENT,
            "expected Name/Version tokens separated by spaces (letters, digits, _ . - +)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("wechat.lab").unwrap(), "/tmp/x.sock")
    }

    fn config(launch: &DriverLaunchConfig) -> Result<WechatConfig, ConfigError> {
        WechatConfig::from_launch(launch, Some(Path::new("/var/lib/channeld-wechat/lab")))
    }

    #[test]
    fn defaults_follow_the_official_client() {
        let config = config(&launch()).unwrap();
        assert_eq!(config.base_url, "https://ilinkai.weixin.qq.com");
        assert_eq!(config.cdn_base_url, "https://novac2c.cdn.weixin.qq.com/c2c");
        assert_eq!(config.state_dir, PathBuf::from("/var/lib/channeld-wechat/lab"));
        assert_eq!(config.poll_timeout, Duration::from_secs(35));
        assert_eq!(config.retry.delay(1), Duration::from_secs(2));
        assert_eq!(config.retry.delay(2), Duration::from_secs(2));
        assert_eq!(config.retry.delay(3), Duration::from_secs(30));
        assert_eq!(config.auth_retry, Some(Duration::from_secs(3600)));
        assert_eq!(config.send_timeout, Duration::from_secs(15));
        assert_eq!(config.request_timeout, Duration::from_secs(10));
        assert_eq!(config.chunk_chars, 4000);
        assert_eq!(config.typing_interval, Duration::from_secs(5));
        assert_eq!(config.dedupe_ttl, Duration::from_secs(86400));
        assert_eq!(config.markdown, Markdown::Simplify);
        assert_eq!(config.bot_agent, format!("channeld-wechat/{}", env!("CARGO_PKG_VERSION")));
        assert!(config.env_token.is_none() && config.route_tag.is_none());
    }

    #[test]
    fn the_state_dir_setting_wins_over_systemd_and_one_of_them_is_required() {
        let launch = launch().with_var(VAR_STATE_DIR, "/srv/wechat");
        assert_eq!(config(&launch).unwrap().state_dir, PathBuf::from("/srv/wechat"));
        let err = WechatConfig::from_launch(&self::launch(), None).unwrap_err().to_string();
        assert!(
            err.contains("CHANNELD_WECHAT_STATE_DIR") && err.contains("STATE_DIRECTORY"),
            "{err}"
        );
    }

    #[test]
    fn tests_may_use_plain_http_and_fractional_seconds() {
        let launch = launch()
            .with_var(VAR_BASE_URL, "http://127.0.0.1:4000/")
            .with_var(VAR_RETRY, "0.2")
            .with_var(VAR_BACKOFF, "0.5")
            .with_var(VAR_BACKOFF_AFTER, "2")
            .with_var(VAR_AUTH_RETRY, "0")
            .with_var(VAR_TYPING_INTERVAL, "0.25");
        let config = config(&launch).unwrap();
        assert_eq!(config.base_url, "http://127.0.0.1:4000");
        assert_eq!(config.retry.delay(1), Duration::from_millis(200));
        assert_eq!(config.retry.delay(2), Duration::from_millis(500));
        assert_eq!(config.auth_retry, None, "0 waits for a new token only");
        assert_eq!(config.typing_interval, Duration::from_millis(250));
    }

    #[test]
    fn errors_name_the_variable() {
        let cases = [
            (VAR_BASE_URL, "ftp://x"),
            (VAR_BASE_URL, "https://user:pw@x"),
            (VAR_CDN_BASE_URL, "https://x/?q=1"),
            (VAR_ROUTE_TAG, "a b"),
            (VAR_BOT_AGENT, "not an agent"),
            (VAR_POLL_TIMEOUT, "0"),
            (VAR_RETRY, "soon"),
            (VAR_BACKOFF_AFTER, "0"),
            (VAR_CHUNK_CHARS, "5000"),
            (VAR_TYPING_MAX, "-1"),
            (VAR_DEDUPE_TTL, "1"),
            (VAR_MARKDOWN, "html"),
        ];
        for (var, value) in cases {
            let err = config(&launch().with_var(var, value)).unwrap_err().to_string();
            assert!(err.starts_with(&format!("CHANNELD_{var} is invalid")), "{var}={value}: {err}");
        }
    }

    #[test]
    fn credentials_in_the_url_are_refused_without_echoing_them() {
        let err = config(&launch().with_var(VAR_BASE_URL, "https://bot:hunter2@x"))
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn an_empty_credential_file_stops_the_start_and_the_token_never_prints() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CREDENTIAL_BOT_TOKEN), "\n").unwrap();
        let vars = [
            ("CHANNELD_CHANNEL_ID", "wechat.lab".to_owned()),
            ("CHANNELD_SOCKET", "/tmp/wechat-test.sock".to_owned()),
            ("CREDENTIALS_DIRECTORY", dir.path().display().to_string()),
            ("CHANNELD_WECHAT_BOT_TOKEN", "env-token-value".to_owned()),
        ];
        let launch = DriverLaunchConfig::from_vars(vars).unwrap();
        let err = config(&launch).unwrap_err().to_string();
        assert!(err.contains(CREDENTIAL_BOT_TOKEN) && err.contains("empty"), "{err}");

        std::fs::write(dir.path().join(CREDENTIAL_BOT_TOKEN), "file-token\n").unwrap();
        let config = config(&launch).unwrap();
        assert_eq!(config.env_token.as_ref().map(Secret::as_str), Some("env-token-value"));
        assert!(!format!("{config:?}").contains("env-token-value"));
    }

    #[test]
    fn login_settings_come_from_the_environment_or_the_flag() {
        let env = |name: &str| match name {
            "CHANNELD_WECHAT_BASE_URL" => Some("http://127.0.0.1:9/".to_owned()),
            "STATE_DIRECTORY" => Some("/var/lib/channeld-wechat/a".to_owned()),
            _ => None,
        };
        let login = LoginConfig::from_env(env, None).unwrap();
        assert_eq!(login.base_url, "http://127.0.0.1:9");
        assert_eq!(login.state_dir, PathBuf::from("/var/lib/channeld-wechat/a"));
        let flagged = LoginConfig::from_env(env, Some("/tmp/w".into())).unwrap();
        assert_eq!(flagged.state_dir, PathBuf::from("/tmp/w"));
        let err = LoginConfig::from_env(|_| None, None).unwrap_err();
        assert!(matches!(err, ConfigError::Missing { .. }), "{err}");
    }
}
