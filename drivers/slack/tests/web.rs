//! The Web API client's classification of Slack's answers against the fake Slack and a
//! closed port: what certainly did nothing, what may have, and what asks to wait.

use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

use channeld_driver_sdk::Secret;
use channeld_driver_sdk::transport::http::{self, HttpOptions};
use channeld_slack::web::{CallError, WebApi};
use channeld_slack::wire;
use channeld_tests::fakes::slack::{FakeSlack, FakeSlackOptions, Fault};
use serde_json::json;

fn api(base: String, fake: &FakeSlackOptions) -> WebApi {
    channeld_driver_sdk::install_crypto_provider();
    let options =
        HttpOptions { timeout: Duration::from_secs(1), ..HttpOptions::for_driver("slack") };
    let client = http::client(&options).unwrap();
    WebApi::new(
        client,
        base,
        Secret::new(fake.app_token.clone()),
        Secret::new(fake.bot_token.clone()),
    )
}

async fn post(api: &WebApi) -> Result<wire::Posted, CallError> {
    api.call("chat.postMessage", &json!({"channel": "C1", "text": "hi"})).await
}

#[tokio::test]
async fn answers_are_classified_by_what_may_have_happened() {
    let fake = FakeSlack::start().await;
    let api = api(fake.api_url(), fake.options());
    assert_eq!(post(&api).await.unwrap().channel, "C1");

    fake.fail("chat.postMessage", Fault::Error("not_in_channel".into()), Some(1));
    assert_eq!(post(&api).await.unwrap_err(), CallError::Slack("not_in_channel".into()));
    fake.fail("chat.postMessage", Fault::RateLimited { retry_after_secs: 7 }, Some(1));
    assert_eq!(post(&api).await.unwrap_err(), CallError::RateLimited(Duration::from_secs(7)));
    fake.fail("chat.postMessage", Fault::ServerError(503), Some(1));
    assert!(
        matches!(post(&api).await.unwrap_err(), CallError::Unknown(reason) if reason.contains("503"))
    );
    fake.fail("chat.postMessage", Fault::Hang, Some(1));
    assert!(
        matches!(post(&api).await.unwrap_err(), CallError::Unknown(_)),
        "a timeout may have posted"
    );
}

#[tokio::test]
async fn a_closed_port_is_not_sent_and_errors_never_carry_a_token() {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
    let options = FakeSlackOptions::default();
    let api = api(format!("http://127.0.0.1:{port}/api/"), &options);
    let err = post(&api).await.unwrap_err();
    assert!(matches!(err, CallError::NotSent(_)), "{err:?}");
    let text = err.to_string();
    assert!(!text.contains(&options.bot_token) && !text.contains("xoxb"), "{text}");
}

#[tokio::test]
async fn each_method_carries_its_own_token_and_reads_take_form_arguments() {
    let fake = FakeSlack::start().await;
    fake.add_user("U1", "Ada Lovelace", "ada");
    let api = api(fake.api_url(), fake.options());
    assert!(api.connections_open().await.unwrap().starts_with("ws://127.0.0.1:"));
    assert_eq!(api.auth_test().await.unwrap().user_id, "U0BOT");
    let user = api.users_info("U1").await.unwrap().user;
    assert_eq!(user.profile.and_then(|p| p.display_name).as_deref(), Some("ada"));
    let record = fake.record();
    assert_eq!(record.calls_to("apps.connections.open")[0].token, "app");
    assert_eq!(record.calls_to("auth.test")[0].token, "bot");
    assert_eq!(
        record.calls_to("users.info")[0].content_type.as_deref(),
        Some("application/x-www-form-urlencoded")
    );
}
