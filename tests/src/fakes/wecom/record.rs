//! Everything the fake WeCom saw and did, kept for a test's assertions.

use serde_json::Value;
use tokio::time::Instant;

/// One client connection, numbered from 1 in opening order.
pub type ConnId = u64;

/// What the fake saw and did, oldest first in every list.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub connections: Vec<ConnectionRecord>,
    /// Every text frame a client sent that parsed as JSON.
    pub received: Vec<Received>,
    /// Every callback the fake pushed (messages and events).
    pub pushed: Vec<Pushed>,
    /// Every acknowledgement the fake answered with (or scheduled, in slow mode).
    pub acks: Vec<AckRecord>,
    pub subscribes: Vec<SubscribeRecord>,
    pub pings: Vec<PingRecord>,
    /// One entry per (callback `req_id`, `stream.id`), in order of the first frame.
    pub streams: Vec<StreamRecord>,
    /// Every `aibot_send_msg`, refused ones included.
    pub sent: Vec<SentRecord>,
    /// Every `aibot_respond_welcome_msg`.
    pub welcomes: Vec<ReplyRecord>,
    /// Every `aibot_respond_update_msg`.
    pub card_updates: Vec<ReplyRecord>,
    /// Template cards sent as replies (`aibot_respond_msg` with `msgtype: template_card`).
    pub reply_cards: Vec<ReplyRecord>,
    /// Protocol rules a client broke (the real platform would refuse or misbehave).
    pub violations: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct ConnectionRecord {
    pub id: ConnId,
    pub opened: Instant,
    pub closed: Option<Instant>,
    /// Closed by the fake after a `disconnected_event` (another connection subscribed).
    pub kicked: bool,
}

#[derive(Debug, Clone)]
pub struct Received {
    pub conn: ConnId,
    pub at: Instant,
    pub frame: Value,
}

#[derive(Debug, Clone)]
pub struct Pushed {
    pub conn: ConnId,
    pub at: Instant,
    pub req_id: String,
    pub frame: Value,
}

#[derive(Debug, Clone)]
pub struct AckRecord {
    pub conn: ConnId,
    pub at: Instant,
    pub req_id: String,
    pub cmd: String,
    pub errcode: i64,
}

#[derive(Debug, Clone)]
pub struct SubscribeRecord {
    pub conn: ConnId,
    pub at: Instant,
    pub bot_id: String,
    pub accepted: bool,
}

#[derive(Debug, Clone)]
pub struct PingRecord {
    pub conn: ConnId,
    pub at: Instant,
    pub acked: bool,
}

#[derive(Debug, Clone)]
pub struct StreamRecord {
    pub req_id: String,
    pub stream_id: String,
    /// The conversation of the callback: its `chatid`, else the sender's user id.
    pub chat: String,
    pub frames: Vec<StreamFrame>,
}

#[derive(Debug, Clone)]
pub struct StreamFrame {
    pub at: Instant,
    pub content: String,
    pub finish: bool,
    /// What the fake answered: 0 when the frame replaced the shown content.
    pub errcode: i64,
}

impl StreamRecord {
    /// The content users see now: the last accepted frame's, or `None` if none was accepted.
    pub fn content(&self) -> Option<&str> {
        self.accepted().last().map(|frame| frame.content.as_str())
    }

    /// Whether an accepted frame had `finish: true`.
    pub fn finished(&self) -> bool {
        self.accepted().any(|frame| frame.finish)
    }

    /// Frames the fake accepted, in order.
    pub fn accepted(&self) -> impl DoubleEndedIterator<Item = &StreamFrame> {
        self.frames.iter().filter(|frame| frame.errcode == 0)
    }
}

#[derive(Debug, Clone)]
pub struct SentRecord {
    pub at: Instant,
    pub req_id: String,
    pub chatid: String,
    pub chat_type: Option<i64>,
    pub msgtype: String,
    /// `markdown.content` for markdown messages.
    pub content: Option<String>,
    /// `template_card` for card messages.
    pub template_card: Option<Value>,
    pub errcode: i64,
}

#[derive(Debug, Clone)]
pub struct ReplyRecord {
    pub at: Instant,
    pub req_id: String,
    pub body: Value,
    pub errcode: i64,
}

impl Record {
    /// The streams opened on one callback `req_id`.
    pub fn streams_on(&self, req_id: &str) -> Vec<&StreamRecord> {
        self.streams.iter().filter(|stream| stream.req_id == req_id).collect()
    }

    /// Accepted `aibot_send_msg` messages to `chat`, in order.
    pub fn sent_to(&self, chat: &str) -> Vec<&SentRecord> {
        self.sent.iter().filter(|sent| sent.chatid == chat && sent.errcode == 0).collect()
    }

    /// Messages users were shown: streams with an accepted frame, accepted proactive
    /// messages (markdown and cards), reply cards and welcome texts.
    pub fn messages(&self) -> usize {
        let ok = |errcode: &i64| *errcode == 0;
        self.streams.iter().filter(|stream| stream.accepted().next().is_some()).count()
            + self.sent.iter().filter(|sent| ok(&sent.errcode)).count()
            + self.reply_cards.iter().filter(|reply| ok(&reply.errcode)).count()
            + self.welcomes.iter().filter(|reply| ok(&reply.errcode)).count()
    }

    /// Subscribes the fake accepted.
    pub fn accepted_subscribes(&self) -> usize {
        self.subscribes.iter().filter(|subscribe| subscribe.accepted).count()
    }

    /// Subscribes (accepted or not) at or after `at`.
    pub fn subscribes_since(&self, at: Instant) -> usize {
        self.subscribes.iter().filter(|subscribe| subscribe.at >= at).count()
    }

    /// Frames a client sent with this `cmd`.
    pub fn received_cmd(&self, cmd: &str) -> Vec<&Received> {
        self.received.iter().filter(|received| received.frame["cmd"] == cmd).collect()
    }

    /// Acknowledgements refused because of the per-conversation rate limit.
    pub fn rate_limited(&self) -> usize {
        self.acks.iter().filter(|ack| ack.errcode == super::rules::ERR_RATE_LIMITED).count()
    }

    /// A readable digest for failure messages: counts, violations and the last frames each
    /// way, long contents cut.
    pub fn summary(&self) -> String {
        const LAST: usize = 12;
        let cut = |value: &Value| {
            let text = value.to_string();
            match text.char_indices().nth(300) {
                Some((at, _)) => format!("{}… ({} bytes)", &text[..at], text.len()),
                None => text,
            }
        };
        let mut out = format!(
            "connections: {}, subscribes: {} ({} accepted), pings: {}, streams: {}, sent: {}\nviolations: {:#?}\nlast frames from clients:\n",
            self.connections.len(),
            self.subscribes.len(),
            self.accepted_subscribes(),
            self.pings.len(),
            self.streams.len(),
            self.sent.len(),
            self.violations,
        );
        for received in self.received.iter().rev().take(LAST).rev() {
            out.push_str(&format!("  [{}] {}\n", received.conn, cut(&received.frame)));
        }
        out.push_str("last acknowledgements:\n");
        for ack in self.acks.iter().rev().take(LAST).rev() {
            out.push_str(&format!(
                "  [{}] {} {} -> {}\n",
                ack.conn, ack.cmd, ack.req_id, ack.errcode
            ));
        }
        out
    }
}
