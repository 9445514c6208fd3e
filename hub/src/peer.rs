//! Who may connect to an instance socket: the connecting process's credentials
//! (`SO_PEERCRED`, plus its supplementary groups from `SO_PEERGROUPS`) checked against the
//! instance's policy before the hub reads a single frame.
//!
//! The default admits exactly whom the socket's mode 0660 already admits: the hub's own user,
//! root, and members of the socket's group (`channeld` under systemd, where drivers run as
//! dynamic users with `SupplementaryGroups=channeld`). `allow_uids` / `allow_gids` in an
//! instance's config replace the default with explicit lists.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// An instance's configured peer rule (from `allow_uids` / `allow_gids`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PeerRule {
    /// The hub's user, root, and members of the socket's group.
    #[default]
    SocketMode,
    /// Only these users, and members of these groups.
    Listed { uids: Vec<u32>, gids: Vec<u32> },
}

/// A rule resolved against the running hub: who it is and which group owns the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPolicy {
    pub rule: PeerRule,
    /// The hub's effective uid.
    pub hub_uid: u32,
    /// The group owning the socket file.
    pub socket_gid: u32,
}

/// The credentials of a connected process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCreds {
    pub uid: u32,
    /// Primary group.
    pub gid: u32,
    /// Supplementary groups; empty when the kernel could not say.
    pub groups: Vec<u32>,
    pub pid: Option<i32>,
}

impl PeerCreds {
    fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

impl PeerPolicy {
    /// Whether `peer` may use the socket.
    pub fn admits(&self, peer: &PeerCreds) -> bool {
        match &self.rule {
            PeerRule::SocketMode => {
                peer.uid == self.hub_uid || peer.uid == 0 || peer.in_group(self.socket_gid)
            }
            PeerRule::Listed { uids, gids } => {
                uids.contains(&peer.uid) || gids.iter().any(|&gid| peer.in_group(gid))
            }
        }
    }

    /// A short description for logs and errors, e.g. `uid 1000 or gid 998`.
    pub fn describe(&self) -> String {
        match &self.rule {
            PeerRule::SocketMode => {
                format!("uid {}, root, or members of gid {}", self.hub_uid, self.socket_gid)
            }
            PeerRule::Listed { uids, gids } => {
                let mut parts: Vec<String> = uids.iter().map(|u| format!("uid {u}")).collect();
                parts.extend(gids.iter().map(|g| format!("gid {g}")));
                parts.join(", ")
            }
        }
    }
}

/// The hub's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The hub's effective gid.
pub fn effective_gid() -> u32 {
    // SAFETY: getegid has no preconditions and cannot fail.
    unsafe { libc::getegid() }
}

/// `SO_PEERGROUPS` (Linux 4.13): not exported by every libc build, and the same on every
/// architecture except sparc.
#[cfg(all(target_os = "linux", not(target_arch = "sparc64")))]
const SO_PEERGROUPS: libc::c_int = 59;
#[cfg(all(target_os = "linux", target_arch = "sparc64"))]
const SO_PEERGROUPS: libc::c_int = 0x3d;

/// The supplementary groups of the process at the other end of a Unix socket.
#[cfg(target_os = "linux")]
pub fn peer_groups(fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    const GID: usize = std::mem::size_of::<libc::gid_t>();
    // The kernel caps supplementary groups at 65536 (NGROUPS_MAX).
    const MAX_GROUPS: usize = 65_536;
    let mut groups: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = (groups.len() * GID) as libc::socklen_t;
        // SAFETY: the buffer is valid for `len` bytes and `len` is passed by pointer, as
        // getsockopt requires; the fd is borrowed for the call's duration.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if rc == 0 {
            groups.truncate(len as usize / GID);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        let needed = len as usize / GID;
        if err.raw_os_error() == Some(libc::ERANGE) && needed > groups.len() && needed <= MAX_GROUPS
        {
            groups.resize(needed, 0);
            continue;
        }
        return Err(err);
    }
}

#[cfg(not(target_os = "linux"))]
pub fn peer_groups(_fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "SO_PEERGROUPS is Linux-only"))
}

/// Resolves a user name to its uid (`Ok(None)`: no such user).
pub fn lookup_user(name: &str) -> io::Result<Option<u32>> {
    let name = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: passwd is plain old data, so all-zero is a valid value.
        let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` outlives the use of `entry`.
        let rc = unsafe {
            libc::getpwnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found)
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(entry.pw_uid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            libc::ENOENT | libc::ESRCH => return Ok(None),
            errno => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Resolves a group name to its gid (`Ok(None)`: no such group).
pub fn lookup_group(name: &str) -> io::Result<Option<u32>> {
    let name = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: group is plain old data, so all-zero is a valid value.
        let mut entry: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` outlives the use of `entry`.
        let rc = unsafe {
            libc::getgrnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found)
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(entry.gr_gid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            libc::ENOENT | libc::ESRCH => return Ok(None),
            errno => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> PeerCreds {
        PeerCreds { uid, gid, groups: groups.to_vec(), pid: Some(42) }
    }

    fn socket_mode() -> PeerPolicy {
        PeerPolicy { rule: PeerRule::SocketMode, hub_uid: 990, socket_gid: 990 }
    }

    #[test]
    fn default_admits_the_hub_user_root_and_the_socket_group() {
        let policy = socket_mode();
        assert!(policy.admits(&peer(990, 990, &[])), "the hub's own user");
        assert!(policy.admits(&peer(0, 0, &[])), "root");
        assert!(policy.admits(&peer(61_234, 61_234, &[990])), "a dynamic user in the group");
        assert!(policy.admits(&peer(1000, 990, &[])), "primary group");
        assert!(!policy.admits(&peer(1000, 1000, &[27, 100])), "a stranger");
    }

    #[test]
    fn explicit_lists_replace_the_default() {
        let policy = PeerPolicy {
            rule: PeerRule::Listed { uids: vec![12_345], gids: vec![4242] },
            hub_uid: 990,
            socket_gid: 990,
        };
        assert!(policy.admits(&peer(12_345, 1, &[])));
        assert!(policy.admits(&peer(7, 7, &[4242])));
        assert!(policy.admits(&peer(7, 4242, &[])));
        assert!(!policy.admits(&peer(990, 990, &[990])), "not even the hub's own user");
        assert!(!policy.admits(&peer(0, 0, &[])), "nor root");
        assert_eq!(policy.describe(), "uid 12345, gid 4242");
    }

    #[test]
    fn our_own_connection_reports_our_credentials_and_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let groups = peer_groups(std::os::fd::AsFd::as_fd(&a)).unwrap();
        // The peer is this process: its groups are ours.
        let mut ours = vec![0 as libc::gid_t; 65_536];
        // SAFETY: the buffer holds as many entries as passed.
        let n = unsafe { libc::getgroups(ours.len() as libc::c_int, ours.as_mut_ptr()) };
        assert!(n >= 0);
        ours.truncate(n as usize);
        let mut got = groups.clone();
        got.sort_unstable();
        ours.sort_unstable();
        ours.dedup();
        got.dedup();
        assert_eq!(got, ours);
    }

    #[test]
    fn names_resolve_and_unknown_names_are_none() {
        assert_eq!(lookup_user("root").unwrap(), Some(0));
        assert_eq!(lookup_group("root").unwrap(), Some(0));
        assert_eq!(lookup_user("no-such-user-channeld-test").unwrap(), None);
        assert_eq!(lookup_group("no-such-group-channeld-test").unwrap(), None);
    }
}
