//! Secrets stay secret, MQTT: `channeld-mqtt` runs with a canary broker password (from a
//! `LoadCredential=` directory and from the environment) against an unreachable broker, a
//! broker that rejects the login and one that accepts it, while the test exercises errors
//! (probes, a proactive send that cannot be posted, shutdown). The canary must appear in none
//! of: the driver's log (at trace level), the hub's log, `channelctl status|health|send` in
//! text or `--json`, or any frame the driver writes to its hub socket.

mod canary;

use canary::{Broker, canary, closed_port, credentials, every_frame_on_the_wire, through_the_hub};
use channeld_tests::mosquitto::{Mosquitto, MosquittoOptions};

fn mqtt_env(url: String, extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("CHANNELD_MQTT_URL", url),
        ("CHANNELD_MQTT_USERNAME", "bot".to_owned()),
        ("CHANNELD_MQTT_PUBLISH_TIMEOUT_SECONDS", "3".to_owned()),
    ];
    env.extend_from_slice(extra);
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_password_from_a_credential_never_leaks() {
    let secret = canary("mqtt-credential");
    // The credential wins over the environment; the unused variable must not leak either.
    let unused = canary("mqtt-env-unused");
    let creds = credentials("mqtt-password", &secret);
    let extra = [
        ("CREDENTIALS_DIRECTORY", creds.path().display().to_string()),
        ("CHANNELD_MQTT_PASSWORD", unused.clone()),
    ];
    let canaries = [secret.as_str(), unused.as_str()];
    let unreachable = format!("mqtt://127.0.0.1:{}", closed_port());
    through_the_hub(
        "channeld-mqtt",
        "mqtt.canary",
        Broker::Unreachable,
        &mqtt_env(unreachable, &extra),
        &canaries,
    )
    .await;

    let rejecting = Mosquitto::start_with(MosquittoOptions {
        users: vec![("bot".into(), canary("other"))],
        ..MosquittoOptions::default()
    });
    let env = mqtt_env(rejecting.url(), &extra);
    through_the_hub("channeld-mqtt", "mqtt.canary", Broker::Rejecting, &env, &canaries).await;
    every_frame_on_the_wire("channeld-mqtt", "mqtt.canary", &env, &canaries).await;

    // The same credential opens a broker that knows it: the driver did read the file.
    let accepting = Mosquitto::start_with(MosquittoOptions {
        users: vec![("bot".into(), secret.clone())],
        ..MosquittoOptions::default()
    });
    let env = mqtt_env(accepting.url(), &extra);
    through_the_hub("channeld-mqtt", "mqtt.canary", Broker::Accepting, &env, &canaries).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_password_from_the_environment_never_leaks() {
    let secret = canary("mqtt-env");
    let extra = [("CHANNELD_MQTT_PASSWORD", secret.clone())];
    let rejecting = Mosquitto::start_with(MosquittoOptions {
        users: vec![("bot".into(), canary("other"))],
        ..MosquittoOptions::default()
    });
    let env = mqtt_env(rejecting.url(), &extra);
    through_the_hub("channeld-mqtt", "mqtt.canary", Broker::Rejecting, &env, &[&secret]).await;
}
