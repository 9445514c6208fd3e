//! Secrets stay secret, Nostr: `channeld-nostr` runs with a canary secret key (from a
//! `LoadCredential=` directory, with another key unused in the environment) against relays
//! that cannot be reached and one that works, while the test exercises probes, sends that
//! fail and one that is receipted, and shutdown. Neither key appears, as hex or as `nsec`,
//! anywhere an operator or the hub can see (see `canary/mod.rs`); the public key does.

// Nostr has no login a relay could refuse, so the harness's `Rejecting` case is not used.
#[allow(dead_code)]
mod canary;

use canary::{
    Broker, closed_port, credentials, every_frame_on_the_wire, through_the_hub, through_the_hub_to,
};
use channeld_tests::nostr_relay::TestRelay;
use nostr_sdk::{Keys, ToBech32};

/// A key's two printable forms: hex and `nsec1…`.
fn forms(keys: &Keys) -> [String; 2] {
    let secret = keys.secret_key();
    [secret.to_secret_hex(), secret.to_bech32().expect("nsec")]
}

fn nostr_env(
    relays: String,
    state: &tempfile::TempDir,
    creds: &tempfile::TempDir,
    unused: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("CHANNELD_NOSTR_RELAYS", relays),
        ("CHANNELD_NOSTR_STATE_DIR", state.path().display().to_string()),
        ("CREDENTIALS_DIRECTORY", creds.path().display().to_string()),
        ("CHANNELD_NOSTR_SECRET_KEY", unused.to_owned()),
        ("CHANNELD_NOSTR_SEND_TIMEOUT", "3".to_owned()),
        ("CHANNELD_NOSTR_RECONNECT", "0.5".to_owned()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nostr_secret_key_from_a_credential_never_leaks() {
    let keys = Keys::generate();
    let unused = Keys::generate();
    let [hex, nsec] = forms(&keys);
    let [unused_hex, unused_nsec] = forms(&unused);
    let canaries = [hex.as_str(), nsec.as_str(), unused_hex.as_str(), unused_nsec.as_str()];
    // The credential as nsec; the environment's unused key as hex.
    let creds = credentials("nostr-secret-key", &nsec);
    let state = tempfile::tempdir().expect("state dir");
    let someone = Keys::generate().public_key().to_bech32().expect("npub");

    let unreachable = format!("ws://127.0.0.1:{},ws://127.0.0.1:{}", closed_port(), closed_port());
    let env = nostr_env(unreachable, &state, &creds, &unused_hex);
    through_the_hub_to(
        "channeld-nostr",
        "nostr.canary",
        Broker::Unreachable,
        &env,
        &canaries,
        &someone,
    )
    .await;
    // A conversation that names nobody is refused at once, without a leak either.
    through_the_hub("channeld-nostr", "nostr.canary", Broker::Unreachable, &env, &canaries).await;
    every_frame_on_the_wire("channeld-nostr", "nostr.canary", &env, &canaries).await;

    // A working relay: the driver did read the credential (its public key is the one the
    // relay sees announcing the inbox), and the receipted send leaks nothing either.
    let relay = TestRelay::start().await;
    let env = nostr_env(relay.url(), &state, &creds, &unused_hex);
    through_the_hub_to(
        "channeld-nostr",
        "nostr.canary",
        Broker::Accepting,
        &env,
        &canaries,
        &someone,
    )
    .await;
    let announced = relay
        .count(
            nostr_sdk::Filter::new().kind(nostr_sdk::Kind::InboxRelays).author(keys.public_key()),
        )
        .await;
    assert_eq!(announced, 1, "the driver runs with the credential's key");
}
