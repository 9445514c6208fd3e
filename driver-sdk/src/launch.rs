//! Launch settings read from the environment: channeld names first, reference names as aliases.

use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_protocol::ChannelId;

use crate::secret::{Secret, SecretError};

/// `CHANNELD_CHANNEL_ID` (alias `CORTEXFS_CHANNEL_ID`): the channel instance, e.g. `mqtt.lab`.
pub const ENV_CHANNEL_ID: [&str; 2] = ["CHANNELD_CHANNEL_ID", "CORTEXFS_CHANNEL_ID"];
/// `CHANNELD_SOCKET` (alias `CORTEXFS_CHANNEL_SOCKET`): the hub's socket for this instance.
pub const ENV_SOCKET: [&str; 2] = ["CHANNELD_SOCKET", "CORTEXFS_CHANNEL_SOCKET"];
/// `CHANNELD_REQUEST_PREFIX` (alias `CORTEXFS_CHANNEL_REQUEST_PREFIX`): prefix of request ids.
pub const ENV_REQUEST_PREFIX: [&str; 2] =
    ["CHANNELD_REQUEST_PREFIX", "CORTEXFS_CHANNEL_REQUEST_PREFIX"];
/// `CHANNELD_REPLY_TIMEOUT_SECONDS` (alias `CORTEXFS_CHANNEL_REPLY_TIMEOUT_SECONDS`).
pub const ENV_REPLY_TIMEOUT: [&str; 2] =
    ["CHANNELD_REPLY_TIMEOUT_SECONDS", "CORTEXFS_CHANNEL_REPLY_TIMEOUT_SECONDS"];
/// `CHANNELD_RUNTIME_DIR` (then systemd's `RUNTIME_DIRECTORY`): where sockets live when
/// `CHANNELD_SOCKET` is not set.
pub const ENV_RUNTIME_DIR: [&str; 2] = ["CHANNELD_RUNTIME_DIR", "RUNTIME_DIRECTORY"];
/// `CHANNELD_DRAIN_SECONDS`: how long SIGTERM waits for in-flight sends.
pub const ENV_DRAIN: &str = "CHANNELD_DRAIN_SECONDS";
/// systemd's `LoadCredential=` directory.
pub const ENV_CREDENTIALS_DIRECTORY: &str = "CREDENTIALS_DIRECTORY";

/// Runtime directory when neither variable is set (systemd's `RuntimeDirectory=channeld`).
pub const DEFAULT_RUNTIME_DIR: &str = "/run/channeld";

/// Why the launch settings are unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("{0} is not set")]
    Missing(&'static str),
    #[error("{var} is invalid: {reason}")]
    Invalid { var: String, reason: String },
}

/// Everything a driver needs to find and talk to its hub.
#[derive(Debug, Clone)]
pub struct DriverLaunchConfig {
    pub channel: ChannelId,
    pub socket: PathBuf,
    pub request_prefix: String,
    pub reply_timeout: Duration,
    pub drain_timeout: Duration,
    pub credentials_dir: Option<PathBuf>,
    env: Vec<(String, String)>,
}

impl DriverLaunchConfig {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, LaunchError> {
        Self::from_vars(std::env::vars())
    }

    /// Reads the given variables (for tests and embedding).
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self, LaunchError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let env: Vec<(String, String)> =
            vars.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let lookup = |names: &[&str]| -> Option<(String, String)> {
            names.iter().find_map(|name| {
                env.iter()
                    .find(|(k, v)| k == name && !v.is_empty())
                    .map(|(k, v)| (k.clone(), v.clone()))
            })
        };
        let (var, raw) = lookup(&ENV_CHANNEL_ID).ok_or(LaunchError::Missing(ENV_CHANNEL_ID[0]))?;
        let channel = ChannelId::new(raw)
            .map_err(|err| LaunchError::Invalid { var, reason: err.to_string() })?;
        let socket = match lookup(&ENV_SOCKET) {
            Some((_, path)) => PathBuf::from(path),
            None => {
                let dir = lookup(&ENV_RUNTIME_DIR)
                    .map_or_else(|| PathBuf::from(DEFAULT_RUNTIME_DIR), |(_, d)| d.into());
                default_socket_path(&dir, &channel)
            }
        };
        let request_prefix = match lookup(&ENV_REQUEST_PREFIX) {
            Some((var, prefix)) => {
                if prefix.len() > 128 || prefix.contains('\0') {
                    return Err(LaunchError::Invalid {
                        var,
                        reason: "must be at most 128 bytes without NUL".into(),
                    });
                }
                prefix
            }
            None => channel.as_str().to_owned(),
        };
        let reply_timeout = match lookup(&ENV_REPLY_TIMEOUT) {
            Some((var, raw)) => Duration::from_secs(parse_seconds(&var, &raw)?.clamp(1, 3600)),
            None => Duration::from_secs(600),
        };
        let drain_timeout = match lookup(&[ENV_DRAIN]) {
            Some((var, raw)) => Duration::from_secs(parse_seconds(&var, &raw)?.min(3600)),
            None => Duration::from_secs(10),
        };
        let credentials_dir = lookup(&[ENV_CREDENTIALS_DIRECTORY]).map(|(_, d)| PathBuf::from(d));
        Ok(Self {
            channel,
            socket,
            request_prefix,
            reply_timeout,
            drain_timeout,
            credentials_dir,
            env,
        })
    }

    /// A driver setting: `CHANNELD_<NAME>` from the launch environment (empty means unset).
    pub fn var(&self, name: &str) -> Option<&str> {
        let key = format!("CHANNELD_{name}");
        self.env.iter().find(|(k, v)| *k == key && !v.is_empty()).map(|(_, v)| v.as_str())
    }

    /// A required driver setting.
    pub fn require(&self, name: &str) -> Result<&str, LaunchError> {
        self.var(name).ok_or_else(|| LaunchError::Invalid {
            var: format!("CHANNELD_{name}"),
            reason: "is not set".into(),
        })
    }

    /// A secret: `$CREDENTIALS_DIRECTORY/<credential>` first (systemd `LoadCredential=`),
    /// then the environment variable `CHANNELD_<env_name>`.
    pub fn secret(&self, credential: &str, env_name: &str) -> Result<Option<Secret>, SecretError> {
        if let Some(dir) = &self.credentials_dir
            && let Some(secret) = Secret::from_credential_file(dir, credential)?
        {
            return Ok(Some(secret));
        }
        Ok(self.var(env_name).map(|v| Secret::new(v.to_owned())))
    }

    /// A request id with this launch's prefix.
    pub fn request_id(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.request_prefix)
    }

    /// A config for tests: channel and socket given, everything else default.
    pub fn for_socket(channel: ChannelId, socket: impl Into<PathBuf>) -> Self {
        Self {
            request_prefix: channel.as_str().to_owned(),
            channel,
            socket: socket.into(),
            reply_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(10),
            credentials_dir: None,
            env: Vec::new(),
        }
    }

    /// Adds a driver setting (`CHANNELD_<name>`), for tests and embedding.
    pub fn with_var(mut self, name: &str, value: impl Into<String>) -> Self {
        self.env.push((format!("CHANNELD_{name}"), value.into()));
        self
    }
}

/// `<runtime dir>/<channel>.sock`: the hub's default socket path for an instance.
pub fn default_socket_path(runtime_dir: &Path, channel: &ChannelId) -> PathBuf {
    runtime_dir.join(format!("{channel}.sock"))
}

fn parse_seconds(var: &str, raw: &str) -> Result<u64, LaunchError> {
    raw.trim().parse().map_err(|_| LaunchError::Invalid {
        var: var.to_owned(),
        reason: "expected a whole number of seconds".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_names_are_aliases() {
        let config = DriverLaunchConfig::from_vars([
            ("CORTEXFS_CHANNEL_ID", "slack.primary"),
            ("CORTEXFS_CHANNEL_SOCKET", "/tmp/x.sock"),
            ("CORTEXFS_CHANNEL_REQUEST_PREFIX", "sp"),
            ("CORTEXFS_CHANNEL_REPLY_TIMEOUT_SECONDS", "99999"),
        ])
        .unwrap();
        assert_eq!(config.channel.as_str(), "slack.primary");
        assert_eq!(config.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(config.request_prefix, "sp");
        assert_eq!(config.reply_timeout, Duration::from_secs(3600));
    }

    #[test]
    fn channeld_names_win_and_socket_defaults_under_the_runtime_dir() {
        let config = DriverLaunchConfig::from_vars([
            ("CORTEXFS_CHANNEL_ID", "slack.other"),
            ("CHANNELD_CHANNEL_ID", "mqtt.lab"),
            ("RUNTIME_DIRECTORY", "/run/x"),
            ("CHANNELD_MQTT_URL", "mqtt://h"),
        ])
        .unwrap();
        assert_eq!(config.channel.as_str(), "mqtt.lab");
        assert_eq!(config.socket, PathBuf::from("/run/x/mqtt.lab.sock"));
        assert_eq!(config.request_prefix, "mqtt.lab");
        assert_eq!(config.reply_timeout, Duration::from_secs(600));
        assert_eq!(config.var("MQTT_URL"), Some("mqtt://h"));
    }

    #[test]
    fn errors_name_the_variable() {
        let err = DriverLaunchConfig::from_vars(Vec::<(String, String)>::new()).unwrap_err();
        assert_eq!(err.to_string(), "CHANNELD_CHANNEL_ID is not set");
        let err = DriverLaunchConfig::from_vars([("CORTEXFS_CHANNEL_ID", "Bad Id")]).unwrap_err();
        assert!(err.to_string().starts_with("CORTEXFS_CHANNEL_ID is invalid"));
        let err = DriverLaunchConfig::from_vars([
            ("CHANNELD_CHANNEL_ID", "a.b"),
            ("CHANNELD_REPLY_TIMEOUT_SECONDS", "soon"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("CHANNELD_REPLY_TIMEOUT_SECONDS"));
    }
}
