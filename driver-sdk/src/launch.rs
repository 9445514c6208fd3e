//! Launch settings read from the environment (channeld names, with the reference names as
//! aliases that must agree), and typed access to the driver's own `CHANNELD_<NAME>` settings
//! and credentials.

use std::ops::RangeInclusive;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_protocol::ChannelId;

use crate::config::{ConfigError, Setting, check_range, parse_value};
use crate::secret::Secret;

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
/// `CHANNELD_RUNTIME_DIR` (then systemd's `RUNTIME_DIRECTORY`): when `CHANNELD_SOCKET` is not
/// set, the socket is `<this dir>/<channel>.sock`.
pub const ENV_RUNTIME_DIR: [&str; 2] = ["CHANNELD_RUNTIME_DIR", "RUNTIME_DIRECTORY"];
/// `CHANNELD_DRAIN_SECONDS`: how long SIGTERM waits for in-flight work.
pub const ENV_DRAIN: &str = "CHANNELD_DRAIN_SECONDS";
/// systemd's `LoadCredential=` directory.
pub const ENV_CREDENTIALS_DIRECTORY: &str = "CREDENTIALS_DIRECTORY";

/// The socket path a `--acecode` driver's launch settings carry; never opened.
pub const ACECODE_SOCKET: &str = "/nonexistent/channeld-acecode-transport.sock";

/// The longest socket path the kernel takes (`sun_path` holds 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Everything a driver needs to find and talk to its hub, plus its own settings.
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
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// Reads the given variables (for tests and embedding).
    ///
    /// A channeld name and its reference alias may both be set only when they agree; an
    /// unusable socket path (empty, a directory, not a socket, too long) is an error here,
    /// while a path that does not exist yet is fine (the hub creates it when it starts).
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let env: Vec<(String, String)> =
            vars.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let get = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());

        let channel = aliased(&get, ENV_CHANNEL_ID, false, |raw| {
            ChannelId::new(raw).map_err(|err| err.to_string())
        })?
        .ok_or_else(|| ConfigError::missing(ENV_CHANNEL_ID[0]))?;
        let socket = match aliased(&get, ENV_SOCKET, true, parse_socket)? {
            Some(socket) => socket,
            None => {
                let dir =
                    ENV_RUNTIME_DIR.iter().find_map(|name| get(name).filter(|v| !v.is_empty()));
                let Some(dir) = dir else {
                    return Err(ConfigError::Invalid {
                        var: ENV_SOCKET[0].to_owned(),
                        reason: format!(
                            "is not set, nor {}, {} or {}: the driver cannot know where its hub is",
                            ENV_SOCKET[1], ENV_RUNTIME_DIR[0], ENV_RUNTIME_DIR[1]
                        ),
                    });
                };
                let socket = default_socket_path(Path::new(dir), &channel);
                parse_socket(&socket.to_string_lossy())
                    .map_err(|reason| ConfigError::invalid(ENV_RUNTIME_DIR[0], reason))?
            }
        };
        let request_prefix = aliased(&get, ENV_REQUEST_PREFIX, false, |raw| {
            if raw.len() > 128 || raw.contains('\0') {
                Err("must be at most 128 bytes without NUL".to_owned())
            } else {
                Ok(raw.to_owned())
            }
        })?
        .unwrap_or_else(|| channel.as_str().to_owned());
        let reply_timeout = aliased(&get, ENV_REPLY_TIMEOUT, false, |raw| {
            whole_seconds(raw).map(|secs| Duration::from_secs(secs.clamp(1, 3600)))
        })?
        .unwrap_or(Duration::from_secs(600));
        let drain_timeout = match get(ENV_DRAIN).map(str::trim).filter(|v| !v.is_empty()) {
            Some(raw) => Duration::from_secs(
                whole_seconds(raw)
                    .map_err(|reason| ConfigError::invalid(ENV_DRAIN, reason))?
                    .min(3600),
            ),
            None => Duration::from_secs(10),
        };
        let credentials_dir =
            get(ENV_CREDENTIALS_DIRECTORY).filter(|v| !v.is_empty()).map(PathBuf::from);
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

    /// The launch settings of a driver run with `--acecode`: the channel id defaults to
    /// `<family>.acecode`, and no socket is needed (a placeholder that is never opened).
    pub fn for_acecode<I, K, V>(vars: I, family: &str) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let mut env: Vec<(String, String)> =
            vars.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let set = |env: &Vec<(String, String)>, names: &[&str]| {
            env.iter().any(|(k, v)| names.contains(&k.as_str()) && !v.is_empty())
        };
        if !set(&env, &ENV_CHANNEL_ID) {
            env.push((ENV_CHANNEL_ID[0].to_owned(), format!("{family}.acecode")));
        }
        // Only the placeholder: a socket named in the environment is not used either.
        env.retain(|(k, _)| !ENV_SOCKET.contains(&k.as_str()));
        env.push((ENV_SOCKET[0].to_owned(), ACECODE_SOCKET.to_owned()));
        Self::from_vars(env)
    }

    /// A driver setting's text: `CHANNELD_<NAME>` from the launch environment (empty means
    /// unset).
    pub fn var(&self, name: &str) -> Option<&str> {
        let key = setting_var(name);
        self.env.iter().find(|(k, v)| *k == key && !v.trim().is_empty()).map(|(_, v)| v.as_str())
    }

    /// A driver setting parsed as `T`; `Ok(None)` when it is not set.
    ///
    /// ```
    /// # use channeld_driver_sdk::{DriverLaunchConfig, protocol::ChannelId};
    /// let launch = DriverLaunchConfig::for_socket(ChannelId::new("demo.a").unwrap(), "/tmp/a.sock")
    ///     .with_var("PREFETCH", "32");
    /// assert_eq!(launch.parse::<u16>("PREFETCH").unwrap(), Some(32));
    /// assert_eq!(launch.parse::<u16>("OTHER").unwrap(), None);
    /// ```
    pub fn parse<T: Setting>(&self, name: &str) -> Result<Option<T>, ConfigError> {
        self.var(name).map(|raw| parse_value(&setting_var(name), raw)).transpose()
    }

    /// A driver setting parsed as `T`, or `default` when it is not set.
    pub fn parse_or<T: Setting>(&self, name: &str, default: T) -> Result<T, ConfigError> {
        Ok(self.parse(name)?.unwrap_or(default))
    }

    /// A driver setting parsed as `T` that must lie in `range`; `Ok(None)` when not set.
    pub fn parse_within<T>(
        &self,
        name: &str,
        range: RangeInclusive<T>,
    ) -> Result<Option<T>, ConfigError>
    where
        T: Setting + PartialOrd + std::fmt::Debug,
    {
        self.parse::<T>(name)?
            .map(|value| check_range(&setting_var(name), value, &range))
            .transpose()
    }

    /// A required driver setting parsed as `T`: [`ConfigError::Missing`] when it is not set.
    pub fn require<T: Setting>(&self, name: &str) -> Result<T, ConfigError> {
        self.parse(name)?.ok_or_else(|| ConfigError::missing(setting_var(name)))
    }

    /// A secret: `$CREDENTIALS_DIRECTORY/<credential>` first (systemd `LoadCredential=`),
    /// then the environment variable `CHANNELD_<env_name>`. `Ok(None)` when neither is set.
    pub fn secret(&self, credential: &str, env_name: &str) -> Result<Option<Secret>, ConfigError> {
        if let Some(dir) = &self.credentials_dir
            && let Some(secret) = Secret::from_credential_file(dir, credential)?
        {
            return Ok(Some(secret));
        }
        Ok(self.var(env_name).map(|v| Secret::new(v.to_owned())))
    }

    /// A secret parsed as `T` (e.g. a URL with a password); the error names the credential
    /// and never quotes the value.
    pub fn secret_parse<T: Setting>(
        &self,
        credential: &str,
        env_name: &str,
    ) -> Result<Option<Secret<T>>, ConfigError> {
        let Some(secret) = self.secret(credential, env_name)? else { return Ok(None) };
        let what = format!("{credential} (or {})", setting_var(env_name));
        T::parse_setting(secret.as_str().trim()).map(|value| Some(Secret::new(value))).map_err(
            |reason| ConfigError::Credential {
                name: what,
                reason: format!("is invalid: {reason}"),
            },
        )
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

    /// This launch as environment variables (`CHANNELD_CHANNEL_ID`, `CHANNELD_SOCKET`, the
    /// prefix, the timeouts, the credentials directory and every driver setting), to start a
    /// driver process with exactly these settings.
    pub fn to_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            (ENV_CHANNEL_ID[0].to_owned(), self.channel.to_string()),
            (ENV_SOCKET[0].to_owned(), self.socket.display().to_string()),
            (ENV_REQUEST_PREFIX[0].to_owned(), self.request_prefix.clone()),
            (ENV_REPLY_TIMEOUT[0].to_owned(), self.reply_timeout.as_secs().to_string()),
            (ENV_DRAIN.to_owned(), self.drain_timeout.as_secs().to_string()),
        ];
        if let Some(dir) = &self.credentials_dir {
            env.push((ENV_CREDENTIALS_DIRECTORY.to_owned(), dir.display().to_string()));
        }
        env.extend(self.env.iter().filter(|(k, _)| k.starts_with("CHANNELD_")).cloned());
        env
    }

    /// Adds a driver setting (`CHANNELD_<name>`), for tests and embedding.
    pub fn with_var(mut self, name: &str, value: impl Into<String>) -> Self {
        self.env.push((setting_var(name), value.into()));
        self
    }
}

/// `CHANNELD_<name>`: the variable of a driver setting.
pub fn setting_var(name: &str) -> String {
    format!("CHANNELD_{name}")
}

/// `<runtime dir>/<channel>.sock`: the hub's default socket path for an instance.
pub fn default_socket_path(runtime_dir: &Path, channel: &ChannelId) -> PathBuf {
    runtime_dir.join(format!("{channel}.sock"))
}

/// Why `path` can never be the hub's socket, or `None` when it can (it may not exist yet:
/// the hub creates it when it starts). Checked at launch and again whenever a connect fails,
/// so a path that turns into a directory stops the driver instead of a retry loop.
pub fn socket_problem(path: &Path) -> Option<String> {
    let len = path.as_os_str().len();
    if len == 0 {
        return Some("is empty".into());
    }
    if len > MAX_SOCKET_PATH {
        return Some(format!("is {len} bytes long; a socket path has at most {MAX_SOCKET_PATH}"));
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            Some(format!("{} is a directory, not a socket", path.display()))
        }
        Ok(meta) if !meta.file_type().is_socket() => {
            Some(format!("{} exists and is not a socket", path.display()))
        }
        Ok(_) => None,
        Err(err) if err.kind() == std::io::ErrorKind::NotADirectory => {
            Some(format!("a parent of {} is not a directory", path.display()))
        }
        // Not there yet, or not readable yet: the hub may still create it.
        Err(_) => None,
    }
}

fn parse_socket(raw: &str) -> Result<PathBuf, String> {
    if raw.trim().is_empty() {
        return Err("is empty".into());
    }
    let path = PathBuf::from(raw);
    match socket_problem(&path) {
        Some(problem) => Err(problem),
        None => Ok(path),
    }
}

/// Reads a setting that has a channeld name and a reference alias. Both may be set only when
/// they agree (after parsing). An empty value counts as unset unless `empty_is_error`.
fn aliased<'a, T: PartialEq>(
    get: &impl Fn(&str) -> Option<&'a str>,
    names: [&str; 2],
    empty_is_error: bool,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    let mut found: Option<(&str, T)> = None;
    for name in names {
        let Some(raw) = get(name) else { continue };
        if raw.is_empty() && !empty_is_error {
            continue;
        }
        let value = parse(raw).map_err(|reason| ConfigError::invalid(name, reason))?;
        match &found {
            None => found = Some((name, value)),
            Some((_, agreed)) if *agreed == value => {}
            Some((first, _)) => {
                return Err(ConfigError::Conflict {
                    var: (*first).to_owned(),
                    other: name.to_owned(),
                    reason: "set both to the same value, or only one".into(),
                });
            }
        }
    }
    Ok(found.map(|(_, value)| value))
}

fn whole_seconds(raw: &str) -> Result<u64, String> {
    raw.trim().parse().map_err(|_| "expected a whole number of seconds".to_owned())
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
    fn agreeing_aliases_are_fine_and_the_socket_defaults_under_the_runtime_dir() {
        let config = DriverLaunchConfig::from_vars([
            ("CORTEXFS_CHANNEL_ID", "mqtt.lab"),
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
    fn aliases_that_disagree_are_a_configuration_error() {
        let cases = [
            ("CHANNELD_CHANNEL_ID", "mqtt.lab", "CORTEXFS_CHANNEL_ID", "slack.other"),
            ("CHANNELD_SOCKET", "/tmp/a.sock", "CORTEXFS_CHANNEL_SOCKET", "/tmp/b.sock"),
            ("CHANNELD_REQUEST_PREFIX", "a", "CORTEXFS_CHANNEL_REQUEST_PREFIX", "b"),
            ("CHANNELD_REPLY_TIMEOUT_SECONDS", "5", "CORTEXFS_CHANNEL_REPLY_TIMEOUT_SECONDS", "6"),
        ];
        for (ours, a, theirs, b) in cases {
            let mut vars =
                vec![("CHANNELD_CHANNEL_ID", "mqtt.lab"), ("CHANNELD_SOCKET", "/tmp/a.sock")];
            vars.retain(|(k, _)| *k != ours);
            vars.extend([(ours, a), (theirs, b)]);
            let err = DriverLaunchConfig::from_vars(vars).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Conflict { var, other, .. } if var == ours && other == theirs),
                "{ours}: {err}"
            );
        }
    }

    #[test]
    fn unusable_socket_values_are_configuration_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain-file");
        std::fs::write(&file, "").unwrap();
        let long = format!("/tmp/{}.sock", "s".repeat(MAX_SOCKET_PATH));
        let under_file = file.join("x.sock");
        let cases = [
            ("", "is empty"),
            (dir.path().to_str().unwrap(), "is a directory"),
            (file.to_str().unwrap(), "is not a socket"),
            (long.as_str(), "a socket path has at most 107"),
            (under_file.to_str().unwrap(), "is not a directory"),
        ];
        for (socket, reason) in cases {
            let err = DriverLaunchConfig::from_vars([
                ("CHANNELD_CHANNEL_ID", "a.b"),
                ("CHANNELD_SOCKET", socket),
            ])
            .unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { var, reason: r } if var == "CHANNELD_SOCKET" && r.contains(reason)),
                "{socket:?}: {err}"
            );
        }
        let unset = DriverLaunchConfig::from_vars([("CHANNELD_CHANNEL_ID", "a.b")]).unwrap_err();
        assert_eq!(unset.variable(), "CHANNELD_SOCKET");
        // A path that is not there yet is fine: the hub creates it when it starts.
        let later = dir.path().join("later.sock");
        let config = DriverLaunchConfig::from_vars([
            ("CHANNELD_CHANNEL_ID", "a.b"),
            ("CHANNELD_SOCKET", later.to_str().unwrap()),
        ])
        .unwrap();
        assert_eq!(config.socket, later);
    }

    #[test]
    fn errors_name_the_variable() {
        let err = DriverLaunchConfig::from_vars(Vec::<(String, String)>::new()).unwrap_err();
        assert_eq!(err.to_string(), "CHANNELD_CHANNEL_ID is not set");
        let err = DriverLaunchConfig::from_vars([("CORTEXFS_CHANNEL_ID", "Bad Id")]).unwrap_err();
        assert!(err.to_string().starts_with("CORTEXFS_CHANNEL_ID is invalid"));
        let err = DriverLaunchConfig::from_vars([
            ("CHANNELD_CHANNEL_ID", "a.b"),
            ("CHANNELD_SOCKET", "/tmp/a.sock"),
            ("CHANNELD_REPLY_TIMEOUT_SECONDS", "soon"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("CHANNELD_REPLY_TIMEOUT_SECONDS"));
    }

    #[test]
    fn typed_settings_parse_check_ranges_and_name_missing_ones() {
        let launch = DriverLaunchConfig::for_socket(ChannelId::new("a.b").unwrap(), "/tmp/a.sock")
            .with_var("TIMEOUT_SECONDS", "2.5")
            .with_var("PREFETCH", "0")
            .with_var("BLANK", "  ")
            .with_var("URL", "ws://127.0.0.1:9/socket");
        assert_eq!(
            launch.parse::<Duration>("TIMEOUT_SECONDS").unwrap(),
            Some(Duration::from_millis(2500))
        );
        let err = launch.parse_within("PREFETCH", 1u16..=256).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CHANNELD_PREFETCH is invalid: expected a whole number from 1 to 256"
        );
        assert_eq!(launch.parse_or("BLANK", 7u8).unwrap(), 7, "blank counts as unset");
        let err = launch.require::<String>("TOKEN").unwrap_err();
        assert_eq!(err, ConfigError::missing("CHANNELD_TOKEN"));
        assert_eq!(err.to_string(), "CHANNELD_TOKEN is not set");
        let url: url::Url = launch.require("URL").unwrap();
        assert_eq!(url.scheme(), "ws");
    }

    #[test]
    fn a_launch_round_trips_through_its_environment() {
        let launch = DriverLaunchConfig::for_socket(ChannelId::new("a.b").unwrap(), "/tmp/a.sock")
            .with_var("URL", "ws://x");
        let again = DriverLaunchConfig::from_vars(launch.to_env()).unwrap();
        assert_eq!(again.channel, launch.channel);
        assert_eq!(again.socket, launch.socket);
        assert_eq!(again.drain_timeout, launch.drain_timeout);
        assert_eq!(again.reply_timeout, launch.reply_timeout);
        assert_eq!(again.var("URL"), Some("ws://x"));
    }

    #[test]
    fn a_secret_url_parses_without_quoting_itself() {
        let launch = DriverLaunchConfig::for_socket(ChannelId::new("a.b").unwrap(), "/tmp/a.sock")
            .with_var("GOOD_URL", "amqp://bot:hunter2@broker/%2f")
            .with_var("BAD_URL", "amqp://bot:hunter2@[broker");
        let good = launch.secret_parse::<url::Url>("good-url", "GOOD_URL").unwrap().unwrap();
        assert_eq!(good.redacted(), "amqp://bot:***@broker/%2f");
        let err = launch.secret_parse::<url::Url>("bad-url", "BAD_URL").unwrap_err();
        assert!(err.to_string().starts_with("credential bad-url (or CHANNELD_BAD_URL) is invalid"));
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
