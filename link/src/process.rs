//! What every channeld process does at start, the hub and the drivers alike: logging (one
//! filter variable; the journal under systemd, JSON for log shippers, else human lines on
//! stderr), and SIGTERM/SIGINT (SIGHUP for interactive processes) turned into a
//! cancellation; and for a process that holds many sockets (the hub), its open-file limit
//! raised to what it may use.

use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The environment variable holding the log filter (`tracing` directives, e.g.
/// `info,lapin=debug`).
pub const LOG_ENV: &str = "CHANNELD_LOG";

/// The environment variable choosing the log format: `json` (one JSON object a line, for
/// log shippers), `journald` or `human`. Unset, the journal is used when stderr is the
/// journal (systemd's `JOURNAL_STREAM` names it), else the human format.
pub const LOG_FORMAT_ENV: &str = "CHANNELD_LOG_FORMAT";

/// Where and how log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Today's lines on stderr: `time LEVEL message field=value`, colour on a terminal.
    Human,
    /// One JSON object a line on stderr: `timestamp`, `level`, `message`, the event's fields
    /// at the top level, and the enclosing spans' fields in `spans`.
    Json,
    /// Native journal entries with every field as its own journal field, upper-cased
    /// (`INSTANCE=`, `EVENT_ID=`, `REQUEST_ID=`, `RUN_ID=`), so `journalctl INSTANCE=mqtt.lab`
    /// finds them.
    Journald,
}

/// Chooses the format from `CHANNELD_LOG_FORMAT` and whether stderr is the journal. An
/// unknown value is `Err` with the human format to fall back to. Pure.
pub fn choose_format(
    format: Option<&str>,
    stderr_is_journal: bool,
) -> Result<LogFormat, LogFormat> {
    match format.map(str::trim) {
        None | Some("") => {
            Ok(if stderr_is_journal { LogFormat::Journald } else { LogFormat::Human })
        }
        Some("json") => Ok(LogFormat::Json),
        Some("journald") => Ok(LogFormat::Journald),
        Some("human") => Ok(LogFormat::Human),
        Some(_) => Err(LogFormat::Human),
    }
}

/// Whether `JOURNAL_STREAM` (`<device>:<inode>`, set by systemd when it connects stderr to the
/// journal) names the file stderr is now: a child whose stderr was redirected elsewhere
/// inherits the variable but must not log to the journal.
fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Ok(stream) = std::env::var("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = stream.split_once(':') else { return false };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else { return false };
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else { return false };
    std::fs::File::from(fd).metadata().is_ok_and(|meta| meta.dev() == dev && meta.ino() == ino)
}

/// Sets up logging for the process: the filter comes from `CHANNELD_LOG`, else
/// `default_filter`; the format from [`choose_format`]. Colour codes only when stderr is a
/// terminal. If the journal cannot be reached the human format is used and a warning says
/// so. Calling it again (or after another subscriber was set) changes nothing.
pub fn init_logging(default_filter: &str) {
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter))
    };
    let requested = std::env::var(LOG_FORMAT_ENV).ok();
    let chosen = choose_format(requested.as_deref(), stderr_is_journal());
    let format = chosen.unwrap_or_else(|fallback| fallback);
    let mut journal_error = None;
    if format == LogFormat::Journald {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        match tracing_journald::layer() {
            Ok(journal) => {
                // Field names as written (upper-cased by the journal), without the `F_` prefix.
                let journal = journal.with_field_prefix(None);
                let _ = tracing_subscriber::registry().with(filter()).with(journal).try_init();
                return;
            }
            Err(err) => journal_error = Some(err),
        }
    }
    if format == LogFormat::Json {
        let _ = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init();
    } else {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .try_init();
    }
    if let Some(err) = journal_error {
        tracing::warn!(error = %err, "the journal cannot be reached; logging to stderr");
    }
    if chosen.is_err() {
        tracing::warn!(
            value = requested.as_deref().unwrap_or_default(),
            "unknown {LOG_FORMAT_ENV} (json, journald or human); using the human format"
        );
    }
}

/// The open-file limit (`RLIMIT_NOFILE`) after [`raise_fd_limit`]: the soft limit before,
/// the soft limit now, and the hard limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    pub before: u64,
    pub now: u64,
    pub hard: u64,
}

/// Raises the soft open-file limit to the hard one. The soft default (1,024, also under
/// systemd) exists for programs that use `select(2)`; nothing here does, and a hub holds
/// two descriptors per instance (its socket and the driver's connection), so the hard limit
/// (systemd's default 524,288, or `LimitNOFILE=`) is the real bound. Fails only when the
/// limit cannot be read or set; the limit is then unchanged.
pub fn raise_fd_limit() -> std::io::Result<FdLimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads the struct we own; raising the soft limit up to the hard
        // one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(FdLimit { before, now: limit.rlim_cur, hard: limit.rlim_max })
}

/// Cancels `token` on the first SIGTERM or SIGINT. Must be called inside a tokio runtime;
/// the task lives as long as the process (abort the handle to stop listening). If the
/// handlers cannot be installed the error is logged and the token is never cancelled by a
/// signal.
pub fn spawn_signal_handler(token: CancellationToken) -> JoinHandle<()> {
    spawn_stop_handler(token, false)
}

/// Like [`spawn_signal_handler`]; with `hangup_stops`, SIGHUP stops the process too (an
/// interactive process whose terminal closed). Without it SIGHUP is left to the caller (the
/// hub reloads its configuration on it).
pub fn spawn_stop_handler(token: CancellationToken, hangup_stops: bool) -> JoinHandle<()> {
    // The handlers are installed here, before the task runs: a signal that arrives right after
    // this call returns stops the process gracefully instead of killing it.
    let (Ok(mut term), Ok(mut int)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        tracing::error!("cannot install signal handlers");
        return tokio::spawn(async {});
    };
    let mut hup = if hangup_stops {
        match signal(SignalKind::hangup()) {
            Ok(hup) => Some(hup),
            Err(err) => {
                tracing::error!(error = %err, "cannot install the SIGHUP handler");
                None
            }
        }
    } else {
        None
    };
    tokio::spawn(async move {
        let hangup = async {
            match hup.as_mut() {
                Some(hup) => hup.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::debug!("SIGTERM received"),
            _ = int.recv() => tracing::debug!("SIGINT received"),
            _ = hangup => tracing::debug!("SIGHUP received"),
        }
        token.cancel();
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_format_follows_the_variable_then_the_journal() {
        assert_eq!(choose_format(None, false), Ok(LogFormat::Human));
        assert_eq!(choose_format(None, true), Ok(LogFormat::Journald));
        assert_eq!(choose_format(Some(""), true), Ok(LogFormat::Journald));
        assert_eq!(choose_format(Some("json"), true), Ok(LogFormat::Json));
        assert_eq!(choose_format(Some("human"), true), Ok(LogFormat::Human));
        assert_eq!(choose_format(Some("journald"), false), Ok(LogFormat::Journald));
        assert_eq!(choose_format(Some("xml"), false), Err(LogFormat::Human));
    }

    #[test]
    fn the_soft_fd_limit_is_raised_to_the_hard_one() {
        let limit = raise_fd_limit().unwrap();
        assert_eq!(limit.now, limit.hard);
        assert!(limit.before <= limit.now);
        let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the struct we own.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
        assert_eq!(now.rlim_cur, limit.hard);
    }

    #[tokio::test]
    async fn a_signal_cancels_the_token() {
        let token = CancellationToken::new();
        let _handler = spawn_signal_handler(token.clone());
        // On this single-threaded runtime the yield lets the handler task run up to its
        // first await, by which point both listeners are installed (before that, SIGINT
        // would end the test process).
        tokio::task::yield_now().await;
        // SAFETY: raising a signal at our own process.
        unsafe { libc::raise(libc::SIGINT) };
        tokio::time::timeout(Duration::from_secs(10), token.cancelled())
            .await
            .expect("SIGINT did not cancel the token");
    }
}
