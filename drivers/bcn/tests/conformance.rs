//! The SDK's conformance suite against the BCN driver, run in-process against the fake BCN
//! server (one per check).

use std::time::Duration;

use channeld_bcn::{BcnConfig, BcnDriver};
use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask};
use channeld_tests::fakes::bcn::{FakeBcn, FakeConfig};
use tempfile::TempDir;

const SESSION: &str = "grp-1:conformance";

/// The driver in-process, its fake BCN and its state directory.
#[derive(Default)]
struct BcnHarness {
    fake: Option<FakeBcn>,
    state: Option<TempDir>,
    task: Option<DriverTask>,
}

impl BcnHarness {
    fn fake(&self) -> &FakeBcn {
        self.fake.as_ref().expect("harness started")
    }
}

impl ConformanceHarness for BcnHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let fake = FakeBcn::start(FakeConfig::default()).await;
        let state = TempDir::new().expect("state dir");
        let launch = launch
            .with_var("BCN_URL", fake.url())
            .with_var("BCN_STATE_DIR", state.path().display().to_string())
            .with_var("BCN_SEND_TIMEOUT_SECONDS", "5");
        let config = BcnConfig::from_launch(&launch, None).expect("valid BCN settings");
        self.task = Some(DriverTask::spawn(BcnDriver::new(config), launch));
        self.fake = Some(fake);
        self.state = Some(state);
    }

    async fn inject_inbound(&mut self, text: &str) {
        // The driver connects to BCN once the hub accepted it; wait for that.
        self.fake().wait_online(Duration::from_secs(20)).await;
        self.fake().chat_send(SESSION, text).expect("a bot online");
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new(SESSION).expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let task = self.task.take().expect("driver started");
        task.stop().await.is_ok()
    }

    fn platform_posts(&self) -> usize {
        self.fake().record().events.values().map(Vec::len).sum()
    }
}

channeld_driver_sdk::conformance_suite!(crate::BcnHarness::default());
