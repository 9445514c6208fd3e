//! The WeChat driver as a real process between the fake iLink server and a real `channeld`:
//! a round trip carrying the context token, replays answered once, SIGKILLs between and
//! during batches with the hub restarting the driver, `-14` and the recovery, the QR login
//! binary, long replies, typing during a slow run, and proactive sends with and without a
//! context token.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::fakes::wechat::{FakeIlink, FakeOptions, LoginStep, Records};
use channeld_tests::{DriverProcess, HubProcess, counting_agent, workspace_bin, write_script};
use serde_json::Value;

const INSTANCE: &str = "wechat.test";
const ALICE: &str = "alice@im.wechat";
const BOB: &str = "bob@im.wechat";
/// How long a test waits for the driver or the hub to get somewhere.
const WITHIN: Duration = Duration::from_secs(30);

/// A fake iLink server with short long polls.
async fn quick_fake() -> FakeIlink {
    FakeIlink::start_with(FakeOptions {
        hold: Duration::from_secs(1),
        advertised_timeout: Duration::from_secs(1),
        ..FakeOptions::default()
    })
    .await
}

/// The driver's settings against `fake`, with its state in `state`.
fn settings(fake: &FakeIlink, state: &Path) -> Vec<(String, String)> {
    vec![
        ("CHANNELD_WECHAT_BASE_URL".into(), fake.base_url()),
        ("CHANNELD_WECHAT_STATE_DIR".into(), state.display().to_string()),
    ]
}

fn with_token(mut env: Vec<(String, String)>, fake: &FakeIlink) -> Vec<(String, String)> {
    env.push(("CHANNELD_WECHAT_BOT_TOKEN".into(), fake.options().bot_token));
    env
}

/// `channeld-wechat` serving the instance.
fn start_driver(hub: &HubProcess, env: &[(String, String)]) -> DriverProcess {
    DriverProcess::spawn("channeld-wechat", hub, INSTANCE, env)
}

/// A hub serving the instance with the echo runtime (or `agent`), letting `allow` talk.
fn hub_with(allow: &[&str], agent: Option<&Path>, extra: &str) -> HubProcess {
    let allow: Vec<String> = allow.iter().map(|user| format!("\"{user}\"")).collect();
    let runtime = match agent {
        Some(agent) => {
            format!("[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n", agent.display())
        }
        None => String::new(),
    };
    let uses = if agent.is_some() { "runtime = \"agent\"\n" } else { "" };
    HubProcess::start(&format!(
        "{runtime}[instance.\"{INSTANCE}\"]\nallow = [{}]\n{uses}{extra}",
        allow.join(", ")
    ))
}

/// Waits until the hub shows the driver connected with `state`; returns the status row.
async fn wait_health(hub: &HubProcess, state: &str, log: &dyn Fn() -> String) -> Value {
    let check = |status: &Value| status["connected"] == true && status["health"]["state"] == state;
    hub.wait_status(INSTANCE, state, WITHIN, check, log).await
}

async fn wait_sent(fake: &FakeIlink, count: usize, what: &str) -> Records {
    fake.wait_for(WITHIN, what, |r| (r.sent.len() >= count).then(|| r.clone())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_round_trips_through_the_hub_with_the_users_context_token() {
    let fake = quick_fake().await;
    let state = tempfile::tempdir().unwrap();
    let hub = hub_with(&[ALICE], None, "");
    let mut driver = start_driver(&hub, &with_token(settings(&fake, state.path()), &fake));
    wait_health(&hub, "Ready", &|| driver.log()).await;

    let pushed = fake.push_text(ALICE, "你好, channeld");
    let records = wait_sent(&fake, 1, "the echo reply").await;
    let reply = &records.sent[0];
    assert_eq!(reply.to_user_id, ALICE);
    assert_eq!(reply.text.as_deref(), Some("你好, channeld"));
    assert_eq!(reply.context_token, pushed.context_token, "the reply carries the user's token");
    let poll = records.of("getupdates")[0];
    for header in ["X-WECHAT-UIN", "iLink-App-Id", "iLink-App-ClientVersion", "AuthorizationType"] {
        assert!(poll.header(header).is_some(), "{header} missing");
    }

    // The short polls of this fake may time out under load (Degraded for a moment): wait.
    wait_health(&hub, "Ready", &|| driver.log()).await;
    let out = hub.ctl(&["health", INSTANCE]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("Ready"));
    assert!(driver.terminate().success(), "clean exit:\n{}", driver.log());
    let notifications = fake.records().notifications;
    assert_eq!(notifications, ["msg/notifystart", "msg/notifystop"]);
    fake.assert_no_violations();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_seconds_or_a_restart_later_are_answered_once() {
    let fake = quick_fake().await;
    let state = tempfile::tempdir().unwrap();
    let hub = hub_with(&[ALICE], None, "");
    let env = with_token(settings(&fake, state.path()), &fake);
    let mut driver = start_driver(&hub, &env);
    wait_health(&hub, "Ready", &|| driver.log()).await;

    let first = fake.push_text(ALICE, "only once");
    wait_sent(&fake, 1, "the first reply").await;
    fake.replay(first.message_id);
    fake.wait_for(WITHIN, "the replay handed out", |r| (r.batches_handed_out >= 2).then_some(()))
        .await;

    // Later (the replay set is on disk): a new driver process, the same replay again.
    assert!(driver.terminate().success());
    let driver = start_driver(&hub, &env);
    wait_health(&hub, "Ready", &|| driver.log()).await;
    fake.replay(first.message_id);
    fake.wait_for(WITHIN, "the late replay handed out", |r| {
        (r.batches_handed_out >= 3).then_some(())
    })
    .await;
    fake.push_text(ALICE, "next");
    let records = wait_sent(&fake, 2, "the second reply").await;
    assert_eq!(records.texts_to(ALICE), ["only once", "next"], "each message answered once");
    assert_eq!(
        hub.instance_status(INSTANCE)["counters"]["inbound"],
        2,
        "replays never reached the hub"
    );
    fake.assert_no_violations();
}

fn driver_pid(hub: &HubProcess) -> Option<i32> {
    hub.instance_status(INSTANCE)["driver_pid"].as_i64().map(|pid| pid as i32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkills_between_and_during_batches_lose_nothing_and_answer_nothing_twice() {
    const USERS: [&str; 3] = [ALICE, BOB, "carol@im.wechat"];
    const WAVES: usize = 4;
    const PER_WAVE: usize = 15;
    let fake = FakeIlink::start_with(FakeOptions {
        hold: Duration::from_secs(1),
        advertised_timeout: Duration::from_secs(1),
        batch_limit: 4,
        ..FakeOptions::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("wechat-state");
    let runs_log = dir.path().join("runs.log");
    // A short pause in each run, so kills find runs in flight.
    let agent = counting_agent(dir.path(), &runs_log, "0.05");
    let spawn_env: Vec<String> = with_token(settings(&fake, &state), &fake)
        .into_iter()
        .map(|(name, value)| format!("{name} = \"{value}\""))
        .collect();
    let hub = hub_with(
        &USERS,
        Some(&agent),
        &format!(
            "max_inflight = 16\nspawn = [\"{}\"]\nspawn_env = {{ {} }}\n",
            workspace_bin("channeld-wechat").display(),
            spawn_env.join(", ")
        ),
    );
    wait_health(&hub, "Ready", &|| hub.log()).await;

    let mut pushed: Vec<String> = Vec::new();
    let mut kills = 0;
    for wave in 0..WAVES {
        for n in 0..PER_WAVE {
            let user = USERS[n % USERS.len()];
            let message = fake.push_text(user, &format!("wave {wave} message {n}"));
            pushed.push(format!("wx-{}", message.message_id));
            // During a batch: right after the hub took some of this wave's messages.
            if wave % 2 == 1 && n == PER_WAVE / 2 {
                let taken = runs(&runs_log).len();
                wait_until("a run of this wave", || runs(&runs_log).len() > taken).await;
                kill_driver(&hub);
                kills += 1;
            }
        }
        // Between batches: every message of the wave answered (or its reply reported
        // unknown: a kill between the driver's journal and the post), the driver polling.
        let wave_done = || {
            let records = fake.records();
            let answered = replies(&records);
            let unknown = hub.replies_reported_unknown();
            pushed.iter().all(|id| answered.contains_key(id.as_str()) || unknown.contains(id))
        };
        wait_until_within(Duration::from_secs(90), "the wave's replies", wave_done).await;
        if wave % 2 == 0 {
            wait_health(&hub, "Ready", &|| hub.log()).await;
            kill_driver(&hub);
            kills += 1;
        }
    }
    wait_health(&hub, "Ready", &|| hub.log()).await;

    let records = fake.records();
    let answered = replies(&records);
    let runs = runs(&runs_log);
    let unknown = hub.replies_reported_unknown();
    for event_id in &pushed {
        // A reply whose post a kill interrupted is reported unknown and never resent: it
        // reached the platform at most once. Every other reply reached it exactly once.
        let times = answered.get(event_id.as_str()).copied().unwrap_or(0);
        let expected = if unknown.contains(event_id) { 0..=1 } else { 1..=1 };
        assert!(expected.contains(&times), "{event_id} answered {times} times");
        assert_eq!(
            runs.iter().filter(|r| *r == event_id).count(),
            1,
            "{event_id} ran more than once"
        );
    }
    assert!(
        answered.keys().all(|id| pushed.iter().any(|p| p == id)),
        "no other message was sent: {answered:?}"
    );
    eprintln!(
        "{kills} SIGKILLs, {} messages, each run once and answered at most once ({} reported unknown)",
        pushed.len(),
        unknown.len()
    );
    fake.assert_no_violations();
}

/// Replies per event id (the agent answers `done <event id>`).
fn replies(records: &Records) -> HashMap<&str, usize> {
    let mut count = HashMap::new();
    for sent in &records.sent {
        if let Some(id) = sent.text.as_deref().and_then(|t| t.strip_prefix("done ")) {
            *count.entry(id).or_insert(0) += 1;
        }
    }
    count
}

fn runs(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log).unwrap_or_default().lines().map(str::to_owned).collect()
}

async fn wait_until(what: &str, done: impl FnMut() -> bool) {
    wait_until_within(WITHIN, what, done).await
}

async fn wait_until_within(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// SIGKILLs the hub's driver; the hub's supervisor starts it again.
fn kill_driver(hub: &HubProcess) {
    let pid = driver_pid(hub).expect("a connected driver has a pid");
    // SAFETY: a plain syscall on a process the hub started for this test.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minus_14_shows_auth_expired_pauses_polling_and_a_new_token_recovers() {
    let fake = quick_fake().await;
    let state = tempfile::tempdir().unwrap();
    let credentials = tempfile::tempdir().unwrap();
    let token_file = credentials.path().join("wechat-bot-token");
    std::fs::write(&token_file, format!("{}\n", fake.options().bot_token)).unwrap();
    let mut env = settings(&fake, state.path());
    env.push(("CREDENTIALS_DIRECTORY".into(), credentials.path().display().to_string()));
    let hub = hub_with(&[ALICE], None, "");
    let driver = start_driver(&hub, &env);
    wait_health(&hub, "Ready", &|| driver.log()).await;

    fake.expire_bot_token();
    let status = wait_health(&hub, "Unavailable", &|| driver.log()).await;
    let detail = status["health"]["detail"].as_str().unwrap_or_default();
    assert!(detail.starts_with("auth_expired"), "{status}");
    let text = String::from_utf8_lossy(&hub.ctl(&["status"]).stdout).into_owned();
    assert!(text.contains("auth_expired"), "channelctl status shows the reason:\n{text}");

    // Paused, not looping: at most a few polls in the next 30 s.
    let before = fake.records().count("getupdates");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let during = fake.records().count("getupdates") - before;
    assert!(during <= 2, "{during} polls in 30 s while the token was expired");
    assert_eq!(hub.instance_status(INSTANCE)["health"]["state"], "Unavailable");

    // A new token in the credential file: polling resumes.
    fake.set_bot_token("renewed-token");
    std::fs::write(&token_file, "renewed-token\n").unwrap();
    wait_health(&hub, "Ready", &|| driver.log()).await;
    fake.push_text(ALICE, "are you back?");
    let records = wait_sent(&fake, 1, "a reply after the renewal").await;
    assert_eq!(records.sent[0].text.as_deref(), Some("are you back?"));
    fake.assert_no_violations();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_against_the_fake_stores_a_state_the_driver_runs_on() {
    let fake = quick_fake().await;
    fake.script_login(vec![
        LoginStep::Wait,
        LoginStep::Scaned,
        LoginStep::NeedVerifyCode { code: "2468".into() },
        LoginStep::Confirmed {
            bot_token: "logged-in-token".into(),
            bot_id: "newbot@im.bot".into(),
            user_id: ALICE.into(),
            base_url: None,
        },
    ]);
    let state = tempfile::tempdir().unwrap();
    let mut login = Command::new(workspace_bin("channeld-wechat"))
        .arg("login")
        .arg("--state-dir")
        .arg(state.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CHANNELD_WECHAT_BASE_URL", fake.base_url())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn channeld-wechat login");
    login.stdin.take().unwrap().write_all(b"2468\n").unwrap();
    let output =
        tokio::task::spawn_blocking(move || login.wait_with_output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "login failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("https://liteapp.weixin.qq.com/q/fake"),
        "the QR URL is printed:\n{stdout}"
    );
    assert!(stdout.contains("newbot@im.bot"));
    assert!(!stdout.contains("logged-in-token"), "the token is not printed");
    let stored = state.path().join("login.json");
    let mode = std::fs::metadata(&stored).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    // The driver needs nothing else: token and base URL come from the stored login.
    let hub = hub_with(&[ALICE], None, "");
    let env = vec![("CHANNELD_WECHAT_STATE_DIR".to_owned(), state.path().display().to_string())];
    let driver = start_driver(&hub, &env);
    wait_health(&hub, "Ready", &|| driver.log()).await;
    fake.push_text(ALICE, "hello new bot");
    let records = wait_sent(&fake, 1, "the reply").await;
    let send = records.of("sendmessage")[0];
    assert_eq!(send.header("authorization"), Some("Bearer logged-in-token"));
    fake.assert_no_violations();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reply_is_chunked_in_order() {
    let fake = quick_fake().await;
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(
        dir.path(),
        "long.sh",
        "cat > /dev/null\nawk 'BEGIN { for (i = 0; i < 1000; i++) printf \"line %04d of the answer\\n\", i }'\n",
    );
    let hub = hub_with(&[ALICE], Some(&agent), "");
    let driver = start_driver(&hub, &with_token(settings(&fake, dir.path()), &fake));
    wait_health(&hub, "Ready", &|| driver.log()).await;
    fake.push_text(ALICE, "tell me everything");
    let records = fake
        .wait_for(WITHIN, "the last line of the answer", |r| {
            r.texts_to(ALICE)
                .last()
                .is_some_and(|t| t.ends_with("line 0999 of the answer"))
                .then(|| r.clone())
        })
        .await;
    let parts = records.texts_to(ALICE);
    assert_eq!(parts.len(), 7, "24,000 characters in requests of at most 4,000");
    assert!(parts.iter().all(|p| p.chars().count() <= 4000));
    let lines: Vec<String> = parts.join("\n").lines().map(str::to_owned).collect();
    let expected: Vec<String> = (0..1000).map(|i| format!("line {i:04} of the answer")).collect();
    assert_eq!(lines.len(), expected.len(), "no line lost or repeated");
    assert!(lines == expected, "the lines arrived out of order");
    fake.assert_no_violations();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typing_is_refreshed_while_a_slow_agent_runs_and_cancelled_after_its_reply() {
    let fake = quick_fake().await;
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(
        dir.path(),
        "slow.sh",
        "cat > /dev/null\nsleep 2\necho 'thought it through'\n",
    );
    let hub = hub_with(&[ALICE], Some(&agent), "");
    let mut env = with_token(settings(&fake, dir.path()), &fake);
    env.push(("CHANNELD_WECHAT_TYPING_INTERVAL_SECONDS".into(), "0.3".into()));
    let driver = start_driver(&hub, &env);
    wait_health(&hub, "Ready", &|| driver.log()).await;
    fake.push_text(ALICE, "think about it");
    wait_sent(&fake, 1, "the slow reply").await;
    let records = fake
        .wait_for(WITHIN, "typing cancelled", |r| {
            r.typing.last().is_some_and(|t| t.status == 2).then(|| r.clone())
        })
        .await;
    let reply_at = records.sent[0].at;
    let refreshes = records.typing.iter().filter(|t| t.status == 1 && t.at <= reply_at).count();
    assert!(refreshes >= 4, "only {refreshes} typing refreshes during a 2 s run");
    assert!(records.typing.last().unwrap().at >= reply_at, "cancelled after the reply");
    assert_eq!(records.configs, [ALICE], "one ticket for the run");
    fake.assert_no_violations();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proactive_send_needs_the_users_context_token() {
    let fake = quick_fake().await;
    let state = tempfile::tempdir().unwrap();
    let hub = hub_with(&[ALICE, BOB], None, "");
    let driver = start_driver(&hub, &with_token(settings(&fake, state.path()), &fake));
    wait_health(&hub, "Ready", &|| driver.log()).await;

    let refused = hub.ctl(&["send", INSTANCE, "--conversation", BOB, "hello bob"]);
    assert_eq!(
        refused.status.code(),
        Some(6),
        "no token: the driver says the send failed: {refused:?}"
    );
    let said = String::from_utf8_lossy(&refused.stderr).into_owned()
        + &String::from_utf8_lossy(&refused.stdout);
    assert!(said.contains("context token"), "the reason is shown: {said}");

    let pushed = fake.push_text(ALICE, "hi");
    wait_sent(&fake, 1, "the echo").await;
    let sent = hub.ctl(&["send", INSTANCE, "--conversation", ALICE, "deploy finished"]);
    assert_eq!(sent.status.code(), Some(0), "{sent:?}");
    let records = fake.records();
    assert_eq!(records.texts_to(ALICE), ["hi", "deploy finished"]);
    assert_eq!(records.sent[1].context_token, pushed.context_token);
    assert!(records.texts_to(BOB).is_empty());
    fake.assert_no_violations();
}
