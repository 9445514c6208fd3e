//! Pure mapping between Nostr events and channeld frames: conversation ids from participant
//! sets, a decrypted NIP-17 rumor or NIP-04 message into what the hub is told, long text into
//! chunks, the tags of what the driver posts, and the relays' answers into one outcome.
//!
//! Nothing here does I/O or cryptography: decryption and unwrapping happen in `platform`, which
//! hands the results to these functions, so every decision can be unit-tested.

use std::collections::BTreeSet;

use channeld_driver_sdk::protocol::types::{
    EventContext, IncomingEvent, MessageTarget, Participant,
};
use channeld_driver_sdk::protocol::{ChannelId, Id, MAX_ID_BYTES};
use channeld_driver_sdk::{Inbound, InboundError};
use nostr_sdk::{Event, EventId, Kind, PublicKey, RelayUrl, Tag, UnsignedEvent};
use sha2::{Digest, Sha256};

use crate::config::npub;

/// Which NIP a conversation speaks; replies go out in the NIP of the message they answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Nip {
    /// Kind 4, encrypted to one recipient (legacy: the metadata is public).
    Nip04,
    /// Kind 14 rumors, sealed (13) and gift-wrapped (1059) for each participant.
    Nip17,
}

impl Nip {
    pub fn as_str(self) -> &'static str {
        match self {
            Nip::Nip04 => "nip04",
            Nip::Nip17 => "nip17",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        match raw.trim().to_ascii_lowercase().trim_start_matches("nip").trim_start_matches('-') {
            "04" | "4" => Some(Nip::Nip04),
            "17" => Some(Nip::Nip17),
            _ => None,
        }
    }
}

/// The metadata key of an outbound message that chooses the NIP (`nip17` or `nip04`).
pub const META_NIP: &str = "nostr_nip";
/// Inbound metadata: the id of the message this one answers, if it names one.
pub const META_REPLY_TO: &str = "nostr_reply_to";
/// Inbound metadata: the relay that delivered the message.
pub const META_RELAY: &str = "nostr_relay";
/// Prefix of a conversation id too long to list its participants.
pub const GROUP_PREFIX: &str = "group-";

/// The people of a conversation other than the bot, in a stable order.
pub type Participants = BTreeSet<PublicKey>;

/// The conversation id of a participant set (the bot excluded): their `npub`s sorted and
/// joined by commas, which names a one-to-one conversation by the other person's npub. A
/// set too large for an id is `group-<sha256 of that list>`; the driver remembers its
/// members.
pub fn conversation_id(participants: &Participants) -> String {
    let mut npubs: Vec<String> = participants.iter().map(npub).collect();
    npubs.sort();
    let joined = npubs.join(",");
    if joined.len() <= MAX_ID_BYTES {
        return joined;
    }
    let digest = Sha256::digest(joined.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{GROUP_PREFIX}{hex}")
}

/// Why a conversation id names nobody the driver can write to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversationError {
    #[error("conversation entry {0} is not an npub or a hex public key")]
    NotAKey(usize),
    #[error("the conversation names nobody but the bot")]
    Empty,
}

/// The participants a conversation id lists (`npub1…` or hex keys, comma-separated), the bot
/// left out. `Ok(None)` for a `group-…` id, whose members only the driver's state knows.
pub fn parse_conversation(
    raw: &str,
    me: &PublicKey,
) -> Result<Option<Participants>, ConversationError> {
    if raw.starts_with(GROUP_PREFIX) {
        return Ok(None);
    }
    let mut participants = Participants::new();
    for (n, item) in raw.split(',').map(str::trim).enumerate() {
        let key = PublicKey::parse(item).map_err(|_| ConversationError::NotAKey(n + 1))?;
        if &key != me {
            participants.insert(key);
        }
    }
    if participants.is_empty() {
        return Err(ConversationError::Empty);
    }
    Ok(Some(participants))
}

/// Why a received event is skipped (logged, remembered as handled, never fatal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("the seal's author does not match the rumor's pubkey (forged seal)")]
    ForgedSeal,
    #[error("the rumor's id does not match its content")]
    BadRumorId,
    #[error("the bot's own message")]
    FromUs,
    #[error("not addressed to the bot")]
    NotForUs,
    #[error("kind {0} is not a direct message or a reaction")]
    UnsupportedKind(u16),
    #[error("a reaction that names no message")]
    ReactionWithoutTarget,
    #[error("empty message")]
    Empty,
    #[error("cannot become a frame: {0}")]
    Invalid(String),
}

/// What a direct message carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Text(String),
    Reaction { message_id: EventId, emoji: String },
}

/// A verified, decrypted direct message, ready to be reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// The message id: the rumor's id (NIP-17) or the event's id (NIP-04).
    pub id: EventId,
    pub nip: Nip,
    /// The verified author: the seal's author (NIP-17) or the event's signer (NIP-04).
    pub sender: PublicKey,
    /// Everyone in the conversation but the bot (the sender included).
    pub participants: Participants,
    /// When the author says it was written (the rumor's time, not the wrap's).
    pub created_at: u64,
    /// The message it answers (its first `e` tag).
    pub reply_to: Option<EventId>,
    pub content: Content,
}

/// An unwrapped gift: `sender` is the seal's author, which the library checked against the
/// rumor; checked again here so a forged seal is refused whatever the library version.
pub fn from_rumor(
    me: &PublicKey,
    sender: PublicKey,
    rumor: &UnsignedEvent,
) -> Result<Incoming, Skip> {
    if rumor.pubkey != sender {
        return Err(Skip::ForgedSeal);
    }
    if sender == *me {
        return Err(Skip::FromUs);
    }
    rumor.verify_id().map_err(|_| Skip::BadRumorId)?;
    // The id is computed, never taken on the sender's word: it is the hub's dedupe key.
    let mut rumor = rumor.clone();
    rumor.id = None;
    let id = rumor.id();
    let mut participants: Participants = rumor.tags.public_keys().copied().collect();
    participants.insert(sender);
    participants.remove(me);
    let content = match rumor.kind {
        Kind::PrivateDirectMessage => text(&rumor.content)?,
        Kind::Reaction => {
            let message_id =
                rumor.tags.event_ids().last().copied().ok_or(Skip::ReactionWithoutTarget)?;
            Content::Reaction { message_id, emoji: reaction_emoji(&rumor.content) }
        }
        other => return Err(Skip::UnsupportedKind(other.as_u16())),
    };
    Ok(Incoming {
        id,
        nip: Nip::Nip17,
        sender,
        participants,
        created_at: rumor.created_at.as_secs(),
        reply_to: reply_target(&rumor.tags, &content),
        content,
    })
}

/// A kind-4 event (its signature already verified by the relay pool) and its decrypted text.
pub fn from_nip04(me: &PublicKey, event: &Event, plaintext: &str) -> Result<Incoming, Skip> {
    if event.pubkey == *me {
        return Err(Skip::FromUs);
    }
    if !event.tags.public_keys().any(|key| key == me) {
        return Err(Skip::NotForUs);
    }
    let content = text(plaintext)?;
    Ok(Incoming {
        id: event.id,
        nip: Nip::Nip04,
        sender: event.pubkey,
        participants: Participants::from([event.pubkey]),
        created_at: event.created_at.as_secs(),
        reply_to: reply_target(&event.tags, &content),
        content,
    })
}

fn text(raw: &str) -> Result<Content, Skip> {
    if raw.trim().is_empty() {
        return Err(Skip::Empty);
    }
    Ok(Content::Text(raw.to_owned()))
}

fn reply_target(tags: &nostr_sdk::Tags, content: &Content) -> Option<EventId> {
    match content {
        Content::Text(_) => tags.event_ids().next().copied(),
        Content::Reaction { .. } => None,
    }
}

/// NIP-25: `+` (or empty) is a like, `-` a dislike, anything else an emoji or shortcode.
fn reaction_emoji(content: &str) -> String {
    match content.trim() {
        "" | "+" => "+".to_owned(),
        other => other.to_owned(),
    }
}

/// What to tell the hub about an [`Incoming`].
#[derive(Debug, Clone, PartialEq)]
pub enum Report {
    Message(Inbound),
    Event { event_id: Id, event: IncomingEvent },
}

/// The report for `incoming`, received from `relay`, on `channel`.
pub fn report(channel: &ChannelId, incoming: &Incoming, relay: &RelayUrl) -> Result<Report, Skip> {
    let conversation = conversation_id(&incoming.participants);
    let sender = npub(&incoming.sender);
    let timestamp_ms = incoming.created_at.saturating_mul(1000);
    match &incoming.content {
        Content::Text(text) => {
            let mut inbound = Inbound::text(conversation, sender, text.clone())
                .id(incoming.id.to_hex())
                .timestamp_ms(timestamp_ms)
                .metadata(META_NIP, incoming.nip.as_str())
                .metadata(META_RELAY, relay.as_str_without_trailing_slash());
            if let Some(parent) = &incoming.reply_to {
                inbound = inbound.metadata(META_REPLY_TO, parent.to_hex());
            }
            // Validated now, so a message that cannot be a frame is skipped here.
            inbound.clone().build(channel).map_err(invalid)?;
            Ok(Report::Message(inbound))
        }
        Content::Reaction { message_id, emoji } => {
            let id = |raw: String| Id::new(raw).map_err(|err| Skip::Invalid(err.to_string()));
            let mut context = EventContext {
                target: MessageTarget::new(channel.clone(), id(conversation)?),
                participant: Some(Participant::new(id(sender)?)),
                timestamp_ms: Some(timestamp_ms),
                metadata: Default::default(),
            };
            context.metadata.insert(META_NIP.into(), incoming.nip.as_str().into());
            let event = IncomingEvent::Reaction {
                context,
                message_id: id(message_id.to_hex())?,
                emoji: emoji.clone(),
                added: true,
            };
            Ok(Report::Event { event_id: id(incoming.id.to_hex())?, event })
        }
    }
}

fn invalid(err: InboundError) -> Skip {
    Skip::Invalid(err.to_string())
}

/// Splits `text` into pieces of at most `max_bytes` (at least 4), in order, cutting at the
/// last line break or else the last space in the second half of a piece, and never inside a
/// character. The pieces joined give `text` back.
pub fn chunks(text: &str, max_bytes: usize) -> Vec<&str> {
    let max_bytes = max_bytes.max(4);
    let mut pieces = Vec::new();
    let mut rest = text;
    while rest.len() > max_bytes {
        let mut end = max_bytes;
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let window = &rest[..end];
        let cut = window
            .rfind('\n')
            .or_else(|| window.rfind(' '))
            .map(|at| at + 1)
            .filter(|&at| at > end / 2)
            .unwrap_or(end);
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    if !rest.is_empty() || pieces.is_empty() {
        pieces.push(rest);
    }
    pieces
}

/// The tags of a NIP-17 rumor (or a NIP-04 event) to `recipients`, answering `reply_to`.
pub fn message_tags(recipients: &Participants, reply_to: Option<EventId>) -> Vec<Tag> {
    let mut tags: Vec<Tag> = recipients.iter().map(|key| Tag::public_key(*key)).collect();
    if let Some(parent) = reply_to {
        tags.push(Tag::event(parent));
    }
    tags
}

/// The tags of a NIP-25 reaction to `message_id`, written by `author` (`k`: it reacts to a
/// direct message of `kind`).
pub fn reaction_tags(message_id: EventId, author: Option<PublicKey>, kind: Kind) -> Vec<Tag> {
    let mut tags = vec![Tag::event(message_id)];
    if let Some(author) = author {
        tags.push(Tag::public_key(author));
    }
    tags.push(Tag::custom(nostr_sdk::TagKind::k(), [kind.as_u16().to_string()]));
    tags
}

/// How one relay answered an event the driver published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayAnswer {
    /// `OK true`.
    Stored,
    /// `OK false` with the relay's reason: certainly not stored there.
    Refused(String),
    /// Never handed to the relay (not connected): certainly not stored there.
    NotSent(String),
    /// Handed over, but no `OK` came (timeout, connection lost): it may be stored.
    NoAnswer(String),
}

/// What one publication amounts to over all relays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// At least one relay stored it.
    Stored { relays: Vec<String> },
    /// No relay stored it and none may have: each relay's reason.
    Failed(String),
    /// No relay confirmed, but one may have stored it.
    Unknown(String),
}

/// Receipt only when at least one relay answered `OK true`; every relay certainly without
/// it → failed with each relay's reason; otherwise (some relay gave no answer) unknown.
pub fn published(answers: &[(String, RelayAnswer)]) -> Published {
    let stored: Vec<String> = answers
        .iter()
        .filter(|(_, answer)| *answer == RelayAnswer::Stored)
        .map(|(relay, _)| relay.clone())
        .collect();
    if !stored.is_empty() {
        return Published::Stored { relays: stored };
    }
    let reasons = answers
        .iter()
        .map(|(relay, answer)| match answer {
            RelayAnswer::Stored => format!("{relay}: stored"),
            RelayAnswer::Refused(why) => format!("{relay}: refused ({why})"),
            RelayAnswer::NotSent(why) => format!("{relay}: not sent ({why})"),
            RelayAnswer::NoAnswer(why) => format!("{relay}: no answer ({why})"),
        })
        .collect::<Vec<_>>()
        .join("; ");
    if answers.is_empty() {
        return Published::Failed("no relay to publish to".into());
    }
    if answers.iter().any(|(_, answer)| matches!(answer, RelayAnswer::NoAnswer(_))) {
        Published::Unknown(reasons)
    } else {
        Published::Failed(reasons)
    }
}

#[cfg(test)]
mod tests {
    use nostr_sdk::{EventBuilder, Keys, Timestamp};

    use super::*;

    fn keys(n: u8) -> Keys {
        Keys::parse(&format!("{n:02x}{}", "11".repeat(31))).unwrap()
    }

    #[test]
    fn a_one_to_one_conversation_is_the_other_persons_npub_and_groups_are_stable() {
        let (me, alice, bob) = (keys(1).public_key(), keys(2).public_key(), keys(3).public_key());
        let one = conversation_id(&Participants::from([alice]));
        assert_eq!(one, npub(&alice));
        assert_eq!(parse_conversation(&one, &me).unwrap(), Some(Participants::from([alice])));
        let pair = conversation_id(&Participants::from([bob, alice]));
        assert_eq!(pair, conversation_id(&Participants::from([alice, bob])), "order-free");
        assert_eq!(parse_conversation(&pair, &me).unwrap(), Some(Participants::from([alice, bob])));
        // Hex keys work for proactive sends too, and the bot itself is left out.
        let hex = format!("{},{}", alice.to_hex(), me.to_hex());
        assert_eq!(parse_conversation(&hex, &me).unwrap(), Some(Participants::from([alice])));
        let crowd: Participants = (2..12).map(|n| keys(n).public_key()).collect();
        let id = conversation_id(&crowd);
        assert!(id.starts_with(GROUP_PREFIX) && id.len() <= MAX_ID_BYTES, "{id}");
        assert_eq!(parse_conversation(&id, &me).unwrap(), None);
        assert_eq!(parse_conversation("room-1", &me), Err(ConversationError::NotAKey(1)));
        assert_eq!(parse_conversation(&npub(&me), &me), Err(ConversationError::Empty));
    }

    #[test]
    fn a_rumor_becomes_a_message_from_the_seal_author_with_its_computed_id() {
        let (me, alice) = (keys(1).public_key(), keys(2));
        let parent = EventId::all_zeros();
        let rumor = EventBuilder::private_msg_rumor(me, "hello")
            .tag(Tag::event(parent))
            .build(alice.public_key());
        let incoming = from_rumor(&me, alice.public_key(), &rumor).unwrap();
        assert_eq!(incoming.nip, Nip::Nip17);
        assert_eq!(incoming.participants, Participants::from([alice.public_key()]));
        assert_eq!(incoming.reply_to, Some(parent));
        assert_eq!(incoming.content, Content::Text("hello".into()));
        let mut expected = rumor.clone();
        assert_eq!(incoming.id, expected.id());
        let channel = ChannelId::new("nostr.bot").unwrap();
        let relay = RelayUrl::parse("ws://127.0.0.1:7000").unwrap();
        let Report::Message(inbound) = report(&channel, &incoming, &relay).unwrap() else {
            panic!("a text is a message")
        };
        let message = inbound.build(&channel).unwrap();
        assert_eq!(message.sender.id, npub(&alice.public_key()).as_str());
        assert_eq!(message.target.conversation, npub(&alice.public_key()).as_str());
        assert_eq!(message.id, incoming.id.to_hex().as_str());
        assert_eq!(message.metadata[META_NIP], "nip17");
        assert_eq!(message.metadata[META_REPLY_TO], parent.to_hex());
        assert_eq!(message.metadata[META_RELAY], "ws://127.0.0.1:7000");
    }

    #[test]
    fn forged_seals_lying_ids_own_and_odd_rumors_are_skipped() {
        let (me, alice, mallory) = (keys(1), keys(2), keys(3));
        let rumor =
            EventBuilder::private_msg_rumor(me.public_key(), "hi").build(alice.public_key());
        assert_eq!(
            from_rumor(&me.public_key(), mallory.public_key(), &rumor),
            Err(Skip::ForgedSeal)
        );
        let mut lying = rumor.clone();
        lying.id = Some(EventId::all_zeros());
        assert_eq!(from_rumor(&me.public_key(), alice.public_key(), &lying), Err(Skip::BadRumorId));
        let own = EventBuilder::private_msg_rumor(alice.public_key(), "x").build(me.public_key());
        assert_eq!(from_rumor(&me.public_key(), me.public_key(), &own), Err(Skip::FromUs));
        let note = EventBuilder::text_note("public").build(alice.public_key());
        assert_eq!(
            from_rumor(&me.public_key(), alice.public_key(), &note),
            Err(Skip::UnsupportedKind(1))
        );
        let blank =
            EventBuilder::private_msg_rumor(me.public_key(), "  ").build(alice.public_key());
        assert_eq!(from_rumor(&me.public_key(), alice.public_key(), &blank), Err(Skip::Empty));
    }

    #[test]
    fn a_reaction_rumor_becomes_a_reaction_event_on_the_message_it_names() {
        let (me, alice) = (keys(1).public_key(), keys(2));
        let target = EventId::all_zeros();
        let rumor = EventBuilder::new(Kind::Reaction, "")
            .tags(reaction_tags(target, Some(me), Kind::PrivateDirectMessage))
            .build(alice.public_key());
        let incoming = from_rumor(&me, alice.public_key(), &rumor).unwrap();
        assert_eq!(incoming.content, Content::Reaction { message_id: target, emoji: "+".into() });
        let channel = ChannelId::new("nostr.bot").unwrap();
        let relay = RelayUrl::parse("ws://127.0.0.1:7000").unwrap();
        let Report::Event { event_id, event } = report(&channel, &incoming, &relay).unwrap() else {
            panic!("a reaction is an event")
        };
        assert_eq!(event_id, incoming.id.to_hex().as_str());
        let IncomingEvent::Reaction { message_id, emoji, added, context } = event else {
            panic!("a reaction event")
        };
        assert_eq!(
            (message_id.as_str(), emoji.as_str(), added),
            (target.to_hex().as_str(), "+", true)
        );
        assert_eq!(context.participant.unwrap().id, npub(&alice.public_key()).as_str());
        let bare = EventBuilder::new(Kind::Reaction, "+").build(alice.public_key());
        assert_eq!(from_rumor(&me, alice.public_key(), &bare), Err(Skip::ReactionWithoutTarget));
    }

    #[test]
    fn a_nip04_message_must_be_addressed_to_the_bot() {
        let (me, alice) = (keys(1), keys(2));
        let event = EventBuilder::new(Kind::EncryptedDirectMessage, "ciphertext")
            .tag(Tag::public_key(me.public_key()))
            .custom_created_at(Timestamp::from_secs(1_700_000_000))
            .sign_with_keys(&alice)
            .unwrap();
        let incoming = from_nip04(&me.public_key(), &event, "hi there").unwrap();
        assert_eq!(
            (incoming.id, incoming.nip, incoming.sender),
            (event.id, Nip::Nip04, alice.public_key())
        );
        assert_eq!(incoming.created_at, 1_700_000_000);
        let elsewhere = EventBuilder::new(Kind::EncryptedDirectMessage, "c")
            .tag(Tag::public_key(keys(3).public_key()))
            .sign_with_keys(&alice)
            .unwrap();
        assert_eq!(from_nip04(&me.public_key(), &elsewhere, "x"), Err(Skip::NotForUs));
    }

    #[test]
    fn long_text_is_cut_in_order_at_line_breaks_spaces_or_character_boundaries() {
        let text = "first line\nsecond line that is longer\nthird";
        let pieces = chunks(text, 16);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces[0], "first line\n");
        assert!(pieces.iter().all(|p| p.len() <= 16 && !p.is_empty()), "{pieces:?}");
        let wide = "é".repeat(10);
        let pieces = chunks(&wide, 5);
        assert_eq!(pieces.concat(), wide);
        assert!(pieces.iter().all(|p| p.len() <= 5), "{pieces:?}");
        assert_eq!(chunks("short", 4000), ["short"]);
        let unbroken = "x".repeat(10_000);
        assert_eq!(chunks(&unbroken, 4000).len(), 3);
    }

    #[test]
    fn a_receipt_needs_one_stored_answer_and_silence_makes_it_unknown() {
        let answer = |relay: &str, answer: RelayAnswer| (relay.to_owned(), answer);
        let stored = published(&[
            answer("ws://a", RelayAnswer::Refused("blocked".into())),
            answer("ws://b", RelayAnswer::Stored),
        ]);
        assert_eq!(stored, Published::Stored { relays: vec!["ws://b".into()] });
        let failed = published(&[
            answer("ws://a", RelayAnswer::Refused("blocked: no".into())),
            answer("ws://b", RelayAnswer::NotSent("not connected".into())),
        ]);
        assert_eq!(
            failed,
            Published::Failed(
                "ws://a: refused (blocked: no); ws://b: not sent (not connected)".into()
            )
        );
        let unknown = published(&[
            answer("ws://a", RelayAnswer::Refused("blocked".into())),
            answer("ws://b", RelayAnswer::NoAnswer("timeout".into())),
        ]);
        assert!(
            matches!(unknown, Published::Unknown(reason) if reason.contains("ws://b: no answer"))
        );
        assert!(matches!(published(&[]), Published::Failed(_)));
    }

    #[test]
    fn nip_names_parse_in_the_usual_spellings() {
        for (raw, nip) in
            [("nip17", Nip::Nip17), ("17", Nip::Nip17), ("NIP-04", Nip::Nip04), ("4", Nip::Nip04)]
        {
            assert_eq!(Nip::parse(raw), Some(nip), "{raw}");
        }
        assert_eq!(Nip::parse("59"), None);
    }
}
