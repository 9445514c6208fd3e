//! Nostr driver settings from the launch environment (`CHANNELD_NOSTR_*`) and the secret key
//! from the credentials directory, validated; every error names its variable and none quotes
//! a value (a relay URL may carry a token, the key is a secret).

use std::path::PathBuf;
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig, Secret};
use nostr_sdk::{Keys, PublicKey, RelayUrl, ToBech32};

/// `CHANNELD_NOSTR_RELAYS`: comma-separated relay URLs (`wss://`, or `ws://` for local
/// relays and tests). Required.
pub const VAR_RELAYS: &str = "NOSTR_RELAYS";
/// The systemd credential (`LoadCredential=nostr-secret-key:…`) holding the bot's secret key,
/// as `nsec1…` or 64 hex digits.
pub const CREDENTIAL_SECRET_KEY: &str = "nostr-secret-key";
/// `CHANNELD_NOSTR_SECRET_KEY`: the secret key, read only when the credential
/// [`CREDENTIAL_SECRET_KEY`] is absent.
pub const VAR_SECRET_KEY: &str = "NOSTR_SECRET_KEY";
/// `CHANNELD_NOSTR_STATE_DIR`: where the checkpoint and the seen-set are kept; default
/// systemd's `$STATE_DIRECTORY` (its first entry). One of them is required.
pub const VAR_STATE_DIR: &str = "NOSTR_STATE_DIR";
/// `CHANNELD_NOSTR_PUBLISH_INBOX`: publish the kind-10050 inbox relay list (and the kind-0
/// metadata when `CHANNELD_NOSTR_NAME` is set) at start; default true.
pub const VAR_PUBLISH_INBOX: &str = "NOSTR_PUBLISH_INBOX";
/// `CHANNELD_NOSTR_NAME`: the bot's name in its kind-0 metadata.
pub const VAR_NAME: &str = "NOSTR_NAME";
/// `CHANNELD_NOSTR_ACCEPT_NIP04`: also receive (and answer) legacy NIP-04 messages; default
/// true.
pub const VAR_ACCEPT_NIP04: &str = "NOSTR_ACCEPT_NIP04";
/// `CHANNELD_NOSTR_LOOKBACK`: how far before the checkpoint the subscription starts; default
/// 49 h (gift wraps are backdated up to two days, plus an hour of clock skew).
pub const VAR_LOOKBACK: &str = "NOSTR_LOOKBACK";
/// `CHANNELD_NOSTR_SEEN_TTL`: how long a handled event is remembered, counted back from the
/// checkpoint; default 72 h, and always longer than the lookback.
pub const VAR_SEEN_TTL: &str = "NOSTR_SEEN_TTL";
/// `CHANNELD_NOSTR_SEEN_MAX`: the most handled events remembered (oldest forgotten first);
/// default 50,000.
pub const VAR_SEEN_MAX: &str = "NOSTR_SEEN_MAX";
/// `CHANNELD_NOSTR_SEND_TIMEOUT`: how long a post waits for a relay connection and then for
/// the relays' `OK`; default 10 s.
pub const VAR_SEND_TIMEOUT: &str = "NOSTR_SEND_TIMEOUT";
/// `CHANNELD_NOSTR_CHUNK_BYTES`: the largest text of one message; longer replies are split
/// into several messages, in order; default 4,000.
pub const VAR_CHUNK_BYTES: &str = "NOSTR_CHUNK_BYTES";
/// `CHANNELD_NOSTR_RECONNECT`: the first delay before reconnecting to a relay (the relay pool
/// stretches it up to a minute while a relay keeps failing); default 10 s.
pub const VAR_RECONNECT: &str = "NOSTR_RECONNECT";

const DEFAULT_LOOKBACK: Duration = Duration::from_secs(49 * 3600);
const DEFAULT_SEEN_TTL: Duration = Duration::from_secs(72 * 3600);
const DEFAULT_SEEN_MAX: usize = 50_000;
const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CHUNK_BYTES: usize = 4_000;
const DEFAULT_RECONNECT: Duration = Duration::from_secs(10);
/// At most this many relays: each is a connection and a subscription.
pub const MAX_RELAYS: usize = 16;

fn invalid(var: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(setting_var(var), reason)
}

/// Everything the Nostr driver needs.
#[derive(Debug, Clone)]
pub struct NostrConfig {
    pub channel: ChannelId,
    pub relays: Vec<RelayUrl>,
    /// The bot's keys; `Debug` prints `***` (the secret key never leaves this value).
    pub keys: Secret<Keys>,
    pub public_key: PublicKey,
    pub state_file: PathBuf,
    pub publish_inbox: bool,
    pub name: Option<String>,
    pub accept_nip04: bool,
    pub lookback: Duration,
    pub seen_ttl: Duration,
    pub seen_max: usize,
    pub send_timeout: Duration,
    pub chunk_bytes: usize,
    pub reconnect: Duration,
    /// How long a stopping driver waits for the hub's answers to messages it reported (half
    /// the SDK's drain deadline).
    pub drain_grace: Duration,
}

impl NostrConfig {
    /// Reads and validates the settings. `state_directory` is systemd's `$STATE_DIRECTORY`,
    /// used when `CHANNELD_NOSTR_STATE_DIR` is not set.
    pub fn from_launch(
        launch: &DriverLaunchConfig,
        state_directory: Option<PathBuf>,
    ) -> Result<Self, ConfigError> {
        let channel = launch.channel.clone();
        let relays = parse_relays(&launch.require::<String>(VAR_RELAYS)?)?;
        let keys = parse_keys(launch)?;
        let public_key = keys.expose().public_key();
        let state_dir = match launch.parse::<PathBuf>(VAR_STATE_DIR)? {
            Some(dir) => dir,
            None => state_directory.ok_or_else(|| {
                invalid(
                    VAR_STATE_DIR,
                    "is not set and neither is STATE_DIRECTORY: the driver keeps its checkpoint and seen-set there",
                )
            })?,
        };
        let state_file = state_dir.join(format!("{channel}.nostr-state.json"));
        let lookback = launch
            .parse_within(VAR_LOOKBACK, Duration::from_secs(60)..=Duration::from_secs(30 * 86400))?
            .unwrap_or(DEFAULT_LOOKBACK);
        let seen_ttl = launch
            .parse_within(VAR_SEEN_TTL, Duration::from_secs(60)..=Duration::from_secs(365 * 86400))?
            .unwrap_or(DEFAULT_SEEN_TTL.max(lookback + Duration::from_secs(3600)));
        if seen_ttl <= lookback {
            return Err(invalid(
                VAR_SEEN_TTL,
                format!(
                    "must be longer than the lookback ({}s), or a message could be answered twice",
                    lookback.as_secs()
                ),
            ));
        }
        let name = launch.parse::<String>(VAR_NAME)?;
        if name.as_ref().is_some_and(|name| name.chars().count() > 100) {
            return Err(invalid(VAR_NAME, "expected at most 100 characters"));
        }
        Ok(Self {
            channel,
            relays,
            keys,
            public_key,
            state_file,
            publish_inbox: launch.parse_or(VAR_PUBLISH_INBOX, true)?,
            name,
            accept_nip04: launch.parse_or(VAR_ACCEPT_NIP04, true)?,
            lookback,
            seen_ttl,
            seen_max: launch
                .parse_within(VAR_SEEN_MAX, 100..=10_000_000)?
                .unwrap_or(DEFAULT_SEEN_MAX),
            send_timeout: launch
                .parse_within(
                    VAR_SEND_TIMEOUT,
                    Duration::from_millis(100)..=Duration::from_secs(600),
                )?
                .unwrap_or(DEFAULT_SEND_TIMEOUT),
            chunk_bytes: launch
                .parse_within(VAR_CHUNK_BYTES, 64..=60_000)?
                .unwrap_or(DEFAULT_CHUNK_BYTES),
            reconnect: launch
                .parse_within(
                    VAR_RECONNECT,
                    Duration::from_millis(100)..=Duration::from_secs(3600),
                )?
                .unwrap_or(DEFAULT_RECONNECT),
            drain_grace: launch.drain_timeout / 2,
        })
    }

    /// The bot's public key as `npub1…`, for logs and health.
    pub fn npub(&self) -> String {
        npub(&self.public_key)
    }
}

/// `npub1…` of a public key (bech32 of a valid key cannot fail; hex is the fallback).
pub fn npub(public_key: &PublicKey) -> String {
    public_key.to_bech32().unwrap_or_else(|_| public_key.to_hex())
}

/// The relay list: comma-separated `ws://` or `wss://` URLs, duplicates dropped, at least one
/// and at most [`MAX_RELAYS`].
pub fn parse_relays(raw: &str) -> Result<Vec<RelayUrl>, ConfigError> {
    let mut relays: Vec<RelayUrl> = Vec::new();
    for (n, item) in raw.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let position = n + 1;
        let url = RelayUrl::parse(item).map_err(|_| {
            invalid(VAR_RELAYS, format!("entry {position} is not a ws:// or wss:// URL"))
        })?;
        let parsed = nostr_sdk::Url::parse(url.as_str())
            .map_err(|_| invalid(VAR_RELAYS, format!("entry {position} is not a URL")))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid(
                VAR_RELAYS,
                format!("entry {position} carries credentials; relays take none in the URL"),
            ));
        }
        if !relays.contains(&url) {
            relays.push(url);
        }
    }
    if relays.is_empty() {
        return Err(invalid(VAR_RELAYS, "names no relay"));
    }
    if relays.len() > MAX_RELAYS {
        return Err(invalid(VAR_RELAYS, format!("names more than {MAX_RELAYS} relays")));
    }
    Ok(relays)
}

/// The secret key from the credential, then the environment; `nsec1…` or hex.
fn parse_keys(launch: &DriverLaunchConfig) -> Result<Secret<Keys>, ConfigError> {
    let secret = launch.secret(CREDENTIAL_SECRET_KEY, VAR_SECRET_KEY)?.ok_or_else(|| {
        ConfigError::Missing {
            var: format!("credential {CREDENTIAL_SECRET_KEY} (or {})", setting_var(VAR_SECRET_KEY)),
        }
    })?;
    // The library's error could describe the input; ours never does.
    Keys::parse(secret.as_str().trim()).map(Secret::new).map_err(|_| ConfigError::Credential {
        name: format!("{CREDENTIAL_SECRET_KEY} (or {})", setting_var(VAR_SECRET_KEY)),
        reason: "is invalid: expected a secret key as nsec1… or 64 hex digits".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX_KEY: &str = "6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e";

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("nostr.bot").unwrap(), "/tmp/x.sock")
    }

    fn minimal() -> DriverLaunchConfig {
        launch()
            .with_var(VAR_RELAYS, "ws://127.0.0.1:7000, wss://relay.example/ ,ws://127.0.0.1:7000")
            .with_var(VAR_SECRET_KEY, HEX_KEY)
            .with_var(VAR_STATE_DIR, "/var/lib/x")
    }

    #[test]
    fn defaults_fill_everything_but_relays_key_and_state() {
        let config = NostrConfig::from_launch(&minimal(), None).unwrap();
        assert_eq!(config.relays.len(), 2, "the duplicate is dropped");
        assert_eq!(config.state_file, PathBuf::from("/var/lib/x/nostr.bot.nostr-state.json"));
        assert!(config.publish_inbox && config.accept_nip04);
        assert_eq!(config.lookback, Duration::from_secs(49 * 3600));
        assert!(config.seen_ttl > config.lookback);
        assert_eq!(config.chunk_bytes, 4_000);
        assert!(config.npub().starts_with("npub1"));
        assert_eq!(format!("{:?}", config.keys), "***");
    }

    #[test]
    fn the_state_directory_comes_from_systemd_when_not_set() {
        let launch =
            launch().with_var(VAR_RELAYS, "ws://127.0.0.1:7000").with_var(VAR_SECRET_KEY, HEX_KEY);
        let err = NostrConfig::from_launch(&launch, None).unwrap_err();
        assert_eq!(err.variable(), "CHANNELD_NOSTR_STATE_DIR");
        let config = NostrConfig::from_launch(&launch, Some("/state".into())).unwrap();
        assert!(config.state_file.starts_with("/state"));
    }

    #[test]
    fn the_secret_key_is_required_and_never_quoted() {
        let launch =
            launch().with_var(VAR_RELAYS, "ws://127.0.0.1:7000").with_var(VAR_STATE_DIR, "/s");
        let err = NostrConfig::from_launch(&launch, None).unwrap_err();
        assert!(err.to_string().contains("nostr-secret-key"), "{err}");
        let bad = launch.with_var(VAR_SECRET_KEY, "nsec1-canary-not-a-key");
        let err = NostrConfig::from_launch(&bad, None).unwrap_err();
        assert!(!err.to_string().contains("canary"), "{err}");
        assert!(err.to_string().contains("nsec1… or 64 hex digits"), "{err}");
    }

    #[test]
    fn relay_lists_are_checked_by_position_without_quoting() {
        for (raw, reason) in [
            ("", "names no relay"),
            (" , ", "names no relay"),
            ("https://relay.example", "entry 1 is not a ws:// or wss:// URL"),
            ("ws://a.example,ws://u:secret-token@b.example", "entry 2 carries credentials"),
        ] {
            let err = parse_relays(raw).unwrap_err();
            assert!(err.to_string().contains(reason), "{raw:?}: {err}");
            assert!(!err.to_string().contains("secret-token"), "{err}");
        }
        let many: Vec<String> = (0..=MAX_RELAYS).map(|n| format!("ws://r{n}.example")).collect();
        assert!(parse_relays(&many.join(",")).is_err());
    }

    #[test]
    fn a_seen_ttl_not_longer_than_the_lookback_is_refused() {
        let launch = minimal().with_var(VAR_LOOKBACK, "48h").with_var(VAR_SEEN_TTL, "48h");
        let err = NostrConfig::from_launch(&launch, None).unwrap_err();
        assert_eq!(err.variable(), "CHANNELD_NOSTR_SEEN_TTL");
        // A longer lookback moves the default TTL along with it.
        let launch = minimal().with_var(VAR_LOOKBACK, "100h");
        let config = NostrConfig::from_launch(&launch, None).unwrap();
        assert!(config.seen_ttl > config.lookback);
    }
}
