//! `channeld-wechat`: a channeld driver for a WeChat iLink bot. Without arguments it runs as
//! the driver (settings from `CHANNELD_WECHAT_*`, see the `config` module); `login` runs the
//! QR login and stores the bot token in the state directory.

use channeld_driver_sdk::DriverError;
use channeld_wechat::client::{IlinkClient, http_client};
use channeld_wechat::config::{ENV_STATE_DIRECTORY, LoginConfig};
use channeld_wechat::login::{self, LoginOutcome};
use channeld_wechat::{WechatConfig, WechatDriver};
use clap::{Parser, Subcommand};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// channeld driver for WeChat iLink bots.
#[derive(Debug, Parser)]
#[command(name = "channeld-wechat", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Log the bot in with a QR code scanned in WeChat and store its token in the state
    /// directory (CHANNELD_WECHAT_STATE_DIR, else $STATE_DIRECTORY).
    Login {
        /// The state directory to store the login in.
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Login { state_dir }) => login_main(state_dir),
        None => channeld_driver_sdk::main(|launch| async move {
            let state_directory = std::env::var_os(ENV_STATE_DIRECTORY).map(PathBuf::from);
            let config = WechatConfig::from_launch(&launch, state_directory.as_deref())?;
            tracing::info!(
                channel = %config.channel,
                base_url = %config.base_url,
                state_dir = %config.state_dir.display(),
                "starting the WeChat iLink driver"
            );
            WechatDriver::new(config, http_client().map_err(DriverError::platform)?)
        }),
    }
}

/// Exit status: 0 logged in (or already bound with a stored login), 1 failed, 78 settings.
fn login_main(state_dir: Option<PathBuf>) -> ExitCode {
    let config = match LoginConfig::from_env(|name| std::env::var(name).ok(), state_dir) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("channeld-wechat login: {err}");
            return ExitCode::from(78);
        }
    };
    channeld_driver_sdk::init_logging("warn");
    let client = match http_client() {
        Ok(http) => IlinkClient::new(
            http,
            concat!("channeld-wechat/", env!("CARGO_PKG_VERSION")),
            config.route_tag.clone(),
        ),
        Err(err) => {
            eprintln!("channeld-wechat login: {err}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("channeld-wechat login: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout();
    // The poll waits while the person types; nothing else runs meanwhile.
    let mut ask = |prompt: &str| -> std::io::Result<Option<String>> {
        let mut stdout = std::io::stdout();
        stdout.write_all(prompt.as_bytes())?;
        stdout.flush()?;
        let mut line = String::new();
        let read = std::io::stdin().lock().read_line(&mut line)?;
        Ok((read > 0).then_some(line))
    };
    match runtime.block_on(login::login(&client, &config, &mut out, &mut ask)) {
        Ok(LoginOutcome::LoggedIn(_) | LoginOutcome::AlreadyBound(_)) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("channeld-wechat login: {err}");
            ExitCode::FAILURE
        }
    }
}
