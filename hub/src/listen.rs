//! Binding the sockets before the hub runs (bind outside, run inside): one per instance,
//! the control socket and, when configured, the metrics listener; Unix sockets mode 0660,
//! stale files of a dead hub removed, and removed again at shutdown.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use channeld_protocol::ChannelId;
use tokio::net::UnixListener;

use crate::config::{HubConfig, MetricsListen};

/// Why the hub could not start.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot bind {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("another hub is already listening on {0}")]
    InUse(PathBuf),
}

/// Sockets bound before the hub runs (bind outside, run inside).
#[derive(Debug)]
pub struct Listeners {
    pub control: UnixListener,
    pub instances: Vec<(ChannelId, UnixListener)>,
    /// Where `/metrics` is served (`hub.metrics_listen`), when configured.
    pub metrics: Option<MetricsListener>,
}

/// The bound `/metrics` listener.
#[derive(Debug)]
pub enum MetricsListener {
    Tcp(tokio::net::TcpListener),
    Unix(UnixListener),
}

impl MetricsListener {
    /// The address clients scrape (the bound port when the configuration said port 0).
    pub fn describe(&self) -> String {
        match self {
            MetricsListener::Tcp(listener) => {
                listener.local_addr().map_or_else(|_| "tcp".to_owned(), |addr| addr.to_string())
            }
            MetricsListener::Unix(listener) => listener
                .local_addr()
                .ok()
                .and_then(|addr| addr.as_pathname().map(|p| p.display().to_string()))
                .unwrap_or_else(|| "unix".to_owned()),
        }
    }
}

/// Binds the control socket, one socket per instance (mode 0660) and the metrics listener,
/// removing stale socket files left by a hub that died. Fails if another hub is listening on
/// any of them.
///
/// The control socket is bound last, so a client that can connect to it knows every instance
/// socket is there too.
pub fn bind(config: &HubConfig) -> Result<Listeners, HubError> {
    let mut paths = Vec::new();
    let mut instances = Vec::new();
    for instance in &config.instances {
        let listener = match bind_one(&instance.socket) {
            Ok(listener) => listener,
            Err(err) => {
                remove_sockets(&paths);
                return Err(err);
            }
        };
        paths.push(instance.socket.clone());
        instances.push((instance.id.clone(), listener));
    }
    let metrics = match config.metrics_listen.as_ref().map(bind_metrics).transpose() {
        Ok(metrics) => metrics,
        Err(err) => {
            remove_sockets(&paths);
            return Err(err);
        }
    };
    if let Some(MetricsListen::Unix(path)) = &config.metrics_listen {
        paths.push(path.clone());
    }
    let control = match bind_one(&config.control_socket) {
        Ok(control) => control,
        Err(err) => {
            remove_sockets(&paths);
            return Err(err);
        }
    };
    Ok(Listeners { control, instances, metrics })
}

fn bind_metrics(listen: &MetricsListen) -> Result<MetricsListener, HubError> {
    match listen {
        MetricsListen::Unix(path) => bind_one(path).map(MetricsListener::Unix),
        MetricsListen::Tcp(addr) => {
            let bind_err = |source: io::Error| match source.kind() {
                io::ErrorKind::AddrInUse => HubError::InUse(PathBuf::from(addr.to_string())),
                _ => HubError::Bind { path: PathBuf::from(addr.to_string()), source },
            };
            let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
            listener.set_nonblocking(true).map_err(bind_err)?;
            tokio::net::TcpListener::from_std(listener).map(MetricsListener::Tcp).map_err(bind_err)
        }
    }
}

/// Binds the socket of an instance a reload added (mode 0660, a stale file removed).
pub(crate) fn bind_instance(path: &Path) -> Result<UnixListener, HubError> {
    bind_one(path)
}

fn bind_one(path: &Path) -> Result<UnixListener, HubError> {
    let bind_err = |source| HubError::Bind { path: path.to_owned(), source };
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(bind_err)?;
    }
    if path.exists() {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(HubError::InUse(path.to_owned())),
            Err(_) => std::fs::remove_file(path).map_err(bind_err)?,
        }
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
    Ok(listener)
}

/// Removes the socket files (the hub's last step of a shutdown).
pub(crate) fn remove_sockets(paths: &[PathBuf]) {
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}
