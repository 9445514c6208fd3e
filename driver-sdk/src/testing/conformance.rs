//! The conformance suite every driver runs against the [`FakeHub`]: handshake, declared versus
//! used capabilities, receipts and their message ids, effect and command gating, operator
//! actions, error survival, reconnects and a prompt stop.
//!
//! A driver's test implements [`ConformanceHarness`] and invokes
//! [`conformance_suite!`](crate::conformance_suite), which expands to one test per check. Each
//! check is also a public async function here, so a failure names the check that found it.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use channeld_protocol::frame::{CommandFrame, EffectFrame, Hello, Inbound};
use channeld_protocol::types::MessageTarget;
use channeld_protocol::{ChannelId, Frame, Id};

pub use super::checks::{commands_to_reject, declaration_problems, sample_effects};
use super::checks::{hello_problems, inbound_problems, receipt_problem, rejection_problem};
use super::fake_hub::{AckMode, FakeConnection, FakeHub};
use crate::launch::DriverLaunchConfig;

/// The channel id every check launches the driver with.
pub const CHANNEL: &str = "conformance.test";

/// How long one whole check may take before it fails.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(120);

/// How soon a driver whose hub connection dropped must be back: the SDK's first reconnect
/// delay is about one second.
pub const RECONNECT_WITHIN: Duration = Duration::from_secs(5);

/// What a driver's test provides so the suite can drive it.
pub trait ConformanceHarness: Send + 'static {
    /// Starts the driver under test with exactly these launch settings: in-process with
    /// [`DriverTask::spawn`](super::DriverTask::spawn), or as a child process with
    /// [`DriverLaunchConfig::to_env`] as its environment (the drain deadline matters: the
    /// suite checks that the driver stops within it).
    fn start(&mut self, launch: DriverLaunchConfig) -> impl Future<Output = ()> + Send;

    /// Makes the platform deliver one text message to the driver (e.g. publish to the broker,
    /// push to a fake platform server, write a stdin line).
    fn inject_inbound(&mut self, text: &str) -> impl Future<Output = ()> + Send;

    /// A target the driver's platform accepts for a proactive send.
    fn outbound_target(&self, channel: &ChannelId) -> MessageTarget;

    /// Stops the driver (SIGTERM for a process, cancel for a task) and waits for it to exit;
    /// returns whether it exited cleanly (status 0, or `Ok` from [`DriverTask::stop`](super::DriverTask::stop)).
    fn stop(&mut self) -> impl Future<Output = bool> + Send;

    /// How many messages the platform has received from the driver so far, counted on the
    /// platform side (a fake server's log, a broker subscriber, the bytes written). The
    /// count must include every post the driver has receipted by the time it is called.
    /// Used to check that a post happens once and a redelivered `outbound` not at all.
    fn platform_posts(&self) -> usize;
}

/// Expands to one test per conformance check, in a module named `conformance`.
///
/// `$make_harness` is evaluated once per test, inside the test's runtime, and must produce a
/// [`ConformanceHarness`]. Each test runs on a two-worker multi-thread runtime (what
/// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` builds) created by the SDK, so
/// the calling crate needs no tokio features of its own.
///
/// ```ignore
/// channeld_driver_sdk::conformance_suite!(MyHarness::new());
/// ```
#[macro_export]
macro_rules! conformance_suite {
    ($make_harness:expr $(,)?) => {
        $crate::conformance_suite!(@checks ($make_harness)
            handshake,
            declared_vs_used_negotiated,
            declared_vs_used_reference,
            outbound_receipt,
            receipt_message_ids,
            effect_gating,
            command_rejection,
            operator_actions,
            error_frame_survival,
            reconnects,
            stops_within_the_drain_deadline,
        );
    };
    (@checks ($make_harness:expr) $($check:ident,)+) => {
        mod conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $check() {
                    $crate::testing::conformance::run_check(stringify!($check), async {
                        $crate::testing::conformance::$check($make_harness).await
                    });
                }
            )+
        }
    };
}

/// Runs one check on a fresh two-worker runtime, bounded by [`CHECK_TIMEOUT`].
#[doc(hidden)]
pub fn run_check<F: Future<Output = ()>>(name: &str, check: F) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CHANNELD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|err| panic!("cannot build the test runtime: {err}"));
    runtime.block_on(async {
        if tokio::time::timeout(CHECK_TIMEOUT, check).await.is_err() {
            panic!("conformance check {name} did not finish within {CHECK_TIMEOUT:?}");
        }
    });
}

/// The first frame is a `hello` for the launch channel with a self-consistent declaration
/// (the rules of `Capabilities::REQUIRES`, valid operator action names), then `start`; on
/// stop the driver sends `stop` and exits cleanly.
pub async fn handshake<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    let problems = hello_problems(&run.hello, &run.launch.channel);
    assert!(problems.is_empty(), "malformed hello: {}", problems.join("; "));
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// Declared versus used, against a hub that negotiates extensions: an injected message
/// arrives as an `inbound` that uses only what the hello declared, and once the hub sent
/// `accepted` it is not resent after a reconnect.
pub async fn declared_vs_used_negotiated<H: ConformanceHarness>(harness: H) {
    declared_vs_used(harness, AckMode::Extensions).await;
}

/// Declared versus used, against a reference hub: as
/// [`declared_vs_used_negotiated`], but with no `accepted` the reply (`deliver`) is what
/// resolves the inbound.
pub async fn declared_vs_used_reference<H: ConformanceHarness>(harness: H) {
    declared_vs_used(harness, AckMode::Reference).await;
}

/// An injected message arrives as an `inbound` that uses only what the hello declared; once
/// the hub has taken it (`accepted`, or a `deliver` without the extension) it is not resent
/// after a reconnect.
async fn declared_vs_used<H: ConformanceHarness>(harness: H, mode: AckMode) {
    let (mut run, mut conn) = Run::start(harness, mode).await;
    let text = format!("conformance inbound ({mode:?})");
    run.harness.inject_inbound(&text).await;
    let inbound = conn.expect_inbound().await;
    check_inbound(&run.hello, &run.launch, &inbound, &text);
    let event_id = inbound.event_id.clone();
    let reply_target = inbound.message.target.clone();

    let resolved_by = if conn.negotiated().accepted {
        conn.accept_inbound(&event_id).await;
        "accepted"
    } else {
        conn.deliver(&event_id, reply_target.clone(), "conformance reply").await;
        "delivered a reply to"
    };
    let mut conn = run.reconnect(conn).await;
    conn.health_request("conformance-probe").await;
    match conn.next_frame().await {
        Frame::HealthResponse(response) if response.request_id == "conformance-probe" => {}
        Frame::Inbound(again) if again.event_id == event_id => {
            panic!("the driver resent inbound {event_id} after the hub {resolved_by} it")
        }
        other => panic!("expected a health_response, got a {} frame", other.type_name()),
    }

    if conn.negotiated().accepted {
        conn.deliver(&event_id, reply_target, "conformance reply").await;
        if conn.negotiated().reply_receipt {
            let receipt = conn.expect_receipt(&event_id).await;
            assert_eq!(receipt.channel, run.launch.channel, "reply receipt names another channel");
        }
    }
    run.stop_cleanly(conn).await;
}

fn check_inbound(hello: &Hello, launch: &DriverLaunchConfig, inbound: &Inbound, text: &str) {
    let problems = inbound_problems(hello, &launch.channel, inbound, text);
    assert!(problems.is_empty(), "{}", problems.join("; "));
}

/// With `send`, an `outbound` gets a `receipt` for the launch channel after exactly one post
/// on the platform, and the same request again gets the same receipt without a second post.
/// Without `send`, an `error` with code `unsupported`.
pub async fn outbound_receipt<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    let target = run.harness.outbound_target(&run.launch.channel);
    let request_id = "conformance-outbound-1";
    let text = "conformance outbound";
    let before = run.harness.platform_posts();
    conn.outbound(request_id, target.clone(), text).await;
    if !run.hello.capabilities.send {
        let err = conn.expect_error(request_id).await;
        assert_eq!(err.code, "unsupported", "an outbound without send refused with {err:?}");
        assert!(!err.retryable, "an outbound without send is not retryable: {err:?}");
        assert_eq!(run.harness.platform_posts(), before, "refused, yet posted");
        run.stop_cleanly(conn).await;
        return;
    }
    let first = conn.expect_receipt(request_id).await;
    if let Some(problem) = receipt_problem(&first, &run.launch.channel) {
        panic!("{problem}");
    }
    let posts = run.harness.platform_posts();
    assert_eq!(posts, before + 1, "one receipt, but the platform saw {} posts", posts - before);

    conn.outbound(request_id, target, text).await;
    let again = conn.expect_receipt(request_id).await;
    assert_eq!(again.message_id, first.message_id, "a redelivered outbound got another message");
    assert_eq!(run.harness.platform_posts(), posts, "a redelivered outbound was posted twice");
    run.stop_cleanly(conn).await;
}

/// A receipt's `message_id` is the platform's id of the posted message: different requests
/// get different ids (each a post of its own), and a reply's receipt (extension
/// `reply_receipt`) names its own message, not the inbound's event id.
pub async fn receipt_message_ids<H: ConformanceHarness>(harness: H) {
    let (mut run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    if !run.hello.capabilities.send {
        health_probe(&mut conn, "conformance-health").await;
        run.stop_cleanly(conn).await;
        return;
    }
    let target = run.harness.outbound_target(&run.launch.channel);
    let mut ids = Vec::new();
    for n in 1..=3 {
        let request_id = format!("conformance-distinct-{n}");
        let before = run.harness.platform_posts();
        conn.outbound(&request_id, target.clone(), "same text, another message").await;
        let receipt = conn.expect_receipt(&request_id).await;
        assert_eq!(run.harness.platform_posts(), before + 1, "{request_id} was not posted once");
        assert!(
            !ids.contains(&receipt.message_id),
            "{request_id} got message_id {} again: each post needs its own",
            receipt.message_id
        );
        ids.push(receipt.message_id);
    }
    if run.hello.capabilities.receive && conn.negotiated().reply_receipt {
        run.harness.inject_inbound("conformance message to reply to").await;
        let inbound = conn.expect_inbound().await;
        conn.accept_inbound(&inbound.event_id).await;
        conn.deliver(&inbound.event_id, inbound.message.target.clone(), "a reply").await;
        let receipt = conn.expect_receipt(&inbound.event_id).await;
        assert!(
            !ids.contains(&receipt.message_id),
            "the reply's message_id {} repeats a proactive post's",
            receipt.message_id
        );
    }
    run.stop_cleanly(conn).await;
}

/// Each effect whose action was not declared is refused with `unsupported_effect`, and the
/// session carries on.
pub async fn effect_gating<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    let target = run.harness.outbound_target(&run.launch.channel);
    let declared = run.hello.actions;
    for effect in sample_effects().into_iter().filter(|effect| !declared.allows(effect)) {
        let action = effect.action();
        let request_id = format!("conformance-effect-{action}");
        let frame = EffectFrame { request_id: id(&request_id), target: target.clone(), effect };
        conn.send(&Frame::Effect(frame)).await;
        let err = conn.expect_error(&request_id).await;
        assert_eq!(err.code, "unsupported_effect", "undeclared {action} refused with {err:?}");
    }
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// Commands the driver cannot present are rejected, never accepted: everything without
/// `commands`, `invoke` without `tool_control`, choices without `choices`/`multi_choice`.
pub async fn command_rejection<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    let target = run.harness.outbound_target(&run.launch.channel);
    let caps = run.hello.capabilities;
    for (name, command) in commands_to_reject(&caps) {
        let request_id = format!("conformance-command-{name}");
        let frame = CommandFrame {
            request_id: id(&request_id),
            session: id("conformance-session"),
            command_id: id(&format!("conformance-{name}")),
            command,
            target: Some(target.clone()),
        };
        conn.send(&Frame::Command(frame.clone())).await;
        let result = conn.expect_command_result(&request_id).await;
        if let Some(problem) = rejection_problem(&frame, &result) {
            panic!("{name}: {problem}");
        }
    }
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// With the `operator_action` extension, an action the driver did not declare is answered
/// `ok: false` with code `unsupported`, never performed; the session carries on.
pub async fn operator_actions<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    assert!(
        run.hello.operator_actions.is_empty()
            || run.hello.extensions.iter().any(|e| e == "operator_action"),
        "hello lists operator_actions without the operator_action extension"
    );
    if conn.negotiated().operator_action {
        let name = "conformance_no_such_action";
        assert!(!run.hello.operator_actions.iter().any(|a| a == name));
        conn.operator_action("conformance-op-1", name, serde_json::json!({})).await;
        let result = conn.expect_operator_action_result("conformance-op-1").await;
        assert!(!result.ok, "an undeclared operator action was performed: {result:?}");
        assert_eq!(result.code.as_deref(), Some("unsupported"), "{result:?}");
    }
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// `error` frames from the hub (with a null or an unknown request id) and a line that is not
/// JSON do not end the session; the bad line is answered with an `invalid_json` error.
pub async fn error_frame_survival<H: ConformanceHarness>(harness: H) {
    let (run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    let unknown = format!("conformance-unknown-{}", unique_suffix());
    let errors = [
        Frame::error(None, "conformance", "an error about nothing in particular", false),
        Frame::error(Some(id(&unknown)), "conformance", "an error about no known request", false),
    ];
    for frame in &errors {
        conn.send(frame).await;
    }
    health_probe(&mut conn, "conformance-health-1").await;
    if run.hello.capabilities.send {
        let target = run.harness.outbound_target(&run.launch.channel);
        conn.outbound("conformance-outbound-after-error", target, "still here").await;
        conn.expect_receipt("conformance-outbound-after-error").await;
    }

    conn.send_raw(b"this line is not json\n").await;
    let err = conn.expect_uncorrelated_error().await;
    assert_eq!(err.code, "invalid_json", "a line that is not JSON answered with {err:?}");
    health_probe(&mut conn, "conformance-health-2").await;
    run.stop_cleanly(conn).await;
}

/// When the hub drops the connection the driver reconnects within [`RECONNECT_WITHIN`], shakes
/// hands again and sends the message that arrived while it was disconnected.
pub async fn reconnects<H: ConformanceHarness>(harness: H) {
    let (mut run, conn) = Run::start(harness, AckMode::Extensions).await;
    conn.disconnect();
    let text = "conformance inbound while disconnected";
    run.harness.inject_inbound(text).await;
    let mut conn = run.await_reconnect().await;

    let inbound = conn.expect_inbound().await;
    check_inbound(&run.hello, &run.launch, &inbound, text);
    conn.accept_inbound(&inbound.event_id).await;
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// A driver told to stop while its platform side is busy (a message was just reported)
/// returns from `run`, says `stop` and exits cleanly within the drain deadline
/// ([`DRAIN`](super::DRAIN)); a `run` that ignores its shutdown token is aborted at the
/// deadline and the driver exits non-zero, which fails this check every time.
pub async fn stops_within_the_drain_deadline<H: ConformanceHarness>(harness: H) {
    let (mut run, mut conn) = Run::start(harness, AckMode::Extensions).await;
    assert!(run.launch.drain_timeout < super::IO_TIMEOUT);
    if run.hello.capabilities.receive {
        run.harness.inject_inbound("conformance inbound before stopping").await;
        let inbound = conn.expect_inbound().await;
        conn.accept_inbound(&inbound.event_id).await;
    }
    health_probe(&mut conn, "conformance-health").await;
    run.stop_cleanly(conn).await;
}

/// A started driver and its fake hub; the current connection is kept next to it.
struct Run<H> {
    harness: H,
    hub: FakeHub,
    launch: DriverLaunchConfig,
    /// The `hello` of the current connection.
    hello: Hello,
    mode: AckMode,
}

impl<H: ConformanceHarness> Run<H> {
    async fn start(mut harness: H, mode: AckMode) -> (Self, FakeConnection) {
        let hub = FakeHub::bind().await;
        let launch = hub.launch_config(CHANNEL);
        harness.start(launch.clone()).await;
        let mut conn = hub.accept().await;
        let hello = conn.handshake(mode).await;
        (Run { harness, hub, launch, hello, mode }, conn)
    }

    /// Drops `conn` and waits for the driver to come back and shake hands again.
    async fn reconnect(&mut self, conn: FakeConnection) -> FakeConnection {
        conn.disconnect();
        self.await_reconnect().await
    }

    /// Waits for the driver to connect again and shake hands.
    async fn await_reconnect(&mut self) -> FakeConnection {
        let mut conn = self.hub.accept_within(RECONNECT_WITHIN).await;
        self.hello = conn.handshake(self.mode).await;
        assert_eq!(
            self.hello.channel, self.launch.channel,
            "hello after a reconnect names another channel"
        );
        conn
    }

    /// Stops the driver and checks it says `stop`, closes the connection and exits cleanly.
    async fn stop_cleanly(mut self, mut conn: FakeConnection) {
        let (clean, ()) = tokio::join!(self.harness.stop(), async {
            conn.expect_stop().await;
            conn.closed().await;
        });
        assert!(
            clean,
            "the driver did not exit cleanly after being stopped (a run that does not return \
             within the drain deadline of {:?} is aborted and the driver exits non-zero)",
            self.launch.drain_timeout
        );
    }
}

/// A `health_request` is answered: the session is alive and reading.
async fn health_probe(conn: &mut FakeConnection, request_id: &str) {
    conn.health_request(request_id).await;
    conn.expect_health_response(request_id).await;
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap_or_else(|err| panic!("{value:?} is not a valid id: {err}"))
}

fn unique_suffix() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}
