//! The Slack driver as a real process between the fake Slack and a real `channeld`: round
//! trips in a DM and in a channel thread, a redelivered envelope answered once, a refresh in
//! the middle of 200 messages, a half-open socket replaced, `link_disabled` reported and
//! retried slowly, 429 honoured, Slack's refusals as failed sends, clicks counted only for
//! allowlisted people, and a preview replaced by the final reply.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::fakes::slack::{
    FakeSlack, FakeSlackOptions, Fault, SocketEnd, StoredMessage, dm_channel,
};
use channeld_tests::{HubProcess, workspace_bin, write_script};

const INSTANCE: &str = "slack.test";
/// How long a test waits for one step through the hub and the driver.
const STEP: Duration = Duration::from_secs(20);
/// The driver's idle timeout in these tests (ping every second).
const IDLE_SECS: u64 = 3;
/// The slow retry after `link_disabled` in these tests.
const SLOW_RETRY_SECS: u64 = 2;

/// A `channeld-slack` process. Killed on drop; its log is printed when the test fails.
struct SlackDriver {
    child: Child,
    log: PathBuf,
}

impl SlackDriver {
    fn spawn(hub: &HubProcess, fake: &FakeSlack) -> Self {
        let log = hub.dir.path().join("slack.driver.log");
        let stderr = OpenOptions::new().create(true).append(true).open(&log).expect("driver log");
        let child = Command::new(workspace_bin("channeld-slack"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", INSTANCE)
            .env("CHANNELD_SOCKET", hub.socket(INSTANCE))
            .env("CHANNELD_LOG", "debug")
            .env("CHANNELD_SLACK_API_URL", fake.api_url())
            .env("CHANNELD_SLACK_APP_TOKEN", &fake.options().app_token)
            .env("CHANNELD_SLACK_BOT_TOKEN", &fake.options().bot_token)
            .env("CHANNELD_SLACK_POST_INTERVAL_MS", "0")
            .env("CHANNELD_SLACK_PREVIEW_INTERVAL_MS", "100")
            .env("CHANNELD_SLACK_PING_SECONDS", "1")
            .env("CHANNELD_SLACK_IDLE_TIMEOUT_SECONDS", IDLE_SECS.to_string())
            .env("CHANNELD_SLACK_RECONNECT_MAX_SECONDS", "1")
            .env("CHANNELD_SLACK_SLOW_RETRY_SECONDS", SLOW_RETRY_SECS.to_string())
            .env("CHANNELD_SLACK_HTTP_TIMEOUT_SECONDS", "5")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn channeld-slack");
        Self { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for SlackDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}

fn quick_fake() -> FakeSlackOptions {
    FakeSlackOptions { redeliver_after: Duration::from_secs(2), ..FakeSlackOptions::default() }
}

fn echo_hub(allow: &[&str]) -> HubProcess {
    let allow: Vec<String> = allow.iter().map(|who| format!("\"{who}\"")).collect();
    HubProcess::start(&format!("[instance.\"{INSTANCE}\"]\nallow = [{}]\n", allow.join(", ")))
}

/// A hub whose runtime is the shell `agent` (stream mode: command results on stdin).
fn agent_hub(dir: &std::path::Path, allow: &str, agent: &str) -> HubProcess {
    let agent = write_script(dir, "agent.sh", agent);
    HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\nstdin = \"stream\"\n[instance.\"{INSTANCE}\"]\nallow = [\"{allow}\"]\nruntime = \"agent\"\n",
        agent.display()
    ))
}

/// Waits until the driver is connected to the hub and its Slack link is up.
async fn wait_ready(hub: &HubProcess, driver: &SlackDriver) {
    let deadline = Instant::now() + STEP;
    loop {
        let status = hub.instance_status(INSTANCE);
        // The driver's own report that its socket is up: the hub says Ready on its own as
        // soon as the driver connects, before the driver opened a Slack connection.
        let health = &status["health"];
        if status["connected"] == true
            && health["state"] == "Ready"
            && health["status"]["transport"] == "connected"
        {
            return;
        }
        assert!(Instant::now() < deadline, "not Ready within {STEP:?}: {status}\n{}", driver.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn bot_replies(fake: &FakeSlack, channel: &str, count: usize) -> Vec<StoredMessage> {
    fake.wait_for(&format!("{count} bot messages in {channel}"), STEP, |r| {
        let visible = r.visible_bot_messages(channel);
        (visible.len() >= count).then(|| visible.into_iter().cloned().collect())
    })
    .await
}

async fn all_acked(fake: &FakeSlack, event_ids: &[String]) {
    fake.wait_for("every event acknowledged", STEP, |r| {
        event_ids.iter().all(|id| r.event_acked(id)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dm_round_trips_inline_through_the_echo_runtime() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    fake.add_user("U1", "Ada Lovelace", "ada");
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    let said = fake.user_dms("U1", "hello **there**");
    let replies = bot_replies(&fake, &dm_channel("U1"), 1).await;
    assert_eq!(replies[0].text, "hello *there*", "echoed, Markdown as mrkdwn");
    assert_eq!(replies[0].thread_ts, None, "a DM reply stays inline");
    all_acked(&fake, &said.event_ids).await;
    let record = fake.record();
    assert_eq!(record.calls_to("auth.test").len(), 1);
    assert!(
        record.calls_to("users.info").iter().any(|c| c.args["user"] == "U1"),
        "display name looked up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_mention_is_answered_once_in_a_thread_under_it() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    let chatter = fake.user_posts("C1", "U1", "not for the bot", None, &[]);
    let said = fake.user_posts("C1", "U1", "<@U0BOT> status?", None, &[]);
    assert_eq!(said.event_ids.len(), 2, "app_mention and message");
    let replies = bot_replies(&fake, "C1", 1).await;
    assert_eq!(replies[0].text, "status?", "the mention is stripped");
    assert_eq!(replies[0].thread_ts.as_deref(), Some(said.ts.as_str()), "the reply opens a thread");
    all_acked(&fake, &said.event_ids).await;
    all_acked(&fake, &chatter.event_ids).await;
    // The bot's own reply comes back as a message event: acknowledged and dropped too.
    fake.wait_for("all four envelopes acknowledged", STEP, |r| {
        (r.envelopes.len() >= 4 && r.envelopes.iter().all(|e| e.acked_at.is_some())).then_some(())
    })
    .await;
    let status = hub.instance_status(INSTANCE);
    assert_eq!(status["counters"]["replies"], 1, "{status}");
    assert_eq!(fake.record().visible_bot_messages("C1").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_envelope_is_answered_once() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    let said = fake.user_dms("U1", "only once");
    bot_replies(&fake, &dm_channel("U1"), 1).await;
    all_acked(&fake, &said.event_ids).await;
    // Slack did not get the ack: the same event again, new envelope id, retry_attempt 1.
    fake.redeliver(&said.event_ids[0]);
    let retry = fake
        .wait_for("the redelivery acknowledged", STEP, |r| {
            r.deliveries_of(&said.event_ids[0])
                .iter()
                .find(|e| e.retry_attempt == 1 && e.acked_at.is_some())
                .map(|e| (*e).clone())
        })
        .await;
    assert_eq!(retry.acks, 1);
    assert_eq!(fake.record().visible_bot_messages(&dm_channel("U1")).len(), 1, "answered once");
    assert_eq!(hub.instance_status(INSTANCE)["counters"]["replies"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_during_200_messages_loses_and_repeats_nothing() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = HubProcess::start(&format!("[instance.\"{INSTANCE}\"]\nallow_all = true\n"));
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    let mut event_ids = Vec::new();
    for n in 0..200 {
        if n == 100 {
            fake.refresh().await;
        }
        let user = format!("U{}", n % 10);
        event_ids.extend(fake.user_dms(&user, &format!("message {n:03}")).event_ids);
        tokio::task::yield_now().await;
    }
    let replies = fake
        .wait_for("200 replies", Duration::from_secs(60), |r| {
            let replies: Vec<String> =
                r.bot_messages().iter().filter(|m| !m.deleted).map(|m| m.text.clone()).collect();
            (replies.len() >= 200).then_some(replies)
        })
        .await;
    all_acked(&fake, &event_ids).await;
    let unique: HashSet<&String> = replies.iter().collect();
    assert_eq!(unique.len(), 200, "every message answered");
    assert_eq!(replies.len(), 200, "none answered twice");
    let old_closed = fake.wait_for("the old socket closed", STEP, |r| r.sockets[0].closed_at).await;
    let record = fake.record();
    let sockets = record.hello_sockets();
    assert!(sockets.len() >= 2, "a second socket was opened for the refresh");
    assert!(
        sockets[1].hello_at.expect("hello") < old_closed,
        "the new socket was up before the old closed"
    );
    assert_eq!(record.sockets[0].end, Some(SocketEnd::ByClient), "the driver closed it, not Slack");
    assert_eq!(hub.instance_status(INSTANCE)["counters"]["replies"], 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_socket_is_replaced_within_the_idle_timeout() {
    let fake =
        FakeSlack::start_with(FakeSlackOptions { ping_interval: None, ..quick_fake() }).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    fake.go_silent().await;
    let silent_since = Instant::now();
    // Bounded by the idle timeout plus a reconnect (the first backoff step is about 1 s),
    // with wide room for a loaded machine: without the idle check the driver would wait
    // on this socket until the fake shuts down.
    let bound = Duration::from_secs(IDLE_SECS + 17);
    fake.wait_for("a new socket after the silence", bound, |r| {
        (r.hello_sockets().len() >= 2).then_some(())
    })
    .await;
    assert!(silent_since.elapsed() <= bound);
    let said = fake.user_dms("U1", "still there?");
    bot_replies(&fake, &dm_channel("U1"), 1).await;
    all_acked(&fake, &said.event_ids).await;
    fake.wait_for("the driver's own pings on the new socket", STEP, |r| {
        r.hello_sockets()
            .last()
            .is_some_and(|socket| socket.id > 1 && socket.pings > 0)
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_disabled_shows_in_status_and_is_retried_slowly() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;
    let opens_before = fake.record().calls_to("apps.connections.open").len();

    fake.disable_link().await;
    let disabled_at = Instant::now();
    let deadline = disabled_at + STEP;
    let status = loop {
        let status = hub.instance_status(INSTANCE);
        if status["health"]["state"] == "Unavailable" {
            break status;
        }
        assert!(Instant::now() < deadline, "not Unavailable: {status}\n{}", driver.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(status["health"]["status"]["reason"], "link_disabled", "{status}");
    let out = hub.ctl(&["status"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("link_disabled"), "{out:?}");

    // The next attempt waits the slow lane (±25 % jitter), and it is a single attempt.
    let next = fake
        .wait_for("the next connection attempt", STEP, |r| {
            r.calls_to("apps.connections.open").get(opens_before).map(|call| call.at)
        })
        .await;
    assert!(
        next.duration_since(disabled_at) >= Duration::from_millis(SLOW_RETRY_SECS * 750),
        "no hot loop"
    );
    fake.enable_link();
    wait_ready(&hub, &driver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_send_waits_retry_after_and_posts_once() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    fake.fail("chat.postMessage", Fault::RateLimited { retry_after_secs: 1 }, Some(1));
    let out = hub.ctl(&["send", INSTANCE, "--conversation", "C1", "deploy finished"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}\n{}", driver.log());
    let record = fake.record();
    let calls = record.calls_to("chat.postMessage");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].status, 429);
    assert!(
        calls[1].at.duration_since(calls[0].at) >= Duration::from_secs(1),
        "Retry-After honoured"
    );
    assert_eq!(record.visible_bot_messages("C1").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slack_refusal_is_a_failed_send_with_its_code() {
    let fake = FakeSlack::start_with(quick_fake()).await;
    let hub = echo_hub(&["U1"]);
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    fake.fail_channel("C404", "channel_not_found");
    let out = hub.ctl(&["send", INSTANCE, "--conversation", "C404", "hello?"]);
    assert_eq!(out.status.code(), Some(6), "{out:?}\n{}", driver.log());
    assert!(String::from_utf8_lossy(&out.stderr).contains("channel_not_found"), "{out:?}");
    let proactive = hub.ctl(&["send", INSTANCE, "--conversation", "U5", "hi"]);
    assert_eq!(proactive.status.code(), Some(0), "{proactive:?}");
    assert_eq!(fake.record().calls_to("conversations.open")[0].args["users"], "U5");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_allowlisted_click_approves() {
    let dir = tempfile::tempdir().unwrap();
    let hub = agent_hub(
        dir.path(),
        "U1",
        "IFS= read -r envelope\n\
         echo '{\"type\":\"request_approval\",\"tool\":\"deploy\",\"arguments\":{\"env\":\"prod\"}}'\n\
         IFS= read -r approval\n\
         case \"$approval\" in *accepted*) a=accepted;; *rejected*) a=rejected;; *) a=missing;; esac\n\
         echo \"{\\\"type\\\":\\\"reply\\\",\\\"text\\\":\\\"approval=$a\\\"}\"\n",
    );
    let fake = FakeSlack::start_with(quick_fake()).await;
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;
    let dm = dm_channel("U1");

    for (clicker, expected) in [("U2", "approval=rejected"), ("U1", "approval=accepted")] {
        let before = fake.record().bot_messages().len();
        fake.user_dms("U1", "deploy please");
        let prompt = fake
            .wait_for("the approval prompt", STEP, |r| {
                r.bot_messages().get(before).filter(|m| m.blocks.is_some()).map(|m| (*m).clone())
            })
            .await;
        fake.click(clicker, &dm, &prompt.ts, "channeld.approve", None);
        let reply = fake
            .wait_for("the agent's reply", STEP, |r| {
                r.visible_bot_messages(&dm)
                    .into_iter()
                    .find(|m| m.text.starts_with("approval=") && m.ts > prompt.ts)
                    .cloned()
            })
            .await;
        assert_eq!(reply.text, expected, "clicked by {clicker}");
        let settled = fake.record().message(&dm, &prompt.ts).cloned().expect("the prompt");
        assert!(settled.blocks.is_none(), "buttons replaced by the outcome");
        assert!(settled.text.contains(&format!("<@{clicker}>")), "{}", settled.text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_reply_replaces_the_preview() {
    let dir = tempfile::tempdir().unwrap();
    let hub = agent_hub(
        dir.path(),
        "U1",
        "IFS= read -r envelope\n\
         echo '{\"type\":\"preview\",\"text\":\"drafting…\"}'\n\
         sleep 1\n\
         echo '{\"type\":\"reply\",\"text\":\"the final answer\"}'\n",
    );
    let fake = FakeSlack::start_with(quick_fake()).await;
    let driver = SlackDriver::spawn(&hub, &fake);
    wait_ready(&hub, &driver).await;

    fake.user_dms("U1", "question");
    let dm = dm_channel("U1");
    let finished = fake
        .wait_for("the final answer", STEP, |r| {
            r.visible_bot_messages(&dm).into_iter().find(|m| m.text == "the final answer").cloned()
        })
        .await;
    assert_eq!(finished.edits, vec!["drafting…".to_owned()], "the preview became the reply");
    assert_eq!(fake.record().visible_bot_messages(&dm).len(), 1);
}
