//! MQTT driver settings from the launch environment (`CHANNELD_MQTT_*`), validated; every
//! error names its variable and none contains a secret.

use std::path::PathBuf;
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret, Setting, Url};

use crate::convert::{IdentityTemplate, OutboundTemplate};

/// `CHANNELD_MQTT_URL`: `mqtt://host[:port]` (default port 1883) or `mqtts://host[:port]`
/// (TLS, default port 8883). Required. Credentials do not go in the URL.
pub const VAR_URL: &str = "MQTT_URL";
/// `CHANNELD_MQTT_USERNAME`: the broker user.
pub const VAR_USERNAME: &str = "MQTT_USERNAME";
/// `CHANNELD_MQTT_PASSWORD`: the broker password, read only when the credential
/// [`CREDENTIAL_PASSWORD`] is absent from `$CREDENTIALS_DIRECTORY`.
pub const VAR_PASSWORD: &str = "MQTT_PASSWORD";
/// The systemd credential (`LoadCredential=mqtt-password:…`) holding the broker password.
pub const CREDENTIAL_PASSWORD: &str = "mqtt-password";
/// `CHANNELD_MQTT_CLIENT_ID`: the MQTT client id; default `channeld-<channel id>`, which is
/// unique per instance and stable across restarts (the persistent session depends on it).
pub const VAR_CLIENT_ID: &str = "MQTT_CLIENT_ID";
/// `CHANNELD_MQTT_INBOUND_TOPIC`: the identity template of inbound topics; default
/// `channeld/<channel id>/in/{sender}/{conversation}`.
pub const VAR_INBOUND_TOPIC: &str = "MQTT_INBOUND_TOPIC";
/// `CHANNELD_MQTT_SUBSCRIBE`: comma-separated subscription filters; default: the inbound
/// template with each placeholder replaced by `+`.
pub const VAR_SUBSCRIBE: &str = "MQTT_SUBSCRIBE";
/// `CHANNELD_MQTT_OUTBOUND_TOPIC`: where replies and proactive sends are published; default
/// `channeld/<channel id>/out/{conversation}`.
pub const VAR_OUTBOUND_TOPIC: &str = "MQTT_OUTBOUND_TOPIC";
/// `CHANNELD_MQTT_QOS`: subscription QoS, `1` (default, at least once, acked after the hub
/// accepted) or `0` (at most once). Publishes are always QoS 1.
pub const VAR_QOS: &str = "MQTT_QOS";
/// `CHANNELD_MQTT_KEEP_ALIVE_SECONDS`: MQTT keep-alive, 5–65535 (default 30).
pub const VAR_KEEP_ALIVE: &str = "MQTT_KEEP_ALIVE_SECONDS";
/// `CHANNELD_MQTT_CA_FILE`: PEM file of CA certificates for `mqtts://` instead of the
/// system's roots.
pub const VAR_CA_FILE: &str = "MQTT_CA_FILE";
/// `CHANNELD_MQTT_RECONNECT_MAX_SECONDS`: the cap of the reconnect backoff, 1–3600 (default 30).
pub const VAR_RECONNECT_MAX: &str = "MQTT_RECONNECT_MAX_SECONDS";
/// `CHANNELD_MQTT_PUBLISH_TIMEOUT_SECONDS`: how long a post waits for the broker (connection
/// and PUBACK), 1–3600 (default 30).
pub const VAR_PUBLISH_TIMEOUT: &str = "MQTT_PUBLISH_TIMEOUT_SECONDS";

const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(30);
const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(30);
const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

fn invalid(var: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(var), reason)
}

/// Where the broker is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broker {
    /// As written in the URL (an IPv6 address in brackets).
    pub host: String,
    pub port: u16,
    pub tls: bool,
}

impl std::fmt::Display for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
        write!(f, "{scheme}://{}:{}", self.host, self.port)
    }
}

impl Broker {
    /// Parses `mqtt://host[:port]` or `mqtts://host[:port]` (`tcp://` and `ssl://` are
    /// accepted as aliases); IPv6 hosts go in brackets. Credentials do not belong in it.
    pub fn parse(raw: &str) -> Result<Self, ConfigError> {
        let url = Url::parse(raw.trim()).map_err(|err| {
            invalid(VAR_URL, format!("expected mqtt://host[:port] or mqtts://host[:port] ({err})"))
        })?;
        let tls = match url.scheme() {
            "mqtt" | "tcp" => false,
            "mqtts" | "ssl" => true,
            _ => {
                return Err(invalid(VAR_URL, "expected mqtt://host[:port] or mqtts://host[:port]"));
            }
        };
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                VAR_URL,
                "credentials do not belong in the URL: use CHANNELD_MQTT_USERNAME and the mqtt-password credential",
            ));
        }
        if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
            return Err(invalid(VAR_URL, "expected no path, query or fragment after host:port"));
        }
        let host = url.host_str().filter(|host| !host.is_empty());
        let Some(host) = host else {
            return Err(invalid(VAR_URL, "the host is missing"));
        };
        let port = match url.port() {
            Some(0) => return Err(invalid(VAR_URL, "port 0 is not 1-65535")),
            Some(port) => port,
            None if tls => 8883,
            None => 1883,
        };
        Ok(Self { host: host.to_owned(), port, tls })
    }

    /// The host to connect to: an IPv6 address without its brackets.
    pub fn connect_host(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }
}

/// Subscription quality of service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboundQos {
    /// QoS 0: the broker forgets a message once sent.
    AtMostOnce,
    /// QoS 1: the broker redelivers until the driver's PUBACK.
    AtLeastOnce,
}

impl Setting for InboundQos {
    const EXPECTED: &'static str = "0 or 1";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        match raw {
            "1" => Ok(InboundQos::AtLeastOnce),
            "0" => Ok(InboundQos::AtMostOnce),
            _ => Err("expected 0 or 1 (QoS 2 is not supported: use 1 with message ids)".into()),
        }
    }
}

/// Everything the MQTT driver needs.
#[derive(Debug, Clone)]
pub struct MqttConfig {
    pub channel: ChannelId,
    pub broker: Broker,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub client_id: String,
    pub inbound: IdentityTemplate,
    pub subscriptions: Vec<String>,
    pub outbound: OutboundTemplate,
    pub qos: InboundQos,
    pub keep_alive: Duration,
    pub ca_file: Option<PathBuf>,
    pub reconnect_max: Duration,
    pub publish_timeout: Duration,
    /// How long a stopping driver waits for the hub's answers to messages it holds (half
    /// the SDK's drain deadline).
    pub drain_grace: Duration,
}

impl MqttConfig {
    /// Reads and validates the settings.
    pub fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, ConfigError> {
        let channel = launch.channel.clone();
        let broker = Broker::parse(&launch.require::<String>(VAR_URL)?)?;
        let username = launch.parse::<String>(VAR_USERNAME)?;
        let password = launch.secret(CREDENTIAL_PASSWORD, VAR_PASSWORD)?;
        if password.is_some() && username.is_none() {
            return Err(invalid(
                VAR_PASSWORD,
                format!(
                    "a broker password (credential {CREDENTIAL_PASSWORD} or CHANNELD_{VAR_PASSWORD}) is set but CHANNELD_{VAR_USERNAME} is not (MQTT sends a password only with a user)"
                ),
            ));
        }
        let client_id = match launch.parse::<String>(VAR_CLIENT_ID)? {
            Some(id) if id.len() > 65535 || id.contains('\0') => {
                return Err(invalid(VAR_CLIENT_ID, "must be at most 65535 bytes without NUL"));
            }
            Some(id) => id,
            None => format!("channeld-{channel}"),
        };
        let inbound_raw = launch.parse_or(
            VAR_INBOUND_TOPIC,
            format!("channeld/{channel}/in/{{sender}}/{{conversation}}"),
        )?;
        let inbound = IdentityTemplate::parse(&inbound_raw)
            .map_err(|err| invalid(VAR_INBOUND_TOPIC, err.to_string()))?;
        let subscriptions = match launch.var(VAR_SUBSCRIBE) {
            Some(list) => parse_filters(list)?,
            None => vec![inbound.filter()],
        };
        let outbound_raw = launch
            .parse_or(VAR_OUTBOUND_TOPIC, format!("channeld/{channel}/out/{{conversation}}"))?;
        let outbound = OutboundTemplate::parse(&outbound_raw)
            .map_err(|err| invalid(VAR_OUTBOUND_TOPIC, err.to_string()))?;
        let qos = launch.parse_or(VAR_QOS, InboundQos::AtLeastOnce)?;
        let keep_alive = launch
            .parse_within(VAR_KEEP_ALIVE, Duration::from_secs(5)..=Duration::from_secs(65535))?
            .unwrap_or(DEFAULT_KEEP_ALIVE);
        let ca_file = launch.parse::<PathBuf>(VAR_CA_FILE)?;
        if ca_file.is_some() && !broker.tls {
            return Err(invalid(VAR_CA_FILE, "is set but CHANNELD_MQTT_URL is not mqtts://"));
        }
        let hour = Duration::from_secs(3600);
        let second = Duration::from_secs(1);
        Ok(Self {
            channel,
            broker,
            username,
            password,
            client_id,
            inbound,
            subscriptions,
            outbound,
            qos,
            keep_alive,
            ca_file,
            reconnect_max: launch
                .parse_within(VAR_RECONNECT_MAX, second..=hour)?
                .unwrap_or(DEFAULT_RECONNECT_MAX),
            publish_timeout: launch
                .parse_within(VAR_PUBLISH_TIMEOUT, second..=hour)?
                .unwrap_or(DEFAULT_PUBLISH_TIMEOUT),
            drain_grace: launch.drain_timeout / 2,
        })
    }
}

fn parse_filters(list: &str) -> Result<Vec<String>, ConfigError> {
    let filters: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|filter| !filter.is_empty())
        .map(str::to_owned)
        .collect();
    if filters.is_empty() {
        return Err(invalid(VAR_SUBSCRIBE, "names no topic filter"));
    }
    for filter in &filters {
        if !valid_filter(filter) {
            return Err(invalid(
                VAR_SUBSCRIBE,
                format!(
                    "{filter:?} is not a topic filter ('+' and '#' must be whole levels, '#' last)"
                ),
            ));
        }
    }
    Ok(filters)
}

/// MQTT 3.1.1 §4.7: wildcards occupy whole levels and `#` is the last level.
fn valid_filter(filter: &str) -> bool {
    if filter.contains('\0') {
        return false;
    }
    let levels: Vec<&str> = filter.split('/').collect();
    levels.iter().enumerate().all(|(index, level)| match *level {
        "+" => true,
        "#" => index == levels.len() - 1,
        _ => !level.contains(['+', '#']),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("mqtt.lab").unwrap(), "/tmp/x.sock")
            .with_var(VAR_URL, "mqtt://broker.example")
    }

    #[test]
    fn defaults_derive_from_the_instance() {
        let config = MqttConfig::from_launch(&launch()).unwrap();
        assert_eq!(config.broker, Broker { host: "broker.example".into(), port: 1883, tls: false });
        assert_eq!(config.client_id, "channeld-mqtt.lab");
        assert_eq!(config.subscriptions, vec!["channeld/mqtt.lab/in/+/+"]);
        assert_eq!(config.outbound.render("c1").unwrap(), "channeld/mqtt.lab/out/c1");
        assert_eq!(config.qos, InboundQos::AtLeastOnce);
        assert_eq!(config.keep_alive, DEFAULT_KEEP_ALIVE);
        assert!(config.username.is_none() && config.password.is_none());
    }

    #[test]
    fn urls_take_a_scheme_host_and_optional_port() {
        let tls = Broker::parse("mqtts://mq.example:9883").unwrap();
        assert_eq!(tls, Broker { host: "mq.example".into(), port: 9883, tls: true });
        assert_eq!(Broker::parse("mqtts://mq.example").unwrap().port, 8883);
        assert_eq!(Broker::parse("tcp://[::1]:1884/").unwrap().host, "[::1]");
        assert_eq!(Broker::parse("mqtt://[::1]").unwrap().port, 1883);
        for bad in ["http://x", "mqtt://", "mqtt://h:0", "mqtt://h:x", "mqtt://h/path", "x"] {
            let err = Broker::parse(bad).unwrap_err().to_string();
            assert!(err.starts_with("CHANNELD_MQTT_URL is invalid"), "{bad}: {err}");
        }
    }

    #[test]
    fn credentials_in_the_url_are_refused_without_echoing_them() {
        let err = Broker::parse("mqtt://user:hunter2@h").unwrap_err().to_string();
        assert!(err.contains("CHANNELD_MQTT_USERNAME"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_password_comes_from_the_credentials_directory_first() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CREDENTIAL_PASSWORD), "from-file\n").unwrap();
        let mut vars = vec![
            ("CHANNELD_CHANNEL_ID", "mqtt.lab".to_owned()),
            ("CHANNELD_SOCKET", "/tmp/mqtt.lab.sock".to_owned()),
            ("CHANNELD_MQTT_URL", "mqtt://h".to_owned()),
            ("CHANNELD_MQTT_USERNAME", "bot".to_owned()),
            ("CHANNELD_MQTT_PASSWORD", "from-env".to_owned()),
        ];
        let env_only = DriverLaunchConfig::from_vars(vars.clone()).unwrap();
        let config = MqttConfig::from_launch(&env_only).unwrap();
        assert_eq!(config.password.as_ref().map(Secret::as_str), Some("from-env"));
        assert_eq!(format!("{config:?}").matches("from-env").count(), 0, "secrets never print");

        vars.push(("CREDENTIALS_DIRECTORY", dir.path().display().to_string()));
        let with_dir = DriverLaunchConfig::from_vars(vars).unwrap();
        let config = MqttConfig::from_launch(&with_dir).unwrap();
        assert_eq!(config.password.as_ref().map(Secret::as_str), Some("from-file"));
    }

    #[test]
    fn a_password_needs_a_user() {
        let err = MqttConfig::from_launch(&launch().with_var(VAR_PASSWORD, "s3cret"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("CHANNELD_MQTT_USERNAME"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[test]
    fn errors_name_the_variable() {
        let cases = [
            (VAR_INBOUND_TOPIC, "lab/in/{conversation}"),
            (VAR_OUTBOUND_TOPIC, "lab/out/+"),
            (VAR_SUBSCRIBE, "lab/#/x"),
            (VAR_QOS, "2"),
            (VAR_KEEP_ALIVE, "1"),
            (VAR_RECONNECT_MAX, "soon"),
            (VAR_PUBLISH_TIMEOUT, "0"),
            (VAR_CA_FILE, "/etc/ca.pem"),
        ];
        for (var, value) in cases {
            let err = MqttConfig::from_launch(&launch().with_var(var, value)).unwrap_err();
            assert!(err.to_string().starts_with(&format!("CHANNELD_{var} is invalid")), "{err}");
        }
        let missing = DriverLaunchConfig::for_socket(ChannelId::new("mqtt.lab").unwrap(), "/x");
        assert_eq!(
            MqttConfig::from_launch(&missing).unwrap_err().to_string(),
            "CHANNELD_MQTT_URL is not set"
        );
    }

    #[test]
    fn explicit_topics_and_filters_are_used() {
        let launch = launch()
            .with_var(VAR_INBOUND_TOPIC, "site/+/in/{sender}")
            .with_var(VAR_SUBSCRIBE, "site/a/in/+, site/b/in/#")
            .with_var(VAR_OUTBOUND_TOPIC, "site/out/{conversation}/msg")
            .with_var(VAR_QOS, "0")
            .with_var(VAR_CLIENT_ID, "bridge-7");
        let config = MqttConfig::from_launch(&launch).unwrap();
        assert_eq!(config.subscriptions, vec!["site/a/in/+", "site/b/in/#"]);
        assert_eq!(config.inbound.filter(), "site/+/in/+");
        assert_eq!(config.outbound.render("c").unwrap(), "site/out/c/msg");
        assert_eq!(config.qos, InboundQos::AtMostOnce);
        assert_eq!(config.client_id, "bridge-7");
    }
}
