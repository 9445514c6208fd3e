//! systemd's service notification protocol (`sd_notify`), without a library: one datagram
//! per state change to the socket named by `$NOTIFY_SOCKET`, and the watchdog interval from
//! `$WATCHDOG_USEC`.
//!
//! The hub says `READY=1` once every socket is bound and served, `WATCHDOG=1` at half the
//! watchdog interval while it runs, and `STOPPING=1` when it starts shutting down. Outside
//! systemd (`$NOTIFY_SOCKET` unset) every call is a no-op.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// The variable naming the notification socket.
pub const ENV_NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// The watchdog interval in microseconds, set by `WatchdogSec=`.
pub const ENV_WATCHDOG_USEC: &str = "WATCHDOG_USEC";
/// The PID the watchdog interval is meant for (unset: this process).
pub const ENV_WATCHDOG_PID: &str = "WATCHDOG_PID";

/// A connection to systemd's notification socket.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notifier named by `$NOTIFY_SOCKET`: `None` when the variable is unset or empty
    /// (not started by systemd with `Type=notify`), an error when it names no usable socket.
    pub fn from_env() -> Option<io::Result<Self>> {
        let path = std::env::var_os(ENV_NOTIFY_SOCKET).filter(|p| !p.is_empty())?;
        Some(Self::new(&path))
    }

    /// A notifier for a socket path; a leading `@` names an abstract socket. Sends never
    /// block: a full socket buffer is an error, not a stalled hub.
    pub fn new(path: &OsStr) -> io::Result<Self> {
        let addr = notify_addr(path)?;
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        Ok(Self { socket, addr })
    }

    /// Sends one notification, e.g. `"READY=1\nSTATUS=serving"`.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let sent = self.socket.send_to_addr(state.as_bytes(), &self.addr)?;
        if sent != state.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "notification truncated"));
        }
        Ok(())
    }
}

fn notify_addr(path: &OsStr) -> io::Result<SocketAddr> {
    match path.as_bytes() {
        [b'@', name @ ..] => abstract_addr(name),
        [b'/', ..] => SocketAddr::from_pathname(path),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{ENV_NOTIFY_SOCKET} must be an absolute path or start with @, not {:?}",
                OsString::from(path)
            ),
        )),
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn abstract_addr(name: &[u8]) -> io::Result<SocketAddr> {
    #[cfg(target_os = "android")]
    use std::os::android::net::SocketAddrExt;
    #[cfg(target_os = "linux")]
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn abstract_addr(_name: &[u8]) -> io::Result<SocketAddr> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "abstract sockets exist only on Linux"))
}

/// How often to send `WATCHDOG=1`: half of `$WATCHDOG_USEC`, when the watchdog is on for this
/// process.
pub fn watchdog_interval_from_env() -> Option<Duration> {
    watchdog_interval(
        std::env::var(ENV_WATCHDOG_USEC).ok().as_deref(),
        std::env::var(ENV_WATCHDOG_PID).ok().as_deref(),
        std::process::id(),
    )
}

/// Half the watchdog interval `usec`, unless `pid` names another process (a child that
/// inherited the variables) or the values do not parse.
pub fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    if let Some(pid) = pid.filter(|p| !p.is_empty())
        && pid.trim().parse::<u32>().ok() != Some(own_pid)
    {
        return None;
    }
    let usec: u64 = usec?.trim().parse().ok().filter(|&u| u > 0)?;
    Some(Duration::from_micros(usec / 2).max(Duration::from_millis(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8(buf[..n].to_vec()).expect("utf-8")
    }

    #[test]
    fn notifications_reach_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).unwrap();
        systemd.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let notifier = Notifier::new(path.as_os_str()).unwrap();
        notifier.notify("READY=1\nSTATUS=serving 2 instances").unwrap();
        notifier.notify("WATCHDOG=1").unwrap();
        notifier.notify("STOPPING=1").unwrap();
        assert_eq!(receive(&systemd), "READY=1\nSTATUS=serving 2 instances");
        assert_eq!(receive(&systemd), "WATCHDOG=1");
        assert_eq!(receive(&systemd), "STOPPING=1");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn notifications_reach_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("channeld-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let systemd = UnixDatagram::bind_addr(&addr).unwrap();
        systemd.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let notifier = Notifier::new(OsStr::new(&format!("@{name}"))).unwrap();
        notifier.notify("READY=1").unwrap();
        assert_eq!(receive(&systemd), "READY=1");
    }

    #[test]
    fn a_relative_socket_name_is_refused_and_a_missing_socket_fails_to_send() {
        let err = Notifier::new(OsStr::new("notify.sock")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let dir = tempfile::tempdir().unwrap();
        let notifier = Notifier::new(dir.path().join("gone.sock").as_os_str()).unwrap();
        assert!(notifier.notify("READY=1").is_err());
    }

    #[test]
    fn watchdog_pings_at_half_the_interval_for_this_process_only() {
        assert_eq!(watchdog_interval(Some("30000000"), None, 7), Some(Duration::from_secs(15)));
        assert_eq!(
            watchdog_interval(Some("30000000"), Some("7"), 7),
            Some(Duration::from_secs(15))
        );
        assert_eq!(watchdog_interval(Some("30000000"), Some("8"), 7), None);
        assert_eq!(watchdog_interval(Some("0"), None, 7), None);
        assert_eq!(watchdog_interval(Some("soon"), None, 7), None);
        assert_eq!(watchdog_interval(None, Some("7"), 7), None);
    }
}
