//! The Nostr driver's stop against a relay that never answers, in-process between the SDK's
//! fake hub and two real relays (nostr-relay-builder's): one stores direct messages, the
//! other takes them and never sends its `OK`.

use std::time::Duration;

use channeld_driver_sdk::protocol::types::{HealthState, MessageTarget};
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{AckMode, DRAIN, DriverTask, FakeHub, temp_dir};
use channeld_nostr::{NostrConfig, NostrDriver};
use channeld_tests::nostr_relay::{Behaviour, NostrTestClient, TestRelay};
use nostr_sdk::Keys;
use tokio::time::Instant;

const CHANNEL: &str = "nostr.test";
const WITHIN: Duration = Duration::from_secs(20);

/// A stop with both of the driver's waits outstanding — an inbound the hub never answered
/// (waited for up to half the drain) and a post one relay never answered after the other
/// stored it (a straggler, waited for up to the send timeout) — still returns before the
/// hub's drain deadline: the straggler gets only what the drain leaves, not another half of
/// it (`Hub::stop_budget`), and not the send timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_answers_a_post_does_not_hold_the_stop_past_the_drain() {
    let storing = TestRelay::start().await;
    let silent = TestRelay::start_with(Behaviour::Silent).await;
    let bot = Keys::generate();
    let state = temp_dir("nostr-stop");
    let hub = FakeHub::bind().await;
    let launch = hub
        .launch_config(CHANNEL)
        .with_var("NOSTR_RELAYS", format!("{},{}", storing.url(), silent.url()))
        .with_var("NOSTR_SECRET_KEY", bot.secret_key().to_secret_hex())
        .with_var("NOSTR_STATE_DIR", state.path().display().to_string())
        .with_var("NOSTR_PUBLISH_INBOX", "false")
        .with_var("NOSTR_SEND_TIMEOUT", "30");
    let config = NostrConfig::from_launch(&launch, None).expect("valid Nostr settings");
    let task = DriverTask::spawn(NostrDriver::new(config).expect("driver builds"), launch);
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;

    // Both relays connected and subscribed, so a post goes to both.
    conn.wait_health(WITHIN, "Ready on both relays", |health| {
        health.state == HealthState::Ready
            && health.detail.as_deref().is_some_and(|d| d.contains("listening on 2 of 2 relays"))
    })
    .await;

    // An inbound the hub leaves unanswered.
    let user = NostrTestClient::connect(&[storing.url()]).await;
    user.send_nip17(bot.public_key(), "are you there?").await;
    let inbound = conn.expect_inbound().await;
    assert_eq!(inbound.message.body.text_str(), "are you there?");

    // A post the storing relay receipts while the silent one keeps it waiting.
    let target = MessageTarget::new(
        ChannelId::new(CHANNEL).unwrap(),
        Id::new(user.npub()).expect("an npub is an id"),
    );
    conn.outbound("out-1", target, "hello").await;
    conn.expect_receipt("out-1").await;

    let began = Instant::now();
    let (stopped, _) = tokio::join!(task.stop(), conn.expect_stop());
    assert!(stopped.is_ok(), "aborted at the drain deadline: {stopped:?}");
    assert!(began.elapsed() < DRAIN, "{:?}", began.elapsed());
}
