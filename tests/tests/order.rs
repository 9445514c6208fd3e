//! Conversation order through the real `channeld` and a shell agent that takes 0.5 s: a
//! session's runs start one after another in arrival order, `/new` applies exactly to the
//! messages after it, replies come back in inbound order, other conversations run beside a
//! slow one, the order survives a hub `kill -9` with messages queued, and a full queue is
//! answered `busy`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use channeld_protocol::Frame;
use channeld_protocol::frame::Delivery;
use channeld_tests::peer::caps;
use channeld_tests::{HubProcess, RawPeer, write_script};

const ONE: &str = "order.one";

/// An agent that logs `start <event id> <session> <redelivered>` and `end <event id>` around
/// a 0.5 s pause and answers `reply <event id>`. An event id `wait-<other>` first waits
/// (up to 20 s) until `<other>` has started, so a test sees two runs overlap without timing;
/// every run waits (up to 20 s) while the file `closed` exists beside the log.
fn agent(dir: &Path, log: &Path) -> PathBuf {
    let closed = closed(log);
    let closed = closed.display();
    let log = log.display();
    write_script(
        dir,
        "agent.sh",
        &format!(
            "IFS= read -r line\n\
             id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
             echo \"start $id $CHANNELD_SESSION $CHANNELD_REDELIVERED\" >> '{log}'\n\
             case \"$id\" in wait-*)\n\
               n=0\n\
               until grep -q \"^start ${{id#wait-}} \" '{log}'; do\n\
                 n=$((n+1)); [ $n -lt 400 ] || break; sleep 0.05\n\
               done;;\n\
             esac\n\
             n=0\n\
             while [ -e '{closed}' ] && [ $n -lt 400 ]; do n=$((n+1)); sleep 0.05; done\n\
             sleep 0.5\n\
             echo \"end $id\" >> '{log}'\n\
             echo \"reply $id\"\n"
        ),
    )
}

/// The file that holds every run while it exists.
fn closed(log: &Path) -> PathBuf {
    log.with_file_name("closed")
}

fn config(agent: &Path, extra: &str) -> String {
    format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 30\n\
         [instance.\"{ONE}\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n{extra}",
        agent.display()
    )
}

/// The agent's log lines, split into words.
fn agent_log(log: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|line| line.split(' ').map(str::to_owned).collect())
        .collect()
}

/// Where `line` (its first words) is in the log; panics when it is missing.
fn position(log: &[Vec<String>], words: &[&str]) -> usize {
    log.iter()
        .position(|line| line.len() >= words.len() && line.iter().zip(words).all(|(a, b)| a == b))
        .unwrap_or_else(|| panic!("{words:?} not in the agent log {log:?}"))
}

/// The session id the agent saw for `event`.
fn session_of(log: &[Vec<String>], event: &str) -> String {
    log[position(log, &["start", event])][2].clone()
}

/// Reads frames until `count` replies (or errors about an inbound) arrived; `accepted` are
/// counted and skipped. Returns the replies in arrival order.
async fn replies(driver: &mut RawPeer, count: usize) -> (Vec<Delivery>, usize) {
    let (mut delivered, mut accepted) = (Vec::new(), 0);
    let deadline = Duration::from_secs(30);
    while delivered.len() < count {
        match driver.frame_within(deadline).await {
            Some(Frame::Accepted(_)) => accepted += 1,
            Some(Frame::Deliver(delivery)) => delivered.push(delivery),
            Some(other) => panic!("unexpected frame {other:?}"),
            None => panic!("only {} of {count} replies within {deadline:?}", delivered.len()),
        }
    }
    (delivered, accepted)
}

fn reply_order(replies: &[Delivery], conversation: &str) -> Vec<String> {
    replies
        .iter()
        .filter(|d| d.message.target.conversation.as_str() == conversation)
        .map(|d| d.request_id.to_string())
        .collect()
}

async fn connect(hub: &HubProcess) -> RawPeer {
    let driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    let mut driver = driver;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_runs_in_order_and_new_applies_to_exactly_the_messages_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.log");
    let hub = HubProcess::start(&config(&agent(dir.path(), &log), ""));
    let mut driver = connect(&hub).await;

    // `wait-x` holds its run until `x`, in another conversation, has started: it only ends
    // if the second conversation runs beside it.
    for (event, text) in [("wait-x", "a"), ("new", "/new"), ("b", "b"), ("c", "c")] {
        driver.inbound(ONE, event, "alice", "c1", text).await;
    }
    driver.inbound(ONE, "x", "alice", "c2", "x").await;
    let (replies, accepted) = replies(&mut driver, 5).await;
    assert_eq!(accepted, 5);

    // Replies in the order of their inbound within the conversation; `/new` answered in
    // its place.
    assert_eq!(reply_order(&replies, "c1"), ["wait-x", "new", "b", "c"]);
    let texts: Vec<&str> = replies
        .iter()
        .filter(|d| d.message.target.conversation.as_str() == "c1")
        .map(|d| d.message.body.text_str())
        .collect();
    assert_eq!(texts, ["reply wait-x", "Started a new session.", "reply b", "reply c"]);
    // The second conversation was not held behind the slow one.
    assert_eq!(reply_order(&replies, "c2"), ["x"]);
    assert!(
        replies.iter().position(|d| d.request_id == "x")
            < replies.iter().position(|d| d.request_id == "b"),
        "x waited behind c1"
    );

    let log = agent_log(&log);
    // Runs of c1 never overlap and start in arrival order.
    let order = [
        position(&log, &["start", "wait-x"]),
        position(&log, &["end", "wait-x"]),
        position(&log, &["start", "b"]),
        position(&log, &["end", "b"]),
        position(&log, &["start", "c"]),
        position(&log, &["end", "c"]),
    ];
    assert!(order.is_sorted(), "c1 runs overlapped or ran out of order: {log:?}");
    assert!(position(&log, &["start", "x"]) < position(&log, &["end", "wait-x"]));
    // `a` in the old session, `b` and `c` in the new one.
    let old = session_of(&log, "wait-x");
    assert_ne!(session_of(&log, "b"), old, "b ran in the session before /new");
    assert_eq!(session_of(&log, "b"), session_of(&log, "c"));
    assert_ne!(session_of(&log, "x"), old);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_is_answered_in_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.log");
    let hub = HubProcess::start(&config(&agent(dir.path(), &log), ""));
    let mut driver = connect(&hub).await;
    driver.inbound(ONE, "a", "alice", "c1", "a").await;
    driver.inbound(ONE, "help", "alice", "c1", "/help").await;
    driver.inbound(ONE, "b", "alice", "c1", "b").await;
    let (replies, _) = replies(&mut driver, 3).await;
    assert_eq!(reply_order(&replies, "c1"), ["a", "help", "b"]);
    assert!(replies[1].message.body.text_str().starts_with("Commands:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_keep_their_order_across_a_hub_kill() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.log");
    let mut hub =
        HubProcess::start_in(tempfile::tempdir().unwrap(), &config(&agent(dir.path(), &log), ""));
    // m1 is held until the kill: the others are certainly still queued then.
    std::fs::write(closed(&log), "").unwrap();
    let mut driver = connect(&hub).await;
    let events = ["m1", "m2", "m3", "m4", "m5"];
    for event in events {
        driver.inbound(ONE, event, "alice", "c1", event).await;
    }
    for _ in events {
        assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    }
    // Every message is accepted (recorded); m1 is running, the others wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !agent_log(&log).iter().any(|line| line[0] == "start") {
        assert!(Instant::now() < deadline, "m1 never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(hub.pid(), libc::SIGKILL) };
    let _ = hub.child.wait();
    drop(driver);
    let before = agent_log(&log).len();
    assert_eq!(before, 1, "only m1 had started: {:?}", agent_log(&log));
    std::fs::remove_file(closed(&log)).unwrap();
    hub.restart();

    let mut driver = connect(&hub).await;
    let (replies, _) = replies(&mut driver, events.len()).await;
    assert_eq!(reply_order(&replies, "c1"), events, "replies out of order after the restart");

    let log = agent_log(&log);
    let after: Vec<&Vec<String>> = log[before..].iter().collect();
    let starts: Vec<(&str, &str)> = after
        .iter()
        .filter(|line| line[0] == "start")
        .map(|line| (line[1].as_str(), line[3].as_str()))
        .collect();
    // m1 was interrupted (run again, flagged redelivered); the rest never started before.
    assert_eq!(starts, [("m1", "1"), ("m2", "0"), ("m3", "0"), ("m4", "0"), ("m5", "0")]);
    // One at a time: each starts after the one before it ended.
    for pair in events.windows(2) {
        let ended = before + after.iter().position(|l| l[0] == "end" && l[1] == pair[0]).unwrap();
        let started =
            before + after.iter().position(|l| l[0] == "start" && l[1] == pair[1]).unwrap();
        assert!(ended < started, "{} started before {} ended: {log:?}", pair[1], pair[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_answered_busy_and_the_queued_messages_still_run() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.log");
    let hub =
        HubProcess::start(&config(&agent(dir.path(), &log), "max_inflight = 1\nmax_queued = 2\n"));
    let mut driver = connect(&hub).await;
    // q1 runs (its own slot), q2 and q3 wait; q4 finds the waiting room full, in any
    // conversation.
    driver.inbound(ONE, "q1", "alice", "c1", "q1").await;
    driver.inbound(ONE, "q2", "alice", "c1", "q2").await;
    driver.inbound(ONE, "q3", "alice", "c2", "q3").await;
    driver.inbound(ONE, "q4", "alice", "c3", "q4").await;
    let mut accepted = Vec::new();
    let busy = loop {
        match driver.frame().await {
            Frame::Accepted(a) => accepted.push(a.event_id.to_string()),
            Frame::Error(err) => break err,
            other => panic!("unexpected frame {other:?}"),
        }
    };
    assert_eq!(busy.code, "busy");
    assert!(busy.retryable);
    assert_eq!(busy.request_id.as_ref().map(|id| id.as_str()), Some("q4"));
    let (replies, more) = replies(&mut driver, 3).await;
    assert_eq!(accepted.len() + more, 3);
    let mut order: Vec<&str> = replies.iter().map(|d| d.request_id.as_str()).collect();
    assert_eq!(order[0], "q1");
    order.sort_unstable();
    assert_eq!(order, ["q1", "q2", "q3"]);
    // One run at a time (`max_inflight = 1`): every start follows the end of the run before.
    let log = agent_log(&log);
    for (n, line) in log.iter().enumerate() {
        let expected = if n % 2 == 0 { "start" } else { "end" };
        assert_eq!(line[0], expected, "runs overlapped: {log:?}");
        if n % 2 == 1 {
            assert_eq!(line[1], log[n - 1][1], "runs overlapped: {log:?}");
        }
    }
    // Retried once there is room, it runs.
    driver.inbound(ONE, "q4", "alice", "c3", "q4").await;
    let (replies, _) = self::replies(&mut driver, 1).await;
    assert_eq!(replies[0].request_id, "q4");
    let status = hub.instance_status(ONE);
    assert_eq!(status["counters"]["busy"], 1, "{status}");
}
