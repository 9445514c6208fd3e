//! The courier: hands the replies recorded in the ledger to each instance's driver and
//! settles them by the driver's answer — posted (receipt), failed for good, failed but
//! retryable (tried again after a backoff, or at once when the instance is Ready again, until
//! the reply TTL passes), or unknown (no answer in time, or the driver cannot tell). Replies of
//! one conversation go out one at a time, in order. The decisions are the ledger's
//! (`ledger/reply_state.rs`); this module only times them and moves frames.
//!
//! A run that recorded its reply hands it over itself: claimed in the same transaction as
//! the run's end when nothing holds its conversation ([`Courier::deliver_claimed`]), else
//! with a claim of its own ([`Courier::deliver`]). A kick (an answer, a driver connected or
//! Ready again, an operator's retry, a timer) starts a dispatcher for the instance if its
//! driver is connected, at most one per instance at a time (tracked with the hub's
//! background tasks). Either way an instance's hand-overs take turns, and a driver slow to
//! read holds up only its own; a conversation has one reply on its way at a time, so its
//! replies leave in order. One timer task (`run`, until connections close) wakes for the
//! next retry, the next answer deadline and expiry, at most [`IDLE_WAKE`] apart.
//!
//! Without the ledger there is no courier: replies go straight to the connection, once.

use std::collections::HashSet;

use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use channeld_protocol::frame::{Delivery, ErrorFrame, Receipt};
use channeld_protocol::{Frame, Id, encode};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::connection::{Connection, lock};
use crate::instance::{Counters, Instance, Registry};
use crate::ledger::{
    Answer, HandedReply, Ledger, LedgerError, Pending, ReplyAnswer, ReplyRecord, ReplyState,
    Settled, StoredReply,
};

/// The loop wakes at least this often (expiry, and retries recorded by another path).
const IDLE_WAKE: Duration = Duration::from_secs(60);

/// How many replies one claim takes.
const CLAIM_BATCH: usize = 256;

/// The error code of a driver that cannot tell whether a post happened.
const SEND_UNKNOWN: &str = "send_unknown";

fn now_ms() -> u64 {
    crate::clock::now_ms()
}

/// A reply handed to a connection and waiting for its answer.
#[derive(Debug, Clone, Copy)]
struct Handed {
    conn: u64,
    deadline: Instant,
}

/// An answer queued on the ledger: what the driver said, and the record's pending result.
#[derive(Debug)]
struct Queued {
    answer: Answer,
    error: Option<String>,
    pending: Pending<Option<Settled>>,
}

/// One instance's turn to hand replies over, and which requests for it were served.
#[derive(Debug, Default)]
struct Turn {
    lock: tokio::sync::Mutex<()>,
    /// Requests made so far (each `deliver` takes the next number).
    asked: AtomicU64,
    /// Every request numbered up to this was made before a hand-over that has finished
    /// began its claim: served.
    served: AtomicU64,
}

/// Hands replies over and settles them. One per hub; cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Courier {
    ledger: Ledger,
    instances: Arc<Registry>,
    /// Where dispatchers and answer writes run; drained by the hub at shutdown.
    tasks: TaskTracker,
    ttl: Duration,
    answer_timeout: Duration,
    /// Wakes the timer task: a deadline or retry time may have come closer.
    wake: Notify,
    /// A settle scheduled a retry: the timer reads the ledger's next wake again.
    schedule_changed: AtomicBool,
    /// Instances with a dispatcher running, and whether it must look again when done.
    dispatching: Mutex<HashMap<String, bool>>,
    /// Per instance, the turn to hand replies over: one hand-over at a time, so replies
    /// leave in the order they were claimed. Bounded by the instances served.
    turns: Mutex<HashMap<String, Arc<Turn>>>,
    /// Replies handed over and not answered yet, by instance and event id. An entry lives
    /// from the hand-over until the answer, the deadline or the connection's end.
    handed: Mutex<HashMap<(String, Id), Handed>>,
}

impl Courier {
    /// `ttl`: how long a reply is tried; `answer_timeout`: how long a handed reply waits for
    /// its receipt or error before it is `unknown`.
    pub fn new(
        ledger: Ledger,
        instances: Arc<Registry>,
        tasks: TaskTracker,
        ttl: Duration,
        answer_timeout: Duration,
    ) -> Self {
        Self {
            ledger,
            instances,
            tasks,
            ttl,
            answer_timeout,
            wake: Notify::new(),
            schedule_changed: AtomicBool::new(false),
            dispatching: Mutex::default(),
            turns: Mutex::default(),
            handed: Mutex::default(),
        }
    }

    pub fn is_on(&self) -> bool {
        self.ledger.is_on()
    }

    /// How long a reply is tried before it expires.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Hands `instance`'s due replies to its driver now, if one is connected.
    pub fn kick(self: &Arc<Self>, instance: &str) {
        if !self.is_on() {
            return;
        }
        if let Some(inst) = self.instances.get(instance)
            && inst.live().is_some()
        {
            self.dispatch(inst);
        }
    }

    /// The instance's driver is connected or Ready again: its retryable failures are due at
    /// once, then everything due is handed over.
    pub fn ready(self: &Arc<Self>, instance: &str) {
        if !self.is_on() {
            return;
        }
        let courier = self.clone();
        let instance = instance.to_owned();
        self.tasks.spawn(async move {
            match courier.ledger.replies_due_now(instance.clone(), now_ms()).await {
                Ok(0) => {}
                Ok(count) => info!(%instance, replies = count, "driver ready again; retrying failed replies now"),
                Err(err) => warn!(%instance, error = %err, "failed replies not made due"),
            }
            courier.kick(&instance);
        });
    }

    /// A driver connection ended: what it was handed and did not answer goes back to
    /// `pending`, handed over again to the next driver.
    pub fn connection_closed(self: &Arc<Self>, inst: &Instance, conn: &Connection) {
        let instance = inst.config.id.to_string();
        let lost: Vec<Id> = {
            let mut handed = lock(&self.handed);
            let lost: Vec<Id> = handed
                .iter()
                .filter(|((i, _), h)| *i == instance && h.conn == conn.id)
                .map(|((_, event), _)| event.clone())
                .collect();
            for event in &lost {
                handed.remove(&(instance.clone(), event.clone()));
            }
            lost
        };
        if lost.is_empty() {
            return;
        }
        debug!(%instance, replies = lost.len(), "driver left before answering replies; they wait for the next one");
        let courier = self.clone();
        self.tasks.spawn(async move {
            for event_id in lost {
                courier.settle(&instance, event_id.as_str(), Answer::Lost, None, None).await;
            }
        });
    }

    /// A `receipt` no outbound waited for: with `reply_receipt` it says the reply to the event
    /// it names was posted.
    pub async fn on_receipt(
        self: &Arc<Self>,
        inst: &Instance,
        conn: &Connection,
        receipt: Receipt,
    ) {
        if !(conn.declaration.extensions.reply_receipt && self.is_on()) {
            debug!(instance = %inst.config.id, request_id = %receipt.request_id, "receipt nobody waits for");
            return;
        }
        let Receipt { request_id, receipt } = receipt;
        let encoded = serde_json::to_vec(&receipt).ok();
        self.answered(inst, request_id, Answer::Posted, encoded, None).await;
    }

    /// An `error` frame no outbound waited for: with `reply_receipt`, the failure of the reply
    /// it names — retryable or final as the driver says, unknown for `send_unknown`.
    pub async fn on_error(self: &Arc<Self>, inst: &Instance, conn: &Connection, err: ErrorFrame) {
        if !(conn.declaration.extensions.reply_receipt && self.is_on()) {
            return;
        }
        let Some(request_id) = err.request_id else { return };
        let answer = if err.code == SEND_UNKNOWN {
            Answer::Unknown
        } else {
            Answer::Failed { retryable: err.retryable }
        };
        let error = format!("{}: {}", err.code, err.message);
        self.answered(inst, request_id, answer, None, Some(error)).await;
    }

    /// A driver's answer, on its reader: queued on the ledger before the frames behind it
    /// (a posted reply's history entry goes before the next message's), settled off the
    /// reader.
    async fn answered(
        self: &Arc<Self>,
        inst: &Instance,
        event_id: Id,
        answer: Answer,
        receipt: Option<Vec<u8>>,
        error: Option<String>,
    ) {
        let instance = inst.config.id.to_string();
        lock(&self.handed).remove(&(instance.clone(), event_id.clone()));
        let queued = self.queue_answer(&instance, event_id.as_str(), answer, receipt, error).await;
        let courier = self.clone();
        self.tasks.spawn(async move {
            courier.settled(&instance, event_id.as_str(), queued).await;
        });
    }

    /// Records an answer; a reply that settled (or failed retryably) lets the next one of its
    /// conversation go, so the instance is kicked.
    async fn settle(
        self: &Arc<Self>,
        instance: &str,
        event_id: &str,
        answer: Answer,
        receipt: Option<Vec<u8>>,
        error: Option<String>,
    ) {
        let queued = self.queue_answer(instance, event_id, answer, receipt, error).await;
        self.settled(instance, event_id, queued).await;
    }

    /// Queues an answer's record on the ledger.
    async fn queue_answer(
        &self,
        instance: &str,
        event_id: &str,
        answer: Answer,
        receipt: Option<Vec<u8>>,
        error: Option<String>,
    ) -> Queued {
        let history = self.instances.get(instance).and_then(|inst| inst.policy().history);
        let answer = ReplyAnswer {
            instance: instance.to_owned(),
            event_id: event_id.to_owned(),
            answer,
            receipt,
            error,
            history,
        };
        let (kind, said) = (answer.answer, answer.error.clone());
        let pending = self.ledger.reply_answer(answer, now_ms(), fastrand::f64()).await;
        Queued { answer: kind, error: said, pending }
    }

    /// Waits for a queued answer's record and acts on the reply's new state.
    async fn settled(self: &Arc<Self>, instance: &str, event_id: &str, queued: Queued) {
        let Queued { answer, error, pending } = queued;
        match pending.answer().await {
            Ok(Some(Settled { state, more_due })) => {
                match state {
                    ReplyState::FailedRetryable => {
                        info!(%instance, %event_id, ?error, "reply not posted; it will be retried")
                    }
                    ReplyState::Failed => {
                        warn!(%instance, %event_id, ?error, "reply refused by the platform; not retried")
                    }
                    ReplyState::Unknown => {
                        warn!(%instance, %event_id, reason = ?error, "reply outcome unknown; it will not be resent automatically")
                    }
                    ReplyState::Expired => {
                        warn!(%instance, %event_id, "reply expired before it could be posted")
                    }
                    _ => {}
                }
                // A retry may now be due sooner than the loop's timer: it reads the ledger's
                // schedule again (only then; other wakes need no ledger read).
                if state == ReplyState::FailedRetryable {
                    self.schedule_changed.store(true, Ordering::SeqCst);
                    self.wake.notify_one();
                }
                // A final reply with none behind it in its conversation let nothing go: any
                // other reply due came with a `deliver` or kick of its own.
                if more_due {
                    self.kick(instance);
                }
            }
            Ok(None) => {
                debug!(%instance, %event_id, ?answer, "answer for no reply waiting for one")
            }
            Err(err) => warn!(%instance, %event_id, error = %err, "reply answer not recorded"),
        }
    }

    /// An operator's retry: an `unknown`, `failed` or `expired` reply is pending again, with a
    /// new TTL, and handed over as soon as its conversation allows.
    pub async fn retry(self: &Arc<Self>, id: i64) -> Result<ReplyRecord, LedgerError> {
        let now = now_ms();
        let record = self.ledger.reply_requeue(id, now, now + self.ttl.as_millis() as u64).await?;
        info!(instance = %record.instance, event_id = %record.event_id, id, "reply queued again by an operator");
        self.kick(&record.instance);
        Ok(record)
    }

    /// The timer: hands over retries when they are due, times out answers, expires replies
    /// past their TTL; until `stop`. Everything owed when it starts is handed over first.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        if !self.is_on() {
            return;
        }
        let mut wake = Instant::now();
        // The ledger's next retry or expiry as last read: read again when the timer fires
        // and when a settle scheduled a retry, not on every wake (a hand-over wakes the loop
        // for its answer deadline, once per reply). A reply recorded since expires no sooner
        // than one TTL after that read, so the loop reads again by then at the latest.
        let mut due = None;
        let mut read_at = Instant::now();
        loop {
            let mut reread = self.schedule_changed.swap(false, Ordering::SeqCst);
            if Instant::now() >= wake {
                reread = true;
                match self.ledger.replies_expire(now_ms()).await {
                    Ok(0) => {}
                    Ok(count) => {
                        warn!(replies = count, "replies expired before they could be posted")
                    }
                    Err(err) => warn!(error = %err, "reply expiry failed"),
                }
                for instance in self.instances.snapshot().keys() {
                    self.kick(instance.as_str());
                }
            }
            for instance in self.time_out() {
                self.kick(&instance);
            }
            if reread {
                read_at = Instant::now();
                due = self.next_due().await;
            }
            let now = Instant::now();
            wake = [due, self.next_deadline(), Some(read_at + self.ttl)]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(now + IDLE_WAKE)
                .min(now + IDLE_WAKE);
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    /// When the next retry or expiry is due, as an instant.
    async fn next_due(&self) -> Option<Instant> {
        let now = now_ms();
        let at = match self.ledger.replies_next_wake(now).await {
            Ok(at) => at?,
            Err(err) => {
                warn!(error = %err, "next reply retry not read");
                return None;
            }
        };
        let wait = Duration::from_millis(at.saturating_sub(now));
        Some(Instant::now() + wait)
    }

    fn next_deadline(&self) -> Option<Instant> {
        lock(&self.handed).values().map(|h| h.deadline).min()
    }

    /// Handed replies whose answer did not come in time become `unknown`; returns their
    /// instances (their conversations may go on).
    fn time_out(self: &Arc<Self>) -> HashSet<String> {
        let now = Instant::now();
        let late: Vec<(String, Id)> = {
            let mut handed = lock(&self.handed);
            let late: Vec<(String, Id)> =
                handed.iter().filter(|(_, h)| h.deadline <= now).map(|(k, _)| k.clone()).collect();
            for key in &late {
                handed.remove(key);
            }
            late
        };
        let instances = late.iter().map(|(i, _)| i.clone()).collect();
        for (instance, event_id) in late {
            if let Some(inst) = self.instances.get(&instance) {
                inst.record_error(format!("reply for {event_id}: no receipt in time"));
            }
            let courier = self.clone();
            let reason = format!("no receipt or error within {} s", self.answer_timeout.as_secs());
            self.tasks.spawn(async move {
                courier
                    .settle(&instance, event_id.as_str(), Answer::NoAnswer, None, Some(reason))
                    .await;
            });
        }
        instances
    }

    /// Starts a dispatcher for `inst`, unless one runs (then it looks again once it is done,
    /// on the driver connection live then).
    fn dispatch(self: &Arc<Self>, inst: Arc<Instance>) {
        let instance = inst.config.id.to_string();
        {
            let mut dispatching = lock(&self.dispatching);
            if let Some(again) = dispatching.get_mut(&instance) {
                *again = true;
                return;
            }
            dispatching.insert(instance.clone(), false);
        }
        let courier = self.clone();
        self.tasks.spawn(async move {
            loop {
                courier.deliver(&inst).await;
                let mut dispatching = lock(&courier.dispatching);
                match dispatching.get_mut(&instance) {
                    Some(again) if *again => *again = false,
                    _ => {
                        dispatching.remove(&instance);
                        return;
                    }
                }
            }
        });
    }

    /// Hands `inst`'s due replies to its live driver now, in its turn, and returns once they
    /// are written: a run that just recorded its reply waits for this, so a hub draining its
    /// runs has written their replies before it tells the drivers `stop`.
    ///
    /// Callers that queue for the turn while a hand-over runs are served by the next one
    /// together: it starts after all of them asked, so its claim sees every reply they
    /// recorded, and the others return without a claim of their own (256 runs ending at once
    /// cost one claim, not 256 one after another).
    pub async fn deliver(self: &Arc<Self>, inst: &Instance) {
        if !self.is_on() {
            return;
        }
        let turn = self.turn(inst);
        let ticket = turn.asked.fetch_add(1, Ordering::SeqCst) + 1;
        let _turn = turn.lock.lock().await;
        if turn.served.load(Ordering::SeqCst) >= ticket {
            return;
        }
        let upto = turn.asked.load(Ordering::SeqCst);
        if let Some(conn) = inst.live() {
            self.hand_over(inst, &conn).await;
        }
        turn.served.store(upto, Ordering::SeqCst);
    }

    /// The instance's turn to hand replies over.
    fn turn(&self, inst: &Instance) -> Arc<Turn> {
        lock(&self.turns).entry(inst.config.id.to_string()).or_default().clone()
    }

    /// Hands over a reply its run claimed as it recorded it ([`Ledger::finish_run`]), in the
    /// instance's turn, and returns once it is written; with no driver to take it, it waits
    /// (`pending`) for the next.
    pub async fn deliver_claimed(self: &Arc<Self>, inst: &Instance, reply: HandedReply) {
        let turn = self.turn(inst);
        let _turn = turn.lock.lock().await;
        let unsent = match inst.live() {
            Some(conn) => self.hand_one(inst, &conn, reply).await.err(),
            None => Some(reply.event_id),
        };
        if let Some(event_id) = unsent {
            let instance = inst.config.id.to_string();
            self.settle(&instance, &event_id, Answer::Lost, None, None).await;
        }
    }

    /// Writes one claimed reply's `deliver` to `conn` (a reply that can never be a frame is
    /// failed instead). `Err` with its event id when the connection is gone: the caller
    /// gives it back.
    async fn hand_one(
        self: &Arc<Self>,
        inst: &Instance,
        conn: &Connection,
        reply: HandedReply,
    ) -> Result<(), String> {
        let instance = inst.config.id.to_string();
        let answers = conn.declaration.extensions.reply_receipt;
        let Ok(event_id) = Id::new(&reply.event_id) else {
            let error = Some("the event id is not a valid id".to_owned());
            let answer = Answer::Failed { retryable: false };
            self.settle(&instance, &reply.event_id, answer, None, error).await;
            return Ok(());
        };
        let line = match deliver_line(&event_id, &reply.message, conn.declaration.extensions.stream)
        {
            Ok(line) => line,
            Err(error) => {
                warn!(%instance, %event_id, %error, "reply can never be a frame; failed");
                let answer = Answer::Failed { retryable: false };
                self.settle(&instance, &reply.event_id, answer, None, Some(error)).await;
                return Ok(());
            }
        };
        if reply.attempts > 1 {
            debug!(%instance, %event_id, attempt = reply.attempts, "handing a reply over again");
        }
        let key = (instance.clone(), event_id.clone());
        if answers {
            let deadline = Instant::now() + self.answer_timeout;
            lock(&self.handed).insert(key.clone(), Handed { conn: conn.id, deadline });
            // The loop's timer must see the new deadline.
            self.wake.notify_one();
        }
        let sent = match conn.sink.send_encoded(line).await {
            // Written just as the connection closed: its end may have been handled already,
            // so the reply is given back here (a second `Lost` is a no-op).
            Ok(()) if conn.is_closed() => Err("the connection closed".to_owned()),
            Ok(()) => Ok(()),
            Err(err) => Err(err.to_string()),
        };
        match sent {
            Ok(()) => {
                Counters::bump(&inst.counters.replies);
                if !answers {
                    self.settle(&instance, event_id.as_str(), Answer::Posted, None, None).await;
                }
                Ok(())
            }
            Err(err) => {
                lock(&self.handed).remove(&key);
                debug!(%instance, %event_id, error = %err, "driver left during hand-over; replies wait for the next one");
                Err(reply.event_id)
            }
        }
    }

    /// Claims what is due for `inst` and writes each `deliver` to `conn`, oldest first. A
    /// driver without `reply_receipt` never answers: written is all the hub can know, so
    /// written counts as posted. When the connection is gone, what was claimed and not
    /// written goes back to `pending`.
    async fn hand_over(self: &Arc<Self>, inst: &Instance, conn: &Connection) {
        let instance = inst.config.id.to_string();
        loop {
            if conn.is_closed() {
                return;
            }
            let claimed =
                match self.ledger.replies_claim(instance.clone(), now_ms(), CLAIM_BATCH).await {
                    Ok(claimed) => claimed,
                    Err(err) => {
                        warn!(%instance, error = %err, "replies not read");
                        return;
                    }
                };
            if claimed.is_empty() {
                return;
            }
            // A short claim took everything due: a reply recorded or unblocked after it
            // began comes with a `deliver` or kick of its own.
            let more = claimed.len() == CLAIM_BATCH;
            let mut claimed = claimed.into_iter();
            while let Some(reply) = claimed.next() {
                if let Err(unsent) = self.hand_one(inst, conn, reply).await {
                    let unsent = std::iter::once(unsent).chain(claimed.map(|r| r.event_id));
                    for event_id in unsent {
                        self.settle(&instance, &event_id, Answer::Lost, None, None).await;
                    }
                    return;
                }
            }
            if !more {
                return;
            }
        }
    }

    /// Replies handed over and waiting for an answer (for tests and status).
    pub fn handed_len(&self) -> usize {
        lock(&self.handed).len()
    }
}

/// The `deliver` line of a recorded reply, or why it cannot be one.
/// A streamed reply carries its seq to a driver with `stream` (see [`StoredReply`]).
fn deliver_line(event_id: &Id, message: &[u8], stream: bool) -> Result<Vec<u8>, String> {
    let stored: StoredReply =
        serde_json::from_slice(message).map_err(|err| format!("unreadable reply record: {err}"))?;
    let message = stored.message_for(stream);
    encode(&Frame::Deliver(Delivery { request_id: event_id.clone(), message }))
        .map_err(|err| err.to_string())
}

#[cfg(test)]
mod tests {
    use channeld_protocol::ChannelId;
    use channeld_protocol::types::{MessageBody, MessageTarget, OutboundMessage};

    use super::*;

    #[test]
    fn a_recorded_reply_becomes_its_deliver_line_or_a_reason() {
        let channel = ChannelId::new("a.b").unwrap();
        let message = OutboundMessage {
            target: MessageTarget::new(channel, Id::new("c1").unwrap()),
            body: MessageBody::text("hi").unwrap(),
            metadata: Default::default(),
        };
        let event = Id::new("e-1").unwrap();
        let line = deliver_line(&event, &serde_json::to_vec(&message).unwrap(), true).unwrap();
        match channeld_protocol::decode(&line[..line.len() - 1]).unwrap() {
            Frame::Deliver(delivery) => {
                assert_eq!(delivery.request_id, event);
                assert_eq!(delivery.message, message);
            }
            other => panic!("expected a deliver, got {other:?}"),
        }
        assert!(deliver_line(&event, b"not json", false).unwrap_err().contains("unreadable"));
        // A streamed reply's seq reaches only a driver with `stream`.
        let stored = StoredReply { message: message.clone(), stream_seq: Some(3) };
        let stored = serde_json::to_vec(&stored).unwrap();
        for (stream, seq) in [(true, Some("3")), (false, None)] {
            let line = deliver_line(&event, &stored, stream).unwrap();
            let Ok(Frame::Deliver(delivery)) = channeld_protocol::decode(&line[..line.len() - 1])
            else {
                panic!("a deliver");
            };
            assert_eq!(delivery.message.metadata.get("stream_seq").map(String::as_str), seq);
        }
    }
}
