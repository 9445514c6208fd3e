//! Who may connect to a socket (an instance socket or the control socket): the connecting
//! process's credentials (`SO_PEERCRED`, plus its supplementary groups from `SO_PEERGROUPS`)
//! checked against the socket's policy before the hub reads a single byte.
//!
//! The default admits exactly whom the socket's mode 0660 already admits: the hub's own user,
//! root, and members of the socket's group (`channeld` under systemd, where drivers run as
//! dynamic users with `SupplementaryGroups=channeld`). `allow_uids` / `allow_gids` in an
//! instance's config (`control_allow_uids` / `control_allow_gids` in `[hub]`) replace the
//! default with explicit lists.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use serde::Deserialize;
use tokio::net::UnixStream;
use tracing::debug;

/// A user or group in `allow_uids` / `allow_gids`: a number or a name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Principal {
    Id(u32),
    Name(String),
}

/// Why configured peer lists are unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerListError {
    /// The error is about the group list (else the user list).
    pub in_gids: bool,
    pub message: String,
}

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

impl PeerRule {
    /// The rule for configured lists: none, the socket's mode; otherwise only the listed
    /// users and members of the listed groups. Names are resolved now.
    pub fn from_lists(
        uids: Option<Vec<Principal>>,
        gids: Option<Vec<Principal>>,
    ) -> Result<Self, PeerListError> {
        if uids.is_none() && gids.is_none() {
            return Ok(PeerRule::SocketMode);
        }
        let uids = resolve(uids.unwrap_or_default(), "user", |name| {
            uzers::get_user_by_name(name).map(|user| user.uid())
        })
        .map_err(|message| PeerListError { in_gids: false, message })?;
        let gids = resolve(gids.unwrap_or_default(), "group", |name| {
            uzers::get_group_by_name(name).map(|group| group.gid())
        })
        .map_err(|message| PeerListError { in_gids: true, message })?;
        if uids.is_empty() && gids.is_empty() {
            return Err(PeerListError {
                in_gids: false,
                message: "empty lists would refuse every peer; remove both lists to admit whom \
                          the socket's mode admits"
                    .into(),
            });
        }
        Ok(PeerRule::Listed { uids, gids })
    }
}

fn resolve(
    list: Vec<Principal>,
    what: &str,
    lookup: impl Fn(&str) -> Option<u32>,
) -> Result<Vec<u32>, String> {
    list.into_iter()
        .map(|principal| match principal {
            Principal::Id(id) => Ok(id),
            Principal::Name(name) => {
                lookup(&name).ok_or_else(|| format!("no {what} named {name:?}"))
            }
        })
        .collect()
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

impl PeerPolicy {
    /// `rule` resolved against this hub: its effective uid, and the group owning the socket
    /// file at `socket` (the hub's effective gid if the file cannot be read).
    pub fn for_socket(rule: PeerRule, socket: &Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let socket_gid = std::fs::metadata(socket)
            .map_or_else(|_| uzers::get_effective_gid(), |meta| meta.gid());
        PeerPolicy { rule, hub_uid: uzers::get_effective_uid(), socket_gid }
    }
}

/// The connecting process's credentials, or `None` when the kernel cannot say.
pub fn peer_creds(stream: &UnixStream) -> Option<PeerCreds> {
    let cred = stream.peer_cred().ok()?;
    let groups = peer_groups(std::os::fd::AsFd::as_fd(stream)).unwrap_or_else(|err| {
        debug!(error = %err, "supplementary groups of the peer unknown; checking its primary group only");
        Vec::new()
    });
    Some(PeerCreds { uid: cred.uid(), gid: cred.gid(), groups, pid: cred.pid() })
}

/// Who a refused peer is, for logs and its error message.
pub fn describe_peer(creds: Option<&PeerCreds>) -> String {
    match creds {
        Some(cred) => format!("uid {} gid {}", cred.uid, cred.gid),
        None => "a peer with unknown credentials".to_owned(),
    }
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
    fn names_resolve_and_unknown_names_are_errors_naming_the_list() {
        let rule = PeerRule::from_lists(
            Some(vec![Principal::Id(12_345), Principal::Name("root".into())]),
            Some(vec![Principal::Name("root".into())]),
        );
        assert_eq!(rule, Ok(PeerRule::Listed { uids: vec![12_345, 0], gids: vec![0] }));
        assert_eq!(PeerRule::from_lists(None, None), Ok(PeerRule::SocketMode));
        let err = PeerRule::from_lists(None, Some(vec![Principal::Name("no-such-group-x".into())]))
            .unwrap_err();
        assert!(err.in_gids);
        assert_eq!(err.message, "no group named \"no-such-group-x\"");
        let err = PeerRule::from_lists(Some(vec![Principal::Name("no-such-user-x".into())]), None)
            .unwrap_err();
        assert!(!err.in_gids);
        let err = PeerRule::from_lists(Some(vec![]), None).unwrap_err();
        assert!(err.message.starts_with("empty lists"), "{}", err.message);
    }
}
