//! Protocol-faithful fake platform servers for the platforms that have no local server: each
//! binds 127.0.0.1:0, speaks the platform's real wire format, records everything it sees and
//! is steered through a handle.

use std::time::Duration;

use tokio::sync::watch;

pub mod bcn;
pub mod slack;
pub mod wechat;
pub mod wecom;

/// Waits until `check` finds something in a fake's state, looking again on every change
/// `version` announces; panics after `within` naming the fake, `what` it waited for and the
/// state's `summary`.
pub async fn wait_until<T>(
    fake: &str,
    what: &str,
    within: Duration,
    mut version: watch::Receiver<u64>,
    mut check: impl FnMut() -> Option<T>,
    summary: impl FnOnce() -> String,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        version.borrow_and_update();
        if let Some(found) = check() {
            return found;
        }
        match tokio::time::timeout_at(deadline, version.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("the fake {fake} stopped while waiting for {what}"),
            Err(_) => panic!("the fake {fake} did not see {what} within {within:?}\n{}", summary()),
        }
    }
}
