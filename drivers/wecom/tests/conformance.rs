//! The SDK's conformance suite against the WeCom driver, run in-process against the fake
//! WeCom server (one per check).

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask};
use channeld_tests::fakes::wecom::{FakeConfig, FakeWeCom, payloads};
use channeld_wecom::{WeComConfig, WeComDriver};
use std::time::Duration;

const BOT: &str = "aib-conformance";
const SECRET: &str = "conformance-secret";
/// The user the platform knows: proactive sends go to them.
const USER: &str = "alice";

/// The driver in-process, its fake WeCom, and a counter for unique message ids.
#[derive(Default)]
struct WeComHarness {
    fake: Option<FakeWeCom>,
    task: Option<DriverTask>,
    messages: u32,
}

impl WeComHarness {
    fn fake(&self) -> &FakeWeCom {
        self.fake.as_ref().expect("harness started")
    }
}

impl ConformanceHarness for WeComHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let fake = FakeWeCom::start(FakeConfig::new(BOT, SECRET)).await;
        fake.know_chat(USER);
        let launch = launch
            .with_var("WECOM_WS_URL", fake.url())
            .with_var("WECOM_BOT_ID", BOT)
            .with_var("WECOM_SECRET", SECRET)
            .with_var("WECOM_SEND_QUEUE_SECONDS", "5");
        let config = WeComConfig::from_launch(&launch).expect("valid WeCom settings");
        self.task = Some(DriverTask::spawn(WeComDriver::new(config), launch));
        self.fake = Some(fake);
    }

    async fn inject_inbound(&mut self, text: &str) {
        self.messages += 1;
        let msgid = format!("conformance-msg-{}", self.messages);
        // The driver subscribes once the hub accepted it; wait for that.
        self.fake().wait_live(Duration::from_secs(20)).await;
        self.fake().push_message(payloads::text(&msgid, USER, text)).expect("a live connection");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(USER).expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let task = self.task.take().expect("driver started");
        task.stop().await.is_ok()
    }

    fn platform_posts(&self) -> usize {
        self.fake().record().messages()
    }
}

channeld_driver_sdk::conformance_suite!(crate::WeComHarness::default());
