//! The bot token and base URL in use, and what happens when the server says `-14`.
//!
//! Tokens come, in this order, from the credential file (`wechat-bot-token`), from
//! `CHANNELD_WECHAT_BOT_TOKEN`, and from the login stored by `channeld-wechat login`; the first
//! one the server has not refused wins. The base URL a login stored wins over the setting.
//!
//! After `-14` the token is marked refused and polling waits — no loop against the server —
//! until a token that was not refused appears (the credential file changed, `login` ran), an
//! operator asks to `resume`, or the auth retry delay passes (the official client pauses an
//! hour, then tries again).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use channeld_driver_sdk::{CancellationToken, Secret};
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, watch};

use crate::config::{CREDENTIAL_BOT_TOKEN, WechatConfig};
use crate::state::StateDir;

/// How often the token sources are read again while waiting for a new token.
pub const TOKEN_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Where the token in use came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    Credential,
    Environment,
    Login,
}

impl TokenSource {
    pub fn describe(self) -> &'static str {
        match self {
            TokenSource::Credential => "the wechat-bot-token credential",
            TokenSource::Environment => "CHANNELD_WECHAT_BOT_TOKEN",
            TokenSource::Login => "the stored login",
        }
    }
}

/// A token to use and where to use it.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub token: Secret,
    pub source: TokenSource,
    pub base_url: String,
}

/// Whether the driver can call the bot API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    Usable,
    /// The server refused every token available (`-14`).
    Expired {
        source: TokenSource,
    },
    /// No source holds a token.
    Missing,
    /// A source could not be read (reason without the secret).
    Unreadable(String),
}

#[derive(Debug)]
struct Inner {
    current: Option<Credentials>,
    /// SHA-256 digests of tokens the server refused.
    refused: HashSet<[u8; 32]>,
    refused_at: Option<Instant>,
    auth: Auth,
}

/// The token state shared by the poll loop, posts and typing.
#[derive(Debug)]
pub struct Session {
    config: Arc<WechatConfig>,
    state: StateDir,
    inner: Mutex<Inner>,
    resume: Notify,
    auth_tx: watch::Sender<Auth>,
}

fn digest(token: &Secret) -> [u8; 32] {
    Sha256::digest(token.expose().as_bytes()).into()
}

impl Session {
    /// Reads the token sources once.
    pub fn new(config: Arc<WechatConfig>, state: StateDir) -> Self {
        let (auth_tx, _) = watch::channel(Auth::Missing);
        let session = Self {
            config,
            state,
            inner: Mutex::new(Inner {
                current: None,
                refused: HashSet::new(),
                refused_at: None,
                auth: Auth::Missing,
            }),
            resume: Notify::new(),
            auth_tx,
        };
        session.refresh();
        session
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The credentials to use now; `None` while no usable token exists.
    pub fn current(&self) -> Option<Credentials> {
        self.lock().current.clone()
    }

    pub fn auth(&self) -> Auth {
        self.lock().auth.clone()
    }

    /// Changes of [`Session::auth`].
    pub fn watch_auth(&self) -> watch::Receiver<Auth> {
        self.auth_tx.subscribe()
    }

    /// The server refused `token` with `-14`. Returns whether this changed anything (a post
    /// and the poll may both report the same token).
    pub fn expired(&self, token: &Secret) -> bool {
        let auth = {
            let mut inner = self.lock();
            if !inner.refused.insert(digest(token)) {
                return false;
            }
            inner.refused_at = Some(Instant::now());
            let source = inner.current.as_ref().map_or(TokenSource::Credential, |c| c.source);
            inner.current = None;
            inner.auth = Auth::Expired { source };
            inner.auth.clone()
        };
        self.auth_tx.send_replace(auth);
        self.refresh();
        true
    }

    /// An operator asked to try again: refused tokens get another chance now.
    pub fn resume(&self) {
        {
            let mut inner = self.lock();
            inner.refused.clear();
            inner.refused_at = None;
        }
        self.refresh();
        self.resume.notify_waiters();
    }

    /// Waits until a usable token exists; `None` when `shutdown` fires first.
    pub async fn usable(&self, shutdown: &CancellationToken) -> Option<Credentials> {
        loop {
            if let Some(credentials) = self.current() {
                return Some(credentials);
            }
            let retry_in = {
                let inner = self.lock();
                match (self.config.auth_retry, inner.refused_at) {
                    (Some(delay), Some(at)) => Some(delay.saturating_sub(at.elapsed())),
                    _ => None,
                }
            };
            if retry_in.is_some_and(|left| left.is_zero()) {
                // The pause is over: the same token may work again (the official client's
                // hourly retry); a new `-14` pauses again.
                let mut inner = self.lock();
                inner.refused.clear();
                inner.refused_at = None;
            }
            let wait = retry_in.map_or(TOKEN_WATCH_INTERVAL, |left| left.min(TOKEN_WATCH_INTERVAL));
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = self.resume.notified() => {}
                () = tokio::time::sleep(wait.max(Duration::from_millis(10))) => {}
            }
            self.refresh();
        }
    }

    /// Reads the sources and takes the first token the server has not refused.
    fn refresh(&self) {
        let candidates = self.candidates();
        let auth = {
            let mut inner = self.lock();
            let (found, unreadable) = match candidates {
                Ok(found) => (found, None),
                Err(reason) => (Vec::new(), Some(reason)),
            };
            let any = !found.is_empty();
            let usable = found.into_iter().find(|c| !inner.refused.contains(&digest(&c.token)));
            inner.auth = match (&usable, unreadable) {
                (Some(_), _) => Auth::Usable,
                (None, Some(reason)) => Auth::Unreadable(reason),
                (None, None) if any || inner.refused_at.is_some() => match &inner.auth {
                    Auth::Expired { source } => Auth::Expired { source: *source },
                    _ => Auth::Expired { source: TokenSource::Credential },
                },
                (None, None) => Auth::Missing,
            };
            inner.current = usable;
            inner.auth.clone()
        };
        self.auth_tx.send_if_modified(|old| {
            let changed = *old != auth;
            *old = auth;
            changed
        });
    }

    /// Every token available now, in order of precedence.
    fn candidates(&self) -> Result<Vec<Credentials>, String> {
        let login = self.state.load_login().map_err(|err| err.to_string())?;
        let base_url = login
            .as_ref()
            .and_then(|l| l.base_url.clone())
            .unwrap_or_else(|| self.config.base_url.clone());
        let mut found = Vec::new();
        if let Some(dir) = &self.config.credentials_dir {
            let file = Secret::from_credential_file(dir, CREDENTIAL_BOT_TOKEN)
                .map_err(|err| err.to_string())?;
            if let Some(token) = file {
                found.push(Credentials {
                    token,
                    source: TokenSource::Credential,
                    base_url: base_url.clone(),
                });
            }
        }
        if let Some(token) = &self.config.env_token {
            found.push(Credentials {
                token: token.clone(),
                source: TokenSource::Environment,
                base_url: base_url.clone(),
            });
        }
        if let Some(login) = login.filter(|l| !l.bot_token.is_empty()) {
            found.push(Credentials {
                token: Secret::new(login.bot_token),
                source: TokenSource::Login,
                base_url,
            });
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::DriverLaunchConfig;
    use channeld_driver_sdk::protocol::ChannelId;

    use super::*;
    use crate::state::StoredLogin;

    struct Setup {
        _dirs: (tempfile::TempDir, tempfile::TempDir),
        creds: std::path::PathBuf,
        state: StateDir,
        config: Arc<WechatConfig>,
    }

    fn setup(env_token: Option<&str>, auth_retry: &str) -> Setup {
        let creds = tempfile::tempdir().unwrap();
        let state_dir = tempfile::tempdir().unwrap();
        let mut vars = vec![
            ("CHANNELD_CHANNEL_ID".to_owned(), "wechat.lab".to_owned()),
            ("CHANNELD_SOCKET".to_owned(), "/tmp/wechat-test.sock".to_owned()),
            ("CREDENTIALS_DIRECTORY".to_owned(), creds.path().display().to_string()),
            ("CHANNELD_WECHAT_AUTH_RETRY_SECONDS".to_owned(), auth_retry.to_owned()),
            ("CHANNELD_WECHAT_BASE_URL".to_owned(), "http://127.0.0.1:1".to_owned()),
        ];
        if let Some(token) = env_token {
            vars.push(("CHANNELD_WECHAT_BOT_TOKEN".to_owned(), token.to_owned()));
        }
        let launch = DriverLaunchConfig::from_vars(vars).unwrap();
        assert_eq!(launch.channel, ChannelId::new("wechat.lab").unwrap());
        let config = WechatConfig::from_launch(&launch, Some(state_dir.path())).unwrap();
        Setup {
            creds: creds.path().to_owned(),
            state: StateDir::open(state_dir.path()).unwrap(),
            config: Arc::new(config),
            _dirs: (creds, state_dir),
        }
    }

    fn login(state: &StateDir, token: &str, base_url: Option<&str>) {
        state
            .save_login(&StoredLogin {
                bot_token: token.into(),
                bot_id: "b".into(),
                user_id: None,
                base_url: base_url.map(str::to_owned),
                saved_at_ms: 0,
                previous_tokens: Vec::new(),
            })
            .unwrap();
    }

    #[test]
    fn the_credential_wins_then_the_environment_then_the_login() {
        let setup = setup(Some("env-token"), "0");
        login(&setup.state, "login-token", Some("https://idc.example"));
        std::fs::write(setup.creds.join(CREDENTIAL_BOT_TOKEN), "file-token\n").unwrap();
        let session = Session::new(setup.config.clone(), setup.state.clone());
        let current = session.current().unwrap();
        assert_eq!(
            (current.token.as_str(), current.source),
            ("file-token", TokenSource::Credential)
        );
        assert_eq!(current.base_url, "https://idc.example", "the login's base URL wins");

        assert!(session.expired(&current.token));
        assert!(!session.expired(&current.token), "reported once");
        let next = session.current().unwrap();
        assert_eq!(next.source, TokenSource::Environment);
        session.expired(&next.token);
        assert_eq!(session.current().unwrap().source, TokenSource::Login);
        session.expired(&session.current().unwrap().token);
        assert!(session.current().is_none());
        assert_eq!(session.auth(), Auth::Expired { source: TokenSource::Login });
    }

    #[test]
    fn without_any_token_the_session_says_so() {
        let setup = setup(None, "0");
        let session = Session::new(setup.config.clone(), setup.state.clone());
        assert_eq!(session.auth(), Auth::Missing);
        assert!(session.current().is_none());
    }

    #[tokio::test]
    async fn after_minus_14_a_new_login_or_a_resume_ends_the_wait() {
        let setup = setup(None, "0");
        login(&setup.state, "old", None);
        let session = Arc::new(Session::new(setup.config.clone(), setup.state.clone()));
        let old = session.current().unwrap();
        assert_eq!(old.base_url, "http://127.0.0.1:1");
        session.expired(&old.token);
        let shutdown = CancellationToken::new();
        let waiting = tokio::spawn({
            let session = session.clone();
            let shutdown = shutdown.clone();
            async move { session.usable(&shutdown).await.map(|c| c.token.expose().to_owned()) }
        });
        login(&setup.state, "new", None);
        assert_eq!(waiting.await.unwrap().as_deref(), Some("new"));

        session.expired(&session.current().unwrap().token);
        let waiting = tokio::spawn({
            let session = session.clone();
            let shutdown = shutdown.clone();
            async move { session.usable(&shutdown).await.map(|c| c.token.expose().to_owned()) }
        });
        tokio::task::yield_now().await;
        session.resume();
        assert_eq!(waiting.await.unwrap().as_deref(), Some("new"), "resume retries the token");

        session.expired(&session.current().unwrap().token);
        shutdown.cancel();
        assert!(session.usable(&shutdown).await.is_none());
    }

    #[tokio::test]
    async fn the_same_token_is_tried_again_after_the_auth_retry_delay() {
        let setup = setup(Some("only"), "0.2");
        let session = Session::new(setup.config.clone(), setup.state.clone());
        session.expired(&session.current().unwrap().token);
        let started = Instant::now();
        let again = session.usable(&CancellationToken::new()).await.unwrap();
        assert_eq!(again.token.expose(), "only");
        assert!(started.elapsed() >= Duration::from_millis(150));
    }
}
