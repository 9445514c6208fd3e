//! Smaller edges of the operator's paths, through the real binaries: a control request cut
//! off before its newline, the deny notice's rate limit and `channeld check`'s warnings about
//! allowlist entries that cannot be what was meant, `status` over thousands of instances a
//! page at a time, and operator actions answered, refused
//! and timed out by a raw driver. (`channelctl health`'s exit status is checked in `hub.rs`;
//! operator actions through a real driver in `acecode.rs`.)

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use channeld_protocol::frame::{Hello, Lifecycle, OperatorActionResult};
use channeld_protocol::{ChannelId, Frame};
use channeld_tests::peer::caps;
use channeld_tests::{HubProcess, RawPeer, workspace_bin, write_file};

const ONE: &str = "test.one";

#[test]
fn a_control_request_without_a_trailing_newline_is_answered_at_end_of_file() {
    let hub = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"));
    let mut stream = std::os::unix::net::UnixStream::connect(hub.control_socket()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(b"{\"id\":7,\"op\":\"status\"}").unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let answer: serde_json::Value =
        serde_json::from_str(answer.trim()).unwrap_or_else(|err| panic!("{err}: {answer:?}"));
    assert_eq!(answer["id"], 7);
    assert_eq!(answer["ok"], true);
}

/// Instances configured in the paging test: their status rows take more than the 1 MiB a
/// control answer may hold.
const MANY: usize = 2500;

#[test]
fn status_of_thousands_of_instances_comes_a_page_at_a_time_and_channelctl_lists_them_all() {
    let mut config = String::new();
    for i in 0..MANY {
        config.push_str(&format!("[instance.\"many.i{i:05}\"]\nallow = [\"alice\"]\n"));
    }
    config.push_str(&format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"));
    let hub = HubProcess::start(&config);

    // One request, no cursor: the first page, in id order, pointing to the next.
    let first = control(&hub, r#"{"id":1,"op":"status"}"#);
    let rows = first["result"]["instances"].as_array().unwrap();
    assert_eq!(rows.len(), 1000, "the default page");
    assert_eq!(rows[0]["instance"], "many.i00000");
    assert_eq!(first["result"]["total"], MANY + 1);
    assert_eq!(first["result"]["next_after"], "many.i00999");

    // channelctl walks every page: all instances once, in order.
    let out = hub.ctl(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = all["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["instance"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), MANY + 1);
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "in id order, none twice");
    assert_eq!(all.get("next_after"), None);
    let out = hub.ctl(&["status"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("many.i02499") && text.contains(ONE), "{}", &text[..300.min(text.len())]);

    // One page on request, and the text says where the next starts.
    let out = hub.ctl(&["status", "--limit", "3", "--after", "many.i00010"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("many.i00011") && text.contains("many.i00013"), "{text}");
    assert!(!text.contains("many.i00014"), "{text}");
    assert!(
        text.contains(&format!(
            "(3 of {} shown; the next page: channelctl status --after many.i00013)",
            MANY + 1
        )),
        "{text}"
    );

    // A filter: one instance, or a family; a name that is neither is refused (exit 4).
    let out = hub.ctl(&["status", ONE, "--json"]);
    let one: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (one["total"].as_u64(), one["instances"][0]["instance"].as_str()),
        (Some(1), Some(ONE))
    );
    let out = hub.ctl(&["status", "many", "--limit", "2", "--json"]);
    let family: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(family["total"], MANY);
    assert_eq!(family["next_after"], "many.i00001");
    let out = hub.ctl(&["status", "many.i99999"]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no instance or driver family named many.i99999 (unknown_instance)"),
        "{err}"
    );
}

/// One control request line; the whole answer.
fn control(hub: &HubProcess, request: &str) -> serde_json::Value {
    let mut stream = std::os::unix::net::UnixStream::connect(hub.control_socket()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(format!("{request}\n").as_bytes()).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    serde_json::from_str(answer.trim()).unwrap_or_else(|err| panic!("{err}: {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_notice_goes_to_each_denied_sender_once_per_interval() {
    let hub = HubProcess::start(&format!(
        "[instance.\"{ONE}\"]\nallow = [\"alice\"]\ndeny_notice = \"This bot is private.\"\n\
         deny_notice_interval_secs = 3600\n"
    ));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver.hello(ONE, caps(&["receive"]), &[]).await;
    let mut notices = Vec::new();
    for (n, sender) in ["mallory", "mallory", "eve", "mallory", "eve"].iter().enumerate() {
        let event = format!("d-{n}");
        driver.inbound(ONE, &event, sender, "c1", "let me in").await;
        // Every denied message is refused; a notice, when one goes, comes first.
        loop {
            match driver.frame().await {
                Frame::Deliver(notice) => {
                    assert_eq!(notice.message.body.text_str(), "This bot is private.");
                    notices.push((*sender, notice.request_id.into_string()));
                }
                Frame::Error(err) => {
                    assert_eq!(err.code, "sender_denied");
                    assert_eq!(err.request_id.map(|r| r.into_string()), Some(event));
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(notices, vec![("mallory", "d-0".to_owned()), ("eve", "d-2".to_owned())]);
    assert_eq!(hub.instance_status(ONE)["counters"]["denied"], 5);
}

#[test]
fn channeld_check_warns_about_allowlist_entries_with_stray_spaces_or_invisible_characters() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(
        dir.path(),
        "channeld.toml",
        "[instance.\"test.one\"]\nallow = [\"alice\", \" bob\", \"carol\\u200b\", \"dave\\t\"]\n",
    );
    let out = Command::new(workspace_bin("channeld"))
        .arg("check")
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "warnings do not make the file invalid");
    let warnings = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = warnings.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(lines.len(), 3, "{warnings}");
    assert!(warnings.contains("instance.\"test.one\".allow"), "{warnings}");
    assert!(warnings.contains("\" bob\""), "{warnings}");
    assert!(warnings.contains("carol\\u{200b}"), "{warnings}");
    assert!(warnings.contains("dave\\t"), "{warnings}");
    assert!(!warnings.contains("alice"), "{warnings}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_action_reaches_the_driver_once_and_its_answer_or_silence_is_the_exit_status() {
    let hub = HubProcess::start(&format!("[instance.\"{ONE}\"]\nallow = [\"alice\"]\n"));
    let mut driver = RawPeer::connect(&hub.socket(ONE)).await;
    driver
        .send(Frame::Hello(Hello {
            request_id: channeld_tests::peer::id("hello-1"),
            channel: ChannelId::new(ONE).unwrap(),
            capabilities: caps(&["receive", "send"]),
            actions: Default::default(),
            extensions: vec!["operator_action".into()],
            operator_actions: vec!["resume".into()],
        }))
        .await;
    driver.send(Frame::Start(Lifecycle { request_id: channeld_tests::peer::id("start-1") })).await;
    let Frame::HelloAck(ack) = driver.frame().await else { panic!("no hello_ack") };
    assert_eq!(ack.extensions, ["operator_action"]);

    // Answered ok, with data.
    let call = hub.ctl_async(&["action", ONE, "resume", "--args", "{\"why\":\"test\"}", "--json"]);
    let Frame::OperatorAction(action) = driver.frame().await else { panic!("no operator_action") };
    assert_eq!(
        (action.name.as_str(), &action.args),
        ("resume", &serde_json::json!({"why": "test"}))
    );
    let answer = OperatorActionResult {
        request_id: action.request_id,
        ok: true,
        code: None,
        message: Some("resumed".into()),
        data: Some(serde_json::json!({"was": "fenced"})),
    };
    driver.send(Frame::OperatorActionResult(answer)).await;
    let out = call.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["data"], serde_json::json!({"was": "fenced"}));
    assert_eq!(result["message"], "resumed");

    // Answered failed: exit 6 with the driver's code and sentence.
    let call = hub.ctl_async(&["resume", ONE]);
    let Frame::OperatorAction(action) = driver.frame().await else { panic!("no operator_action") };
    let answer = OperatorActionResult {
        request_id: action.request_id,
        ok: false,
        code: Some("failed".into()),
        message: Some("still displaced".into()),
        data: None,
    };
    driver.send(Frame::OperatorActionResult(answer)).await;
    let out = call.await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{err}");
    assert!(err.contains("failed: still displaced") && err.contains("action_failed"), "{err}");

    // Not answered: exit 5 after the timeout, and the action was sent once.
    let out = hub.ctl_async(&["resume", ONE, "--timeout", "1"]).await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert!(err.contains("action_timeout"), "{err}");
    let Frame::OperatorAction(_) = driver.frame().await else { panic!("no operator_action") };

    // Not declared: refused by the hub; the driver sees nothing.
    let out = hub.ctl(&["action", ONE, "relogin"]);
    assert_eq!(out.status.code(), Some(4));
    let out = hub.ctl(&["action", ONE, "resume", "--args", "[1]"]);
    assert_eq!(out.status.code(), Some(2), "--args must be an object");
    // The next frame the driver sees is the next declared action: nothing came in between.
    let call = hub.ctl_async(&["action", ONE, "resume", "--args", "{\"n\":2}", "--timeout", "1"]);
    let Frame::OperatorAction(action) = driver.frame().await else { panic!("no operator_action") };
    assert_eq!(action.args, serde_json::json!({"n": 2}));
    assert_eq!(call.await.unwrap().status.code(), Some(5));
}
