//! `channeld-acecode` settings from the launch environment (`CHANNELD_ACECODE_*`) and the
//! plugin's manifest, validated before anything starts: an invalid manifest is a
//! configuration error (exit 78) naming the rule it broke.

use std::path::{Path, PathBuf};
use std::time::Duration;

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::ChannelId;
use channeld_driver_sdk::protocol::acecode::{Manifest, valid_plugin_id};
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig};

/// `CHANNELD_ACECODE_MANIFEST`: the plugin's `channel-platform.json` (required).
pub const VAR_MANIFEST: &str = "ACECODE_MANIFEST";
/// `CHANNELD_ACECODE_WATCHED_GROUPS`: comma-separated group ids sent as
/// `settings.watched_groups` (only with the manifest's `watched_groups` feature).
pub const VAR_WATCHED_GROUPS: &str = "ACECODE_WATCHED_GROUPS";
/// `CHANNELD_ACECODE_SEND_TIMEOUT_SECONDS`: how long `send_text` waits for its response,
/// 1-600 (default 60, the seed's); `send_file` waits twice as long.
pub const VAR_SEND_TIMEOUT: &str = "ACECODE_SEND_TIMEOUT_SECONDS";

/// Everything the plugin host needs.
#[derive(Debug, Clone)]
pub struct AcecodeConfig {
    pub channel: ChannelId,
    pub manifest: Manifest,
    pub watched_groups: Vec<String>,
    pub send_timeout: Duration,
}

impl AcecodeConfig {
    /// Reads the settings and validates the manifest.
    pub fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, ConfigError> {
        let path: PathBuf = launch.require(VAR_MANIFEST)?;
        let manifest = load_manifest(&path)
            .map_err(|reason| ConfigError::invalid(setting_var(VAR_MANIFEST), reason))?;
        let watched_groups: Vec<String> = launch
            .var(VAR_WATCHED_GROUPS)
            .map(|list| {
                list.split(',')
                    .map(str::trim)
                    .filter(|g| !g.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        if let Some(bad) = watched_groups.iter().find(|g| !valid_plugin_id(g)) {
            return Err(ConfigError::invalid(
                setting_var(VAR_WATCHED_GROUPS),
                format!("{bad:?} is not a group id (letters, digits, - _ . : @ + / = $)"),
            ));
        }
        if !watched_groups.is_empty() && !manifest.watched_groups {
            return Err(ConfigError::invalid(
                setting_var(VAR_WATCHED_GROUPS),
                "the plugin's manifest does not list the watched_groups feature",
            ));
        }
        let send_timeout = launch
            .parse_within::<u64>(VAR_SEND_TIMEOUT, 1..=600)?
            .map_or(Duration::from_secs(60), Duration::from_secs);
        Ok(Self { channel: launch.channel.clone(), manifest, watched_groups, send_timeout })
    }
}

/// Reads and validates a manifest file; the error names the broken rule.
pub fn load_manifest(path: &Path) -> Result<Manifest, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir = std::fs::canonicalize(dir)
        .map_err(|err| format!("cannot resolve {}: {err}", dir.display()))?;
    Manifest::validate(&text, &dir, |p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
        .map_err(|err| format!("{}: {err}", path.display()))
}
