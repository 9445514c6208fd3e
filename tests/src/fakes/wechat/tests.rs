//! The fake iLink server against a raw HTTP client: headers and tokens, held long polls and
//! cursors, replays, context-token rules, typing tickets, modes and the QR login script.

use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use channeld_driver_sdk::transport::http::{HttpOptions, client, reqwest};
use serde_json::{Value, json};

use super::*;

/// The SDK's HTTP client (it installs the TLS provider reqwest needs).
fn http() -> reqwest::Client {
    client(&HttpOptions::for_driver("fake-test")).expect("HTTP client")
}

/// A client that sends exactly what the official plugin sends.
struct Raw {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Raw {
    fn new(fake: &FakeIlink) -> Self {
        Self { http: http(), base: fake.base_url(), token: fake.options().bot_token }
    }

    fn uin() -> String {
        BASE64.encode(fastrand::u32(..).to_string())
    }

    async fn post(&self, op: &str, body: Value) -> (u16, Value) {
        let mut body = body;
        body["base_info"] = json!({"channel_version": "1.0.0", "bot_agent": "fake-test/1"});
        let response = self
            .http
            .post(format!("{}/ilink/bot/{op}", self.base))
            .header("Content-Type", "application/json")
            .header("AuthorizationType", "ilink_bot_token")
            .header("Authorization", format!("Bearer {}", self.token))
            .header("X-WECHAT-UIN", Self::uin())
            .header("iLink-App-Id", "bot")
            .header("iLink-App-ClientVersion", "65547")
            .body(body.to_string())
            .send()
            .await
            .expect("request to the fake");
        let status = response.status().as_u16();
        let text = response.text().await.expect("response body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn poll(&self, cursor: &str) -> Value {
        let (status, body) = self.post("getupdates", json!({"get_updates_buf": cursor})).await;
        assert_eq!(status, 200, "{body}");
        body
    }

    async fn send(&self, to: &str, context_token: Option<&str>, text: &str) -> Value {
        let mut msg = json!({
            "from_user_id": "",
            "to_user_id": to,
            "client_id": format!("test-{}", fastrand::u64(..)),
            "message_type": 2,
            "message_state": 2,
            "item_list": [{"type": 1, "text_item": {"text": text}}],
        });
        if let Some(token) = context_token {
            msg["context_token"] = json!(token);
        }
        let (status, body) = self.post("sendmessage", json!({ "msg": msg })).await;
        assert_eq!(status, 200, "{body}");
        body
    }

    async fn qr_status(&self, host: &str, qrcode: &str, verify_code: Option<&str>) -> Value {
        let mut url = format!("http://{host}/ilink/bot/get_qrcode_status?qrcode={qrcode}");
        if let Some(code) = verify_code {
            url.push_str(&format!("&verify_code={code}"));
        }
        let response = self
            .http
            .get(url)
            .header("iLink-App-Id", "bot")
            .header("iLink-App-ClientVersion", "65547")
            .send()
            .await
            .expect("status poll");
        assert_eq!(response.status().as_u16(), 200);
        response.json().await.expect("status JSON")
    }

    async fn new_qr(&self) -> String {
        let response = self
            .http
            .post(format!("{}/ilink/bot/get_bot_qrcode?bot_type=3", self.base))
            .header("Content-Type", "application/json")
            .header("iLink-App-Id", "bot")
            .header("iLink-App-ClientVersion", "65547")
            .body(json!({"local_token_list": ["old-token"]}).to_string())
            .send()
            .await
            .expect("QR request");
        let body: Value = response.json().await.expect("QR JSON");
        assert!(body["qrcode_img_content"].as_str().is_some_and(|c| !c.is_empty()), "{body}");
        body["qrcode"].as_str().expect("qrcode").to_owned()
    }
}

fn quick() -> FakeOptions {
    FakeOptions {
        hold: Duration::from_millis(300),
        advertised_timeout: Duration::from_millis(1500),
        ..FakeOptions::default()
    }
}

#[tokio::test]
async fn a_bot_request_without_the_ilink_headers_is_refused_and_recorded() {
    let fake = FakeIlink::start_with(quick()).await;
    let response = http()
        .post(format!("{}/ilink/bot/getupdates", fake.base_url()))
        .header("Content-Type", "application/json")
        .body(r#"{"get_updates_buf":""}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let violations = fake.records().violations;
    assert!(violations.iter().any(|v| v.contains("iLink-App-Id")), "{violations:?}");
}

#[tokio::test]
async fn a_wrong_or_expired_token_gets_minus_14_in_each_operations_envelope() {
    let fake = FakeIlink::start_with(quick()).await;
    let mut raw = Raw::new(&fake);
    raw.token = "stolen".into();
    let (status, polled) = raw.post("getupdates", json!({"get_updates_buf": ""})).await;
    assert_eq!(status, 200);
    assert_eq!((polled["ret"].as_i64(), polled["errcode"].as_i64()), (Some(-14), Some(-14)));

    raw.token = fake.options().bot_token;
    fake.expire_bot_token();
    let sent = raw.send("alice", Some("x"), "hi").await;
    assert_eq!(sent["errcode"], -14);
    assert!(sent.get("ret").is_none(), "the gateway envelope carries errcode only: {sent}");

    fake.set_bot_token("fresh");
    raw.token = "fresh".into();
    let (_, config) = raw.post("getconfig", json!({"ilink_user_id": "alice"})).await;
    assert_eq!(config["ret"], 0, "{config}");
    fake.assert_no_violations();
}

#[tokio::test]
async fn a_long_poll_is_held_until_a_message_arrives_and_the_cursor_moves_past_it() {
    let fake =
        FakeIlink::start_with(FakeOptions { hold: Duration::from_secs(10), ..quick() }).await;
    let raw = Raw::new(&fake);
    let started = Instant::now();
    let poll = raw.poll("");
    let push = async {
        fake.wait_for(Duration::from_secs(5), "the poll", |r| {
            (r.count("getupdates") == 1).then_some(())
        })
        .await;
        fake.push_text("alice", "hello")
    };
    let (answer, pushed) = tokio::join!(poll, push);
    assert!(started.elapsed() < Duration::from_secs(5), "the held poll answered the push");
    assert_eq!(answer["ret"], 0);
    assert_eq!(answer["longpolling_timeout_ms"], 1500);
    let msgs = answer["msgs"].as_array().unwrap();
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0]["message_id"], pushed.message_id);
    assert_eq!(msgs[0]["context_token"], pushed.context_token.as_str());
    assert_eq!(msgs[0]["item_list"][0]["text_item"]["text"], "hello");
    assert_eq!(msgs[0]["message_type"], 1);

    let cursor = answer["get_updates_buf"].as_str().unwrap().to_owned();
    fake.push_text("bob", "second");
    let next = raw.poll(&cursor).await;
    assert_eq!(next["msgs"][0]["from_user_id"], "bob");
    fake.assert_no_violations();
}

#[tokio::test]
async fn an_idle_poll_ends_empty_at_the_hold_and_keeps_its_position() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    fake.push_text("alice", "one");
    let first = raw.poll("").await;
    let cursor = first["get_updates_buf"].as_str().unwrap().to_owned();
    let started = Instant::now();
    let idle = raw.poll(&cursor).await;
    assert!(started.elapsed() >= Duration::from_millis(250), "held for the hold");
    assert_eq!(idle["msgs"].as_array().unwrap().len(), 0);
    assert_eq!(idle["get_updates_buf"], cursor.as_str(), "an empty answer keeps the position");
}

#[tokio::test]
async fn an_old_cursor_gets_the_batch_again_and_an_empty_one_resumes_at_the_committed_position() {
    let fake = FakeIlink::start_with(FakeOptions { batch_limit: 2, ..quick() }).await;
    let raw = Raw::new(&fake);
    for text in ["a", "b", "c"] {
        fake.push_text("alice", text);
    }
    let first = raw.poll("").await;
    assert_eq!(first["msgs"].as_array().unwrap().len(), 2, "batches are limited");
    let again = raw.poll("").await;
    assert_eq!(again["msgs"], first["msgs"], "not committed: the same batch again");
    let cursor = first["get_updates_buf"].as_str().unwrap().to_owned();
    let rest = raw.poll(&cursor).await;
    assert_eq!(rest["msgs"][0]["item_list"][0]["text_item"]["text"], "c");
    let resumed = raw.poll("").await;
    assert_eq!(resumed["msgs"][0]["item_list"][0]["text_item"]["text"], "c");
    let garbage = raw.poll("not-a-cursor").await;
    assert_eq!(garbage["msgs"][0]["item_list"][0]["text_item"]["text"], "c");
    assert_eq!(fake.records().cursor_resets, 1);
}

#[tokio::test]
async fn a_replay_offers_a_delivered_message_again_with_the_same_ids() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    let pushed = fake.push_text("alice", "once");
    let first = raw.poll("").await;
    let cursor = first["get_updates_buf"].as_str().unwrap().to_owned();
    fake.replay(pushed.message_id);
    let replayed = raw.poll(&cursor).await;
    assert_eq!(replayed["msgs"][0], first["msgs"][0]);
    let cursor = replayed["get_updates_buf"].as_str().unwrap().to_owned();
    assert_eq!(fake.replay_handed_out(), 2);
    let both = raw.poll(&cursor).await;
    assert_eq!(both["msgs"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn sendmessage_needs_a_context_token_of_that_user_with_uses_left() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    let pushed = fake.push_text("alice", "hi");
    fake.push_text("bob", "hi too");
    assert_eq!(raw.send("alice", None, "x").await["ret"], -2);
    assert_eq!(raw.send("alice", Some("made-up"), "x").await["ret"], -2);
    assert_eq!(raw.send("bob", Some(&pushed.context_token), "x").await["ret"], -2);
    for n in 0..10 {
        let answer = raw.send("alice", Some(&pushed.context_token), &format!("reply {n}")).await;
        assert_eq!(answer["ret"], 0, "send {n}: {answer}");
    }
    let over = raw.send("alice", Some(&pushed.context_token), "eleventh").await;
    assert_eq!((over["ret"].as_i64(), over["errmsg"].as_str()), (Some(-2), Some("prepare failed")));
    let fresh = fake.push_text("alice", "again");
    assert_eq!(raw.send("alice", Some(&fresh.context_token), "ok").await["ret"], 0);
    fake.revoke_context_tokens("alice");
    assert_eq!(raw.send("alice", Some(&fresh.context_token), "late").await["ret"], -2);

    let records = fake.records();
    assert_eq!(records.texts_to("alice").len(), 11);
    let reasons: Vec<&str> = records.refused.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            "no context_token",
            "unknown context_token",
            "context_token of another user",
            "context_token used up",
            "context_token expired"
        ]
    );
    fake.assert_no_violations();
}

#[tokio::test]
async fn typing_needs_a_ticket_issued_to_that_user() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    let (_, config) =
        raw.post("getconfig", json!({"ilink_user_id": "alice", "context_token": "c"})).await;
    let ticket = config["typing_ticket"].as_str().unwrap().to_owned();
    for status in [1, 2] {
        let (_, answer) = raw
            .post(
                "sendtyping",
                json!({"ilink_user_id": "alice", "typing_ticket": ticket, "status": status}),
            )
            .await;
        assert_eq!(answer["ret"], 0);
    }
    let (_, wrong) = raw
        .post("sendtyping", json!({"ilink_user_id": "bob", "typing_ticket": ticket, "status": 1}))
        .await;
    assert_eq!(wrong["ret"], -1);
    let records = fake.records();
    let statuses: Vec<i64> = records.typing.iter().map(|t| t.status).collect();
    assert_eq!(statuses, [1, 2]);
    assert_eq!(records.violations.len(), 1, "the wrong ticket is a violation");
}

#[tokio::test]
async fn modes_make_an_operation_slow_silent_or_fail() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    fake.set_op_mode("msg/notifystart", Mode::Http(502));
    let (status, page) = raw.post("msg/notifystart", json!({})).await;
    assert_eq!(status, 502);
    assert!(page.as_str().is_some_and(|p| p.contains("502")), "an HTML page: {page}");

    fake.set_op_mode("msg/notifystart", Mode::Ret(-1));
    let (_, failed) = raw.post("msg/notifystart", json!({})).await;
    assert_eq!(failed["ret"], -1);

    let pushed = fake.push_text("alice", "hi");
    fake.set_op_mode("sendmessage", Mode::Slow(Duration::from_millis(400)));
    let started = Instant::now();
    assert_eq!(raw.send("alice", Some(&pushed.context_token), "slow").await["ret"], 0);
    assert!(started.elapsed() >= Duration::from_millis(400));

    fake.set_mode(Mode::Silent);
    let silent =
        tokio::time::timeout(Duration::from_millis(300), raw.post("msg/notifystop", json!({})));
    assert!(silent.await.is_err(), "a silent server never answers");
    let pending = tokio::spawn({
        let raw = Raw::new(&fake);
        async move { raw.post("msg/notifystop", json!({})).await }
    });
    fake.wait_for(Duration::from_secs(5), "the held request", |r| {
        (r.count("msg/notifystop") == 2).then_some(())
    })
    .await;
    fake.set_mode(Mode::Normal);
    let (status, answer) = pending.await.unwrap();
    assert_eq!((status, answer["ret"].as_i64()), (200, Some(0)), "answered once the mode changed");
    assert_eq!(fake.records().notifications, ["msg/notifystop"], "silence processes nothing");
}

#[tokio::test]
async fn the_qr_login_walks_the_scripted_statuses_and_then_accepts_the_new_token() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    let redirect = format!("localhost:{}", fake.port());
    fake.script_login(vec![
        LoginStep::Wait,
        LoginStep::Scaned,
        LoginStep::NeedVerifyCode { code: "4321".into() },
        LoginStep::ScanedButRedirect { host: redirect.clone() },
        LoginStep::Confirmed {
            bot_token: "new-token".into(),
            bot_id: "bot@im.bot".into(),
            user_id: "owner@im.wechat".into(),
            base_url: None,
        },
    ]);
    let qr = raw.new_qr().await;
    let host = fake.host();
    assert_eq!(raw.qr_status(&host, &qr, None).await["status"], "wait");
    assert_eq!(raw.qr_status(&host, &qr, None).await["status"], "scaned");
    assert_eq!(raw.qr_status(&host, &qr, None).await["status"], "need_verifycode");
    assert_eq!(raw.qr_status(&host, &qr, Some("0000")).await["status"], "need_verifycode");
    assert_eq!(raw.qr_status(&host, &qr, Some("4321")).await["status"], "scaned");
    let redirected = raw.qr_status(&host, &qr, None).await;
    assert_eq!(redirected["status"], "scaned_but_redirect");
    assert_eq!(redirected["redirect_host"], redirect.as_str());
    let confirmed = raw.qr_status(&redirect, &qr, None).await;
    assert_eq!(confirmed["status"], "confirmed");
    assert_eq!(confirmed["bot_token"], "new-token");
    assert_eq!(confirmed["ilink_bot_id"], "bot@im.bot");
    assert_eq!(confirmed["ilink_user_id"], "owner@im.wechat");
    assert_eq!(confirmed["baseurl"], fake.base_url().as_str());
    assert_eq!(fake.records().local_token_lists, [vec!["old-token".to_owned()]]);
    fake.assert_no_violations();

    let mut raw = raw;
    raw.token = "new-token".into();
    assert_eq!(raw.poll("").await["ret"], 0, "the confirmed token works");
}

#[tokio::test]
async fn an_expired_or_blocked_qr_code_is_dead_and_polling_it_is_a_violation() {
    let fake = FakeIlink::start_with(quick()).await;
    let raw = Raw::new(&fake);
    fake.script_login(vec![
        LoginStep::Expired,
        LoginStep::NeedVerifyCode { code: "1".into() },
        LoginStep::BindedRedirect,
    ]);
    let host = fake.host();
    let first = raw.new_qr().await;
    assert_eq!(raw.qr_status(&host, &first, None).await["status"], "expired");
    let second = raw.new_qr().await;
    assert_ne!(first, second);
    for _ in 1..MAX_WRONG_CODES {
        assert_eq!(raw.qr_status(&host, &second, Some("9")).await["status"], "need_verifycode");
    }
    assert_eq!(raw.qr_status(&host, &second, Some("9")).await["status"], "verify_code_blocked");
    let third = raw.new_qr().await;
    assert_eq!(raw.qr_status(&host, &third, None).await["status"], "binded_redirect");
    assert!(fake.records().violations.is_empty());
    assert_eq!(raw.qr_status(&host, &first, None).await["status"], "expired");
    assert_eq!(fake.records().violations.len(), 1, "polling a dead code is recorded");
}

#[tokio::test]
async fn a_context_token_older_than_its_ttl_is_refused() {
    let fake = FakeIlink::start_with(FakeOptions {
        context_token_ttl: Duration::from_millis(200),
        ..quick()
    })
    .await;
    let raw = Raw::new(&fake);
    let pushed = fake.push_text("alice", "hi");
    assert_eq!(raw.send("alice", Some(&pushed.context_token), "in time").await["ret"], 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(raw.send("alice", Some(&pushed.context_token), "too late").await["ret"], -2);
    assert_eq!(fake.records().refused[0].reason, "context_token expired");
}

#[tokio::test]
async fn a_repeated_uin_is_a_violation() {
    let fake = FakeIlink::start_with(quick()).await;
    let send = |uin: &'static str| {
        http()
            .post(format!("{}/ilink/bot/msg/notifystart", fake.base_url()))
            .header("Content-Type", "application/json")
            .header("AuthorizationType", "ilink_bot_token")
            .header("Authorization", "Bearer fake-bot-token")
            .header("X-WECHAT-UIN", uin)
            .header("iLink-App-Id", "bot")
            .header("iLink-App-ClientVersion", "1")
            .body(r#"{"base_info":{"channel_version":"1"}}"#)
            .send()
    };
    let uin = "MTIzNDU=";
    assert_eq!(send(uin).await.unwrap().status().as_u16(), 200);
    assert_eq!(send(uin).await.unwrap().status().as_u16(), 200);
    let violations = fake.records().violations;
    assert!(violations.iter().any(|v| v.contains("X-WECHAT-UIN repeated")), "{violations:?}");
}
