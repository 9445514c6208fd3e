//! Console driver settings from the launch environment: who is typing, and in which
//! conversation.

use channeld_driver_sdk::launch::setting_var;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::{ConfigError, DriverLaunchConfig};

/// `CHANNELD_CONSOLE_SENDER`: the participant id of the person at the terminal.
pub const VAR_SENDER: &str = "CONSOLE_SENDER";
/// `CHANNELD_CONSOLE_CONVERSATION`: the conversation every line belongs to.
pub const VAR_CONVERSATION: &str = "CONSOLE_CONVERSATION";

/// The sender when neither `CHANNELD_CONSOLE_SENDER` nor a usable `$USER` is set.
pub const DEFAULT_SENDER: &str = "console-user";
/// The conversation when `CHANNELD_CONSOLE_CONVERSATION` is not set.
pub const DEFAULT_CONVERSATION: &str = "console";

/// Everything the console driver needs besides its input and output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleConfig {
    /// The launch channel; every message and receipt names it.
    pub channel: ChannelId,
    pub sender: Id,
    pub conversation: Id,
}

impl ConsoleConfig {
    /// Reads the settings. `user` is the login name (`$USER`), the sender's fallback.
    pub fn from_launch(
        launch: &DriverLaunchConfig,
        user: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let sender = match launch.var(VAR_SENDER) {
            Some(sender) => setting(VAR_SENDER, sender)?,
            // $USER is ambient, not configured: an unusable one falls back quietly.
            None => user
                .and_then(|user| Id::new(user).ok())
                .unwrap_or_else(|| Id::new(DEFAULT_SENDER).expect("default sender is a valid id")),
        };
        let conversation = setting(
            VAR_CONVERSATION,
            launch.var(VAR_CONVERSATION).unwrap_or(DEFAULT_CONVERSATION),
        )?;
        Ok(Self { channel: launch.channel.clone(), sender, conversation })
    }
}

fn setting(var: &'static str, value: &str) -> Result<Id, ConfigError> {
    Id::new(value).map_err(|err| ConfigError::invalid(setting_var(var), err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> DriverLaunchConfig {
        DriverLaunchConfig::for_socket(ChannelId::new("console.test").unwrap(), "/tmp/x.sock")
    }

    #[test]
    fn defaults_are_the_login_name_and_the_console_conversation() {
        let config = ConsoleConfig::from_launch(&launch(), Some("ada")).unwrap();
        assert_eq!(config.sender, "ada");
        assert_eq!(config.conversation, DEFAULT_CONVERSATION);
        assert_eq!(config.channel.as_str(), "console.test");
    }

    #[test]
    fn without_a_usable_login_name_the_sender_is_console_user() {
        let config = ConsoleConfig::from_launch(&launch(), None).unwrap();
        assert_eq!(config.sender, DEFAULT_SENDER);
        let too_long = "u".repeat(300);
        let config = ConsoleConfig::from_launch(&launch(), Some(&too_long)).unwrap();
        assert_eq!(config.sender, DEFAULT_SENDER);
    }

    #[test]
    fn explicit_settings_win_and_are_validated() {
        let launch =
            launch().with_var(VAR_SENDER, "operator").with_var(VAR_CONVERSATION, "ops-room");
        let config = ConsoleConfig::from_launch(&launch, Some("ada")).unwrap();
        assert_eq!(config.sender, "operator");
        assert_eq!(config.conversation, "ops-room");

        let bad = self::launch().with_var(VAR_CONVERSATION, "c".repeat(300));
        let err = ConsoleConfig::from_launch(&bad, None).unwrap_err();
        assert!(err.to_string().starts_with("CHANNELD_CONSOLE_CONVERSATION is invalid"));
    }
}
