//! The fake WeCom exercised by a raw WebSocket client: each mode does what its doc says.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::payloads::{self, MixedItem};
use super::*;

const WITHIN: Duration = Duration::from_secs(5);

struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Client {
    async fn connect(fake: &FakeWeCom) -> Self {
        let (ws, _) = tokio_tungstenite::connect_async(fake.url()).await.expect("connect");
        Self { ws }
    }

    async fn subscribed(fake: &FakeWeCom) -> Self {
        let mut client = Self::connect(fake).await;
        let ack = client
            .command("aibot_subscribe", "sub-1", json!({"bot_id": "bot-1", "secret": "s3cret"}))
            .await;
        assert_eq!(ack["errcode"], 0, "{ack}");
        client
    }

    async fn send(&mut self, frame: Value) {
        self.ws.send(Message::Text(frame.to_string().into())).await.expect("send");
    }

    /// Sends a command and returns the next frame, which must be its acknowledgement.
    async fn command(&mut self, cmd: &str, req_id: &str, body: Value) -> Value {
        self.send(json!({"cmd": cmd, "headers": {"req_id": req_id}, "body": body})).await;
        let ack = self.next().await.expect("an acknowledgement");
        assert_eq!(ack["headers"]["req_id"], req_id, "{ack}");
        assert!(ack.get("cmd").is_none(), "acknowledgements carry no cmd: {ack}");
        ack
    }

    /// The next text frame, or `None` once the server closed.
    async fn next(&mut self) -> Option<Value> {
        loop {
            let message =
                tokio::time::timeout(WITHIN, self.ws.next()).await.expect("a frame in time");
            match message {
                Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(&text).unwrap()),
                Some(Ok(Message::Close(_)) | Err(_)) | None => return None,
                Some(Ok(_)) => {}
            }
        }
    }

    /// Whether nothing arrives for `quiet` (the caller's reason names what it proves).
    async fn quiet_for(&mut self, quiet: Duration) -> bool {
        tokio::time::timeout(quiet, self.ws.next()).await.is_err()
    }
}

fn stream(req_id: &str, id: &str, content: &str, finish: bool) -> (String, Value) {
    (
        req_id.to_owned(),
        json!({"msgtype": "stream", "stream": {"id": id, "finish": finish, "content": content}}),
    )
}

async fn fake() -> FakeWeCom {
    FakeWeCom::start(FakeConfig::new("bot-1", "s3cret")).await
}

#[tokio::test]
async fn subscribe_checks_the_credentials_and_other_commands_need_it() {
    let fake = fake().await;
    let mut client = Client::connect(&fake).await;
    let ack = client.command("ping", "ping-0", Value::Null).await;
    assert_eq!(ack["errcode"], ERR_NOT_SUBSCRIBED);
    let ack = client
        .command("aibot_subscribe", "sub-1", json!({"bot_id": "bot-1", "secret": "wrong"}))
        .await;
    assert_eq!(ack["errcode"], ERR_BAD_CREDENTIALS);
    assert!(!fake.is_live());
    let ack = client
        .command("aibot_subscribe", "sub-2", json!({"bot_id": "bot-1", "secret": "s3cret"}))
        .await;
    assert_eq!(ack["errcode"], 0);
    assert_eq!(ack["errmsg"], "ok");
    assert_eq!(fake.wait_live(WITHIN).await, 1);
    let record = fake.record();
    assert_eq!(record.subscribes.len(), 2);
    assert_eq!(record.accepted_subscribes(), 1);
    assert_eq!(
        record.violations.len(),
        1,
        "the early ping is a violation: {:?}",
        record.violations
    );
}

#[tokio::test]
async fn pings_are_acknowledged_unless_ignored() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    assert_eq!(client.command("ping", "ping-1", Value::Null).await["errcode"], 0);
    fake.set_ping_mode(PingMode::Ignore);
    client.send(json!({"cmd": "ping", "headers": {"req_id": "ping-2"}})).await;
    // Other commands are still answered, and the ignored ping's answer never comes first.
    let (req_id, body) = stream("nope", "s", "x", true);
    let ack = client.command("aibot_respond_msg", &req_id, body).await;
    assert_eq!(ack["errcode"], ERR_UNKNOWN_REQ_ID);
    let pings = fake.record().pings;
    assert_eq!(pings.iter().map(|ping| ping.acked).collect::<Vec<_>>(), [true, false]);
}

#[tokio::test]
async fn stream_frames_replace_the_content_until_finish() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    let req_id = fake.push_message(payloads::text("m-1", "alice", "hello")).unwrap();
    let callback = client.next().await.unwrap();
    assert_eq!(callback["cmd"], "aibot_msg_callback");
    assert_eq!(callback["headers"]["req_id"], req_id.as_str());
    assert_eq!(callback["body"]["msgid"], "m-1");
    assert_eq!(callback["body"]["aibotid"], "bot-1");
    assert!(callback["body"]["create_time"].is_u64());

    for (content, finish) in [("<think></think>", false), ("partial", false), ("the answer", true)]
    {
        let (r, body) = stream(&req_id, "st-1", content, finish);
        assert_eq!(client.command("aibot_respond_msg", &r, body).await["errcode"], 0);
    }
    let (r, body) = stream(&req_id, "st-1", "too late", true);
    assert_eq!(client.command("aibot_respond_msg", &r, body).await["errcode"], ERR_STREAM_EXPIRED);
    let record = fake.record();
    let streams = record.streams_on(&req_id);
    assert_eq!(streams.len(), 1);
    assert_eq!(streams[0].content(), Some("the answer"));
    assert!(streams[0].finished());
    assert_eq!(streams[0].chat, "alice");
    assert_eq!(
        record.violations,
        ["stream st-1 on ".to_owned() + &req_id + " updated after finish"]
    );
}

#[tokio::test]
async fn an_expired_stream_gets_846608_and_an_unknown_req_id_846605() {
    let fake = fake().await;
    fake.set_stream_expiry(Duration::from_millis(100));
    let mut client = Client::subscribed(&fake).await;
    let req_id = fake.push_message(payloads::text("m-1", "alice", "hello")).unwrap();
    client.next().await.unwrap();
    let (r, body) = stream(&req_id, "st-1", "…", false);
    assert_eq!(client.command("aibot_respond_msg", &r, body).await["errcode"], 0);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (r, body) = stream(&req_id, "st-1", "final", true);
    assert_eq!(client.command("aibot_respond_msg", &r, body).await["errcode"], ERR_STREAM_EXPIRED);
    let (r, body) = stream("unknown-req", "st-1", "final", true);
    assert_eq!(client.command("aibot_respond_msg", &r, body).await["errcode"], ERR_UNKNOWN_REQ_ID);
    assert_eq!(fake.record().streams_on(&req_id)[0].content(), Some("…"));
    assert!(fake.record().violations.is_empty());
}

#[tokio::test]
async fn a_second_subscribe_sends_the_first_a_disconnected_event_then_closes_it() {
    let fake = fake().await;
    let mut first = Client::subscribed(&fake).await;
    let _second = Client::subscribed(&fake).await;
    let event = first.next().await.expect("disconnected_event");
    assert_eq!(event["cmd"], "aibot_event_callback");
    assert_eq!(event["body"]["event"]["eventtype"], "disconnected_event");
    assert!(first.next().await.is_none(), "the kicked connection is closed");
    let record = fake.record();
    assert!(record.connections[0].kicked);
    assert_eq!(fake.wait_live(WITHIN).await, 2);

    // The handle's kick does the same to the live connection.
    let mut third = Client::subscribed(&fake).await;
    fake.kick().unwrap();
    assert_eq!(third.next().await.unwrap()["body"]["event"]["eventtype"], "disconnected_event");
    assert!(third.next().await.is_none());
    assert!(!fake.is_live());
    assert_eq!(fake.push_message(payloads::text("m", "u", "x")), Err(NoLiveConnection));
}

#[tokio::test]
async fn proactive_sends_go_only_to_conversations_that_messaged_the_bot() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    let markdown = |chat: &str| json!({"chatid": chat, "msgtype": "markdown", "markdown": {"content": "news"}});
    assert_eq!(
        client.command("aibot_send_msg", "send-1", markdown("room-9")).await["errcode"],
        ERR_UNKNOWN_CHAT
    );
    fake.push_message(payloads::group_text("m-1", "room-9", "bob", "@Bot hi")).unwrap();
    client.next().await.unwrap();
    assert_eq!(client.command("aibot_send_msg", "send-2", markdown("room-9")).await["errcode"], 0);
    let long = json!({"chatid": "room-9", "msgtype": "markdown", "markdown": {"content": "x".repeat(MAX_CONTENT_BYTES + 1)}});
    assert_eq!(
        client.command("aibot_send_msg", "send-3", long).await["errcode"],
        ERR_CONTENT_TOO_LONG
    );
    fake.fail_next("aibot_send_msg", 50001, "injected");
    assert_eq!(
        client.command("aibot_send_msg", "send-4", markdown("room-9")).await["errcode"],
        50001
    );
    let record = fake.record();
    assert_eq!(record.sent_to("room-9").len(), 1);
    assert_eq!(
        record.sent.len(),
        3,
        "the injected failure is refused before the send is looked at"
    );
    assert_eq!(record.violations.len(), 1, "{:?}", record.violations);
}

#[tokio::test]
async fn the_rate_limit_mode_refuses_the_message_over_the_limit() {
    let fake = fake().await;
    fake.set_rate_limit(Some(RateLimit { max: 2, per: Duration::from_secs(60) }));
    let mut client = Client::subscribed(&fake).await;
    fake.push_message(payloads::text("m-1", "alice", "hi")).unwrap();
    client.next().await.unwrap();
    let markdown = json!({"chatid": "alice", "msgtype": "markdown", "markdown": {"content": "n"}});
    let codes: Vec<Value> = {
        let mut codes = Vec::new();
        for n in 0..3 {
            codes.push(client.command("aibot_send_msg", &format!("send-{n}"), markdown.clone()).await["errcode"].clone());
        }
        codes
    };
    assert_eq!(codes, [json!(0), json!(0), json!(ERR_RATE_LIMITED)]);
    assert_eq!(fake.record().rate_limited(), 1);
}

#[tokio::test]
async fn slow_mode_delays_acks_and_a_second_frame_before_the_ack_is_a_violation() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    let req_id = fake.push_message(payloads::text("m-1", "alice", "hi")).unwrap();
    client.next().await.unwrap();
    fake.set_slow(Some(Duration::from_millis(300)));
    let (r, first) = stream(&req_id, "st", "…", false);
    let (_, second) = stream(&req_id, "st", "done", true);
    client.send(json!({"cmd": "aibot_respond_msg", "headers": {"req_id": r}, "body": first})).await;
    client
        .send(json!({"cmd": "aibot_respond_msg", "headers": {"req_id": r}, "body": second}))
        .await;
    assert!(client.quiet_for(Duration::from_millis(200)).await, "acks come late in slow mode");
    for _ in 0..2 {
        assert_eq!(client.next().await.unwrap()["errcode"], 0);
    }
    let violations = fake.record().violations;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].contains("before the previous frame on it was acknowledged"));
}

#[tokio::test]
async fn a_silenced_connection_answers_nothing_until_replaced() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    fake.silence_live().unwrap();
    client.send(json!({"cmd": "ping", "headers": {"req_id": "ping-1"}})).await;
    assert!(
        client.quiet_for(Duration::from_millis(300)).await,
        "a half-open connection answers no ping"
    );
    let mut replacement = Client::subscribed(&fake).await;
    assert_eq!(replacement.command("ping", "ping-2", Value::Null).await["errcode"], 0);
    assert!(fake.record().pings.iter().all(|ping| ping.conn == 2));
}

#[tokio::test]
async fn callbacks_repeat_with_the_same_msgid_under_a_new_req_id() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    let image = MixedItem::Image { url: "https://wework.example/img", aeskey: "a2V5" };
    let first = fake
        .push_message(payloads::mixed("m-7", "alice", &[MixedItem::Text("look"), image]))
        .unwrap();
    let again = fake.repeat(&first).unwrap();
    assert_ne!(first, again);
    let (a, b) = (client.next().await.unwrap(), client.next().await.unwrap());
    assert_eq!(a["body"], b["body"]);
    assert_eq!(b["headers"]["req_id"], again.as_str());
    assert_eq!(b["body"]["mixed"]["msg_item"][1]["image"]["aeskey"], "a2V5");
}

#[tokio::test]
async fn welcome_texts_and_card_updates_must_answer_their_event_in_time() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    let enter = fake.push_event(payloads::enter_chat("e-1", "alice")).unwrap();
    client.next().await.unwrap();
    let welcome = json!({"msgtype": "text", "text": {"content": "welcome"}});
    assert_eq!(
        client.command("aibot_respond_welcome_msg", &enter, welcome.clone()).await["errcode"],
        0
    );
    assert_eq!(
        client.command("aibot_respond_welcome_msg", &enter, welcome).await["errcode"],
        ERR_UNKNOWN_REQ_ID
    );

    fake.set_reply_window(Duration::from_millis(100));
    let click =
        fake.push_event(payloads::card_click("e-2", None, "alice", "task-1", "approve")).unwrap();
    client.next().await.unwrap();
    let update = json!({"response_type": "update_template_card",
                        "template_card": {"card_type": "button_interaction", "task_id": "task-1"}});
    // A stream reply on a card event is refused.
    let (_, body) = stream(&click, "s", "x", true);
    assert_eq!(
        client.command("aibot_respond_msg", &click, body).await["errcode"],
        ERR_UNKNOWN_REQ_ID
    );
    assert_eq!(
        client.command("aibot_respond_update_msg", &click, update.clone()).await["errcode"],
        0
    );
    let late =
        fake.push_event(payloads::card_click("e-3", None, "alice", "task-1", "approve")).unwrap();
    client.next().await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        client.command("aibot_respond_update_msg", &late, update).await["errcode"],
        ERR_UNKNOWN_REQ_ID
    );
    let record = fake.record();
    assert_eq!(record.welcomes.len(), 2);
    assert_eq!(record.card_updates.iter().filter(|update| update.errcode == 0).count(), 1);
    assert!(record.violations.is_empty(), "{:?}", record.violations);
}

#[tokio::test]
async fn dropping_the_live_connection_ends_it_without_an_event() {
    let fake = fake().await;
    let mut client = Client::subscribed(&fake).await;
    fake.drop_live().unwrap();
    assert!(client.next().await.is_none());
    fake.wait_for("the connection closed", WITHIN, |record| record.connections[0].closed).await;
    assert!(!fake.is_live());
    assert!(fake.record().pushed.is_empty());
}
