//! The SDK's conformance suite against the MQTT driver, run in-process against a real
//! mosquitto (one broker per check, on its own loopback port).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use channeld_driver_sdk::DriverLaunchConfig;
use channeld_driver_sdk::protocol::types::MessageTarget;
use channeld_driver_sdk::protocol::{ChannelId, Id};
use channeld_driver_sdk::testing::{ConformanceHarness, DriverTask};
use channeld_mqtt::{MqttConfig, MqttDriver};
use channeld_tests::mosquitto::{Mosquitto, MqttTestClient, provision_session};

const PREFIX: &str = "conformance";
const SYNC_TOPIC: &str = "conformance/sync";
/// How long the observer waits for its own marker to come back.
const OBSERVE_WITHIN: Duration = Duration::from_secs(10);

/// The driver on a private broker, a publisher playing the people on the platform, and an
/// observer subscribed to the outbound topics that counts what the driver published.
struct MqttHarness {
    broker: Mosquitto,
    publisher: Option<MqttTestClient>,
    observer: Mutex<Option<MqttTestClient>>,
    /// Outbound messages the observer has seen so far.
    posts: AtomicUsize,
    markers: AtomicUsize,
    task: Option<DriverTask>,
}

impl MqttHarness {
    fn new() -> Self {
        Self {
            broker: Mosquitto::start(),
            publisher: None,
            observer: Mutex::new(None),
            posts: AtomicUsize::new(0),
            markers: AtomicUsize::new(0),
            task: None,
        }
    }
}

impl ConformanceHarness for MqttHarness {
    async fn start(&mut self, launch: DriverLaunchConfig) {
        let launch = launch
            .with_var("MQTT_URL", self.broker.url())
            .with_var("MQTT_INBOUND_TOPIC", format!("{PREFIX}/in/{{sender}}/{{conversation}}"))
            .with_var("MQTT_OUTBOUND_TOPIC", format!("{PREFIX}/out/{{conversation}}"));
        let config = MqttConfig::from_launch(&launch).expect("valid MQTT settings");
        let port = self.broker.port();
        // The driver's session exists before it runs, so nothing published meanwhile is lost.
        provision_session(port, &config.client_id, None, &[&config.inbound.filter()]).await;
        let driver = MqttDriver::new(config).expect("driver builds");
        let observer =
            MqttTestClient::connect(port, "observer", &[&format!("{PREFIX}/out/+"), SYNC_TOPIC])
                .await;
        *self.observer.lock().unwrap() = Some(observer);
        self.publisher = Some(MqttTestClient::connect(port, "publisher", &[]).await);
        self.task = Some(DriverTask::spawn(driver, launch));
    }

    async fn inject_inbound(&mut self, text: &str) {
        let payload = serde_json::json!({ "text": text }).to_string();
        let publisher = self.publisher.as_mut().expect("harness started");
        publisher.publish_confirmed(&format!("{PREFIX}/in/alice/c1"), payload).await;
    }

    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget {
        MessageTarget::new(channel.clone(), Id::new("c1").expect("valid id"))
    }

    async fn stop(&mut self) -> bool {
        let task = self.task.take().expect("driver started");
        task.stop().await.is_ok()
    }

    /// Messages the observer received on the outbound topics. A marker it publishes itself
    /// comes back after everything the broker took before it, so the count includes every
    /// post the broker acknowledged before this call.
    fn platform_posts(&self) -> usize {
        let mut observer = self.observer.lock().unwrap();
        let observer = observer.as_mut().expect("harness started");
        let marker = format!("marker-{}", self.markers.fetch_add(1, Ordering::SeqCst));
        let seen = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                observer.publish_confirmed(SYNC_TOPIC, marker.clone()).await;
                let mut seen = 0;
                loop {
                    let message = observer.next_message(OBSERVE_WITHIN).await;
                    if message.topic != SYNC_TOPIC {
                        seen += 1;
                    } else if message.payload == marker.as_bytes() {
                        return seen;
                    }
                }
            })
        });
        self.posts.fetch_add(seen, Ordering::SeqCst) + seen
    }
}

channeld_driver_sdk::conformance_suite!(crate::MqttHarness::new());
