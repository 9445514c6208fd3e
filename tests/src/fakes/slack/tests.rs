//! The fake Slack's own tests: a raw Socket Mode client and plain Web API calls exercise each
//! behaviour and mode the driver tests rely on.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::*;

const WITHIN: Duration = Duration::from_secs(10);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn quick() -> FakeSlackOptions {
    FakeSlackOptions {
        redeliver_after: Duration::from_millis(200),
        refresh_grace: Duration::from_millis(300),
        ping_interval: None,
        echo_bot_messages: false,
        ..FakeSlackOptions::default()
    }
}

async fn call(
    fake: &FakeSlack,
    method: &str,
    token: Option<&str>,
    body: Value,
) -> (u16, Value, Option<String>) {
    channeld_driver_sdk::install_crypto_provider();
    let client = reqwest::Client::new();
    let mut request = client.post(format!("{}{method}", fake.api_url())).json(&body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("fake answers");
    let status = response.status().as_u16();
    let retry_after =
        response.headers().get("retry-after").map(|v| v.to_str().expect("ascii header").to_owned());
    let body = response.json().await.expect("JSON body");
    (status, body, retry_after)
}

async fn bot(fake: &FakeSlack, method: &str, body: Value) -> Value {
    let token = fake.options().bot_token.clone();
    call(fake, method, Some(&token), body).await.1
}

async fn connect_url(fake: &FakeSlack) -> String {
    let token = fake.options().app_token.clone();
    let (status, body, _) = call(fake, "apps.connections.open", Some(&token), json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(body["ok"], true, "{body}");
    body["url"].as_str().expect("url").to_owned()
}

async fn next_json(ws: &mut Ws) -> Value {
    loop {
        let message = tokio::time::timeout(WITHIN, ws.next())
            .await
            .expect("a frame in time")
            .expect("socket open")
            .expect("frame");
        match message {
            Message::Text(text) => return serde_json::from_str(&text).expect("JSON frame"),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
}

/// Opens a socket and reads its `hello`.
async fn open_socket(fake: &FakeSlack) -> Ws {
    let url = connect_url(fake).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.expect("connect");
    let hello = next_json(&mut ws).await;
    assert_eq!(hello["type"], "hello", "{hello}");
    assert_eq!(hello["connection_info"]["app_id"], fake.options().app_id);
    ws
}

async fn ack(ws: &mut Ws, envelope: &Value) {
    let frame = json!({"envelope_id": envelope["envelope_id"]}).to_string();
    ws.send(Message::Text(frame.into())).await.expect("send ack");
}

#[tokio::test]
async fn connection_urls_need_the_app_token_and_are_single_use() {
    let fake = FakeSlack::start_with(quick()).await;
    let bot_token = fake.options().bot_token.clone();
    let (_, refused, _) = call(&fake, "apps.connections.open", Some(&bot_token), json!({})).await;
    assert_eq!(refused["error"], "not_allowed_token_type");
    let (_, missing, _) = call(&fake, "apps.connections.open", None, json!({})).await;
    assert_eq!(missing["error"], "not_authed");

    let url = connect_url(&fake).await;
    assert!(url.starts_with("ws://127.0.0.1:"), "{url}");
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.expect("first use");
    assert_eq!(next_json(&mut ws).await["type"], "hello");
    assert!(
        tokio_tungstenite::connect_async(url.as_str()).await.is_err(),
        "a ticket is single-use"
    );
}

#[tokio::test]
async fn web_api_errors_are_http_200_with_ok_false() {
    let fake = FakeSlack::start_with(quick()).await;
    let (status, body, _) =
        call(&fake, "chat.postMessage", Some("xoxb-wrong"), json!({"channel": "C1", "text": "x"}))
            .await;
    assert_eq!((status, body["error"].as_str()), (200, Some("invalid_auth")));
    let app_token = fake.options().app_token.clone();
    let (_, body, _) =
        call(&fake, "chat.postMessage", Some(&app_token), json!({"channel": "C1", "text": "x"}))
            .await;
    assert_eq!(body["error"], "not_allowed_token_type");
    assert_eq!(bot(&fake, "chat.postMessage", json!({"channel": "C1"})).await["error"], "no_text");
    let long = "x".repeat(MAX_TEXT_CHARS + 1);
    assert_eq!(
        bot(&fake, "chat.postMessage", json!({"channel": "C1", "text": long})).await["error"],
        "msg_too_long"
    );
    fake.fail_channel("C404", "channel_not_found");
    assert_eq!(
        bot(&fake, "chat.postMessage", json!({"channel": "C404", "text": "x"})).await["error"],
        "channel_not_found"
    );
    fake.revoke_tokens(true);
    assert_eq!(bot(&fake, "auth.test", json!({})).await["error"], "invalid_auth");
    fake.revoke_tokens(false);
    let auth = bot(&fake, "auth.test", json!({})).await;
    assert_eq!((auth["user_id"].as_str(), auth["bot_id"].as_str()), (Some("U0BOT"), Some("B0BOT")));
}

#[tokio::test]
async fn users_info_takes_form_arguments_only() {
    channeld_driver_sdk::install_crypto_provider();
    let fake = FakeSlack::start_with(quick()).await;
    fake.add_user("U1", "Ada Lovelace", "ada");
    assert_eq!(bot(&fake, "users.info", json!({"user": "U1"})).await["error"], "invalid_arguments");
    let response = reqwest::Client::new()
        .post(format!("{}users.info", fake.api_url()))
        .bearer_auth(&fake.options().bot_token)
        .form(&[("user", "U1")])
        .send()
        .await
        .expect("fake answers");
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["user"]["profile"]["display_name"], "ada", "{body}");
    let query = reqwest::Client::new()
        .post(format!("{}users.info", fake.api_url()))
        .bearer_auth(&fake.options().bot_token)
        .query(&[("user", "U2")])
        .send()
        .await
        .expect("fake answers");
    let body: Value = query.json().await.expect("JSON");
    assert_eq!(body["error"], "user_not_found");
}

#[tokio::test]
async fn faults_rate_limit_then_answer_normally() {
    let fake = FakeSlack::start_with(quick()).await;
    fake.fail("chat.postMessage", Fault::RateLimited { retry_after_secs: 2 }, Some(1));
    let token = fake.options().bot_token.clone();
    let (status, body, retry_after) =
        call(&fake, "chat.postMessage", Some(&token), json!({"channel": "C1", "text": "x"})).await;
    assert_eq!(
        (status, body["error"].as_str(), retry_after.as_deref()),
        (429, Some("ratelimited"), Some("2"))
    );
    let posted = bot(&fake, "chat.postMessage", json!({"channel": "C1", "text": "x"})).await;
    assert_eq!(posted["ok"], true, "{posted}");
    let record = fake.record();
    assert_eq!(record.calls_to("chat.postMessage").len(), 2);
    assert_eq!(record.visible_bot_messages("C1").len(), 1, "the rate-limited call posted nothing");
}

#[tokio::test]
async fn messages_update_delete_react_and_open_dms() {
    let fake = FakeSlack::start_with(quick()).await;
    let posted =
        bot(&fake, "chat.postMessage", json!({"channel": "C1", "text": "one", "thread_ts": "1.0"}))
            .await;
    let ts = posted["ts"].as_str().expect("ts").to_owned();
    assert_eq!(posted["message"]["bot_id"], "B0BOT");
    assert_eq!(
        bot(&fake, "chat.update", json!({"channel": "C1", "ts": ts, "text": "two"})).await["ok"],
        true
    );
    assert_eq!(
        bot(&fake, "chat.update", json!({"channel": "C1", "ts": "9.9", "text": "x"})).await["error"],
        "message_not_found"
    );
    let react = json!({"channel": "C1", "timestamp": ts, "name": "eyes"});
    assert_eq!(bot(&fake, "reactions.add", react.clone()).await["ok"], true);
    assert_eq!(bot(&fake, "reactions.add", react.clone()).await["error"], "already_reacted");
    assert_eq!(bot(&fake, "reactions.remove", react.clone()).await["ok"], true);
    assert_eq!(bot(&fake, "reactions.remove", react).await["error"], "no_reaction");
    let colons = json!({"channel": "C1", "timestamp": ts, "name": ":eyes:"});
    assert_eq!(bot(&fake, "reactions.add", colons).await["error"], "invalid_name");
    let message = fake.record().message("C1", &ts).cloned().expect("stored");
    assert_eq!(
        (message.text.as_str(), message.edits.clone(), message.thread_ts.as_deref()),
        ("two", vec!["one".to_owned()], Some("1.0"))
    );
    assert_eq!(bot(&fake, "chat.delete", json!({"channel": "C1", "ts": ts})).await["ok"], true);
    assert!(fake.record().visible_bot_messages("C1").is_empty());
    let opened = bot(&fake, "conversations.open", json!({"users": "U7"})).await;
    assert_eq!(opened["channel"]["id"], dm_channel("U7"));
    let status = json!({"channel_id": "D1", "thread_ts": "1.0", "status": "is thinking…"});
    assert_eq!(bot(&fake, "assistant.threads.setStatus", status).await["ok"], true);
    assert_eq!(fake.record().statuses[0].status, "is thinking…");
}

#[tokio::test]
async fn an_unacknowledged_event_is_redelivered_with_a_new_envelope_id() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut ws = open_socket(&fake).await;
    let said = fake.user_dms("U1", "hello");
    let first = next_json(&mut ws).await;
    assert_eq!(first["type"], "events_api");
    assert_eq!(first["retry_attempt"], 0);
    assert_eq!(first["payload"]["event"]["text"], "hello");
    assert_eq!(first["payload"]["event"]["channel_type"], "im");
    assert_eq!(first["payload"]["event_id"].as_str(), Some(said.event_ids[0].as_str()));
    let second = next_json(&mut ws).await;
    assert_eq!(second["retry_attempt"], 1);
    assert_eq!(second["retry_reason"], "timeout");
    assert_eq!(second["payload"]["event_id"], first["payload"]["event_id"]);
    assert_ne!(second["envelope_id"], first["envelope_id"]);
    ack(&mut ws, &second).await;
    fake.wait_for("the ack", WITHIN, |r| r.event_acked(&said.event_ids[0]).then_some(())).await;
    assert!(fake.shared.lock().outstanding.is_empty(), "an acked event is not redelivered");
    assert!(fake.record().acks.iter().all(|a| a.matched));
}

#[tokio::test]
async fn a_channel_mention_arrives_as_app_mention_and_message() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut ws = open_socket(&fake).await;
    let said = fake.user_posts(
        "C1",
        "U1",
        "<@U0BOT> deploy?",
        None,
        &[file("F1", "a.txt", "text/plain", 3)],
    );
    assert_eq!(said.event_ids.len(), 2);
    let mention = next_json(&mut ws).await;
    let message = next_json(&mut ws).await;
    assert_eq!(mention["payload"]["event"]["type"], "app_mention");
    assert_eq!(message["payload"]["event"]["type"], "message");
    assert_eq!(message["payload"]["event"]["subtype"], "file_share");
    assert_eq!(mention["payload"]["event"]["ts"], message["payload"]["event"]["ts"]);
    assert_ne!(mention["payload"]["event_id"], message["payload"]["event_id"]);
    let plain = fake.user_posts("C1", "U1", "no mention here", None, &[]);
    assert_eq!(plain.event_ids.len(), 1, "only message.channels for a post without a mention");
}

#[tokio::test]
async fn a_refresh_keeps_two_sockets_until_the_old_one_is_closed() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut old = open_socket(&fake).await;
    fake.refresh().await;
    let disconnect = next_json(&mut old).await;
    assert_eq!(
        (disconnect["type"].as_str(), disconnect["reason"].as_str()),
        (Some("disconnect"), Some("refresh_requested"))
    );
    let mut new = open_socket(&fake).await;
    fake.wait_for("two live sockets", WITHIN, |r| {
        (r.sockets.iter().filter(|s| s.is_live()).count() == 2).then_some(())
    })
    .await;
    let a = fake.user_dms("U1", "one");
    let b = fake.user_dms("U1", "two");
    let on_old = next_json(&mut old).await;
    let on_new = next_json(&mut new).await;
    let mut seen = [on_old["payload"]["event_id"].clone(), on_new["payload"]["event_id"].clone()];
    seen.sort_by_key(|v| v.to_string());
    assert_eq!(seen, [json!(a.event_ids[0]), json!(b.event_ids[0])], "each socket delivers one");
    ack(&mut old, &on_old).await;
    ack(&mut new, &on_new).await;
    let closed = fake.wait_for("the old socket closed", WITHIN, |r| r.sockets[0].end.clone()).await;
    assert_eq!(closed, SocketEnd::ByServer);
    assert!(fake.record().sockets[1].is_live());
}

#[tokio::test]
async fn an_ack_counts_only_on_the_socket_that_got_the_envelope() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut one = open_socket(&fake).await;
    let mut two = open_socket(&fake).await;
    let said = fake.user_dms("U1", "x");
    let envelope = tokio::select! {
        frame = next_json(&mut one) => { ack(&mut two, &frame).await; frame }
        frame = next_json(&mut two) => { ack(&mut one, &frame).await; frame }
    };
    let misrouted = fake.wait_for("the ack", WITHIN, |r| r.acks.first().cloned()).await;
    assert!(!misrouted.matched);
    assert_eq!(misrouted.envelope_id, envelope["envelope_id"].as_str().expect("id"));
    assert!(!fake.record().event_acked(&said.event_ids[0]));
}

#[tokio::test]
async fn link_disabled_refuses_new_sockets_and_too_many_sockets_are_refused() {
    let fake = FakeSlack::start_with(FakeSlackOptions { max_sockets: 1, ..quick() }).await;
    let mut first = open_socket(&fake).await;
    let url = connect_url(&fake).await;
    let (mut second, _) = tokio_tungstenite::connect_async(url.as_str()).await.expect("connect");
    let refused = next_json(&mut second).await;
    assert_eq!(refused["reason"], "too_many_websockets");

    fake.disable_link().await;
    assert_eq!(next_json(&mut first).await["reason"], "link_disabled");
    let url = connect_url(&fake).await;
    let (mut third, _) = tokio_tungstenite::connect_async(url.as_str()).await.expect("connect");
    let refused = next_json(&mut third).await;
    assert_eq!(
        (refused["type"].as_str(), refused["reason"].as_str()),
        (Some("disconnect"), Some("link_disabled"))
    );
    fake.enable_link();
    fake.wait_for("the disabled socket closed", WITHIN, |r| r.sockets[0].closed_at.map(drop)).await;
    let _fourth = open_socket(&fake).await;
}

#[tokio::test]
async fn an_abrupt_close_sends_no_close_frame() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut ws = open_socket(&fake).await;
    fake.close_abruptly().await;
    let end = tokio::time::timeout(WITHIN, ws.next()).await.expect("the socket ends");
    assert!(!matches!(end, Some(Ok(Message::Close(_)))), "got a close frame: {end:?}");
    let record = fake.wait_for("the socket closed", WITHIN, |r| r.sockets[0].end.clone()).await;
    assert_eq!(record, SocketEnd::Abrupt);
}

#[tokio::test]
async fn a_silent_socket_gets_no_envelopes() {
    let fake = FakeSlack::start_with(quick()).await;
    let _ws = open_socket(&fake).await;
    fake.go_silent().await;
    fake.wait_for("silence", WITHIN, |r| r.sockets[0].silent.then_some(())).await;
    fake.user_dms("U1", "into the void");
    assert!(fake.record().envelopes.is_empty(), "nothing is sent on a half-open socket");
    let mut fresh = open_socket(&fake).await;
    assert_eq!(next_json(&mut fresh).await["payload"]["event"]["text"], "into the void");
}

#[tokio::test]
async fn bot_posts_are_echoed_and_clicks_carry_the_button() {
    let fake = FakeSlack::start_with(FakeSlackOptions { echo_bot_messages: true, ..quick() }).await;
    let mut ws = open_socket(&fake).await;
    let blocks = json!([{"type": "actions", "block_id": "b1", "elements": [
        {"type": "button", "action_id": "approve", "value": "cmd-1", "text": {"type": "plain_text", "text": "Approve"}}
    ]}]);
    let posted =
        bot(&fake, "chat.postMessage", json!({"channel": "C1", "text": "ok?", "blocks": blocks}))
            .await;
    let echo = next_json(&mut ws).await;
    assert_eq!(echo["payload"]["event"]["bot_id"], "B0BOT");
    ack(&mut ws, &echo).await;
    let ts = posted["ts"].as_str().expect("ts");
    fake.click("U1", "C1", ts, "approve", None);
    let click = next_json(&mut ws).await;
    assert_eq!(click["type"], "interactive");
    assert!(click.get("retry_attempt").is_none());
    let payload = &click["payload"];
    assert_eq!(payload["type"], "block_actions");
    assert_eq!(payload["user"]["id"], "U1");
    assert_eq!(payload["actions"][0]["value"], "cmd-1");
    assert_eq!(payload["container"]["message_ts"], ts);
}

#[tokio::test]
async fn an_acknowledged_event_can_be_redelivered_as_if_the_ack_was_lost() {
    let fake = FakeSlack::start_with(quick()).await;
    let mut ws = open_socket(&fake).await;
    let said = fake.user_dms("U1", "once");
    let first = next_json(&mut ws).await;
    ack(&mut ws, &first).await;
    fake.wait_for("the ack", WITHIN, |r| r.event_acked(&said.event_ids[0]).then_some(())).await;
    fake.redeliver(&said.event_ids[0]);
    let again = next_json(&mut ws).await;
    assert_eq!(again["payload"]["event_id"], first["payload"]["event_id"]);
    assert_eq!(again["retry_attempt"], 1);
    assert_ne!(again["envelope_id"], first["envelope_id"]);
}

#[tokio::test]
async fn posting_faster_than_the_channel_limit_is_rate_limited() {
    let fake =
        FakeSlack::start_with(FakeSlackOptions { posts_per_channel_second: Some(2), ..quick() })
            .await;
    let token = fake.options().bot_token.clone();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            call(&fake, "chat.postMessage", Some(&token), json!({"channel": "C1", "text": "x"}))
                .await
                .0,
        );
    }
    let (other, _, _) =
        call(&fake, "chat.postMessage", Some(&token), json!({"channel": "C2", "text": "x"})).await;
    assert_eq!(statuses, [200, 200, 429]);
    assert_eq!(other, 200, "the limit is per channel");
}
