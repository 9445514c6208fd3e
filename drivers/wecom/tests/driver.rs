//! The WeCom driver in-process between the SDK's fake hub and the fake WeCom, for what the
//! cross-process tests cannot reach: `resume` after a kick (the hub does not pass operator
//! actions on yet), approval and choice cards, welcome texts, pacing with shortened windows
//! and the driver's own stream window.

use std::time::Duration;

use channeld_driver_sdk::protocol::frame::CommandFrame;
use channeld_driver_sdk::protocol::types::{
    Choice, Command, CommandResult, HealthState, MessageTarget,
};
use channeld_driver_sdk::protocol::{ChannelId, Frame, Id};
use channeld_driver_sdk::testing::{AckMode, DriverTask, FakeConnection, FakeHub};
use channeld_tests::fakes::wecom::{FakeConfig, FakeWeCom, RateLimit, payloads};
use channeld_wecom::{WeComConfig, WeComDriver};
use serde_json::json;
use tokio::time::Instant;

const CHANNEL: &str = "wecom.test";
const BOT: &str = "aib-test";
const SECRET: &str = "test-secret";
const WITHIN: Duration = Duration::from_secs(10);

/// The driver, connected to a fake hub and subscribed to a fake WeCom.
struct Rig {
    fake: FakeWeCom,
    conn: FakeConnection,
    task: Option<DriverTask>,
    _hub: FakeHub,
}

impl Rig {
    async fn start(vars: &[(&str, &str)], adjust: impl FnOnce(&mut WeComConfig)) -> Self {
        let fake = FakeWeCom::start(FakeConfig::new(BOT, SECRET)).await;
        let hub = FakeHub::bind().await;
        let mut launch = hub
            .launch_config(CHANNEL)
            .with_var("WECOM_WS_URL", fake.url())
            .with_var("WECOM_BOT_ID", BOT)
            .with_var("WECOM_SECRET", SECRET);
        for (name, value) in vars {
            launch = launch.with_var(name, *value);
        }
        let mut config = WeComConfig::from_launch(&launch).expect("valid settings");
        adjust(&mut config);
        let task = DriverTask::spawn(WeComDriver::new(config), launch);
        let mut conn = hub.accept().await;
        conn.handshake(AckMode::Extensions).await;
        fake.wait_live(WITHIN).await;
        Self { fake, conn, task: Some(task), _hub: hub }
    }

    fn target(conversation: &str) -> MessageTarget {
        MessageTarget::new(ChannelId::new(CHANNEL).unwrap(), Id::new(conversation).unwrap())
    }

    /// Probes health until `done` holds for it.
    async fn wait_health(
        &mut self,
        what: &str,
        done: impl Fn(&channeld_driver_sdk::protocol::types::Health) -> bool,
    ) {
        self.conn.wait_health(WITHIN, what, done).await;
    }

    async fn command(&self, request_id: &str, command: Command, conversation: &str) {
        let frame = CommandFrame {
            request_id: Id::new(request_id).unwrap(),
            session: Id::new("session-1").unwrap(),
            command_id: Id::new(format!("cmd-{request_id}")).unwrap(),
            command,
            target: Some(Self::target(conversation)),
        };
        self.conn.send(&Frame::Command(frame)).await;
    }

    /// The task id of the next card the driver sends to `chat`.
    async fn card_sent(&self, chat: &str, nth: usize) -> String {
        self.fake
            .wait_for("a card", WITHIN, |record| {
                let cards: Vec<_> = record
                    .sent_to(chat)
                    .into_iter()
                    .filter(|s| s.msgtype == "template_card")
                    .collect();
                cards
                    .get(nth)
                    .and_then(|sent| sent.template_card.as_ref())
                    .map(|card| card["task_id"].as_str().unwrap().to_owned())
            })
            .await
    }

    async fn stop(mut self) {
        let task = self.task.take().unwrap();
        let (stopped, ()) = tokio::join!(task.stop(), async {
            self.conn.expect_stop().await;
        });
        assert!(stopped.is_ok(), "{stopped:?}");
        assert!(self.fake.record().violations.is_empty(), "{:#?}", self.fake.record().violations);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_takes_a_fenced_bot_back() {
    let mut rig = Rig::start(&[("WECOM_RECONNECT_MAX_SECONDS", "1")], |_| {}).await;
    rig.conn.operator_action("op-0", "resume", json!({})).await;
    let result = rig.conn.expect_operator_action_result("op-0").await;
    assert!(result.ok);
    assert_eq!(result.data.unwrap()["resumed"], false, "nothing to resume while connected");

    rig.fake.kick().unwrap();
    rig.wait_health("Unavailable fenced", |health| {
        health.state == HealthState::Unavailable
            && health.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("fenced")
    })
    .await;
    assert_eq!(rig.fake.record().accepted_subscribes(), 1);

    rig.conn.operator_action("op-1", "resume", json!({})).await;
    let result = rig.conn.expect_operator_action_result("op-1").await;
    assert!(result.ok, "{result:?}");
    assert_eq!(result.data.unwrap(), json!({"resumed": true, "was": "fenced"}));
    rig.fake
        .wait_for("a second subscribe", WITHIN, |record| {
            (record.accepted_subscribes() == 2).then_some(())
        })
        .await;
    rig.wait_health("Ready", |health| health.state == HealthState::Ready).await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_card_is_answered_by_an_allowed_click_with_the_responder() {
    let mut rig = Rig::start(&[("WECOM_RESPONDERS", "lisi")], |_| {}).await;
    rig.fake.know_chat("room-7");
    let approval = Command::RequestApproval {
        tool: "restart_job".into(),
        arguments: json!({"job": "nightly"}),
    };
    rig.command("c-1", approval, "room-7").await;
    let task_id = rig.card_sent("room-7", 0).await;
    // Someone not in CHANNELD_WECOM_RESPONDERS clicks first: nothing is answered.
    rig.fake
        .push_event(payloads::card_click("e-1", Some("room-7"), "intern", &task_id, "approve"))
        .unwrap();
    let click = rig
        .fake
        .push_event(payloads::card_click("e-2", Some("room-7"), "lisi", &task_id, "approve"))
        .unwrap();
    let result = rig.conn.expect_command_result("c-1").await;
    assert_eq!(result.result, CommandResult::Accepted);
    assert_eq!(result.responder.unwrap().id, "lisi", "the next answer is lisi's, not the intern's");
    let update = rig
        .fake
        .wait_for("the card update", WITHIN, |record| {
            record.card_updates.iter().find(|u| u.req_id == click).cloned()
        })
        .await;
    assert_eq!(update.errcode, 0);
    assert_eq!(update.body["template_card"]["main_title"]["desc"], "Approved by lisi");
    assert_eq!(update.body["template_card"]["button_list"], json!([]));
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_choice_card_answers_with_the_chosen_option_and_an_unanswered_one_is_rejected() {
    let mut rig = Rig::start(&[], |config| config.card_timeout = Duration::from_millis(300)).await;
    rig.fake.know_chat("alice");
    let choices = ["blue", "green"]
        .map(|id| Choice { id: Id::new(id).unwrap(), label: id.to_uppercase() })
        .to_vec();
    let question =
        Command::RequestChoice { question: "Which deploy?".into(), choices, multiple: false };
    rig.command("c-1", question.clone(), "alice").await;
    let task_id = rig.card_sent("alice", 0).await;
    rig.fake.push_event(payloads::card_click("e-1", None, "alice", &task_id, "choice_1")).unwrap();
    let result = rig.conn.expect_command_result("c-1").await;
    assert_eq!(
        result.result,
        CommandResult::Value { payload: json!({"choice": "green", "label": "GREEN"}) }
    );

    rig.command("c-2", question, "alice").await;
    let result = rig.conn.expect_command_result("c-2").await;
    assert!(
        matches!(&result.result, CommandResult::Rejected { reason } if reason.contains("nobody answered")),
        "{result:?}"
    );
    // A late click finds no card waiting and changes nothing.
    let late = rig.card_sent("alice", 1).await;
    rig.fake.push_event(payloads::card_click("e-2", None, "alice", &late, "choice_0")).unwrap();
    rig.conn.health_request("after-late-click").await;
    rig.conn.expect_health_response("after-late-click").await;
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enter_chat_is_welcomed_within_the_window() {
    let rig = Rig::start(&[("WECOM_WELCOME_TEXT", "Hi! Ask me about the servers.")], |_| {}).await;
    let req_id = rig.fake.push_event(payloads::enter_chat("e-1", "wangwu")).unwrap();
    let welcome = rig
        .fake
        .wait_for("the welcome", WITHIN, |record| {
            record.welcomes.iter().find(|w| w.req_id == req_id).cloned()
        })
        .await;
    assert_eq!(welcome.errcode, 0);
    assert_eq!(
        welcome.body,
        json!({"msgtype": "text", "text": {"content": "Hi! Ask me about the servers."}})
    );
    rig.stop().await;
}

/// A send still waiting at the stop must not hold it past the hub's drain. A welcome
/// waiting for its acknowledgement ends when the stop closes the connection; one waiting
/// for the conversation's next turn under the pace limit would, once it had its turn, wait up
/// to 4 s for a connection that no longer comes back (the fake hub drains for 3 s). The
/// stop waits for such sends only as long as the drain leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_still_waiting_at_the_stop_do_not_hold_it_past_the_drain() {
    let rig = Rig::start(&[("WECOM_WELCOME_TEXT", "Hi!")], |config| {
        config.pace.per_minute = 1;
        config.pace.minute = Duration::from_millis(2500);
    })
    .await;
    rig.fake.push_event(payloads::enter_chat("e-1", "wangwu")).unwrap();
    rig.fake.wait_for("the first welcome", WITHIN, |record| record.welcomes.first().cloned()).await;
    // The second welcome waits for the conversation's next turn; the third is sent and never
    // acknowledged.
    rig.fake.push_event(payloads::enter_chat("e-2", "wangwu")).unwrap();
    rig.fake.set_slow(Some(Duration::from_secs(60)));
    rig.fake.push_event(payloads::enter_chat("e-3", "lisi")).unwrap();
    rig.fake
        .wait_for("the unanswered welcome sent", WITHIN, |record| {
            (record.received_cmd("aibot_respond_welcome_msg").len() >= 2).then_some(())
        })
        .await;
    let began = Instant::now();
    // `stop` fails if `run` is aborted at the fake hub's drain deadline.
    rig.stop().await;
    assert!(began.elapsed() < channeld_driver_sdk::testing::DRAIN, "{:?}", began.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_over_the_pace_queue_and_go_later_instead_of_failing() {
    let mut rig = Rig::start(&[], |config| {
        config.pace.per_minute = 2;
        config.pace.minute = Duration::from_secs(1);
    })
    .await;
    rig.fake.know_chat("alice");
    // The platform refuses what goes over the same limit: the driver must never hit it.
    rig.fake.set_rate_limit(Some(RateLimit { max: 2, per: Duration::from_secs(1) }));
    let started = Instant::now();
    for n in 1..=3 {
        rig.conn.outbound(format!("send-{n}"), Rig::target("alice"), &format!("note {n}")).await;
    }
    // The SDK posts concurrently, so the receipts may come in any order.
    let mut receipted = Vec::new();
    while receipted.len() < 3 {
        match rig.conn.next_frame().await {
            Frame::Receipt(receipt) => receipted.push(receipt.request_id.to_string()),
            other => panic!("expected receipts, got {other:?}"),
        }
    }
    receipted.sort();
    assert_eq!(receipted, ["send-1", "send-2", "send-3"]);
    assert!(started.elapsed() >= Duration::from_secs(1), "one send waited for the window");
    let record = rig.fake.record();
    assert_eq!(record.rate_limited(), 0, "the platform's limit was never hit");
    let mut texts: Vec<_> =
        record.sent_to("alice").iter().map(|sent| sent.content.clone().unwrap()).collect();
    texts.sort();
    assert_eq!(texts, ["note 1", "note 2", "note 3"]);
    let sent = record.sent_to("alice");
    assert!(
        sent[2].at.duration_since(sent[0].at) >= Duration::from_secs(1),
        "at most two in any second"
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_cannot_get_a_slot_in_time_is_reported_failed() {
    let mut rig =
        Rig::start(&[("WECOM_PACE_PER_MINUTE", "1"), ("WECOM_SEND_QUEUE_SECONDS", "0.3")], |_| {})
            .await;
    rig.fake.know_chat("alice");
    rig.conn.outbound("send-1", Rig::target("alice"), "first").await;
    rig.conn.expect_receipt("send-1").await;
    rig.conn.outbound("send-2", Rig::target("alice"), "second").await;
    let err = rig.conn.expect_error("send-2").await;
    assert_eq!(err.code, "send_failed");
    assert!(err.retryable);
    assert!(err.message.contains("message limit"), "{}", err.message);
    assert_eq!(rig.fake.record().sent_to("alice").len(), 1);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_after_the_drivers_stream_window_goes_proactive_without_trying_the_stream() {
    let mut rig = Rig::start(&[], |config| {
        config.stream_window = Duration::from_millis(400);
        config.ack_timeout = Duration::from_millis(200);
    })
    .await;
    let req_id = rig.fake.push_message(payloads::text("m-1", "alice", "slow question")).unwrap();
    let inbound = rig.conn.expect_inbound().await;
    rig.conn.accept_inbound(&inbound.event_id).await;
    rig.fake
        .wait_for("the placeholder", WITHIN, |record| {
            (!record.streams_on(&req_id).is_empty()).then_some(())
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    rig.conn.deliver(&inbound.event_id, inbound.message.target.clone(), "slow answer").await;
    let receipt = rig.conn.expect_receipt(&inbound.event_id).await;
    let record = rig.fake.record();
    let sent = record.sent_to("alice");
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].content.as_deref(), Some("slow answer"));
    assert_eq!(receipt.message_id, sent[0].req_id.as_str());
    let stream = record.streams_on(&req_id)[0];
    assert_eq!(stream.frames.len(), 1, "only the placeholder: {:?}", stream.frames);
    rig.stop().await;
}
