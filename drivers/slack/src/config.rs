//! Slack driver settings from the launch environment (`CHANNELD_SLACK_*`) and the two tokens
//! from the credentials directory, validated; every error names its variable and none
//! contains a token.

use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret, Url};

/// `CHANNELD_SLACK_API_URL`: the Web API base, ending in `/`; every method is
/// `POST <base><method>`.
pub const VAR_API_URL: &str = "SLACK_API_URL";
/// `CHANNELD_SLACK_APP_TOKEN`: the app-level token (`xapp-…`), read only when the credential
/// [`CREDENTIAL_APP_TOKEN`] is absent. Used only for `apps.connections.open`.
pub const VAR_APP_TOKEN: &str = "SLACK_APP_TOKEN";
/// The systemd credential holding the app-level token.
pub const CREDENTIAL_APP_TOKEN: &str = "slack-app-token";
/// `CHANNELD_SLACK_BOT_TOKEN`: the bot token (`xoxb-…`), read only when the credential
/// [`CREDENTIAL_BOT_TOKEN`] is absent.
pub const VAR_BOT_TOKEN: &str = "SLACK_BOT_TOKEN";
/// The systemd credential holding the bot token.
pub const CREDENTIAL_BOT_TOKEN: &str = "slack-bot-token";
/// `CHANNELD_SLACK_RESPOND`: `mentions` (DMs always, channels only when the bot is
/// @mentioned) or `all`.
pub const VAR_RESPOND: &str = "SLACK_RESPOND";
/// `CHANNELD_SLACK_INBOUND_EVENTS`: comma-separated platform events reported to the hub as
/// `inbound_event`: `edits`, `deletes`, `reactions` (default: none).
pub const VAR_INBOUND_EVENTS: &str = "SLACK_INBOUND_EVENTS";
/// `CHANNELD_SLACK_MAX_MESSAGE_CHARS`: longer replies are split into several messages,
/// 100–40000 (default 3900).
pub const VAR_MAX_MESSAGE_CHARS: &str = "SLACK_MAX_MESSAGE_CHARS";
/// `CHANNELD_SLACK_TYPING_REACTION`: the reaction shown while the agent works, outside
/// assistant threads (default `eyes`).
pub const VAR_TYPING_REACTION: &str = "SLACK_TYPING_REACTION";
/// `CHANNELD_SLACK_USER_NAMES`: look up display names with `users.info` (`true`, default) or
/// not (`false`, no `users:read` scope needed).
pub const VAR_USER_NAMES: &str = "SLACK_USER_NAMES";
/// `CHANNELD_SLACK_PING_SECONDS`: the driver's own WebSocket ping interval, 1–300 (default 15).
pub const VAR_PING: &str = "SLACK_PING_SECONDS";
/// `CHANNELD_SLACK_IDLE_TIMEOUT_SECONDS`: a socket with nothing received for this long is
/// replaced, 2–600 and more than the ping interval (default 45: a half-open socket is
/// replaced within a minute).
pub const VAR_IDLE_TIMEOUT: &str = "SLACK_IDLE_TIMEOUT_SECONDS";
/// `CHANNELD_SLACK_RECONNECT_MAX_SECONDS`: the cap of the reconnect backoff, 1–3600 (default 30).
pub const VAR_RECONNECT_MAX: &str = "SLACK_RECONNECT_MAX_SECONDS";
/// `CHANNELD_SLACK_SLOW_RETRY_SECONDS`: the retry interval while Slack refuses the tokens
/// (`invalid_auth`) or Socket Mode is off (`link_disabled`), 1–86400 (default 300).
pub const VAR_SLOW_RETRY: &str = "SLACK_SLOW_RETRY_SECONDS";
/// `CHANNELD_SLACK_HTTP_TIMEOUT_SECONDS`: one Web API request, 1–300 (default 30).
pub const VAR_HTTP_TIMEOUT: &str = "SLACK_HTTP_TIMEOUT_SECONDS";
/// `CHANNELD_SLACK_POST_INTERVAL_MS`: the least time between two posts to one channel,
/// 0–60000 (default 1000, Slack's "about one message per second per channel").
pub const VAR_POST_INTERVAL: &str = "SLACK_POST_INTERVAL_MS";
/// `CHANNELD_SLACK_PREVIEW_INTERVAL_MS`: the least time between two `chat.update`s of one
/// preview, 0–60000 (default 1000).
pub const VAR_PREVIEW_INTERVAL: &str = "SLACK_PREVIEW_INTERVAL_MS";
/// `CHANNELD_SLACK_COMMAND_TIMEOUT_SECONDS`: how long buttons wait for a click, 1–86400
/// (default 300, the hub's default command timeout).
pub const VAR_COMMAND_TIMEOUT: &str = "SLACK_COMMAND_TIMEOUT_SECONDS";

/// Slack's production Web API.
pub const DEFAULT_API_URL: &str = "https://slack.com/api/";
const DEFAULT_MAX_MESSAGE_CHARS: usize = 3_900;
/// Slack truncates `text` above this.
pub const SLACK_MAX_TEXT_CHARS: usize = 40_000;
const DEFAULT_TYPING_REACTION: &str = "eyes";

/// Which messages get an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Respond {
    /// DMs always; channels only when the bot is @mentioned.
    Mentions,
    /// Every message the app receives.
    All,
}

/// Platform events forwarded as `inbound_event`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboundEvents {
    pub edits: bool,
    pub deletes: bool,
    pub reactions: bool,
}

/// Everything the Slack driver needs.
#[derive(Debug, Clone)]
pub struct SlackConfig {
    pub channel: ChannelId,
    /// Ends in `/`.
    pub api_url: String,
    pub app_token: Secret,
    pub bot_token: Secret,
    pub respond: Respond,
    pub inbound_events: InboundEvents,
    pub max_message_chars: usize,
    pub typing_reaction: String,
    pub user_names: bool,
    pub ping_interval: Duration,
    pub idle_timeout: Duration,
    pub reconnect_max: Duration,
    pub slow_retry: Duration,
    pub http_timeout: Duration,
    pub post_interval: Duration,
    pub preview_interval: Duration,
    pub command_timeout: Duration,
}

impl SlackConfig {
    /// Reads and validates the settings.
    pub fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, ConfigError> {
        let api_url = api_url(launch.var(VAR_API_URL).unwrap_or(DEFAULT_API_URL))?;
        let app_token = token(launch, CREDENTIAL_APP_TOKEN, VAR_APP_TOKEN, "xapp-")?;
        let bot_token = token(launch, CREDENTIAL_BOT_TOKEN, VAR_BOT_TOKEN, "xoxb-")?;
        let respond = match launch.var(VAR_RESPOND).map(str::trim) {
            None | Some("mentions") => Respond::Mentions,
            Some("all") => Respond::All,
            Some(_) => return Err(invalid(VAR_RESPOND, "expected mentions or all")),
        };
        let inbound_events = inbound_events(launch.var(VAR_INBOUND_EVENTS).unwrap_or(""))?;
        let max_message_chars = launch
            .parse_within(VAR_MAX_MESSAGE_CHARS, 100..=SLACK_MAX_TEXT_CHARS)?
            .unwrap_or(DEFAULT_MAX_MESSAGE_CHARS);
        let typing_reaction = match launch.var(VAR_TYPING_REACTION) {
            None => DEFAULT_TYPING_REACTION.to_owned(),
            Some(raw) => {
                let name = raw.trim().trim_matches(':');
                if !is_reaction_name(name) {
                    return Err(invalid(
                        VAR_TYPING_REACTION,
                        "expected an emoji name such as eyes or hourglass_flowing_sand",
                    ));
                }
                name.to_owned()
            }
        };
        let user_names = launch.parse_or(VAR_USER_NAMES, true)?;
        let ping_interval = seconds(launch, VAR_PING, 1..=300, 15)?;
        let idle_timeout = seconds(launch, VAR_IDLE_TIMEOUT, 2..=600, 45)?;
        if idle_timeout <= ping_interval {
            return Err(invalid(
                VAR_IDLE_TIMEOUT,
                format!(
                    "must be longer than CHANNELD_{VAR_PING} ({} s), or every quiet socket is replaced",
                    ping_interval.as_secs()
                ),
            ));
        }
        Ok(Self {
            channel: launch.channel.clone(),
            api_url,
            app_token,
            bot_token,
            respond,
            inbound_events,
            max_message_chars,
            typing_reaction,
            user_names,
            ping_interval,
            idle_timeout,
            reconnect_max: seconds(launch, VAR_RECONNECT_MAX, 1..=3600, 30)?,
            slow_retry: seconds(launch, VAR_SLOW_RETRY, 1..=86_400, 300)?,
            http_timeout: seconds(launch, VAR_HTTP_TIMEOUT, 1..=300, 30)?,
            post_interval: Duration::from_millis(
                launch.parse_within(VAR_POST_INTERVAL, 0..=60_000u64)?.unwrap_or(1000),
            ),
            preview_interval: Duration::from_millis(
                launch.parse_within(VAR_PREVIEW_INTERVAL, 0..=60_000u64)?.unwrap_or(1000),
            ),
            command_timeout: seconds(launch, VAR_COMMAND_TIMEOUT, 1..=86_400, 300)?,
        })
    }

    /// `<base><method>`.
    pub fn method_url(&self, method: &str) -> String {
        format!("{}{method}", self.api_url)
    }
}

fn invalid(var: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(var), reason)
}

/// An `http://` or `https://` URL ending in `/`, without credentials, query or fragment.
fn api_url(raw: &str) -> Result<String, ConfigError> {
    let url =
        Url::parse(raw.trim()).map_err(|err| invalid(VAR_API_URL, format!("not a URL: {err}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(VAR_API_URL, "expected an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(VAR_API_URL, "the host is missing"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(VAR_API_URL, "credentials do not belong in the URL"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid(VAR_API_URL, "expected no query or fragment"));
    }
    if !url.path().ends_with('/') {
        return Err(invalid(VAR_API_URL, "must end in / (for example https://slack.com/api/)"));
    }
    Ok(url.to_string())
}

fn token(
    launch: &DriverLaunchConfig,
    credential: &'static str,
    var: &'static str,
    prefix: &str,
) -> Result<Secret, ConfigError> {
    let what = format!("{credential} (or {})", setting_var(var));
    let secret = launch.secret(credential, var)?.ok_or_else(|| ConfigError::Credential {
        name: what.clone(),
        reason: "is missing: a Slack token is required".into(),
    })?;
    let value = secret.as_str();
    if !value.starts_with(prefix) || value.contains(char::is_whitespace) {
        return Err(ConfigError::Credential {
            name: what,
            reason: format!("does not look like a Slack {prefix}… token"),
        });
    }
    Ok(secret)
}

fn inbound_events(raw: &str) -> Result<InboundEvents, ConfigError> {
    let mut events = InboundEvents::default();
    for name in raw.split(',').map(str::trim).filter(|name| !name.is_empty()) {
        match name {
            "edits" => events.edits = true,
            "deletes" => events.deletes = true,
            "reactions" => events.reactions = true,
            other => {
                return Err(invalid(
                    VAR_INBOUND_EVENTS,
                    format!("{other:?} is not one of edits, deletes, reactions"),
                ));
            }
        }
    }
    Ok(events)
}

/// Slack emoji names: lowercase letters, digits, `_`, `-`, `+`, `'`.
pub fn is_reaction_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-+'".contains(c))
}

/// Whole seconds within `range` (the `_SECONDS` settings).
fn seconds(
    launch: &DriverLaunchConfig,
    var: &'static str,
    range: std::ops::RangeInclusive<u64>,
    default: u64,
) -> Result<Duration, ConfigError> {
    Ok(Duration::from_secs(launch.parse_within(var, range)?.unwrap_or(default)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const APP: &str = "xapp-1-A1-1-secretapp";
    const BOT: &str = "xoxb-1-secretbot";

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("slack.lab").unwrap(), "/tmp/x.sock")
            .with_var(VAR_APP_TOKEN, APP)
            .with_var(VAR_BOT_TOKEN, BOT)
    }

    #[test]
    fn defaults_follow_slack() {
        let config = SlackConfig::from_launch(&launch()).unwrap();
        assert_eq!(config.api_url, DEFAULT_API_URL);
        assert_eq!(config.method_url("auth.test"), "https://slack.com/api/auth.test");
        assert_eq!(config.respond, Respond::Mentions);
        assert_eq!(config.inbound_events, InboundEvents::default());
        assert_eq!(config.max_message_chars, 3_900);
        assert_eq!(config.typing_reaction, "eyes");
        assert!(config.user_names);
        assert_eq!(config.ping_interval, Duration::from_secs(15));
        assert_eq!(config.idle_timeout, Duration::from_secs(45));
        assert_eq!(config.post_interval, Duration::from_secs(1));
        assert_eq!(config.slow_retry, Duration::from_secs(300));
    }

    #[test]
    fn tokens_come_from_credentials_first_and_never_print() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CREDENTIAL_APP_TOKEN), "xapp-from-file\n").unwrap();
        std::fs::write(dir.path().join(CREDENTIAL_BOT_TOKEN), "xoxb-from-file\n").unwrap();
        let launch = DriverLaunchConfig::from_vars([
            ("CHANNELD_CHANNEL_ID", "slack.lab".to_owned()),
            ("CHANNELD_SOCKET", "/tmp/slack.lab.sock".to_owned()),
            ("CHANNELD_SLACK_APP_TOKEN", APP.to_owned()),
            ("CHANNELD_SLACK_BOT_TOKEN", BOT.to_owned()),
            ("CREDENTIALS_DIRECTORY", dir.path().display().to_string()),
        ])
        .unwrap();
        let config = SlackConfig::from_launch(&launch).unwrap();
        assert_eq!(config.app_token.as_str(), "xapp-from-file");
        assert_eq!(config.bot_token.as_str(), "xoxb-from-file");
        let printed = format!("{config:?}");
        assert!(!printed.contains("from-file") && !printed.contains("secret"), "{printed}");
    }

    #[test]
    fn a_missing_or_swapped_token_names_both_sources_without_the_value() {
        let missing = DriverLaunchConfig::for_socket(ChannelId::new("slack.lab").unwrap(), "/x")
            .with_var(VAR_APP_TOKEN, APP);
        let err = SlackConfig::from_launch(&missing).unwrap_err().to_string();
        assert_eq!(
            err,
            "credential slack-bot-token (or CHANNELD_SLACK_BOT_TOKEN) is missing: a Slack token is required"
        );
        let swapped = DriverLaunchConfig::for_socket(ChannelId::new("slack.lab").unwrap(), "/x")
            .with_var(VAR_APP_TOKEN, BOT)
            .with_var(VAR_BOT_TOKEN, BOT);
        let err = SlackConfig::from_launch(&swapped).unwrap_err().to_string();
        assert!(err.contains("slack-app-token") && err.contains("xapp-"), "{err}");
        assert!(!err.contains("secretbot"), "{err}");
    }

    #[test]
    fn the_api_url_must_be_a_base_ending_in_a_slash() {
        let ok = launch().with_var(VAR_API_URL, "http://127.0.0.1:4000/api/");
        assert_eq!(SlackConfig::from_launch(&ok).unwrap().api_url, "http://127.0.0.1:4000/api/");
        for bad in [
            "https://slack.com/api",
            "ftp://x/",
            "http:///",
            "https://u:p@h/api/",
            "https://h/api/?x=1",
        ] {
            let err = SlackConfig::from_launch(&launch().with_var(VAR_API_URL, bad)).unwrap_err();
            assert!(
                err.to_string().starts_with("CHANNELD_SLACK_API_URL is invalid"),
                "{bad}: {err}"
            );
            assert!(!err.to_string().contains("u:p"), "{err}");
        }
    }

    #[test]
    fn errors_name_the_variable() {
        let cases = [
            (VAR_RESPOND, "everyone"),
            (VAR_INBOUND_EVENTS, "edits,typing"),
            (VAR_MAX_MESSAGE_CHARS, "50000"),
            (VAR_TYPING_REACTION, "👀"),
            (VAR_USER_NAMES, "maybe"),
            (VAR_PING, "0"),
            (VAR_IDLE_TIMEOUT, "15"),
            (VAR_RECONNECT_MAX, "soon"),
            (VAR_SLOW_RETRY, "0"),
            (VAR_HTTP_TIMEOUT, "301"),
            (VAR_POST_INTERVAL, "-1"),
            (VAR_PREVIEW_INTERVAL, "x"),
            (VAR_COMMAND_TIMEOUT, "0"),
        ];
        for (var, value) in cases {
            let err = SlackConfig::from_launch(&launch().with_var(var, value)).unwrap_err();
            assert!(err.to_string().starts_with(&format!("CHANNELD_{var} is invalid")), "{err}");
        }
    }

    #[test]
    fn explicit_settings_are_used() {
        let launch = launch()
            .with_var(VAR_RESPOND, "all")
            .with_var(VAR_INBOUND_EVENTS, "edits, deletes,reactions")
            .with_var(VAR_MAX_MESSAGE_CHARS, "100")
            .with_var(VAR_TYPING_REACTION, ":hourglass_flowing_sand:")
            .with_var(VAR_USER_NAMES, "false")
            .with_var(VAR_PING, "1")
            .with_var(VAR_IDLE_TIMEOUT, "3")
            .with_var(VAR_POST_INTERVAL, "0");
        let config = SlackConfig::from_launch(&launch).unwrap();
        assert_eq!(config.respond, Respond::All);
        assert_eq!(
            config.inbound_events,
            InboundEvents { edits: true, deletes: true, reactions: true }
        );
        assert_eq!(config.max_message_chars, 100);
        assert_eq!(config.typing_reaction, "hourglass_flowing_sand");
        assert!(!config.user_names);
        assert_eq!(
            (config.ping_interval, config.idle_timeout),
            (Duration::from_secs(1), Duration::from_secs(3))
        );
        assert_eq!(config.post_interval, Duration::ZERO);
    }
}
