//! The AMQP driver's stop against a broker that hangs, in-process between the SDK's fake hub
//! and a real RabbitMQ node frozen with SIGSTOP (its connections stay open, nothing on them
//! is answered).

use std::time::Duration;

use channeld_amqp::{AmqpConfig, AmqpDriver};
use channeld_driver_sdk::protocol::types::HealthState;
use channeld_driver_sdk::testing::{AckMode, DRAIN, DriverTask, FakeHub};
use channeld_tests::rabbitmq::RabbitMq;
use tokio::time::Instant;

const WITHIN: Duration = Duration::from_secs(20);

/// Stopping waits on the broker three times — the consumer's cancel, the consuming channel's
/// close and the connection's close — each bounded (half the drain, then 2 s each). Against a
/// hung broker those bounds add up past the hub's 3-s drain; the driver must still return
/// before it, each wait given only what the drain leaves (`Hub::stop_budget`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_hangs_does_not_hold_the_stop_past_the_drain() {
    let mut broker = tokio::task::block_in_place(RabbitMq::start);
    let hub = FakeHub::bind().await;
    let launch = hub
        .launch_config("amqp.test")
        .with_var("AMQP_URL", broker.guest_url())
        .with_var("AMQP_QUEUE", "stop.in");
    let config = AmqpConfig::from_launch(&launch).expect("valid AMQP settings");
    let task = DriverTask::spawn(AmqpDriver::new(config), launch);
    let mut conn = hub.accept().await;
    conn.handshake(AckMode::Extensions).await;
    conn.wait_health(WITHIN, "Ready (consuming)", |health| health.state == HealthState::Ready)
        .await;

    tokio::task::block_in_place(|| broker.pause());
    let began = Instant::now();
    let (stopped, _) = tokio::join!(task.stop(), conn.expect_stop());
    let took = began.elapsed();
    tokio::task::block_in_place(|| broker.resume());
    assert!(stopped.is_ok(), "aborted at the drain deadline: {stopped:?}");
    assert!(took < DRAIN, "{took:?}");
}
