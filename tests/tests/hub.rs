//! The hub as a real process: handshake, gating, in-flight limit, receipts, runtimes,
//! multiple instances, bounded reads and graceful shutdown.

use std::time::{Duration, Instant};

use channeld_protocol::frame::{ControlHello, ControlRequest, Delivery, HelloAck, Receipt};
use channeld_protocol::types::{
    Actions, CommandResult, ControlAction, DeliveryReceipt, Effect, MessageBody, OutboundMessage,
};
use channeld_protocol::{ChannelId, Frame};
use channeld_tests::peer::{caps, id, target};
use channeld_tests::{HubProcess, RawPeer, rss_kib, write_script};

const ONE: &str = "test.one";

fn echo_hub() -> HubProcess {
    HubProcess::start("[instance.\"test.one\"]\nallow = [\"alice\"]\n")
}

fn receipt_for(request_id: &channeld_protocol::Id, conversation: &str, message_id: &str) -> Frame {
    Frame::Receipt(Receipt {
        request_id: request_id.clone(),
        receipt: DeliveryReceipt {
            channel: ChannelId::new(ONE).unwrap(),
            message_id: id(message_id),
            target: target(ONE, conversation),
            timestamp_ms: Some(1),
        },
    })
}

fn expect_deliver(frame: Frame) -> Delivery {
    match frame {
        Frame::Deliver(delivery) => delivery,
        other => panic!("expected deliver, got {other:?}"),
    }
}

fn expect_outbound(frame: Frame) -> Delivery {
    match frame {
        Frame::Outbound(delivery) => delivery,
        other => panic!("expected outbound, got {other:?}"),
    }
}

/// Runs channelctl on a blocking thread so the test can play the driver meanwhile.
fn ctl_async(hub: &HubProcess, args: &[&str]) -> tokio::task::JoinHandle<std::process::Output> {
    let socket = hub.control_socket();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        channeld_tests::channelctl(&socket, &refs)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_driver_without_extensions_works_end_to_end() {
    let hub = echo_hub();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;

    driver.inbound(ONE, "m-1", "alice", "c1", "ping").await;
    // No extension was declared: the first frame is the reply itself, no hello_ack, no accepted.
    let reply = expect_deliver(driver.frame().await);
    assert_eq!(reply.request_id, "m-1");
    assert_eq!(reply.message.body.text_str(), "ping");
    assert_eq!(reply.message.target.conversation, "c1");
    assert_eq!(reply.message.target.reply_to.as_ref().map(|r| r.as_str()), Some("m-1"));

    let ctl = ctl_async(&hub, &["send", ONE, "--conversation", "c1", "hello there"]);
    let outbound = expect_outbound(driver.frame().await);
    assert_eq!(outbound.message.body.text_str(), "hello there");
    driver.send(receipt_for(&outbound.request_id, "c1", "posted-1")).await;
    let out = ctl.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("receipted posted-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extensions_are_negotiated_and_accepted_precedes_the_reply() {
    let hub = echo_hub();
    let offered = ["accepted", "reply_receipt", "from_the_future"];
    negotiate_then_ping(&hub, &offered, &["accepted", "reply_receipt"]).await;
}

/// Says `hello` with the `offered` extensions, checks the hub's `hello_ack` names `agreed`,
/// then sends an inbound and expects `accepted` before its reply.
async fn negotiate_then_ping(hub: &HubProcess, offered: &[&str], agreed: &[&str]) -> RawPeer {
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), offered).await;
    match driver.frame().await {
        Frame::HelloAck(HelloAck { extensions, request_id, .. }) => {
            assert_eq!(request_id, "test.one-hello");
            assert_eq!(extensions, agreed);
        }
        other => panic!("expected hello_ack, got {other:?}"),
    }
    driver.inbound(ONE, "m-1", "alice", "c1", "ping").await;
    match driver.frame().await {
        Frame::Accepted(accepted) => assert_eq!(accepted.event_id, "m-1"),
        other => panic!("expected accepted, got {other:?}"),
    }
    assert_eq!(expect_deliver(driver.frame().await).request_id, "m-1");
    driver
}

/// Without a ledger a reply is done once written: the hub does not offer `reply_receipt`, so
/// a driver does not answer replies with a receipt nobody would read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_without_a_ledger_does_not_ask_for_reply_receipts() {
    let dir = tempfile::tempdir().unwrap();
    let hub =
        HubProcess::start_without_ledger(dir, "[instance.\"test.one\"]\nallow = [\"alice\"]\n");
    let offered = ["accepted", "reply_receipt", "history"];
    let mut driver = negotiate_then_ping(&hub, &offered, &["accepted", "history"]).await;
    // Sends still wait for their receipts.
    let ctl = ctl_async(&hub, &["send", ONE, "--conversation", "c1", "hello there"]);
    let outbound = expect_outbound(driver.frame().await);
    driver.send(receipt_for(&outbound.request_id, "c1", "posted-1")).await;
    let out = ctl.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("receipted posted-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_frame_does_not_end_the_connection() {
    let hub = echo_hub();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    driver.inbound(ONE, "m-1", "mallory", "c1", "let me in").await;
    let denied = driver.error().await;
    assert_eq!(denied.code, "sender_denied");
    assert_eq!(denied.request_id.as_ref().map(|r| r.as_str()), Some("m-1"));
    assert!(!denied.retryable);
    // A garbage line is answered too, and the connection goes on.
    driver.sink.send_encoded(b"this is not json\n".to_vec()).await.unwrap();
    assert_eq!(driver.error().await.code, "invalid_json");
    driver.inbound(ONE, "m-2", "alice", "c1", "still here").await;
    assert_eq!(expect_deliver(driver.frame().await).message.body.text_str(), "still here");
    let status = hub.ctl(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["instances"][0]["counters"]["denied"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_with_every_run_slot_taken_and_no_room_to_wait_is_busy_and_retryable() {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!("while [ ! -e '{}' ]; do sleep 0.02; done\necho done\n", gate.display()),
    );
    let hub = HubProcess::start(&format!(
        "[runtime.slow]\nkind = \"exec\"\ncommand = [\"{}\"]\n[instance.\"test.one\"]\nallow = [\"alice\"]\nruntime = \"slow\"\nmax_queued = 0\n",
        agent.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    // Four conversations take the four run slots (`max_inflight`); nothing may wait.
    for n in 1..=4 {
        driver.inbound(ONE, &format!("m-{n}"), "alice", &format!("c{n}"), "work").await;
        assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    }
    driver.inbound(ONE, "m-5", "alice", "c5", "one too many").await;
    let busy = driver.error().await;
    assert_eq!(busy.code, "busy");
    assert!(busy.retryable);
    assert_eq!(busy.request_id.as_ref().map(|r| r.as_str()), Some("m-5"));
    // A redelivery of an active event is not a second run: it is acknowledged as a duplicate.
    driver.inbound(ONE, "m-1", "alice", "c1", "work").await;
    match driver.frame().await {
        Frame::Accepted(accepted) => assert!(accepted.duplicate && accepted.event_id == "m-1"),
        other => panic!("expected a duplicate acceptance, got {other:?}"),
    }

    std::fs::write(&gate, "").unwrap();
    let mut replied = Vec::new();
    for _ in 0..4 {
        replied.push(expect_deliver(driver.frame().await).request_id.into_string());
    }
    replied.sort();
    assert_eq!(replied, vec!["m-1", "m-2", "m-3", "m-4"]);
    // The slots are free again.
    driver.inbound(ONE, "m-5", "alice", "c5", "now").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert_eq!(expect_deliver(driver.frame().await).request_id, "m-5");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_and_wait_fails_at_once_when_the_driver_disconnects() {
    let hub = echo_hub();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    // Let the hub register the driver before sending.
    driver.inbound(ONE, "m-0", "alice", "c1", "sync").await;
    expect_deliver(driver.frame().await);

    let started = Instant::now();
    let ctl = ctl_async(
        &hub,
        &["send", ONE, "--conversation", "c1", "--timeout", "60", "will you post this?"],
    );
    expect_outbound(driver.frame().await);
    driver.close().await;
    let out = ctl.await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(5),
        "outcome unknown: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("driver disconnected"));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the wait ended by disconnect, not by its 60 s timeout"
    );

    // With no driver the send waits in the outbox (exit 7) and goes out when one connects.
    let out = hub.ctl(&["send", ONE, "--conversation", "c1", "--timeout", "1", "anyone?"]);
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("queued"));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    let queued = expect_outbound(driver.frame().await);
    assert_eq!(queued.message.body.text_str(), "anyone?");
    driver.send(receipt_for(&queued.request_id, "c1", "late-1")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_ledger_an_offline_send_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hub =
        HubProcess::start_without_ledger(dir, "[instance.\"test.one\"]\nallow = [\"alice\"]\n");
    let out = hub.ctl(&["send", ONE, "--conversation", "c1", "anyone?"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("driver_offline"));
    let out = hub.ctl(&["send", ONE, "--conversation", "c1", "--key", "k1", "anyone?"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("state_dir"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_counts_only_from_the_connection_that_got_the_outbound() {
    let hub = HubProcess::start(
        "[hub]\nreceipt_timeout_secs = 2\n[instance.\"test.one\"]\nallow = [\"alice\"]\n",
    );
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    driver.inbound(ONE, "m-0", "alice", "c1", "sync").await;
    expect_deliver(driver.frame().await);

    let ctl = ctl_async(&hub, &["send", ONE, "--conversation", "c1", "--timeout", "2", "x"]);
    let outbound = expect_outbound(driver.frame().await);
    // A legacy connection forging the receipt is ignored.
    let forger = RawPeer::connect(&hub.socket(ONE)).await;
    forger.send(receipt_for(&outbound.request_id, "c1", "forged")).await;
    let out = ctl.await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(5),
        "no genuine receipt: outcome unknown; stdout {} stderr {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("forged"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_of_one_family_are_independent_and_one_driver_per_instance() {
    let hub = HubProcess::start(
        "[instance.\"test.one\"]\nallow = [\"alice\"]\n[instance.\"test.two\"]\nallow = [\"bob\"]\n",
    );
    let mut one = RawPeer::connect(&hub.socket("test.one")).await;
    let mut two = RawPeer::connect(&hub.socket("test.two")).await;
    one.hello("test.one", caps(&["receive"]), &[]).await;
    two.hello("test.two", caps(&["receive"]), &[]).await;
    one.inbound("test.one", "e", "alice", "c", "for one").await;
    two.inbound("test.two", "e", "bob", "c", "for two").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "for one");
    assert_eq!(expect_deliver(two.frame().await).message.body.text_str(), "for two");
    // Each allowlist is its own.
    one.inbound("test.one", "e2", "bob", "c", "bob on one").await;
    assert_eq!(one.error().await.code, "sender_denied");

    // A second hello for a live instance is refused and closed; the first keeps working.
    let mut second = RawPeer::connect(&hub.socket("test.one")).await;
    second.hello("test.one", caps(&["receive"]), &[]).await;
    let refused = second.error().await;
    assert_eq!(refused.code, "already_connected");
    assert!(refused.retryable);
    assert!(second.closed_within(Duration::from_secs(5)).await);
    // A hello naming another instance is refused for good.
    let mut wrong = RawPeer::connect(&hub.socket("test.one")).await;
    wrong.hello("test.two", caps(&["receive"]), &[]).await;
    let mismatch = wrong.error().await;
    assert_eq!(mismatch.code, "channel_mismatch");
    assert!(!mismatch.retryable);
    one.inbound("test.one", "e3", "alice", "c", "still mine").await;
    assert_eq!(expect_deliver(one.frame().await).message.body.text_str(), "still mine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_runtime_runs_a_shell_agent_with_envelope_and_environment() {
    let dir = tempfile::tempdir().unwrap();
    let envelope = dir.path().join("envelope.json");
    let agent = write_script(
        dir.path(),
        "agent.sh",
        &format!(
            "IFS= read -r line\nprintf '%s\\n' \"$line\" > '{}'\necho \"agent for $CHANNELD_CHANNEL_ID in $CHANNELD_SESSION\"\necho 'second line'\n",
            envelope.display()
        ),
    );
    let hub = HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n[instance.\"test.one\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send", "threads"]), &[]).await;
    driver.inbound(ONE, "m-1", "alice", "c1", "what's up?").await;
    let reply = expect_deliver(driver.frame().await);
    let text = reply.message.body.text_str().to_owned();
    assert!(text.starts_with("agent for test.one in im-"), "{text}");
    assert!(text.ends_with("\nsecond line"), "{text}");

    let envelope: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&envelope).unwrap()).unwrap();
    assert_eq!(envelope["version"], "channeld.agent/v1");
    assert_eq!(envelope["instance"], "test.one");
    assert_eq!(envelope["family"], "test");
    assert_eq!(envelope["kind"], "message");
    assert_eq!(envelope["event_id"], "m-1");
    assert_eq!(envelope["redelivered"], false);
    assert_eq!(envelope["message"]["body"]["text"], "what's up?");
    assert_eq!(envelope["sender"]["id"], "alice");
    assert_eq!(envelope["capabilities"], serde_json::json!(["receive", "send", "threads"]));
    let session = envelope["session"].as_str().unwrap();
    assert!(text.contains(session));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_agent_yields_an_error_frame_and_the_hub_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(dir.path(), "agent.sh", "echo 'secret stack trace' >&2\nexit 3\n");
    let slow = write_script(dir.path(), "slow.sh", "sleep 30\n");
    let hub = HubProcess::start(&format!(
        "[runtime.bad]\nkind = \"exec\"\ncommand = [\"{}\"]\n[runtime.slow]\nkind = \"exec\"\ncommand = [\"{}\"]\ntimeout_secs = 1\n\
         [instance.\"test.one\"]\nallow = [\"alice\"]\nruntime = \"bad\"\n[instance.\"test.two\"]\nallow = [\"alice\"]\nruntime = \"slow\"\n",
        agent.display(),
        slow.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    driver.inbound(ONE, "m-1", "alice", "c1", "crash please").await;
    let err = driver.error().await;
    assert_eq!(err.code, "agent_failed");
    assert_eq!(err.request_id.as_ref().map(|r| r.as_str()), Some("m-1"));
    assert!(!err.message.contains("secret stack trace"), "agent stderr stays in the hub's log");
    assert!(hub.log().contains("secret stack trace"));

    let mut slow_driver = RawPeer::connect(&hub.socket("test.two")).await;
    slow_driver.hello("test.two", caps(&["receive"]), &[]).await;
    slow_driver.inbound("test.two", "m-2", "alice", "c1", "take your time").await;
    let err = slow_driver.error().await;
    assert_eq!(err.code, "agent_timeout");

    let status = hub.ctl(&["status", "--json"]);
    assert_eq!(status.status.code(), Some(0));
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["instances"][0]["counters"]["runs_failed"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_and_commands_are_gated_by_the_declaration() {
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(
        dir.path(),
        "agent.sh",
        "IFS= read -r envelope\n\
         echo '{\"type\":\"typing\",\"active\":true}'\n\
         echo '{\"type\":\"effect\",\"effect\":{\"type\":\"pin\",\"message_id\":\"m-1\"}}'\n\
         echo '{\"type\":\"request_approval\",\"tool\":\"shell\",\"arguments\":{\"cmd\":\"ls\"},\"command_id\":\"ap-1\"}'\n\
         IFS= read -r approval\n\
         echo '{\"type\":\"invoke\",\"name\":\"x.y\",\"payload\":{},\"command_id\":\"inv-1\"}'\n\
         IFS= read -r invoke\n\
         case \"$approval\" in *accepted*) a=accepted;; *rejected*) a=rejected;; *) a=missing;; esac\n\
         case \"$invoke\" in *rejected*) i=rejected;; *value*) i=value;; *) i=missing;; esac\n\
         echo \"{\\\"type\\\":\\\"reply\\\",\\\"text\\\":\\\"approval=$a invoke=$i\\\"}\"\n",
    );
    let config = format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\nstdin = \"stream\"\n[instance.\"test.one\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    );
    let hub = HubProcess::start(&config);

    // Nothing declared: no effect and no command reaches the driver; both commands fail closed.
    let mut plain = RawPeer::connect(&hub.socket(ONE)).await;
    plain.hello(ONE, caps(&["receive"]), &[]).await;
    plain.inbound(ONE, "m-1", "alice", "c1", "go").await;
    let reply = expect_deliver(plain.frame().await);
    assert_eq!(reply.message.body.text_str(), "approval=rejected invoke=rejected");
    plain.close().await;

    // typing + commands declared: the typing effect and the approval arrive; the pin and the
    // invoke (no tool_control) do not.
    let mut rich = loop {
        let mut peer = RawPeer::connect(&hub.socket(ONE)).await;
        let actions = Actions { typing: true, ..Actions::default() };
        peer.hello_with(ONE, caps(&["receive", "commands"]), actions, &["accepted", "responder"])
            .await;
        // The previous driver's connection may not be released yet: retry, as the SDK does.
        match peer.frame().await {
            Frame::Error(err) if err.code == "already_connected" => continue,
            Frame::HelloAck(_) => break peer,
            other => panic!("unexpected {other:?}"),
        }
    };
    rich.inbound(ONE, "m-2", "alice", "c1", "go").await;
    assert!(matches!(rich.frame().await, Frame::Accepted(_)));
    match rich.frame().await {
        Frame::Effect(effect) => assert_eq!(effect.effect, Effect::Typing { active: true }),
        other => panic!("expected the typing effect, got {other:?}"),
    }
    let command = match rich.frame().await {
        Frame::Command(command) => command,
        other => panic!("expected the approval command, got {other:?}"),
    };
    assert_eq!(command.command.kind(), "request_approval");
    assert_eq!(command.command_id, "ap-1");
    assert_eq!(command.target.as_ref().map(|t| t.conversation.as_str()), Some("c1"));
    rich.send(Frame::CommandResult(channeld_protocol::frame::CommandResultFrame {
        request_id: command.request_id,
        session: command.session,
        command_id: command.command_id,
        result: CommandResult::Accepted,
        responder: Some(channeld_protocol::types::Participant::new(id("alice"))),
    }))
    .await;
    let reply = expect_deliver(rich.frame().await);
    assert_eq!(reply.message.body.text_str(), "approval=accepted invoke=rejected");

    // An approval from someone who is not on the allowlist does not count: fail closed.
    rich.inbound(ONE, "m-3", "alice", "c1", "go").await;
    assert!(matches!(rich.frame().await, Frame::Accepted(_)));
    assert!(matches!(rich.frame().await, Frame::Effect(_)));
    let command = match rich.frame().await {
        Frame::Command(command) => command,
        other => panic!("expected the approval command, got {other:?}"),
    };
    rich.send(Frame::CommandResult(channeld_protocol::frame::CommandResultFrame {
        request_id: command.request_id,
        session: command.session,
        command_id: command.command_id,
        result: CommandResult::Accepted,
        responder: Some(channeld_protocol::types::Participant::new(id("mallory"))),
    }))
    .await;
    let reply = expect_deliver(rich.frame().await);
    assert_eq!(reply.message.body.text_str(), "approval=rejected invoke=rejected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_tools_use_control_hello_and_ours_get_results() {
    let hub = echo_hub();
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive", "send"]), &[]).await;
    driver.inbound(ONE, "m-0", "alice", "c1", "sync").await;
    expect_deliver(driver.frame().await);

    let message = OutboundMessage {
        target: target(ONE, "c1"),
        body: MessageBody::text("from a tool").unwrap(),
        metadata: Default::default(),
    };
    // A reference controller: accepted once forwarded, no result field.
    let mut tool = RawPeer::connect(&hub.socket(ONE)).await;
    tool.send(Frame::ControlHello(ControlHello {
        request_id: id("ctl-1"),
        channel: ChannelId::new(ONE).unwrap(),
        extensions: vec![],
    }))
    .await;
    tool.send(Frame::ControlRequest(ControlRequest {
        request_id: id("ctl-2"),
        action: ControlAction::Send { message: message.clone() },
    }))
    .await;
    let outbound = expect_outbound(driver.frame().await);
    match tool.frame().await {
        Frame::ControlResponse(response) => {
            assert_eq!(response.request_id, "ctl-2");
            assert!(response.accepted);
            assert!(response.result.is_none());
        }
        other => panic!("expected control_response, got {other:?}"),
    }
    driver.send(receipt_for(&outbound.request_id, "c1", "posted-ref")).await;
    tool.send(Frame::ControlRequest(ControlRequest {
        request_id: id("ctl-3"),
        action: ControlAction::Effect {
            target: target(ONE, "c1"),
            effect: Effect::Pin { message_id: id("x") },
        },
    }))
    .await;
    match tool.frame().await {
        Frame::ControlResponse(response) => {
            assert!(!response.accepted);
            assert_eq!(response.error.as_deref(), Some("action pin not declared by driver"));
        }
        other => panic!("expected control_response, got {other:?}"),
    }

    // Our controller declares control_result and gets the receipt.
    let mut ours = RawPeer::connect(&hub.socket(ONE)).await;
    ours.send(Frame::ControlHello(ControlHello {
        request_id: id("ctl-9"),
        channel: ChannelId::new(ONE).unwrap(),
        extensions: vec!["control_result".into()],
    }))
    .await;
    assert!(matches!(ours.frame().await, Frame::HelloAck(_)));
    ours.send(Frame::ControlRequest(ControlRequest {
        request_id: id("ctl-10"),
        action: ControlAction::Send { message },
    }))
    .await;
    let outbound = expect_outbound(driver.frame().await);
    driver.send(receipt_for(&outbound.request_id, "c1", "posted-ours")).await;
    match ours.frame().await {
        Frame::ControlResponse(response) => {
            assert!(response.accepted);
            match response.result {
                Some(channeld_protocol::frame::ControlResult::Receipt { receipt }) => {
                    assert_eq!(receipt.message_id, "posted-ours");
                }
                other => panic!("expected a receipt result, got {other:?}"),
            }
        }
        other => panic!("expected control_response, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_line_without_newline_keeps_memory_bounded_and_resyncs() {
    let hub = echo_hub();
    let pid = hub.pid();
    let before = rss_kib(pid);
    let socket = hub.socket(ONE);
    let writer = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..100 {
            stream.write_all(&chunk).unwrap();
        }
        stream
    });
    let stream = writer.await.unwrap();
    let after = rss_kib(pid);
    assert!(
        after < before + 16 * 1024,
        "hub RSS grew from {before} KiB to {after} KiB while reading a 100 MiB line"
    );
    // The hub answered with line_too_long and resynchronises at the next newline.
    let stream = tokio::net::UnixStream::from_std({
        stream.set_nonblocking(true).unwrap();
        stream
    })
    .unwrap();
    let mut peer = RawPeer::from_stream(stream);
    let err = peer.error().await;
    assert_eq!(err.code, "line_too_long");
    peer.sink.send_encoded(b"\n".to_vec()).await.unwrap();
    peer.hello(ONE, caps(&["receive"]), &[]).await;
    peer.inbound(ONE, "m-1", "alice", "c1", "after the flood").await;
    assert_eq!(expect_deliver(peer.frame().await).message.body.text_str(), "after the flood");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_runs_says_stop_and_removes_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let agent = write_script(dir.path(), "agent.sh", "sleep 1\necho finished\n");
    let mut hub = HubProcess::start(&format!(
        "[runtime.agent]\nkind = \"exec\"\ncommand = [\"{}\"]\n[instance.\"test.one\"]\nallow = [\"alice\"]\nruntime = \"agent\"\n",
        agent.display()
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &["accepted"]).await;
    assert!(matches!(driver.frame().await, Frame::HelloAck(_)));
    driver.inbound(ONE, "m-1", "alice", "c1", "slow one").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    let pid = hub.pid();
    // SAFETY: signal to our own child.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    assert_eq!(expect_deliver(driver.frame().await).message.body.text_str(), "finished");
    assert!(matches!(driver.frame().await, Frame::Stop(_)));
    let status = hub.wait_exit(Duration::from_secs(20));
    assert!(status.success());
    assert!(!hub.socket(ONE).exists());
    assert!(!hub.control_socket().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channelctl_reports_status_health_catalog_and_exit_codes() {
    let hub = echo_hub();
    let out = hub.ctl(&["health", ONE]);
    assert_eq!(out.status.code(), Some(9), "Unavailable has its own exit status");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test.one Unavailable: no driver connected")
    );

    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    driver.inbound(ONE, "m-0", "alice", "c1", "sync").await;
    expect_deliver(driver.frame().await);
    let health = ctl_async(&hub, &["health", ONE]);
    let request = match driver.frame().await {
        Frame::HealthRequest(request) => request,
        other => panic!("expected health_request, got {other:?}"),
    };
    driver
        .send(Frame::HealthResponse(channeld_protocol::frame::HealthResponse {
            request_id: request.request_id,
            health: channeld_protocol::types::Health::new(
                channeld_protocol::types::HealthState::Degraded,
                Some("broker reconnecting".into()),
            ),
        }))
        .await;
    let out = health.await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "test.one Degraded: broker reconnecting"
    );
    assert_eq!(out.status.code(), Some(0), "Degraded is not Unavailable");

    let out = hub.ctl(&["status"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("test.one") && text.contains("Degraded"), "{text}");

    let out = hub.ctl(&["catalog", "--json"]);
    let catalog: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let families: Vec<&str> = catalog["families"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["family"].as_str().unwrap())
        .collect();
    assert!(families.contains(&"console") && families.contains(&"mqtt"));

    assert_eq!(hub.ctl(&["send", "nope.x", "--conversation", "c", "hi"]).status.code(), Some(4));
    assert_eq!(hub.ctl(&["send", ONE, "--conversation", "", "hi"]).status.code(), Some(4));
    let missing = channeld_tests::channelctl(&hub.dir.path().join("absent.sock"), &["status"]);
    assert_eq!(missing.status.code(), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_driver_that_keeps_dying_is_restarted_with_growing_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let driver = write_script(
        dir.path(),
        "driver.sh",
        &format!(
            "date +%s.%N >> '{}'\necho \"$CHANNELD_CHANNEL_ID $CHANNELD_SOCKET\" >> '{}.env'\nexit 1\n",
            starts.display(),
            starts.display()
        ),
    );
    let hub = HubProcess::start(&format!(
        "[instance.\"test.one\"]\nallow = [\"alice\"]\nspawn = [\"{}\"]\n",
        driver.display()
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    let times = loop {
        let times: Vec<f64> = std::fs::read_to_string(&starts)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect();
        if times.len() >= 4 {
            break times;
        }
        assert!(Instant::now() < deadline, "only {} starts; log:\n{}", times.len(), hub.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    // 1 s, 2 s, 4 s with ±25 % jitter: each gap grows.
    assert!(gaps[0] >= 0.7 && gaps[1] > gaps[0] && gaps[2] > gaps[1], "gaps {gaps:?}");
    let env = std::fs::read_to_string(format!("{}.env", starts.display())).unwrap();
    assert!(env.starts_with(&format!("test.one {}", hub.socket(ONE).display())), "{env}");
    let status: serde_json::Value =
        serde_json::from_slice(&hub.ctl(&["status", "--json"]).stdout).unwrap();
    assert!(
        status["instances"][0]["last_error"].as_str().unwrap().contains("driver process exited")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_driver_that_exits_78_is_not_restarted_and_status_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let driver = write_script(
        dir.path(),
        "driver.sh",
        &format!(
            "echo started >> '{}'\necho 'CHANNELD_X: not a URL' >&2\nexit 78\n",
            starts.display()
        ),
    );
    let hub = HubProcess::start(&format!(
        "[instance.\"test.one\"]\nallow = [\"alice\"]\nspawn = [\"{}\"]\n",
        driver.display()
    ));
    // "stopped" is set as the supervisor gives up: from then on no restart is scheduled.
    let deadline = Instant::now() + Duration::from_secs(20);
    let row = loop {
        let row = hub.instance_status(ONE);
        if row["driver_process"]["state"] == "stopped" {
            break row;
        }
        assert!(Instant::now() < deadline, "the driver was not stopped: {row}\n{}", hub.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let started = std::fs::read_to_string(&starts).unwrap();
    assert_eq!(started.lines().count(), 1, "the driver was restarted: {started:?}");
    assert_eq!(row["driver_process"]["starts"], 1);
    assert!(row["driver_process"]["last_exit"].as_str().unwrap().contains("78"), "{row}");
    assert!(row["last_error"].as_str().unwrap().contains("invalid configuration"), "{row}");
    assert!(hub.log().contains("not restarting it"), "{}", hub.log());
    let text = String::from_utf8_lossy(&hub.ctl(&["status"]).stdout).into_owned();
    assert!(text.contains("driver process stopped (exit status: 78)"), "{text}");
}
