//! Secrets stay secret, AMQP: `channeld-amqp` runs with a canary password inside its broker
//! URL (a `LoadCredential=` file) against an unreachable broker, a RabbitMQ that rejects the
//! login and one that accepts it; the canary must appear nowhere an operator or the hub can
//! see (see `canary/mod.rs`).

mod canary;

use std::path::Path;

use canary::{Broker, canary, closed_port, credentials, every_frame_on_the_wire, through_the_hub};
use channeld_tests::rabbitmq::{AmqpTestClient, RabbitMq};

/// Where the AMQP driver's proactive sends go (the default exchange routes by queue name).
const OUTBOUND_QUEUE: &str = "canary.outbound";

fn amqp_env(url_credential: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("CREDENTIALS_DIRECTORY", url_credential.display().to_string()),
        ("CHANNELD_AMQP_QUEUE", "canary.inbound".to_owned()),
        ("CHANNELD_AMQP_CONFIRM_TIMEOUT_SECONDS", "3".to_owned()),
        ("CHANNELD_AMQP_OUTBOUND_ROUTING_KEY", OUTBOUND_QUEUE.to_owned()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_url_from_a_credential_never_leaks() {
    let secret = canary("amqp");
    let unreachable =
        credentials("amqp-url", &format!("amqp://bot:{secret}@127.0.0.1:{}/%2f", closed_port()));
    let env = amqp_env(unreachable.path());
    through_the_hub("channeld-amqp", "amqp.canary", Broker::Unreachable, &env, &[&secret]).await;
    every_frame_on_the_wire("channeld-amqp", "amqp.canary", &env, &[&secret]).await;

    let broker = RabbitMq::start();
    let url = credentials("amqp-url", &broker.url("bot", &secret));
    let env = amqp_env(url.path());
    through_the_hub("channeld-amqp", "amqp.canary", Broker::Rejecting, &env, &[&secret]).await;
    broker.add_user("bot", &secret);
    AmqpTestClient::connect(&broker.guest_url()).await.declare_queue(OUTBOUND_QUEUE).await;
    through_the_hub("channeld-amqp", "amqp.canary", Broker::Accepting, &env, &[&secret]).await;
}
