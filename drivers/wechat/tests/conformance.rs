//! The SDK's conformance suite against the WeChat driver, run in-process against the fake
//! iLink server (one per check).

use std::time::Duration;

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask, TempDir, temp_dir};
use channeld_tests::fakes::wechat::{FakeIlink, FakeOptions};
use channeld_wechat::state::{ContextTokens, StateDir};
use channeld_wechat::{WechatConfig, WechatDriver};

/// The person on the platform.
const USER: &str = "o9cq800conformance@im.wechat";

struct WechatHarness {
    fake: Option<FakeIlink>,
    state: TempDir,
    task: Option<DriverTask>,
}

impl WechatHarness {
    fn new() -> Self {
        Self { fake: None, state: temp_dir("wechat-state"), task: None }
    }

    fn fake(&self) -> &FakeIlink {
        self.fake.as_ref().expect("harness started")
    }
}

impl ConformanceHarness for WechatHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let fake = FakeIlink::start_with(FakeOptions {
            hold: Duration::from_secs(2),
            advertised_timeout: Duration::from_secs(2),
            ..FakeOptions::default()
        })
        .await;
        // The user wrote before: a proactive send has a context token to carry.
        let mut contexts = ContextTokens::default();
        contexts.offer(USER, &fake.issue_context_token(USER), None, 0);
        StateDir::open(self.state.path()).unwrap().save_contexts(&contexts).unwrap();
        let launch = launch
            .with_var("WECHAT_BASE_URL", fake.base_url())
            .with_var("WECHAT_BOT_TOKEN", fake.options().bot_token)
            .with_var("WECHAT_STATE_DIR", self.state.path().display().to_string());
        let config = WechatConfig::from_launch(&launch, None).expect("valid WeChat settings");
        let driver = WechatDriver::new(config, channeld_wechat::client::http_client().unwrap())
            .expect("driver builds");
        self.fake = Some(fake);
        self.task = Some(DriverTask::spawn(driver, launch));
    }

    async fn inject_inbound(&mut self, text: &str) {
        self.fake().push_text(USER, text);
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(USER).expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let clean = self.task.take().expect("driver started").stop().await.is_ok();
        self.fake().assert_no_violations();
        clean
    }

    fn platform_posts(&self) -> usize {
        self.fake().records().sent.len()
    }
}

channeld_driver_sdk::conformance_suite!(crate::WechatHarness::new());
