//! The hub in process: connections served over in-memory pipes (`serve::serve`,
//! `control::serve`) with the ledger in memory — the behaviour the cross-process tests check
//! through real sockets, here without processes, files or sockets.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use channeld_hub::Hub;
use channeld_hub::config::{HubConfig, Overrides};
use channeld_hub::ledger::Commit;
use channeld_hub::ledger::{
    Added, DB_FILE, Durability, Ledger, NewInbound, NewSend, OutboxRecord, OutboxState, Recorded,
    ReplyState, RunEnd,
};
use channeld_hub::outbox::SendRequest;
use channeld_hub::send::{SendError, SendOutcome, SendState};
use channeld_link::{FrameReader, FrameSink, Writer, spawn_writer};
use channeld_protocol::frame::{Hello, Inbound, Lifecycle};
use channeld_protocol::types::{
    Capabilities, InboundMessage, MessageBody, MessageTarget, OutboundMessage, Participant,
};
use channeld_protocol::{ChannelId, Frame, Id};
use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader, DuplexStream, ReadBuf, ReadHalf,
};
use tokio_util::sync::CancellationToken;

const ONE: &str = "test.one";
const WAIT: Duration = Duration::from_secs(10);

fn hub(extra: &str, ledger: Ledger) -> Arc<Hub> {
    let text = format!("{extra}\n[instance.\"{ONE}\"]\nallow = [\"alice\"]\n");
    let overrides =
        Overrides { runtime_dir: Some("/nonexistent/in-process".into()), state_dir: None };
    let config = HubConfig::parse(&text, Path::new("in-process.toml"), &overrides).unwrap();
    Hub::new(config, ledger, CancellationToken::new())
}

fn id(value: &str) -> Id {
    Id::new(value).unwrap()
}

/// The driver's end of an in-memory connection to the hub's instance `ONE`.
struct Peer {
    reader: FrameReader<ReadHalf<DuplexStream>>,
    sink: FrameSink,
    _writer: Writer,
    served: tokio::task::JoinHandle<()>,
}

impl Peer {
    fn connect(hub: &Arc<Hub>) -> Self {
        let (ours, theirs) = tokio::io::duplex(256 * 1024);
        let (read, write) = tokio::io::split(theirs);
        let inst = hub.instance(ONE).unwrap().clone();
        let served = tokio::spawn(channeld_hub::serve::serve(hub.clone(), inst, read, write, None));
        let (read, write) = tokio::io::split(ours);
        let (sink, writer) = spawn_writer(write, 64);
        Self { reader: FrameReader::new(read), sink, _writer: writer, served }
    }

    async fn send(&self, frame: Frame) {
        self.sink.send(&frame).await.unwrap();
    }

    async fn frame(&mut self) -> Frame {
        match tokio::time::timeout(WAIT, self.reader.next()).await {
            Ok(Ok(Some(Ok(frame)))) => frame,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    async fn hello(&mut self, extensions: &[&str]) {
        self.send(hello(extensions)).await;
        if !extensions.is_empty() {
            assert!(matches!(self.frame().await, Frame::HelloAck(_)));
        }
    }

    async fn inbound(&self, event_id: &str, sender: &str, text: &str) {
        self.send(Frame::Inbound(Inbound {
            event_id: id(event_id),
            message: InboundMessage {
                id: id(event_id),
                target: MessageTarget::new(ChannelId::new(ONE).unwrap(), id("c1")),
                sender: Participant::new(id(sender)),
                body: MessageBody::text(text).unwrap(),
                timestamp_ms: None,
                metadata: Default::default(),
            },
        }))
        .await;
    }
}

/// A driver's `hello` to instance `ONE` (receives and sends) with these extensions.
fn hello(extensions: &[&str]) -> Frame {
    let mut capabilities = Capabilities::default();
    capabilities.set("receive", true);
    capabilities.set("send", true);
    Frame::Hello(Hello {
        request_id: id("hello"),
        channel: ChannelId::new(ONE).unwrap(),
        capabilities,
        actions: Default::default(),
        extensions: extensions.iter().map(|e| (*e).to_owned()).collect(),
        operator_actions: Vec::new(),
    })
}

fn reply_text(frame: Frame) -> String {
    match frame {
        Frame::Deliver(delivery) => delivery.message.body.text_str().to_owned(),
        other => panic!("expected deliver, got {other:?}"),
    }
}

#[tokio::test]
async fn a_driver_in_memory_is_accepted_and_answered() {
    let hub = hub("", Ledger::in_memory().unwrap());
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    driver.inbound("m-1", "alice", "ping").await;
    match driver.frame().await {
        Frame::Accepted(accepted) => assert!(accepted.event_id == "m-1" && !accepted.duplicate),
        other => panic!("expected accepted, got {other:?}"),
    }
    assert_eq!(reply_text(driver.frame().await), "ping");
    driver.inbound("m-2", "mallory", "let me in").await;
    match driver.frame().await {
        Frame::Error(err) => assert_eq!(err.code, "sender_denied"),
        other => panic!("expected sender_denied, got {other:?}"),
    }
}

#[tokio::test]
async fn a_redelivery_replays_from_the_ledger_and_other_content_conflicts() {
    let hub = hub("", Ledger::in_memory().unwrap());
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    driver.inbound("m-1", "alice", "first").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if !a.duplicate));
    assert_eq!(reply_text(driver.frame().await), "first");
    driver.inbound("m-1", "alice", "first").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(a) if a.duplicate));
    assert_eq!(reply_text(driver.frame().await), "first");
    driver.inbound("m-1", "alice", "second").await;
    match driver.frame().await {
        Frame::Error(err) => assert!(err.code == "conflict" && !err.retryable),
        other => panic!("expected conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn help_is_answered_by_the_hub_without_a_ledger() {
    let hub = hub("", Ledger::off());
    let mut driver = Peer::connect(&hub);
    driver.hello(&[]).await;
    driver.inbound("m-1", "alice", "/help").await;
    assert!(reply_text(driver.frame().await).starts_with("Commands: /help"));
}

#[tokio::test]
async fn closing_connections_says_stop_and_ends_the_connection() {
    let hub = hub("", Ledger::off());
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    // The hub knows the driver once it answered something.
    driver.inbound("m-1", "alice", "sync").await;
    assert!(matches!(driver.frame().await, Frame::Accepted(_)));
    assert_eq!(reply_text(driver.frame().await), "sync");
    hub.close_connections.cancel();
    assert!(matches!(driver.frame().await, Frame::Stop(Lifecycle { .. })));
    tokio::time::timeout(WAIT, driver.served).await.expect("served ends").unwrap();
    assert!(hub.instance(ONE).unwrap().live().is_none());
}

/// A driver that never pauses: its `hello`, then `start` lines with no end, every read
/// filled at once (never pending). Once `closed` is cancelled it serves `AFTER_CLOSE` more
/// bytes (thousands of lines) and then ends the stream, noting that it `ran_dry`.
struct Endless {
    pending: Vec<u8>,
    line: Vec<u8>,
    at: usize,
    closed: CancellationToken,
    after_close: usize,
    ran_dry: Arc<AtomicBool>,
}

impl Endless {
    const AFTER_CLOSE: usize = 1 << 20;
}

impl AsyncRead for Endless {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if !this.pending.is_empty() {
            let n = this.pending.len().min(buf.remaining());
            buf.put_slice(&this.pending[..n]);
            this.pending.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let mut room = buf.remaining();
        if this.closed.is_cancelled() {
            if this.after_close == 0 {
                this.ran_dry.store(true, Ordering::SeqCst);
                return Poll::Ready(Ok(()));
            }
            room = room.min(this.after_close);
            this.after_close -= room;
        }
        while room > 0 {
            let rest = &this.line[this.at..];
            let n = rest.len().min(room);
            buf.put_slice(&rest[..n]);
            this.at = (this.at + n) % this.line.len();
            room -= n;
        }
        Poll::Ready(Ok(()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_never_pauses_is_still_closed_when_connections_close() {
    let hub = hub("", Ledger::off());
    let inst = hub.instance(ONE).unwrap().clone();
    let ran_dry = Arc::new(AtomicBool::new(false));
    let driver = Endless {
        pending: channeld_protocol::frame::encode(&hello(&[])).unwrap(),
        line: channeld_protocol::frame::encode(&Frame::Start(Lifecycle { request_id: id("s") }))
            .unwrap(),
        at: 0,
        closed: hub.close_connections.clone(),
        after_close: Endless::AFTER_CLOSE,
        ran_dry: ran_dry.clone(),
    };
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (_, write) = tokio::io::split(theirs);
    let served =
        tokio::spawn(channeld_hub::serve::serve(hub.clone(), inst.clone(), driver, write, None));
    let deadline = tokio::time::Instant::now() + WAIT;
    while inst.live().is_none() {
        assert!(tokio::time::Instant::now() < deadline, "the driver's hello was never taken");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    hub.close_connections.cancel();
    tokio::time::timeout(WAIT, served).await.expect("served ends").unwrap();
    assert!(
        !ran_dry.load(Ordering::SeqCst),
        "the connection ended only when its stream did, not when connections closed"
    );
    let (read, _write) = tokio::io::split(ours);
    let mut reader = FrameReader::new(read);
    let said = tokio::time::timeout(WAIT, reader.next()).await.unwrap().unwrap();
    assert!(matches!(said, Some(Ok(Frame::Stop(_)))), "{said:?}");
}

#[tokio::test]
async fn repeated_idempotency_keys_leave_no_waiting_callers_behind() {
    let hub = hub("", Ledger::in_memory().unwrap());
    let message = OutboundMessage {
        target: MessageTarget::new(ChannelId::new(ONE).unwrap(), id("c1")),
        body: MessageBody::text("notice").unwrap(),
        metadata: Default::default(),
    };
    let request = SendRequest {
        instance: ONE.into(),
        message,
        wait: Some(Duration::from_millis(10)),
        idempotency_key: Some("k-1".into()),
    };
    // No driver: the send waits in the outbox; every repeat waits briefly, then answers queued.
    for _ in 0..20 {
        let outcome = hub.outbox.submit(request.clone()).await.unwrap();
        assert_eq!(outcome.state, SendState::Queued);
    }
    assert!(hub.outbox.waiters().is_empty(), "{} callers left waiting", hub.outbox.waiters().len());
    // The queued send goes out when a driver connects, and its caller's wait is answered.
    let mut driver = Peer::connect(&hub);
    driver.hello(&[]).await;
    match driver.frame().await {
        Frame::Outbound(outbound) => assert_eq!(outbound.message.body.text_str(), "notice"),
        other => panic!("expected the queued send, got {other:?}"),
    }
}

#[tokio::test]
async fn the_control_protocol_is_served_in_memory() {
    let hub = hub("", Ledger::off());
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (read, write) = tokio::io::split(theirs);
    tokio::spawn(channeld_hub::control::serve(hub.clone(), read, write));
    let (read, mut write) = tokio::io::split(ours);
    write.write_all(b"{\"id\":7,\"op\":\"status\"}\n{\"id\":8,\"op\":\"nope\"}\n").await.unwrap();
    let mut lines = BufReader::new(read).lines();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let line = tokio::time::timeout(WAIT, lines.next_line()).await.unwrap().unwrap().unwrap();
        answers.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
    }
    answers.sort_by_key(|a| a["id"].as_u64());
    assert_eq!(answers[0]["ok"], true);
    assert_eq!(answers[0]["result"]["instances"][0]["instance"], ONE);
    assert_eq!(answers[1]["ok"], false);
    assert_eq!(answers[1]["error"]["code"], "invalid_request");
}

#[tokio::test]
async fn an_entry_fingerprinted_by_an_older_hub_still_replays_after_the_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    {
        let hub = hub("", Ledger::open(dir.path(), Durability::Normal).unwrap());
        let mut driver = Peer::connect(&hub);
        driver.hello(&["accepted"]).await;
        driver.inbound("m-1", "alice", "before the upgrade").await;
        assert!(matches!(driver.frame().await, Frame::Accepted(_)));
        assert_eq!(reply_text(driver.frame().await), "before the upgrade");
        hub.ledger.close().await;
    }
    // What a hub of fingerprint version 1 left behind: a hash this build cannot reproduce.
    let db = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
    let changed = db
        .execute("UPDATE inbound SET hash_version = 1, content_hash = randomblob(32)", [])
        .unwrap();
    assert_eq!(changed, 1);
    drop(db);

    let hub = hub("", Ledger::open(dir.path(), Durability::Normal).unwrap());
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    driver.inbound("m-1", "alice", "before the upgrade").await;
    match driver.frame().await {
        Frame::Accepted(accepted) => assert!(accepted.duplicate, "ran again instead of replaying"),
        other => panic!("expected a duplicate acceptance, got {other:?}"),
    }
    assert_eq!(reply_text(driver.frame().await), "before the upgrade");
    driver.inbound("m-1", "alice", "other content").await;
    match driver.frame().await {
        Frame::Error(err) => assert_eq!(err.code, "conflict"),
        other => panic!("expected conflict, got {other:?}"),
    }
    hub.ledger.close().await;
}

fn outbound(text: String) -> OutboundMessage {
    OutboundMessage {
        target: MessageTarget::new(ChannelId::new(ONE).unwrap(), id("c1")),
        body: MessageBody::text(text).unwrap(),
        metadata: Default::default(),
    }
}

/// A send of `text` to `ONE` through the outbox, submitted on its own task (joined by the
/// test) so the test can act while it waits.
fn submit_in_background(
    hub: &Arc<Hub>,
    text: &str,
    wait: Option<Duration>,
) -> tokio::task::JoinHandle<Result<SendOutcome, SendError>> {
    let hub = hub.clone();
    let request = SendRequest {
        instance: ONE.into(),
        message: outbound(text.into()),
        wait,
        idempotency_key: None,
    };
    tokio::spawn(async move { hub.outbox.submit(request).await })
}

/// Outbox record `id` once it is written.
async fn written(hub: &Hub, id: i64) -> OutboxRecord {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(record) = hub.ledger.outbox_get(id).await.unwrap() {
            return record;
        }
        assert!(tokio::time::Instant::now() < deadline, "record {id} was never written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn outbound_text(frame: Frame) -> String {
    match frame {
        Frame::Outbound(outbound) => outbound.message.body.text_str().to_owned(),
        other => panic!("expected outbound, got {other:?}"),
    }
}

#[tokio::test]
async fn a_queued_send_too_large_for_a_frame_fails_and_never_blocks_the_sends_behind_it() {
    let hub = hub("", Ledger::in_memory().unwrap());
    // Queued by a hub that did not check sizes first: small, too large, small.
    let mut ids = Vec::new();
    for text in ["first".to_owned(), "x".repeat(300_000), "second".to_owned()] {
        let added = hub
            .ledger
            .outbox_add(
                NewSend {
                    instance: ONE.into(),
                    idempotency_key: None,
                    message: serde_json::to_vec(&outbound(text)).unwrap(),
                    state: OutboxState::Queued,
                    now_ms: 1,
                    expires_ms: u64::MAX / 2,
                },
                channeld_hub::ledger::Commit::Durable,
            )
            .await
            .unwrap();
        match added {
            Added::New(id) => ids.push(id),
            other => panic!("{other:?}"),
        }
    }
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    // A send made as the driver connects queues behind them instead of overtaking.
    let third = submit_in_background(&hub, "third", None);
    for expected in ["first", "second", "third"] {
        assert_eq!(outbound_text(driver.frame().await), expected);
    }
    third.await.unwrap().unwrap();
    let big = hub.ledger.outbox_get(ids[1]).await.unwrap().unwrap();
    assert_eq!(big.state, OutboxState::Failed);
    assert!(big.error.as_deref().unwrap_or_default().starts_with("too_large"), "{big:?}");

    // Every handed-over send waits for its receipt: the driver leaving makes them unknown.
    drop(driver);
    let deadline = tokio::time::Instant::now() + WAIT;
    for id in [ids[0], ids[2]] {
        loop {
            let record = hub.ledger.outbox_get(id).await.unwrap().unwrap();
            if record.state == OutboxState::Unknown {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "record {id} stayed {}", record.state);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn a_reply_too_big_for_a_frame_is_fitted_recorded_and_delivered_on_connect() {
    let hub = hub("", Ledger::in_memory().unwrap());
    // A reply whose deliver frame is twice the line limit once escaped, recorded while no
    // driver is connected.
    let inbound = Frame::Inbound(Inbound {
        event_id: id("big-1"),
        message: InboundMessage {
            id: id("big-1"),
            target: MessageTarget::new(ChannelId::new(ONE).unwrap(), id("c1")),
            sender: Participant::new(id("alice")),
            body: MessageBody::text("quote me").unwrap(),
            timestamp_ms: None,
            metadata: Default::default(),
        },
    });
    let line = channeld_protocol::encode(&inbound).unwrap();
    let new = NewInbound {
        instance: ONE.into(),
        event_id: "big-1".into(),
        content_hash: channeld_hub::inbound::fingerprint::fingerprint(&inbound).unwrap(),
        hash_version: channeld_hub::inbound::fingerprint::FINGERPRINT_VERSION,
        frame: line[..line.len() - 1].to_vec(),
        run_id: "run-big-1".into(),
        started: true,
        now_ms: 1,
        item: None,
    };
    let recorded = hub.ledger.record_inbound(new, channeld_hub::inbound::fingerprint::rehash, None);
    let (recorded, synced) = recorded.await.answer().await.unwrap();
    assert_eq!(recorded, Recorded::New { entry: None });
    synced.wait().await.unwrap();
    let text = "\"".repeat(200_000);
    let inst = hub.instance(ONE).unwrap();
    let target = MessageTarget::new(ChannelId::new(ONE).unwrap(), id("c1"));
    let reply = channeld_hub::inbound::reply::new_reply(
        &hub,
        &inst,
        &id("big-1"),
        &target,
        &Default::default(),
        &text,
        None,
    );
    let stranded = RunEnd::Reply(text);
    let finished = hub.ledger.finish_run(ONE.into(), "big-1".into(), stranded, reply, false, 2);
    assert!(finished.await.unwrap().ended);

    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    let text = reply_text(driver.frame().await);
    assert!(text.ends_with("[reply truncated]"));
    assert!(text.len() > 100_000, "cut to fit, not dropped");
    // A driver without `reply_receipt` never answers: written counts as posted, and the
    // next driver is not handed it again.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let state = hub.ledger.reply_state(ONE.into(), "big-1".into()).await.unwrap();
        if state == Some(ReplyState::Posted) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the reply is still {state:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_send_queued_during_a_dispatch_is_handed_over_after_it_with_its_wait() {
    let hub = hub("", Ledger::in_memory().unwrap());
    let queued = NewSend {
        instance: ONE.into(),
        idempotency_key: None,
        message: serde_json::to_vec(&outbound("first".into())).unwrap(),
        state: OutboxState::Queued,
        now_ms: 1,
        expires_ms: u64::MAX / 2,
    };
    let first = match hub.ledger.outbox_add(queued, Commit::Durable).await.unwrap() {
        Added::New(id) => id,
        other => panic!("{other:?}"),
    };
    // A dispatcher's turn, held as by one handing queued sends over right now: the driver's
    // connect-time dispatch waits for it. A waited send made meanwhile is recorded at once
    // (a dispatch under way holds back its hand-over, not its record), queued behind the
    // first. That its wait is registered before any dispatcher can claim it is the ledger
    // test `a_watched_send_is_watched_before_the_next_call_sees_its_record`; here, the outcome.
    let backlog = hub.outbox.backlog(ONE);
    let turn = backlog.turn().await;
    let mut driver = Peer::connect(&hub);
    driver.hello(&["accepted"]).await;
    let wait = Duration::from_secs(2);
    let waited = submit_in_background(&hub, "waited", Some(wait));
    let record = written(&hub, first + 1).await;
    assert_eq!(record.state, OutboxState::Queued);
    drop(turn);

    assert_eq!(outbound_text(driver.frame().await), "first");
    assert_eq!(outbound_text(driver.frame().await), "waited");
    // The driver never answers: the caller hears `unknown` at the end of its own wait, not
    // `handed` (what a send waiting for the hub's receipt timeout would still be).
    let started = tokio::time::Instant::now();
    match waited.await.unwrap() {
        Err(SendError::Unknown { .. }) => {}
        other => panic!("expected unknown, got {other:?}"),
    }
    assert!(started.elapsed() < wait + Duration::from_secs(1), "{:?}", started.elapsed());
    let record = hub.ledger.outbox_get(first + 1).await.unwrap().unwrap();
    assert_eq!(record.state, OutboxState::Unknown);
    assert_eq!(
        hub.ledger.outbox_get(first).await.unwrap().unwrap().state,
        OutboxState::Sent,
        "the queued send keeps the hub's receipt timeout"
    );
}
