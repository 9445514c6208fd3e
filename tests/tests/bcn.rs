//! The BCN driver as a real process between the fake BCN (in this test) and a real
//! `channeld`: a round trip answered with the run id before the final event, an inject that
//! starts no run, the bot identity kept across a BCN restart, a heartbeat timeout and a driver
//! restart (the stored token), refused bots (`auth_rejected`), version negotiation with a
//! deprecation notice, an unsupported version, the `env` of `bot.connect` in the agent's
//! environment (through `agent_env`, never in the hub's ledger; in each inbound's metadata for
//! a hub without the extension), and `chat.abort` of ended, unknown and foreign runs.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use channeld_tests::fakes::bcn::{FakeBcn, FakeConfig, Record};
use channeld_tests::{DriverProcess, HubProcess, files_holding, write_script};
use serde_json::{Value, json};
use tempfile::TempDir;

const INSTANCE: &str = "bcn.lab";
const SESSION: &str = "grp-456:channel_dingtalk_abcdef12";
/// How long a test waits for something the driver should do within a few seconds.
const WITHIN: Duration = Duration::from_secs(20);

/// Starts `channeld-bcn` for [`INSTANCE`] against `fake`, keeping its token in `state`.
fn spawn_driver(
    hub: &HubProcess,
    fake: &FakeBcn,
    state: &Path,
    env: &[(&str, &str)],
) -> DriverProcess {
    let mut settings = vec![
        ("CHANNELD_BCN_URL".to_owned(), fake.url()),
        ("CHANNELD_BCN_STATE_DIR".to_owned(), state.display().to_string()),
        ("CHANNELD_BCN_RECONNECT_MAX_SECONDS".to_owned(), "1".to_owned()),
        ("CHANNELD_BCN_AUTH_RETRY_SECONDS".to_owned(), "1".to_owned()),
    ];
    settings.extend(env.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())));
    DriverProcess::spawn("channeld-bcn", hub, INSTANCE, &settings)
}

/// A hub serving [`INSTANCE`] with the echo runtime or `agent`.
fn hub(agent: Option<&Path>) -> HubProcess {
    let mut config = String::new();
    if let Some(agent) = agent {
        config.push_str(&format!(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n",
            agent.display()
        ));
    }
    config.push_str(&format!("[instance.\"{INSTANCE}\"]\nallow = [\"alice\", \"user-001\"]\n"));
    if agent.is_some() {
        config.push_str("runtime = \"agent\"\n");
    }
    HubProcess::start(&config)
}

/// Polls `channelctl status` until `check` holds for the instance.
async fn wait_status(
    hub: &HubProcess,
    driver: &DriverProcess,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    hub.wait_status(INSTANCE, what, WITHIN, check, || driver.log()).await
}

fn ready(status: &Value) -> bool {
    status["connected"] == true && status["health"]["state"] == "Ready"
}

/// Starts the driver and waits until its bot is online and the hub shows it Ready.
async fn start(
    hub: &HubProcess,
    fake: &FakeBcn,
    state: &Path,
    env: &[(&str, &str)],
) -> DriverProcess {
    let driver = spawn_driver(hub, fake, state, env);
    fake.wait_online(WITHIN).await;
    wait_status(hub, &driver, "Ready", ready).await;
    driver
}

fn assert_no_violations(record: &Record) {
    assert!(record.violations.is_empty(), "protocol rules broken: {:#?}", record.violations);
}

/// Waits for the terminal event of `run_id` and returns its payload.
async fn terminal(fake: &FakeBcn, run_id: &str) -> Value {
    fake.wait_for(&format!("the end of run {run_id}"), WITHIN, |record| {
        record.events.get(run_id).and_then(|events| {
            events
                .iter()
                .find(|(_, payload)| {
                    matches!(payload["state"].as_str(), Some("final" | "error" | "aborted"))
                })
                .map(|(_, payload)| payload.clone())
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_send_is_answered_with_the_run_id_before_the_final_event() {
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    let _driver = start(&hub, &fake, state.path(), &[]).await;

    let send = fake.chat_send(SESSION, "Please analyze this deadlock").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    let last = terminal(&fake, &run_id).await;
    assert_eq!(last["state"], "final");
    assert_eq!(last["bcs_group_id"], "grp-456");
    assert_eq!(last["message"]["role"], "assistant");
    assert_eq!(last["message"]["content"][0]["text"], "Please analyze this deadlock");
    let record = fake.record();
    assert_eq!(record.events[&run_id][0].0, 1, "the first event of a run is seq 1");
    let acked = record.response_index(&send).unwrap();
    let ended = record.event_index(&run_id, "final").unwrap();
    assert!(acked < ended, "the ACK comes before the final event");
    assert_no_violations(&record);

    // A second message in the same session is its own run.
    let again = fake.chat_send(SESSION, "and now?").unwrap();
    let second = fake.run_id(&again, WITHIN).await;
    assert_ne!(second, run_id);
    assert_eq!(terminal(&fake, &second).await["message"]["content"][0]["text"], "and now?");
    let status = hub.instance_status(INSTANCE);
    assert_eq!(status["counters"]["inbound"], 2);

    // The token BCN issued is kept, readable by the driver's user only, and never logged.
    let connect = &fake.record().connects[0];
    assert!(connect.is_new && connect.token.is_none());
    let token_file = state.path().join(format!("{INSTANCE}.token"));
    let token = std::fs::read_to_string(&token_file).unwrap();
    assert!(token.starts_with("tok-"), "{token}");
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(!_driver.log().contains(&token), "the token is never logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inject_is_acknowledged_and_starts_no_run() {
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    let _driver = start(&hub, &fake, state.path(), &[]).await;

    let inject = fake
        .request(
            "chat.inject",
            json!({
                "session_key": "sess-123",
                "bcs_group_id": "grp-456",
                "message": {"role": "user", "content": [{"type": "text", "text": "FYI"}]},
                "channel": {},
                "session_context": {"you_are_mentioned": false, "is_sender": false}
            }),
        )
        .unwrap();
    let answer = fake.response(&inject, WITHIN).await;
    assert_eq!(answer["ok"], true);
    assert_eq!(answer["payload"], json!({}));
    // A chat.send after it is answered; by then the inject would have reached the hub.
    let send = fake.chat_send(SESSION, "hello").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    terminal(&fake, &run_id).await;
    let record = fake.record();
    assert_eq!(record.events.len(), 1, "only the chat.send produced events: {:?}", record.events);
    assert_eq!(hub.instance_status(INSTANCE)["counters"]["inbound"], 1, "the inject ran nothing");
    assert_no_violations(&record);

    // Unknown methods are answered as the guide says.
    let odd = fake.request("chat.teleport", json!({})).unwrap();
    assert_eq!(fake.response(&odd, WITHIN).await["error"]["code"], "unknown_method");
    let bad = fake.request("chat.send", json!({"no_session_key": true})).unwrap();
    assert_eq!(fake.response(&bad, WITHIN).await["error"]["code"], "invalid_request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bot_identity_survives_a_bcn_restart_a_heartbeat_timeout_and_a_driver_restart() {
    let fake = FakeBcn::start(FakeConfig {
        heartbeat_ttl: Duration::from_millis(1500),
        ..FakeConfig::default()
    })
    .await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    // Heartbeats well within the fake's TTL.
    let mut driver =
        start(&hub, &fake, state.path(), &[("CHANNELD_BCN_STATUS_INTERVAL_SECONDS", "0.3")]).await;
    let first = fake.record().connects[0].clone();
    let token = std::fs::read_to_string(state.path().join(format!("{INSTANCE}.token"))).unwrap();
    fake.wait_for("three heartbeats", WITHIN, |record| (record.statuses >= 3).then_some(())).await;
    assert_eq!(fake.record().heartbeat_timeouts, 0, "heartbeats keep the bot online");

    fake.restart();
    let again = fake
        .wait_for("a second bot.connect", WITHIN, |record| record.connects.get(1).cloned())
        .await;
    assert_eq!(again.token.as_deref(), Some(token.as_str()), "the token is passed again");
    assert!(!again.is_new);
    assert_eq!(again.outcome, first.outcome, "the same bot_uuid");
    fake.wait_online(WITHIN).await;
    let send = fake.chat_send(SESSION, "still there?").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    assert_eq!(terminal(&fake, &run_id).await["state"], "final");

    // A driver restart reads the token from its file.
    driver.terminate();
    let mut driver = spawn_driver(&hub, &fake, state.path(), &[]);
    let third = fake
        .wait_for("a third bot.connect", WITHIN, |record| record.connects.get(2).cloned())
        .await;
    assert_eq!(third.token.as_deref(), Some(token.as_str()));
    assert_eq!(third.outcome, first.outcome);

    // This driver sends its heartbeat every 60 s: the fake's TTL drops it, and it comes back
    // as the same bot.
    fake.wait_for("a heartbeat timeout", WITHIN, |record| {
        (record.heartbeat_timeouts >= 1).then_some(())
    })
    .await;
    let fourth = fake
        .wait_for("a bot.connect after the timeout", WITHIN, |record| {
            record.connects.get(3).cloned()
        })
        .await;
    assert_eq!(fourth.token.as_deref(), Some(token.as_str()));
    assert_eq!(fourth.outcome, first.outcome);
    assert!(fake.record().connects.iter().filter(|c| c.is_new).count() == 1);
    assert_no_violations(&fake.record());
    driver.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_bot_is_auth_rejected_and_retried_slowly() {
    let fake = FakeBcn::start(FakeConfig { refuse_new_bots: true, ..FakeConfig::default() }).await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    let driver = spawn_driver(&hub, &fake, state.path(), &[]);
    let status = wait_status(&hub, &driver, "Unavailable auth_rejected", |status| {
        status["connected"] == true && status["health"]["status"]["reason"] == "auth_rejected"
    })
    .await;
    assert_eq!(status["health"]["state"], "Unavailable", "{status}");
    assert!(!state.path().join(format!("{INSTANCE}.token")).exists(), "no token was issued");

    // Registration opens again: the slow lane (1 s here) retries and the bot comes online.
    fake.set_refuse_new_bots(false);
    fake.wait_online(WITHIN).await;
    wait_status(&hub, &driver, "Ready", ready).await;

    // A revoked token is refused too.
    fake.revoke_all();
    fake.restart();
    wait_status(&hub, &driver, "auth_rejected after a revocation", |status| {
        status["health"]["status"]["reason"] == "auth_rejected"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_negotiated_and_a_deprecation_is_logged_once_and_shown_in_health() {
    let fake = FakeBcn::start(FakeConfig { deprecated: vec![2], ..FakeConfig::default() }).await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    let driver = start(&hub, &fake, state.path(), &[("CHANNELD_BCN_PROTOCOL_VERSION", "2")]).await;
    assert_eq!(fake.record().connects[0].asked_version, Some(2));
    let status = wait_status(&hub, &driver, "the deprecation in health", |status| {
        status["health"]["detail"].as_str().is_some_and(|d| d.contains("deprecation"))
    })
    .await;
    let detail = status["health"]["detail"].as_str().unwrap();
    assert!(detail.contains("2026-06-01") && detail.contains("v2"), "{detail}");
    fake.restart();
    fake.wait_for("a second bot.connect", WITHIN, |record| record.connects.get(1).cloned()).await;
    fake.wait_online(WITHIN).await;
    wait_status(&hub, &driver, "Ready again", ready).await;
    let log = driver.log();
    assert_eq!(log.matches("BCN deprecates the protocol version").count(), 1, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsupported_version_is_setup_refused() {
    let fake = FakeBcn::start(FakeConfig { min_version: 2, ..FakeConfig::default() }).await;
    let hub = hub(None);
    let state = TempDir::new().unwrap();
    let driver = spawn_driver(&hub, &fake, state.path(), &[]);
    let status = wait_status(&hub, &driver, "Unavailable setup_refused", |status| {
        status["health"]["status"]["reason"] == "setup_refused"
    })
    .await;
    let detail = status["health"]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("protocol version 1"), "{status}");
    assert_eq!(fake.record().connects[0].outcome, Err("unsupported_protocol_version".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_env_of_bot_connect_reaches_the_agent_and_sessions_stay_apart() {
    let dir = TempDir::new().unwrap();
    // The token goes to a file of the test's, not into the reply (which the ledger keeps).
    let token_file = dir.path().join("token");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!(
            "cat > /dev/null\nprintf '%s' \"$BCN_BOT_TOKEN\" > '{}'\n\
             echo \"uuid=$BCN_BOT_UUID path_kept=${{PATH:+yes}}\"\n",
            token_file.display()
        ),
    );
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = hub(Some(&agent));
    let state = TempDir::new().unwrap();
    let _driver = start(&hub, &fake, state.path(), &[]).await;
    let send = fake.chat_send(SESSION, "who am I?").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    let last = terminal(&fake, &run_id).await;
    let uuid = fake.record().connects[0].outcome.clone().unwrap();
    assert_eq!(
        last["message"]["content"][0]["text"],
        format!("uuid={uuid} path_kept=yes"),
        "{last}"
    );
    // The bot token reached the agent through the hub's `agent_env`, held in its memory: it
    // is in none of the ledger's files (the inbound's metadata no longer carries it) and
    // not in the hub's log.
    let token = std::fs::read_to_string(&token_file).unwrap();
    assert!(token.starts_with("tok-"), "the agent saw BCN_BOT_TOKEN={token:?}");
    let state = hub.dir.path().join("state");
    assert_eq!(files_holding(&state, &token), Vec::<std::path::PathBuf>::new(), "token on disk");
    assert!(!hub.log().contains(&token), "the bot token is in the hub's log");

    // chat.abort: an ended run is idempotent success with no ids; another session's run and
    // an unknown run are protocol errors.
    let session = fake.session_of(&run_id).unwrap();
    let abort =
        fake.request("chat.abort", json!({"session_key": session, "run_id": run_id})).unwrap();
    let answer = fake.response(&abort, WITHIN).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["payload"]["aborted_run_ids"], json!([]));
    let foreign = fake
        .request("chat.abort", json!({"session_key": "grp-9:other", "run_id": run_id}))
        .unwrap();
    assert_eq!(fake.response(&foreign, WITHIN).await["ok"], false);
    let unknown =
        fake.request("chat.abort", json!({"session_key": session, "run_id": "run-nope"})).unwrap();
    assert_eq!(fake.response(&unknown, WITHIN).await["error"]["code"], "not_found");
    assert_no_violations(&fake.record());
}

/// The pid an agent wrote to `file`, once it is there.
async fn agent_pid(file: &Path) -> i32 {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Ok(text) = std::fs::read_to_string(file)
            && let Ok(pid) = text.trim().parse()
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "the agent never wrote its pid");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_reply_arrives_as_deltas_and_tool_reports_in_order_then_the_final() {
    let dir = TempDir::new().unwrap();
    let agent = write_script(
        dir.path(),
        "agent.sh",
        "cat > /dev/null\n\
         echo '{\"type\":\"delta\",\"text\":\"Analysis\"}'\n\
         echo '{\"type\":\"tool\",\"name\":\"search\",\"status\":\"start\",\"id\":\"tc-1\",\"args\":{\"query\":\"deadlock\"}}'\n\
         echo '{\"type\":\"tool\",\"name\":\"search\",\"status\":\"done\",\"id\":\"tc-1\",\"result\":{\"results\":[]}}'\n\
         echo '{\"type\":\"delta\",\"text\":\" result:\"}'\n\
         echo '{\"type\":\"reply\",\"text\":\"Analysis result: the root cause is a lock order\",\"metadata\":{\"routing\":{\"responders\":[{\"type\":\"name\",\"value\":\"DBA\"}],\"mode\":\"required\",\"reason\":\"a DBA is needed\"}}}'\n",
    );
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = hub(Some(&agent));
    let state = TempDir::new().unwrap();
    let _driver = start(&hub, &fake, state.path(), &[]).await;
    let send = fake.chat_send(SESSION, "Please analyze this deadlock").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    let last = terminal(&fake, &run_id).await;
    let record = fake.record();
    assert_eq!(
        record.states(&run_id),
        ["delta", "tool_call_start", "tool_call_end", "delta", "final"],
        "{}",
        record.summary()
    );
    let events = &record.events[&run_id];
    let seqs: Vec<u64> = events.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    assert_eq!(events[0].1["message"]["content"][0]["text"], "Analysis");
    assert_eq!(events[1].1["tool_call_id"], "tc-1");
    assert_eq!(events[1].1["args"]["query"], "deadlock");
    assert_eq!(events[2].1["success"], true);
    assert_eq!(events[3].1["message"]["content"][0]["text"], " result:");
    assert_eq!(
        last["message"]["content"][0]["text"],
        "Analysis result: the root cause is a lock order"
    );
    // The agent's reply metadata `routing` rides on `final` as the guide's structured routing.
    assert_eq!(last["routing"]["mode"], "required", "{last}");
    assert_eq!(last["routing"]["responders"][0]["value"], "DBA");
    assert_eq!(last["routing"]["reason"], "a DBA is needed");
    assert!(record.response_index(&send).unwrap() < record.event_index(&run_id, "delta").unwrap());
    assert_no_violations(&record);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_stops_exactly_that_run_and_nothing_of_it_comes_later() {
    let dir = TempDir::new().unwrap();
    let pid_file = dir.path().join("agent.pid");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!(
            "cat > /dev/null\necho $$ > '{}'\n\
             echo '{{\"type\":\"delta\",\"text\":\"thinking\"}}'\n\
             sleep 30\necho late\n",
            pid_file.display()
        ),
    );
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = hub(Some(&agent));
    let state = TempDir::new().unwrap();
    let _driver = start(&hub, &fake, state.path(), &[]).await;
    let send = fake.chat_send(SESSION, "think hard").unwrap();
    let run_id = fake.run_id(&send, WITHIN).await;
    fake.wait_for("the first delta", WITHIN, |record| record.event_index(&run_id, "delta")).await;
    let pid = agent_pid(&pid_file).await;
    assert!(Path::new(&format!("/proc/{pid}")).exists());

    // Another session's key is refused and the run goes on.
    let foreign = fake
        .request("chat.abort", json!({"session_key": "grp-9:other", "run_id": run_id}))
        .unwrap();
    assert_eq!(fake.response(&foreign, WITHIN).await["ok"], false);
    assert!(Path::new(&format!("/proc/{pid}")).exists(), "a refused abort stops nothing");

    let abort =
        fake.request("chat.abort", json!({"session_key": SESSION, "run_id": run_id})).unwrap();
    let answer = fake.response(&abort, WITHIN).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["payload"]["aborted"], true);
    assert_eq!(answer["payload"]["aborted_run_ids"], json!([run_id]));
    // The answer comes after the hub stopped the agent.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < deadline, "agent {pid} still runs after the abort");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fake.record().states(&run_id), ["delta", "aborted"]);

    // Again: idempotent success with no ids.
    let again =
        fake.request("chat.abort", json!({"session_key": SESSION, "run_id": run_id})).unwrap();
    let answer = fake.response(&again, WITHIN).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["payload"]["aborted_run_ids"], json!([]));

    // A later run of the session works, and nothing more of the aborted one arrived.
    let next = fake.chat_send(SESSION, "quick one").unwrap();
    let next_run = fake.run_id(&next, WITHIN).await;
    fake.wait_for("the next run's first delta", WITHIN, |record| {
        record.event_index(&next_run, "delta")
    })
    .await;
    assert_eq!(fake.record().states(&run_id), ["delta", "aborted"], "no late events");
    assert_no_violations(&fake.record());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_answers_from_the_hub_also_after_a_hub_restart() {
    let fake = FakeBcn::start(FakeConfig::default()).await;
    let mut hub = hub(None);
    let state = TempDir::new().unwrap();
    let driver = start(&hub, &fake, state.path(), &[]).await;
    for text in ["first question", "second question"] {
        let send = fake.chat_send(SESSION, text).unwrap();
        let run_id = fake.run_id(&send, WITHIN).await;
        terminal(&fake, &run_id).await;
    }
    let history = |limit: u64| {
        fake.request("chat.history", json!({"session_key": SESSION, "limit": limit})).unwrap()
    };
    let texts = |answer: &Value| -> Vec<(String, String)> {
        answer["payload"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (m["role"].as_str().unwrap().to_owned(), m["content"].as_str().unwrap().to_owned())
            })
            .collect()
    };
    // The reply is recorded once the driver's receipt reached the hub: ask until it shows.
    let deadline = Instant::now() + WITHIN;
    let answer = loop {
        let answer = fake.response(&history(50), WITHIN).await;
        if texts(&answer).len() == 4 || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let expected: Vec<(String, String)> = [
        ("user", "first question"),
        ("assistant", "first question"),
        ("user", "second question"),
        ("assistant", "second question"),
    ]
    .iter()
    .map(|(r, t)| ((*r).to_owned(), (*t).to_owned()))
    .collect();
    assert_eq!(texts(&answer), expected, "{answer}");
    assert_eq!(answer["payload"]["session_key"], SESSION);
    assert_eq!(answer["payload"]["session_id"], "grp-456");
    assert!(answer["payload"]["messages"][0]["timestamp"].as_u64().unwrap() > 0);
    let newest = fake.response(&history(1), WITHIN).await;
    assert_eq!(texts(&newest), expected[3..]);
    let unknown = fake.request("chat.history", json!({"session_key": "grp-0:nobody"})).unwrap();
    assert_eq!(fake.response(&unknown, WITHIN).await["payload"]["messages"], json!([]));

    hub.restart();
    wait_status(&hub, &driver, "Ready after the hub restart", ready).await;
    let after = fake.response(&history(50), WITHIN).await;
    assert_eq!(texts(&after), expected, "{after}");
}

/// A hub without the `agent_env` extension (a reference hub, which answers no `hello`) gets
/// `bot.connect`'s env in each inbound's metadata instead, and no `agent_env` frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_without_agent_env_gets_the_env_in_each_inbounds_metadata() {
    use channeld_driver_sdk::testing::{AckMode, FakeHub};
    use channeld_protocol::types::HealthState;

    let fake = FakeBcn::start(FakeConfig::default()).await;
    let hub = FakeHub::bind().await;
    let state = TempDir::new().unwrap();
    let mut driver = std::process::Command::new(channeld_tests::workspace_bin("channeld-bcn"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(hub.launch_config(INSTANCE).to_env())
        .env("CHANNELD_BCN_URL", fake.url())
        .env("CHANNELD_BCN_STATE_DIR", state.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn channeld-bcn");
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Reference).await;
    fake.wait_online(WITHIN).await;
    conn.wait_health(WITHIN, "Ready", |h| h.state == HealthState::Ready).await;
    fake.chat_send(SESSION, "who am I?").unwrap();
    let inbound = conn.expect_inbound().await;
    let metadata = &inbound.message.metadata;
    assert!(metadata["env.BCN_BOT_TOKEN"].starts_with("tok-"), "{metadata:?}");
    assert!(metadata.contains_key("env.BCN_BOT_UUID"), "{metadata:?}");
    assert!(conn.agent_envs().is_empty(), "agent_env sent to a hub without it");
    let _ = driver.kill();
    let _ = driver.wait();
}
