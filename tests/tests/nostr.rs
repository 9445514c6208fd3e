//! The Nostr driver as a real process, spawned and supervised by a real `channeld`, between
//! real relays (nostr-relay-builder's, in this test process) and a test client with its own
//! keys: NIP-17 and NIP-04 round trips, a backdated gift wrap, a SIGKILL with the hub
//! restarting the driver (nothing repeated, nothing missed), garbage and forged seals skipped,
//! one relay of two down, every relay refusing (exit 6) or silent (exit 5), a stranger
//! ignored, a reaction from the agent, bad settings (exit 78) and the TLS path of `wss://`.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use channeld_tests::nostr_relay::{Behaviour, NostrTestClient, TestRelay, free_port};
use channeld_tests::{HubProcess, alive, workspace_bin, write_script};
use nostr_sdk::{Filter, Keys, Kind, ToBech32};
use serde_json::Value;
use tempfile::TempDir;

const BOT: &str = "nostr.bot";
/// How long a test waits for one direct message.
const MESSAGE_WITHIN: Duration = Duration::from_secs(20);
/// How long the driver may take to be Ready (connected and subscribed).
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The bot's identity and state directory, kept across driver restarts.
struct Bot {
    keys: Keys,
    state: TempDir,
}

impl Bot {
    fn new() -> Self {
        Self { keys: Keys::generate(), state: tempfile::tempdir().expect("state dir") }
    }

    fn public_key(&self) -> nostr_sdk::PublicKey {
        self.keys.public_key()
    }

    /// A hub config with the driver spawned for `relays`, `allow`ed senders, the runtime
    /// (`None`: echo) and extra driver settings.
    fn hub_config(
        &self,
        relays: &[String],
        allow: &[String],
        runtime: Option<&Path>,
        extra: &[(&str, &str)],
    ) -> String {
        let mut env = vec![
            ("CHANNELD_NOSTR_RELAYS".to_owned(), relays.join(",")),
            ("CHANNELD_NOSTR_SECRET_KEY".to_owned(), self.keys.secret_key().to_secret_hex()),
            ("CHANNELD_NOSTR_STATE_DIR".to_owned(), self.state.path().display().to_string()),
            ("CHANNELD_NOSTR_SEND_TIMEOUT".to_owned(), "3".to_owned()),
            ("CHANNELD_NOSTR_RECONNECT".to_owned(), "0.5".to_owned()),
            ("CHANNELD_LOG".to_owned(), "debug".to_owned()),
        ];
        env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let env: Vec<String> = env.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
        let allow: Vec<String> = allow.iter().map(|a| format!("{a:?}")).collect();
        let runtime = match runtime {
            Some(agent) => format!(
                "[runtime.agent]\nkind = \"exec\"\ncommand = [{:?}]\n",
                agent.display().to_string()
            ),
            None => String::new(),
        };
        let runtime_line = if runtime.is_empty() { "" } else { "runtime = \"agent\"\n" };
        format!(
            "[hub]\nhealth_probe_interval_secs = 1\n{runtime}\
             [instance.\"{BOT}\"]\nallow = [{}]\n{runtime_line}spawn = [{:?}]\nspawn_env = {{ {} }}\n",
            allow.join(", "),
            workspace_bin("channeld-nostr").display().to_string(),
            env.join(", ")
        )
    }
}

/// Waits until the driver is connected to the hub and Ready (a relay connected and
/// subscribed); returns the status.
async fn wait_ready(hub: &HubProcess) -> Value {
    wait_health(hub, "Ready").await
}

async fn wait_health(hub: &HubProcess, state: &str) -> Value {
    // Until the driver reports its own health the hub shows its placeholder "driver
    // connected" as Ready; wait for the driver's report.
    let check = |status: &Value| {
        let reported = status["health"]["detail"] != "driver connected";
        status["connected"] == true && status["health"]["state"] == state && reported
    };
    hub.wait_status(BOT, state, READY_WITHIN, check, String::new).await
}

fn counter(hub: &HubProcess, name: &str) -> u64 {
    hub.instance_status(BOT)["counters"][name].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nip17_and_nip04_messages_are_answered_in_the_nip_they_came_in() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(
        &[relay.url()],
        &[alice.npub()],
        None,
        &[("CHANNELD_NOSTR_NAME", "channeld test bot"), ("CHANNELD_NOSTR_CHUNK_BYTES", "4000")],
    ));
    let status = wait_ready(&hub).await;
    let npub = bot.public_key().to_bech32().unwrap();
    let detail = status["health"]["detail"].as_str().unwrap_or_default();
    assert!(detail.starts_with(&format!("{npub} listening on 1 of 1 relays")), "{status}");

    let asked = alice.send_nip17(bot.public_key(), "ping over NIP-17").await;
    let reply = alice.next_message(MESSAGE_WITHIN).await;
    assert_eq!((reply.nip, reply.kind), (17, Kind::PrivateDirectMessage));
    assert_eq!(reply.text, "ping over NIP-17");
    assert_eq!(reply.sender, bot.public_key(), "the seal is the bot's");
    assert_eq!(reply.reply_to, Some(asked), "the reply names its parent");

    let asked = alice.send_nip04(bot.public_key(), "ping over NIP-04").await;
    let reply = alice.next_message(MESSAGE_WITHIN).await;
    assert_eq!((reply.nip, reply.text.as_str()), (4, "ping over NIP-04"));
    assert_eq!(reply.reply_to, Some(asked));

    // A long reply comes in chunks of at most 4,000 bytes, in order.
    let long: String = (0..900).map(|n| format!("word{n:04} ")).collect();
    alice.send_nip17(bot.public_key(), &long).await;
    let mut parts: Vec<String> = Vec::new();
    while parts.concat().len() < long.len() {
        let part = alice.next_message(MESSAGE_WITHIN).await;
        assert_eq!(part.nip, 17);
        assert!(part.text.len() <= 4000, "a chunk of {} bytes", part.text.len());
        parts.push(part.text);
    }
    assert_eq!(parts.len(), 3, "{} bytes in chunks of 4,000", long.len());
    assert_eq!(parts.concat(), long, "the chunks, joined, are the reply");

    // A proactive send goes to the npub in the NIP the conversation last spoke (NIP-17 now).
    let out = hub.ctl(&["send", BOT, "--conversation", &alice.npub(), "deploy finished"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let sent = alice.next_message(MESSAGE_WITHIN).await;
    assert_eq!((sent.nip, sent.text.as_str()), (17, "deploy finished"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&sent.id.to_hex()), "the receipt names the rumor id: {stdout}");

    // At start the bot published where it reads (kind 10050) and its name (kind 0).
    let inbox = relay.events(Filter::new().kind(Kind::InboxRelays).author(bot.public_key())).await;
    assert_eq!(inbox.len(), 1);
    assert!(inbox[0].tags.iter().any(|tag| tag.as_slice() == ["relay", relay.url().as_str()]));
    let profile = relay.count(Filter::new().kind(Kind::Metadata).author(bot.public_key())).await;
    assert_eq!(profile, 1);
    assert_eq!(counter(&hub, "inbound"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gift_wrap_backdated_by_40_hours_is_received() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(&[relay.url()], &[alice.npub()], None, &[]));
    wait_ready(&hub).await;
    let age = Duration::from_secs(40 * 3600);
    let asked = alice.send_nip17_backdated(bot.public_key(), "from the past", age).await;
    let reply = alice.next_message(MESSAGE_WITHIN).await;
    assert_eq!((reply.text.as_str(), reply.reply_to), ("from the past", Some(asked)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_driver_restarted_by_the_hub_repeats_nothing_and_misses_nothing() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(&[relay.url()], &[alice.npub()], None, &[]));
    wait_ready(&hub).await;
    alice.send_nip17(bot.public_key(), "one").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "one");
    alice.send_nip04(bot.public_key(), "two").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "two");
    // A backdated wrap, so the restarted driver's lookback brings it again too.
    alice.send_nip17_backdated(bot.public_key(), "three", Duration::from_secs(30 * 3600)).await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "three");
    // The driver logs (to the hub's log) once each reply is posted and saved.
    hub.wait_log("reply posted and saved", 3, MESSAGE_WITHIN);

    let status = hub.instance_status(BOT);
    let pid = status["driver_process"]["pid"].as_i64().expect("driver pid") as i32;
    // SAFETY: a plain syscall on the hub's child, which this test started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(Instant::now() < deadline, "the driver survived SIGKILL");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Sent while no driver runs (the hub waits a second before restarting it).
    alice.send_nip17(bot.public_key(), "while down").await;
    assert_eq!(hub.instance_status(BOT)["connected"], false, "sent while the driver was down");

    let status = wait_ready(&hub).await;
    assert_eq!(status["driver_process"]["starts"], 2, "{status}");
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "while down");
    // The restarted driver subscribed from its checkpoint minus the lookback and had every
    // older event again before this one; none of them reached the hub a second time.
    alice.send_nip17(bot.public_key(), "after").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "after");
    assert_eq!(counter(&hub, "inbound"), 5, "{}", hub.instance_status(BOT));
    assert_eq!(relay.direct_messages_to(&alice.public_key()).await, 5, "one reply each");
    assert!(alice.next_within(Duration::from_millis(500)).await.is_none(), "nothing repeated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_a_forged_seal_are_skipped_and_the_driver_carries_on() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let mallory = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(&[relay.url()], &[alice.npub()], None, &[]));
    let status = wait_ready(&hub).await;
    mallory.send_garbage_wrap(bot.public_key()).await;
    // Claims to be alice (who is allowed); the seal says mallory.
    mallory.send_forged_seal(bot.public_key(), alice.public_key(), "wire the money").await;
    alice.send_nip17(bot.public_key(), "genuine").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "genuine");
    assert_eq!(counter(&hub, "inbound"), 1, "only the genuine message reached the hub");
    let log = hub.log();
    assert!(log.contains("forged seal"), "{log}");
    assert!(log.contains("cannot unwrap the gift wrap"), "{log}");
    let now = hub.instance_status(BOT);
    assert_eq!(now["driver_process"]["starts"], status["driver_process"]["starts"], "not fatal");
    assert_eq!(now["health"]["state"], "Ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_of_two_relays_down_messages_are_answered_and_sends_receipted() {
    let relay = TestRelay::start().await;
    let down = format!("ws://127.0.0.1:{}", free_port());
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(
        &[relay.url(), down.clone()],
        &[alice.npub()],
        None,
        &[],
    ));
    let status = wait_ready(&hub).await;
    let detail = status["health"]["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("listening on 1 of 2 relays"), "{detail}");
    alice.send_nip17(bot.public_key(), "hello").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "hello");
    let out = hub.ctl(&["send", BOT, "--conversation", &alice.npub(), "still here"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "still here");
    let health = hub.ctl(&["health", BOT]);
    let text = String::from_utf8_lossy(&health.stdout);
    assert!(text.contains(&format!("{down} disconnected")), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_relay_refuses_a_send_fails_with_each_relays_reason() {
    let refusing = |why: &str| TestRelay::start_with(Behaviour::Refuse(format!("blocked: {why}")));
    let (one, two) = (refusing("first says no").await, refusing("second says no").await);
    let bot = Bot::new();
    let alice = Keys::generate().public_key().to_bech32().unwrap();
    let hub = HubProcess::start(&bot.hub_config(
        &[one.url(), two.url()],
        std::slice::from_ref(&alice),
        None,
        &[],
    ));
    wait_ready(&hub).await;
    let out = hub.ctl(&["send", BOT, "--conversation", &alice, "nobody takes this"]);
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(6), "{text}");
    assert!(text.contains("first says no") && text.contains("second says no"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_answers_makes_the_send_unknown() {
    let relay = TestRelay::start_with(Behaviour::Silent).await;
    let bot = Bot::new();
    let alice = Keys::generate().public_key().to_bech32().unwrap();
    let hub =
        HubProcess::start(&bot.hub_config(&[relay.url()], std::slice::from_ref(&alice), None, &[]));
    wait_ready(&hub).await;
    let out = hub.ctl(&["send", BOT, "--conversation", &alice, "into the void"]);
    assert_eq!(out.status.code(), Some(5), "outcome unknown: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_not_on_the_allowlist_gets_no_answer() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let mut stranger = NostrTestClient::connect(&[relay.url()]).await;
    let hub = HubProcess::start(&bot.hub_config(&[relay.url()], &[alice.npub()], None, &[]));
    wait_ready(&hub).await;
    stranger.send_nip17(bot.public_key(), "let me in").await;
    stranger.send_nip04(bot.public_key(), "please").await;
    alice.send_nip17(bot.public_key(), "hi").await;
    assert_eq!(alice.next_message(MESSAGE_WITHIN).await.text, "hi");
    assert_eq!(counter(&hub, "denied"), 2);
    assert_eq!(relay.direct_messages_to(&stranger.public_key()).await, 0, "nothing was sent");
    assert!(stranger.next_within(Duration::from_millis(200)).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaction_from_the_agent_reaches_the_user_gift_wrapped() {
    let relay = TestRelay::start().await;
    let bot = Bot::new();
    let mut alice = NostrTestClient::connect(&[relay.url()]).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(
        dir.path(),
        "agent.sh",
        "IFS= read -r line\n\
         id=$(printf '%s' \"$line\" | sed -n 's/.*\"event_id\":\"\\([^\"]*\\)\".*/\\1/p')\n\
         echo '{\"type\":\"effect\",\"effect\":{\"type\":\"reaction\",\"message_id\":\"'\"$id\"'\",\"emoji\":\"👍\",\"remove\":false}}'\n\
         echo seen\n",
    );
    let hub =
        HubProcess::start(&bot.hub_config(&[relay.url()], &[alice.npub()], Some(&agent), &[]));
    wait_ready(&hub).await;
    let asked = alice.send_nip17(bot.public_key(), "react to this").await;
    let mut got =
        [alice.next_message(MESSAGE_WITHIN).await, alice.next_message(MESSAGE_WITHIN).await];
    got.sort_by_key(|m| m.kind.as_u16());
    let (reaction, reply) = (&got[0], &got[1]);
    assert_eq!((reaction.kind, reaction.text.as_str()), (Kind::Reaction, "👍"));
    assert_eq!(reaction.sender, bot.public_key());
    assert_eq!(reaction.reply_to, Some(asked), "it names the message reacted to");
    assert_eq!(reply.text, "seen");
    let public = relay.count(Filter::new().kind(Kind::Reaction)).await;
    assert_eq!(public, 0, "no public kind-7 event: the reaction is wrapped");
}

#[test]
fn invalid_settings_exit_78_naming_the_setting_and_never_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nostr.bot.sock");
    let key = "nsec1canarythisisnotavalidkey";
    let cases: [(&[(&str, &str)], &str); 3] = [
        (&[("CHANNELD_NOSTR_SECRET_KEY", key)], "CHANNELD_NOSTR_RELAYS is not set"),
        (
            &[("CHANNELD_NOSTR_RELAYS", "ws://127.0.0.1:1"), ("CHANNELD_NOSTR_SECRET_KEY", key)],
            "nostr-secret-key (or CHANNELD_NOSTR_SECRET_KEY) is invalid",
        ),
        (
            &[("CHANNELD_NOSTR_RELAYS", "ws://127.0.0.1:1")],
            "credential nostr-secret-key (or CHANNELD_NOSTR_SECRET_KEY) is not set",
        ),
    ];
    for (env, reason) in cases {
        let out = Command::new(workspace_bin("channeld-nostr"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CHANNELD_CHANNEL_ID", BOT)
            .env("CHANNELD_SOCKET", &socket)
            .env("CHANNELD_NOSTR_STATE_DIR", dir.path())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run channeld-nostr");
        let log = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{env:?}: {log}");
        assert!(log.contains(reason), "{env:?}: {log}");
        assert!(!log.contains("canary"), "{log}");
    }
}

/// `wss://` goes through rustls with the provider the SDK installed (ring): against a
/// loopback port that speaks no TLS, the driver sends a TLS ClientHello (record type 0x16)
/// instead of panicking for want of a provider, and reports the relay as failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wss_relay_is_dialled_with_the_sdks_tls_provider() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let first_bytes = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("the driver dials the relay");
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut header = [0u8; 3];
        stream.read_exact(&mut header).expect("the driver writes a TLS record");
        header
        // Dropping the stream fails the handshake.
    });
    let bot = Bot::new();
    let alice = Keys::generate().public_key().to_bech32().unwrap();
    let wss = format!("wss://127.0.0.1:{port}");
    let hub = HubProcess::start(&bot.hub_config(std::slice::from_ref(&wss), &[alice], None, &[]));
    let header = tokio::task::spawn_blocking(move || first_bytes.join().unwrap()).await.unwrap();
    assert_eq!(header[0], 0x16, "a TLS handshake record");
    assert_eq!(header[1], 0x03, "TLS major version 3");
    let status = wait_health(&hub, "Degraded").await;
    let pid = status["driver_process"]["pid"].as_i64().expect("pid") as i32;
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let status = hub.instance_status(BOT);
        let detail = status["health"]["detail"].as_str().unwrap_or_default().to_owned();
        if detail.contains(&format!("{wss} disconnected")) {
            break;
        }
        assert!(Instant::now() < deadline, "no failed attempt reported: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(alive(pid), "the driver is still running");
    assert_eq!(hub.instance_status(BOT)["driver_process"]["starts"], 1);
    assert!(!hub.log().contains("CryptoProvider"), "{}", hub.log());
}
