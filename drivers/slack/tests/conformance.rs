//! The SDK's conformance suite against the Slack driver, run in-process against the fake
//! Slack (one per check): people's DMs are injected as Socket Mode events, and the fake's
//! record counts what the driver posted.

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask};
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_slack::{SlackConfig, SlackDriver};
use channeld_tests::fakes::slack::FakeSlack;

/// The channel proactive sends go to.
const OUTBOUND_CHANNEL: &str = "C0CONFORMANCE";

struct SlackHarness {
    fake: Option<FakeSlack>,
    task: Option<DriverTask>,
}

impl SlackHarness {
    fn new() -> Self {
        Self { fake: None, task: None }
    }

    fn fake(&self) -> &FakeSlack {
        self.fake.as_ref().expect("harness started")
    }
}

impl ConformanceHarness for SlackHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let fake = FakeSlack::start().await;
        let launch = launch
            .with_var("SLACK_API_URL", fake.api_url())
            .with_var("SLACK_APP_TOKEN", fake.options().app_token.clone())
            .with_var("SLACK_BOT_TOKEN", fake.options().bot_token.clone())
            .with_var("SLACK_POST_INTERVAL_MS", "0");
        let config = SlackConfig::from_launch(&launch).expect("valid Slack settings");
        let options =
            HttpOptions { timeout: config.http_timeout, ..HttpOptions::for_driver("slack") };
        let client = http::client(&options).expect("HTTP client");
        self.task = Some(DriverTask::spawn(SlackDriver::new(config, client), launch));
        self.fake = Some(fake);
    }

    async fn inject_inbound(&mut self, text: &str) {
        // Before the socket is up the fake keeps the event and delivers it on hello.
        self.fake().user_dms("U0PERSON", text);
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(OUTBOUND_CHANNEL).expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let task = self.task.take().expect("driver started");
        task.stop().await.is_ok()
    }

    /// Every `chat.postMessage` the fake accepted: it records a post before answering, so
    /// every receipted post is counted.
    fn platform_posts(&self) -> usize {
        self.fake().record().bot_messages().len()
    }
}

channeld_driver_sdk::conformance_suite!(crate::SlackHarness::new());
