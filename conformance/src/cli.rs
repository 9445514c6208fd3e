//! The command line: `channeld-conformance [--json] [--inject 'CMD {text}'] [--timeout SECS]
//! -- COMMAND [ARGS…]`, parsed and validated into [`Options`].

use std::time::Duration;

use channeld_protocol::{ChannelId, Id};
use clap::Parser;

/// Checks a channeld driver written in any language: serves a hub socket, starts COMMAND as the
/// driver under test with the launch environment pointing at it, plays the hub and prints one
/// line per check (PASS, FAIL or SKIP with a reason).
///
/// Exit status: 0 every check passed or was skipped, 1 a check failed, 2 usage error, 3 the
/// checks could not run (no socket, COMMAND cannot start).
#[derive(Debug, Parser)]
#[command(name = "channeld-conformance", version)]
struct Args {
    /// Print one JSON document instead of a line per check.
    #[arg(long)]
    json: bool,

    /// A shell command that makes the platform deliver a message whose text is `{text}` (the
    /// text is shell-quoted when substituted), e.g. `mosquitto_pub -t in/alice/c1 -m {text}`.
    /// Enables the checks that need the platform.
    #[arg(long, value_name = "CMD")]
    inject: Option<String>,

    /// How long to wait for each answer from the driver.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    timeout: f64,

    /// The drain time given to the driver (`CHANNELD_DRAIN_SECONDS`): after SIGTERM it must
    /// say `stop` and exit 0 within it.
    #[arg(long, value_name = "SECS", default_value_t = 3)]
    drain: u64,

    /// The channel id the driver is launched as.
    #[arg(long, value_name = "ID", default_value = "conformance.test")]
    channel: String,

    /// The conversation proactive sends (`outbound`) are addressed to.
    #[arg(long, value_name = "ID", default_value = "conformance")]
    conversation: String,

    /// An environment variable holding a secret to watch for, besides the canary in
    /// `CHANNELD_CONFORMANCE_SECRET`: its value (a fresh canary when it is not set) must never
    /// appear on the socket, stdout or stderr. Repeatable.
    #[arg(long = "secret", value_name = "VAR")]
    secrets: Vec<String>,

    /// The driver under test and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// What to run and how.
#[derive(Debug, Clone)]
pub struct Options {
    pub json: bool,
    pub inject: Option<String>,
    pub timeout: Duration,
    pub drain: Duration,
    pub channel: ChannelId,
    pub conversation: Id,
    pub secrets: Vec<String>,
    pub program: String,
    pub args: Vec<String>,
}

/// The command line could not be used; `message` says why (clap's own rendering for its
/// errors, help and version included).
#[derive(Debug)]
pub struct UsageError {
    pub message: String,
    /// `--help` or `--version`: print to stdout and exit 0.
    pub informational: bool,
}

impl Options {
    /// Parses `argv` (program name first).
    pub fn parse<I, T>(argv: I) -> Result<Options, UsageError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args = Args::try_parse_from(argv).map_err(|err| UsageError {
            informational: !err.use_stderr(),
            message: err.render().to_string(),
        })?;
        let usage = |message: String| UsageError { message, informational: false };
        if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 600.0) {
            return Err(usage("--timeout must be a number of seconds above 0, at most 600".into()));
        }
        if args.drain > 600 {
            return Err(usage("--drain must be at most 600 seconds".into()));
        }
        let channel = ChannelId::new(&args.channel).map_err(|err| {
            usage(format!("--channel {:?} is not a channel id: {err}", args.channel))
        })?;
        let conversation = Id::new(&args.conversation).map_err(|err| {
            usage(format!("--conversation {:?} is not an id: {err}", args.conversation))
        })?;
        if let Some(inject) = &args.inject
            && !inject.contains("{text}")
        {
            return Err(usage("--inject must contain {text}, where the message text goes".into()));
        }
        for var in &args.secrets {
            let valid = !var.is_empty()
                && !var.starts_with(|c: char| c.is_ascii_digit())
                && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(usage(format!("--secret {var:?} is not an environment variable name")));
            }
        }
        let mut command = args.command.into_iter();
        let program = command.next().filter(|p| !p.is_empty()).ok_or_else(|| {
            usage(
                "give the driver to check after --: channeld-conformance -- COMMAND [ARGS…]".into(),
            )
        })?;
        Ok(Options {
            json: args.json,
            inject: args.inject,
            timeout: Duration::from_secs_f64(args.timeout),
            drain: Duration::from_secs(args.drain),
            channel,
            conversation,
            secrets: args.secrets,
            program,
            args: command.collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, UsageError> {
        Options::parse(std::iter::once("channeld-conformance").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_follows_the_double_dash() {
        let options =
            parse(&["--json", "--timeout", "2", "--", "python3", "driver.py", "--flag"]).unwrap();
        assert!(options.json);
        assert_eq!(options.timeout, Duration::from_secs(2));
        assert_eq!(options.program, "python3");
        assert_eq!(options.args, ["driver.py", "--flag"]);
        assert_eq!(options.channel.as_str(), "conformance.test");
        assert_eq!(options.drain, Duration::from_secs(3));
    }

    #[test]
    fn unusable_command_lines_are_usage_errors() {
        for bad in [
            &[][..],
            &["--", ""],
            &["--timeout", "0", "--", "x"],
            &["--channel", "Not An Id", "--", "x"],
            &["--inject", "echo hi", "--", "x"],
            &["--secret", "A-B", "--", "x"],
            &["--no-such-flag", "--", "x"],
        ] {
            let err = parse(bad).unwrap_err();
            assert!(!err.informational, "{bad:?}");
            assert!(!err.message.is_empty());
        }
        assert!(parse(&["--help"]).unwrap_err().informational);
    }
}
