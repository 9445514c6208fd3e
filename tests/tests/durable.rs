//! Crash tests for the durable ledger: a real `channeld` killed with SIGKILL and restarted
//! while an SDK driver streams inbound messages (re-sending each until its reply arrives, as
//! an at-least-once platform does) or while an application sends with idempotency keys.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use channeld_driver_sdk::protocol::types::{
    DeliveryReceipt, InboundMessage, MessageBody, MessageTarget, Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::{
    CancellationToken, Declaration, Driver, DriverError, DriverLaunchConfig, Hub, Post, PostError,
    PostKind, run_driver,
};
use channeld_tests::control::ControlClient;
use channeld_tests::{HubProcess, write_script};
use serde_json::{Value, json};
use tokio::sync::Notify;

const CHANNEL: &str = "crash.one";
/// At most this many messages are unanswered at once, like a polite platform.
const WINDOW: usize = 4;
/// An unanswered message is sent again after this long.
const RESEND_AFTER: Duration = Duration::from_secs(3);

/// What the fake platform observed.
#[derive(Debug, Default)]
struct Platform {
    /// Reply posts per inbound event id.
    replies: HashMap<String, usize>,
    /// Proactive posts per idempotency key.
    sends: HashMap<String, usize>,
}

/// An SDK driver whose platform is a counter of messages and posts.
struct CrashDriver {
    channel: ChannelId,
    total: usize,
    platform: Arc<Mutex<Platform>>,
    replied: Arc<Notify>,
}

fn inbound(channel: &ChannelId, n: usize) -> InboundMessage {
    InboundMessage {
        id: Id::new(format!("ev-{n:05}")).unwrap(),
        target: MessageTarget::new(channel.clone(), Id::new(format!("conv-{}", n % 7)).unwrap()),
        sender: Participant::new(Id::new("user").unwrap()),
        body: MessageBody::text(format!("message {n}")).unwrap(),
        timestamp_ms: None,
        metadata: Default::default(),
    }
}

impl Driver for CrashDriver {
    fn declaration(&self) -> Declaration {
        let mut declaration = Declaration::default();
        declaration.capabilities.receive = true;
        declaration.capabilities.send = true;
        declaration
    }

    async fn run(&self, hub: Hub, shutdown: CancellationToken) -> Result<(), DriverError> {
        let mut next = 0;
        let mut unanswered: HashMap<usize, Instant> = HashMap::new();
        loop {
            {
                let platform = self.platform.lock().unwrap();
                unanswered.retain(|n, _| !platform.replies.contains_key(&format!("ev-{n:05}")));
            }
            if next == self.total && unanswered.is_empty() && self.total > 0 {
                shutdown.cancelled().await;
                return Ok(());
            }
            while unanswered.len() < WINDOW && next < self.total {
                if hub.inbound(inbound(&self.channel, next)).await.is_err() {
                    return Ok(());
                }
                unanswered.insert(next, Instant::now());
                next += 1;
            }
            for (n, sent) in unanswered.iter_mut() {
                if sent.elapsed() > RESEND_AFTER {
                    // At-least-once: the platform delivers it again.
                    if hub.inbound(inbound(&self.channel, *n)).await.is_err() {
                        return Ok(());
                    }
                    *sent = Instant::now();
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = self.replied.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let key = match &post.kind {
            PostKind::Reply { event_id } => {
                *self.platform.lock().unwrap().replies.entry(event_id.to_string()).or_default() +=
                    1;
                self.replied.notify_one();
                format!("reply-{event_id}")
            }
            PostKind::Proactive { request_id } => {
                let key = post.message.metadata.get("idempotency_key").cloned().unwrap_or_default();
                *self.platform.lock().unwrap().sends.entry(key.clone()).or_default() += 1;
                format!("post-{request_id}")
            }
        };
        Ok(DeliveryReceipt {
            channel: post.message.target.channel.clone(),
            message_id: Id::new(key).unwrap(),
            target: post.message.target,
            timestamp_ms: None,
        })
    }
}

/// An agent that appends `<event id> <redelivered 0|1>` to `log` when its run completes.
fn counting_agent(dir: &std::path::Path, log: &std::path::Path) -> PathBuf {
    write_script(
        dir,
        "agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             case \"$line\" in *'\"redelivered\":true'*) r=1;; *) r=0;; esac\n\
             [ -n \"$id\" ] || exit 1\n\
             echo \"$id $r\" >> '{}'\n\
             echo \"done $id\"\n",
            log.display()
        ),
    )
}

fn hub_config(agent: &std::path::Path) -> String {
    format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n\
         [instance.\"{CHANNEL}\"]\nallow = [\"user\"]\nruntime = \"agent\"\n",
        agent.display()
    )
}

fn completed_runs(log: &std::path::Path) -> Vec<(String, bool)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (id, flag) = line.split_once(' ')?;
            Some((id.to_owned(), flag == "1"))
        })
        .collect()
}

fn kill(hub: &mut HubProcess) {
    // SAFETY: signal to our own child.
    unsafe {
        libc::kill(hub.pid(), libc::SIGKILL);
    }
    let _ = hub.child.wait();
}

/// Streams `total` messages through a hub, killing it with SIGKILL after each count in
/// `kill_after` completed runs; returns the agent's log of completed runs and the platform.
async fn stream_inbound(
    total: usize,
    kill_after: &[usize],
) -> (Vec<(String, bool)>, Platform, usize) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("runs.log");
    let agent = counting_agent(dir.path(), &log);
    let hub_dir = tempfile::tempdir().unwrap();
    let mut hub = HubProcess::start_in(hub_dir, &hub_config(&agent));

    let platform = Arc::new(Mutex::new(Platform::default()));
    let replied = Arc::new(Notify::new());
    let channel = ChannelId::new(CHANNEL).unwrap();
    let launch = DriverLaunchConfig::for_socket(channel.clone(), hub.socket(CHANNEL));
    let shutdown = CancellationToken::new();
    let driver = CrashDriver { channel, total, platform: platform.clone(), replied };
    let driver_task = tokio::spawn(run_driver(driver, launch, shutdown.clone()));

    let deadline = Instant::now() + Duration::from_secs(600);
    let mut kills = 0;
    for &after in kill_after {
        while completed_runs(&log).len() < after {
            assert!(Instant::now() < deadline, "runs stalled before the kill at {after}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        kill(&mut hub);
        kills += 1;
        hub.restart();
    }
    loop {
        let done = platform.lock().unwrap().replies.len();
        if done == total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done} of {total} replies arrived; hub log:\n{}",
            hub.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    driver_task.await.unwrap().unwrap();
    let platform = std::mem::take(&mut *platform.lock().unwrap());
    (completed_runs(&log), platform, kills)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_survives_three_hub_kills_without_loss_or_unflagged_repeats() {
    let total = 2000;
    let mut kill_after =
        vec![fastrand::usize(200..600), fastrand::usize(700..1200), fastrand::usize(1300..1800)];
    kill_after.sort_unstable();
    let (runs, platform, kills) = stream_inbound(total, &kill_after).await;

    let mut by_id: HashMap<&str, Vec<bool>> = HashMap::new();
    for (id, redelivered) in &runs {
        by_id.entry(id.as_str()).or_default().push(*redelivered);
    }
    // None lost: every event has a completed run and its reply reached the driver.
    assert_eq!(by_id.len(), total, "events without a completed run");
    assert_eq!(platform.replies.len(), total, "replies that never reached the driver");
    // Repeats only for runs a kill interrupted, flagged redelivered, at most once more.
    let repeated: Vec<(&str, &Vec<bool>)> =
        by_id.iter().filter(|(_, r)| r.len() > 1).map(|(i, r)| (*i, r)).collect();
    for (id, flags) in &repeated {
        assert_eq!(flags.len(), 2, "{id} ran {} times", flags.len());
        assert!(flags[1], "{id}: the repeated run was not flagged redelivered ({flags:?})");
    }
    assert!(
        repeated.len() <= kills * WINDOW,
        "{} repeated runs, more than {kills} kills × {WINDOW} in flight",
        repeated.len()
    );
    eprintln!(
        "kills at {kill_after:?}: {} runs for {total} events, {} repeated",
        runs.len(),
        repeated.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kills_no_run_repeats_even_with_resends() {
    let total = 300;
    let (runs, platform, _) = stream_inbound(total, &[]).await;
    let ids: HashSet<&str> = runs.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(runs.len(), total, "a run repeated or went missing");
    assert_eq!(ids.len(), total);
    assert!(runs.iter().all(|(_, redelivered)| !redelivered));
    assert!(platform.replies.values().all(|&posts| posts >= 1));
    assert_eq!(platform.replies.len(), total);
}

/// Sends `key` until the hub gives a final answer, reconnecting across hub restarts.
async fn send_until_final(
    socket: PathBuf,
    key: String,
    client: Arc<tokio::sync::Mutex<Option<Arc<ControlClient>>>>,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        assert!(Instant::now() < deadline, "no final answer for {key}");
        let current = {
            let mut slot = client.lock().await;
            if slot.is_none() {
                *slot = ControlClient::connect(&socket).await.ok().map(Arc::new);
            }
            slot.clone()
        };
        let Some(conn) = current else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let request = json!({
            "op": "send", "instance": CHANNEL, "conversation": format!("room-{}", key.len() % 3),
            "text": format!("notice {key}"), "idempotency_key": key, "wait": true, "timeout_ms": 5000,
        });
        match conn.call(request).await {
            Ok(answer) => {
                let state = answer["result"]["state"].as_str().map(str::to_owned);
                let code = answer["error"]["code"].as_str().map(str::to_owned);
                match (state.as_deref(), code.as_deref()) {
                    (Some("receipted"), _) => return "receipted".into(),
                    (_, Some("outcome_unknown")) => return "unknown".into(),
                    (_, Some(other)) if other != "ledger_unavailable" => {
                        panic!("{key}: unexpected failure {answer}")
                    }
                    // queued or handed: ask again with the same key.
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            Err(_) => {
                let mut slot = client.lock().await;
                if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    *slot = None;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_sends_end_receipted_once_or_unknown_across_kills_and_driver_restarts() {
    let hub_dir = tempfile::tempdir().unwrap();
    let mut hub =
        HubProcess::start_in(hub_dir, &format!("[instance.\"{CHANNEL}\"]\nallow = [\"user\"]\n"));
    let socket = hub.control_socket();
    let platform = Arc::new(Mutex::new(Platform::default()));
    let channel = ChannelId::new(CHANNEL).unwrap();
    let driver_socket = hub.socket(CHANNEL);
    let start_driver = |platform: Arc<Mutex<Platform>>| {
        let launch = DriverLaunchConfig::for_socket(channel.clone(), driver_socket.clone());
        let shutdown = CancellationToken::new();
        let driver = CrashDriver {
            channel: channel.clone(),
            total: 0,
            platform,
            replied: Arc::new(Notify::new()),
        };
        (shutdown.clone(), tokio::spawn(run_driver(driver, launch, shutdown)))
    };
    let (mut driver_stop, mut driver_task) = start_driver(platform.clone());

    let total = 1000;
    let client = Arc::new(tokio::sync::Mutex::new(None));
    let senders = Arc::new(tokio::sync::Semaphore::new(16));
    let mut tasks = Vec::new();
    for n in 0..total {
        let permit = senders.clone().acquire_owned().await.unwrap();
        let (socket, client) = (socket.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let key = format!("key-{n:04}");
            let outcome = send_until_final(socket, key.clone(), client).await;
            (key, outcome)
        }));
        match n {
            250 | 700 => {
                kill(&mut hub);
                hub.restart();
            }
            450 => {
                // The driver goes away for a while and comes back as a new process would.
                driver_stop.cancel();
                driver_task.await.unwrap().unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                (driver_stop, driver_task) = start_driver(platform.clone());
            }
            _ => {}
        }
    }
    let mut outcomes = HashMap::new();
    for task in tasks {
        let (key, outcome) = task.await.unwrap();
        outcomes.insert(key, outcome);
    }
    let posts = platform.lock().unwrap().sends.clone();
    let mut receipted = 0;
    for (key, outcome) in &outcomes {
        let posted = posts.get(key).copied().unwrap_or(0);
        assert!(posted <= 1, "{key} was posted {posted} times");
        if outcome == "receipted" {
            receipted += 1;
            assert_eq!(posted, 1, "{key} receipted without a post");
        }
    }
    // The ledger agrees with what the callers saw.
    let admin = ControlClient::connect(&socket).await.unwrap();
    let listed = admin.call(json!({"op": "outbox", "limit": 5000})).await.unwrap();
    let records = listed["result"]["records"].as_array().unwrap();
    assert_eq!(records.len(), total);
    let states: HashMap<&str, &str> = records
        .iter()
        .map(|r| (r["idempotency_key"].as_str().unwrap(), r["state"].as_str().unwrap()))
        .collect();
    for (key, outcome) in &outcomes {
        assert_eq!(states[key.as_str()], outcome, "{key}");
    }
    // Repeating every key (with its message: another one would be a conflict) posts nothing
    // new.
    let before: usize = posts.values().sum();
    for n in (0..total).step_by(10) {
        let key = format!("key-{n:04}");
        let answer = admin
            .call(json!({
                "op": "send", "instance": CHANNEL, "conversation": format!("room-{}", key.len() % 3),
                "text": format!("notice {key}"), "idempotency_key": key, "wait": true,
            }))
            .await
            .unwrap();
        let expected: Value =
            if outcomes[&key] == "receipted" { json!(true) } else { json!(false) };
        assert_eq!(answer["ok"], expected, "{key}: {answer}");
    }
    let after: usize = platform.lock().unwrap().sends.values().sum();
    assert_eq!(before, after, "a repeated key produced a new platform message");
    eprintln!("{receipted} of {total} receipted, {} unknown", total - receipted);
    driver_stop.cancel();
    driver_task.await.unwrap().unwrap();
}

mod sessions_and_commands {
    use std::time::Duration;

    use channeld_protocol::Frame;
    use channeld_tests::peer::caps;
    use channeld_tests::{HubProcess, RawPeer, write_script};

    const ONE: &str = "test.one";

    async fn reply(peer: &mut RawPeer) -> String {
        loop {
            match peer.frame().await {
                Frame::Deliver(delivery) => return delivery.message.body.text_str().to_owned(),
                Frame::Accepted(_) | Frame::HelloAck(_) => continue,
                other => panic!("expected a reply, got {other:?}"),
            }
        }
    }

    /// The reply to `event_id`, skipping replies to earlier events that the hub hands over
    /// again after a restart (it may not have recorded their delivery before it died).
    async fn reply_to(peer: &mut RawPeer, event_id: &str) -> String {
        loop {
            match peer.frame().await {
                Frame::Deliver(delivery) if delivery.request_id == event_id => {
                    return delivery.message.body.text_str().to_owned();
                }
                Frame::Deliver(_) | Frame::Accepted(_) | Frame::HelloAck(_) => continue,
                other => panic!("expected a reply, got {other:?}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn new_sessions_survive_a_hub_restart() {
        let dir = tempfile::tempdir().unwrap();
        let agent = write_script(dir.path(), "agent.sh", "echo \"$CHANNELD_SESSION\"\n");
        let config = format!(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
            agent.display()
        );
        let mut hub = HubProcess::start(&config);
        let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
        driver.hello(ONE, caps(&["receive"]), &[]).await;
        driver.inbound(ONE, "m-1", "alice", "c1", "hi").await;
        let first = reply(&mut driver).await;
        driver.inbound(ONE, "m-2", "alice", "c1", "/new").await;
        assert_eq!(reply(&mut driver).await, "Started a new session.");
        driver.inbound(ONE, "m-3", "alice", "c1", "hi again").await;
        let second = reply(&mut driver).await;
        assert_ne!(first, second, "/new must change the session");
        assert!(second.starts_with("im-"));

        hub.restart();
        let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
        driver.hello(ONE, caps(&["receive"]), &[]).await;
        driver.inbound(ONE, "m-4", "alice", "c1", "after restart").await;
        assert_eq!(
            reply_to(&mut driver, "m-4").await,
            second,
            "the session generation was lost on restart"
        );
        // A redelivered /new is not a second /new.
        driver.inbound(ONE, "m-2", "alice", "c1", "/new").await;
        assert_eq!(reply_to(&mut driver, "m-2").await, "Started a new session.");
        driver.inbound(ONE, "m-5", "alice", "c1", "same session?").await;
        assert_eq!(reply_to(&mut driver, "m-5").await, second);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn denied_senders_get_the_notice_only_when_configured() {
        let hub = HubProcess::start(&format!(
            "[instance.\"{ONE}\"]\nallow = [\"alice\"]\ndeny_notice = \"This bot is private.\"\n[instance.\"test.two\"]\n"
        ));
        let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
        driver.hello(ONE, caps(&["receive"]), &[]).await;
        driver.inbound(ONE, "m-1", "mallory", "c1", "hello?").await;
        match driver.frame().await {
            Frame::Deliver(notice) => {
                assert_eq!(notice.message.body.text_str(), "This bot is private.")
            }
            other => panic!("expected the notice, got {other:?}"),
        }
        assert_eq!(driver.error().await.code, "sender_denied");
        // An empty allowlist denies everyone, silently, and the hub warned at startup.
        let mut two = RawPeer::connect(&hub.socket("test.two")).await;
        two.hello("test.two", caps(&["receive"]), &[]).await;
        two.inbound("test.two", "m-1", "alice", "c1", "hello?").await;
        assert_eq!(two.error().await.code, "sender_denied");
        assert!(hub.log().contains("sender allowlist is empty"));
        let status = hub.ctl(&["status", "--json"]);
        let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        let denied: u64 = status["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["counters"]["denied"].as_u64().unwrap())
            .sum();
        assert_eq!(denied, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_disconnect_during_an_approval_fails_closed_and_the_reply_waits_for_the_driver() {
        let dir = tempfile::tempdir().unwrap();
        let agent = write_script(
            dir.path(),
            "agent.sh",
            "IFS= read -r envelope\n\
             echo '{\"type\":\"request_approval\",\"tool\":\"deploy\",\"arguments\":{}}'\n\
             IFS= read -r answer\n\
             case \"$answer\" in *accepted*) echo approved;; *) echo refused;; esac\n",
        );
        let hub = HubProcess::start(&format!(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\nstdin = \"stream\"\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
            agent.display()
        ));
        let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
        driver.hello(ONE, caps(&["receive", "commands"]), &["accepted", "responder"]).await;
        assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
        driver.inbound(ONE, "m-1", "alice", "c1", "deploy it").await;
        assert!(matches!(driver.frame().await, Frame::Accepted(_)));
        assert!(matches!(driver.frame().await, Frame::Command(_)));
        // The driver goes away with the approval pending: it must not count as approved.
        driver.close().await;
        let mut driver = loop {
            let mut peer = RawPeer::connect(&hub.socket(ONE)).await;
            peer.hello(ONE, caps(&["receive", "commands"]), &["accepted"]).await;
            match peer.frame().await {
                Frame::HelloAck(_) => break peer,
                Frame::Error(err) if err.code == "already_connected" => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        // The run finished while no driver was connected (or just as one came back); its
        // reply is delivered to the new connection.
        assert_eq!(reply(&mut driver).await, "refused");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_die_with_a_killed_hub() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("agent.pid");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!("echo $$ > '{}'\nexec sleep 60\n", pid_file.display()),
    );
    let mut hub = HubProcess::start(&hub_config(&agent));
    let driver = channeld_tests::RawPeer::connect(&hub.socket(CHANNEL)).await;
    driver.hello(CHANNEL, channeld_tests::peer::caps(&["receive"]), &[]).await;
    driver.inbound(CHANNEL, "m-1", "user", "c1", "take forever").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid: i32 = loop {
        if let Some(pid) =
            std::fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse().ok())
        {
            break pid;
        }
        assert!(Instant::now() < deadline, "the agent never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    kill(&mut hub);
    let deadline = Instant::now() + Duration::from_secs(10);
    // SAFETY: signal 0 only checks whether the process exists.
    while unsafe { libc::kill(pid, 0) } == 0 {
        // A zombie still answers kill(0); it has exited when its state is Z or it is gone.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if state.split_whitespace().nth(2) == Some("Z") {
            break;
        }
        assert!(Instant::now() < deadline, "agent {pid} outlived the hub");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_replays_and_only_changed_content_conflicts() {
    use channeld_protocol::Frame;
    use channeld_protocol::frame::Inbound;

    let hub = HubProcess::start("[instance.\"crash.one\"]\nallow = [\"user\"]\n");
    let mut driver = channeld_tests::RawPeer::connect(&hub.socket(CHANNEL)).await;
    driver.hello(CHANNEL, channeld_tests::peer::caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    let mut message = channeld_tests::peer::message(CHANNEL, "m-1", "user", "c1", "first");
    message.timestamp_ms = Some(1);
    driver
        .send(Frame::Inbound(Inbound {
            event_id: Id::new("m-1").unwrap(),
            message: message.clone(),
        }))
        .await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if !a.duplicate));
    assert!(
        matches!(driver.frame().await, Frame::Deliver(d) if d.message.body.text_str() == "first")
    );

    // The platform redelivers it with another receive time and a display name: same message.
    message.timestamp_ms = Some(2);
    message.sender.display_name = Some("User".into());
    message.metadata.insert("delivery".into(), "2".into());
    driver
        .send(Frame::Inbound(Inbound {
            event_id: Id::new("m-1").unwrap(),
            message: message.clone(),
        }))
        .await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if a.duplicate));
    assert!(
        matches!(driver.frame().await, Frame::Deliver(d) if d.message.body.text_str() == "first")
    );

    // The same id with other text is not a redelivery.
    message.body = MessageBody::text("second").unwrap();
    driver.send(Frame::Inbound(Inbound { event_id: Id::new("m-1").unwrap(), message })).await;
    let conflict = driver.error().await;
    assert_eq!(conflict.code, "conflict");
    assert!(!conflict.retryable);
}
