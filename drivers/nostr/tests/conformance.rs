//! The SDK's conformance suite against the Nostr driver, run in-process against a real relay
//! (nostr-relay-builder's, one per check, on its own loopback port). The people on the
//! platform are a test client with its own keys; what the driver posts is counted in the
//! relay's database.

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask, TempDir, temp_dir};
use channeld_nostr::{NostrConfig, NostrDriver};
use channeld_tests::nostr_relay::{NostrTestClient, TestRelay};
use nostr_sdk::Keys;

/// The driver on a private relay, with a user who writes to it.
struct NostrHarness {
    bot: Keys,
    state: TempDir,
    relay: Option<TestRelay>,
    user: Option<NostrTestClient>,
    task: Option<DriverTask>,
}

impl NostrHarness {
    fn new() -> Self {
        Self {
            bot: Keys::generate(),
            state: temp_dir("nostr-state"),
            relay: None,
            user: None,
            task: None,
        }
    }

    fn user(&self) -> &NostrTestClient {
        self.user.as_ref().expect("harness started")
    }
}

impl ConformanceHarness for NostrHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let relay = TestRelay::start().await;
        let launch = launch
            .with_var("NOSTR_RELAYS", relay.url())
            .with_var("NOSTR_SECRET_KEY", self.bot.secret_key().to_secret_hex())
            .with_var("NOSTR_STATE_DIR", self.state.path().display().to_string())
            .with_var("NOSTR_SEND_TIMEOUT", "5")
            .with_var("NOSTR_RECONNECT", "0.5");
        let config = NostrConfig::from_launch(&launch, None).expect("valid Nostr settings");
        let driver = NostrDriver::new(config).expect("driver builds");
        self.user = Some(NostrTestClient::connect(&[relay.url()]).await);
        self.relay = Some(relay);
        self.task = Some(DriverTask::spawn(driver, launch));
    }

    async fn inject_inbound(&mut self, text: &str) {
        self.user().send_nip17(self.bot.public_key(), text).await;
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(self.user().npub()).expect("an npub is an id"))
    }

    async fn stop(&mut self) -> bool {
        self.task.take().expect("driver started").stop().await.is_ok()
    }

    /// Direct messages the relay stored for the user: it stores an event before its `OK`,
    /// so every receipted post is counted.
    fn platform_posts(&self) -> usize {
        let relay = self.relay.as_ref().expect("harness started");
        let user = self.user().public_key();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(relay.direct_messages_to(&user))
        })
    }
}

channeld_driver_sdk::conformance_suite!(crate::NostrHarness::new());
