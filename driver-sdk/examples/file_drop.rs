//! A complete channeld driver: a drop directory. Each `*.txt` file that appears in
//! `CHANNELD_FILE_DROP_INBOX` is a message from `CHANNELD_FILE_DROP_SENDER`; the file is
//! removed once the hub has the message, and each reply is written to
//! `CHANNELD_FILE_DROP_OUTBOX` as a file of its own. A file must appear whole: write it under
//! another name (`m-1.tmp`) and rename it to `*.txt`, as mail drops do, or a poll may read it
//! half-written. The conformance suite at the end tests it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::{Capabilities, DeliveryReceipt};
use channeld_driver_sdk::{
    Acceptance, CancellationToken, Declaration, Driver, DriverError, DriverLaunchConfig, Hub,
    HubError, Inbound, LinkState, PendingAcks, Post, PostError, Settle, tokio, tracing,
};

struct FileDrop {
    inbox: PathBuf,
    outbox: PathBuf,
    sender: String,
    poll: Duration,
    posted: AtomicU64,
}

impl FileDrop {
    /// Reads the settings; `?` turns a missing or invalid one into exit status 78.
    fn from_launch(launch: &DriverLaunchConfig) -> Result<Self, DriverError> {
        Ok(Self {
            inbox: launch.require("FILE_DROP_INBOX")?,
            outbox: launch.require("FILE_DROP_OUTBOX")?,
            sender: launch.parse_or("FILE_DROP_SENDER", "file-drop".to_owned())?,
            poll: launch.parse_or("FILE_DROP_POLL_SECONDS", Duration::from_secs(1))?,
            posted: AtomicU64::new(0),
        })
    }

    /// The files waiting in the inbox, oldest name first.
    fn waiting(&self) -> Result<Vec<PathBuf>, DriverError> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&self.inbox)? {
            let path = entry?.path();
            if path.extension().is_some_and(|ext| ext == "txt") {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    /// A file as a message; its name is the message id, so a file reported again after a
    /// restart is recognised by the hub instead of running twice.
    fn message(&self, path: &Path) -> Result<Inbound, DriverError> {
        let text = std::fs::read_to_string(path)?;
        let id = path.file_stem().map(|stem| stem.to_string_lossy().into_owned());
        let id = id.ok_or_else(|| DriverError::platform("a file without a name"))?;
        Ok(Inbound::text("drop", self.sender.as_str(), text.trim_end()).id(id))
    }
}

/// The platform's acknowledgement: the file is removed once the hub has the message (or
/// refused it for good). Without an answer it stays, and is reported again next time.
struct RemoveFile(PathBuf);

impl Settle for RemoveFile {
    async fn settle(self, outcome: &Acceptance) {
        if !matches!(outcome, Acceptance::Unresolved)
            && let Err(err) = std::fs::remove_file(&self.0)
        {
            tracing::warn!(file = %self.0.display(), error = %err, "cannot remove a reported file");
        }
    }
}

impl Driver for FileDrop {
    fn declaration(&self) -> Declaration {
        Declaration::new(Capabilities { receive: true, send: true, ..Default::default() })
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        std::fs::create_dir_all(&self.outbox)?;
        hub.link_state(LinkState::up_as(format!("watching {}", self.inbox.display())));
        let acks = PendingAcks::new();
        let mut reported = HashSet::new();
        'input: loop {
            let waiting = self.waiting()?;
            reported.retain(|path| waiting.contains(path));
            for path in waiting {
                if reported.contains(&path) {
                    continue;
                }
                let message = match self.message(&path) {
                    Ok(message) => message,
                    Err(err) => {
                        tracing::warn!(file = %path.display(), error = %err, "skipped");
                        continue;
                    }
                };
                match hub.inbound(message).await {
                    Ok(ticket) => acks.track(ticket, RemoveFile(path.clone())),
                    Err(HubError::ShuttingDown) => break 'input,
                    Err(err) => {
                        // Empty, too large: it can never be delivered as it is.
                        tracing::warn!(file = %path.display(), error = %err, "dropped");
                        let refused = Acceptance::Rejected {
                            code: "invalid".into(),
                            message: err.to_string(),
                        };
                        acks.settle_now(RemoveFile(path.clone()), refused);
                    }
                }
                reported.insert(path);
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(self.poll) => {}
            }
        }
        acks.drain(hub.launch().drain_timeout / 2).await;
        Ok(())
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        // A new id for each post (the SDK answers a redelivered request itself).
        let n = self.posted.fetch_add(1, Ordering::Relaxed) + 1;
        let message_id = Id::new(format!("out-{}-{n}", std::process::id()))
            .map_err(|err| PostError::failed(err.to_string(), false))?;
        let file = self.outbox.join(format!("{message_id}.txt"));
        std::fs::write(&file, post.message.body.text_str())
            .map_err(|err| PostError::failed(format!("cannot write the reply: {err}"), false))?;
        let target = post.message.target;
        Ok(DeliveryReceipt {
            channel: target.channel.clone(),
            message_id,
            target,
            timestamp_ms: None,
        })
    }
}

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move { FileDrop::from_launch(&launch) })
}

#[cfg(test)]
mod tests {
    use channeld_driver_sdk::protocol::ChannelId;
    use channeld_driver_sdk::protocol::types::MessageTarget;
    use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask, TempDir, temp_dir};

    use super::*;

    /// The driver in-process, on a temp inbox and outbox.
    struct Harness {
        dir: TempDir,
        task: Option<DriverTask>,
        injected: usize,
    }

    impl ConformanceHarness for Harness {
        async fn start(&mut self, launch: DriverLaunchConfig) {
            let launch = launch
                .with_var("FILE_DROP_INBOX", self.dir.path().join("in").display().to_string())
                .with_var("FILE_DROP_OUTBOX", self.dir.path().join("out").display().to_string())
                .with_var("FILE_DROP_POLL_SECONDS", "0.05");
            std::fs::create_dir_all(self.dir.path().join("in")).unwrap();
            let driver = FileDrop::from_launch(&launch).unwrap();
            self.task = Some(DriverTask::spawn(driver, launch));
        }

        async fn inject_inbound(&mut self, text: &str) {
            self.injected += 1;
            // Written aside and renamed in, so a poll never sees it half-written.
            let inbox = self.dir.path().join("in");
            let partial = inbox.join(format!("m-{}.tmp", self.injected));
            std::fs::write(&partial, text).unwrap();
            std::fs::rename(partial, inbox.join(format!("m-{}.txt", self.injected))).unwrap();
        }

        fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
            MessageTarget::new(channel.clone(), Id::new("drop").unwrap())
        }

        async fn stop(&mut self) -> bool {
            self.task.take().unwrap().stop().await.is_ok()
        }

        fn platform_posts(&self) -> usize {
            std::fs::read_dir(self.dir.path().join("out")).map_or(0, |dir| dir.count())
        }
    }

    channeld_driver_sdk::conformance_suite!(Harness {
        dir: temp_dir("file-drop"),
        task: None,
        injected: 0
    });
}
