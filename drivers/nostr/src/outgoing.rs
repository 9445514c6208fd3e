//! Building what the driver posts, signed and encrypted, before anything is sent: a message
//! as chunks (each a NIP-17 rumor gift-wrapped for every recipient, or a NIP-04 event for
//! the one recipient) and a NIP-25 reaction.
//!
//! Chunks get consecutive `created_at` seconds so clients, which sort by it, show them in
//! order.

use nostr_sdk::nips::nip04;
use nostr_sdk::{Event, EventBuilder, EventId, Keys, Kind, PublicKey, Timestamp, UnsignedEvent};

use crate::convert::{self, Nip, Participants};

/// Why an event could not be built (encryption, signing): nothing was sent.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the event: {0}")]
pub struct BuildError(String);

fn build_error(err: impl std::fmt::Display) -> BuildError {
    BuildError(err.to_string())
}

/// Whom a message goes to, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addressing {
    pub nip: Nip,
    pub recipients: Participants,
    /// The message it answers (an `e` tag on every chunk).
    pub reply_to: Option<EventId>,
}

/// A message ready to publish: chunk after chunk, each one event per recipient.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The id the recipients see for the first chunk (a rumor id, or a kind-4 event id):
    /// the receipt's message id.
    pub message_id: EventId,
    pub chunks: Vec<Vec<Event>>,
}

/// Signs (and wraps) `text` for `to`, split into chunks of at most `chunk_bytes`.
pub async fn message(
    keys: &Keys,
    to: &Addressing,
    text: &str,
    chunk_bytes: usize,
    now: Timestamp,
) -> Result<Prepared, BuildError> {
    let tags = convert::message_tags(&to.recipients, to.reply_to);
    let mut chunks = Vec::new();
    let mut first_id = None;
    for (n, piece) in convert::chunks(text, chunk_bytes).into_iter().enumerate() {
        let created_at = Timestamp::from_secs(now.as_secs() + n as u64);
        let (id, events) = match to.nip {
            Nip::Nip17 => {
                let rumor = EventBuilder::new(Kind::PrivateDirectMessage, piece)
                    .tags(tags.clone())
                    .custom_created_at(created_at)
                    .build(keys.public_key());
                wrap_for_each(keys, &to.recipients, rumor).await?
            }
            Nip::Nip04 => {
                let recipient = single(&to.recipients)?;
                let ciphertext =
                    nip04::encrypt(keys.secret_key(), &recipient, piece).map_err(build_error)?;
                let event = EventBuilder::new(Kind::EncryptedDirectMessage, ciphertext)
                    .tags(tags.clone())
                    .custom_created_at(created_at)
                    .sign_with_keys(keys)
                    .map_err(build_error)?;
                (event.id, vec![event])
            }
        };
        first_id.get_or_insert(id);
        chunks.push(events);
    }
    let message_id = first_id.ok_or_else(|| BuildError("the message has no text".into()))?;
    Ok(Prepared { message_id, chunks })
}

/// A reaction (`emoji`) to `message_id` written by `author`, in the conversation's NIP: a
/// gift-wrapped kind-7 rumor for each recipient (NIP-17), or a plain kind-7 event (NIP-04
/// conversations have no private reactions).
pub async fn reaction(
    keys: &Keys,
    nip: Nip,
    recipients: &Participants,
    message_id: EventId,
    author: Option<PublicKey>,
    emoji: &str,
) -> Result<Vec<Event>, BuildError> {
    let reacted_kind = match nip {
        Nip::Nip17 => Kind::PrivateDirectMessage,
        Nip::Nip04 => Kind::EncryptedDirectMessage,
    };
    let mut tags = convert::reaction_tags(message_id, author, reacted_kind);
    match nip {
        Nip::Nip17 => {
            // Every participant is tagged, as in the conversation's messages.
            tags.extend(convert::message_tags(recipients, None).into_iter().filter(|tag| {
                author.is_none_or(|author| *tag != nostr_sdk::Tag::public_key(author))
            }));
            let rumor =
                EventBuilder::new(Kind::Reaction, emoji).tags(tags).build(keys.public_key());
            Ok(wrap_for_each(keys, recipients, rumor).await?.1)
        }
        Nip::Nip04 => {
            let event = EventBuilder::new(Kind::Reaction, emoji)
                .tags(tags)
                .sign_with_keys(keys)
                .map_err(build_error)?;
            Ok(vec![event])
        }
    }
}

/// The rumor's id and one gift wrap of it per recipient (no copy for the bot itself).
async fn wrap_for_each(
    keys: &Keys,
    recipients: &Participants,
    mut rumor: UnsignedEvent,
) -> Result<(EventId, Vec<Event>), BuildError> {
    let id = rumor.id();
    let mut wraps = Vec::with_capacity(recipients.len());
    for recipient in recipients {
        let wrap = EventBuilder::gift_wrap(keys, recipient, rumor.clone(), [])
            .await
            .map_err(build_error)?;
        wraps.push(wrap);
    }
    Ok((id, wraps))
}

fn single(recipients: &Participants) -> Result<PublicKey, BuildError> {
    match recipients.iter().collect::<Vec<_>>().as_slice() {
        [one] => Ok(**one),
        _ => Err(BuildError("NIP-04 reaches exactly one person; use nip17 for a group".into())),
    }
}

#[cfg(test)]
mod tests {
    use nostr_sdk::nips::nip59::UnwrappedGift;

    use super::*;

    #[tokio::test]
    async fn each_chunk_is_wrapped_for_each_recipient_in_order_and_answers_the_parent() {
        let (bot, alice, bob) = (Keys::generate(), Keys::generate(), Keys::generate());
        let parent = EventId::all_zeros();
        let to = Addressing {
            nip: Nip::Nip17,
            recipients: Participants::from([alice.public_key(), bob.public_key()]),
            reply_to: Some(parent),
        };
        let now = Timestamp::from_secs(1_700_000_000);
        let prepared = message(&bot, &to, "one two three four", 8, now).await.unwrap();
        assert_eq!(prepared.chunks.len(), 3);
        let mut texts = Vec::new();
        for (n, chunk) in prepared.chunks.iter().enumerate() {
            assert_eq!(chunk.len(), 2, "one wrap per recipient");
            let for_alice =
                |wrap: &&Event| wrap.tags.public_keys().any(|k| *k == alice.public_key());
            let (to_alice, to_bob): (Vec<&Event>, Vec<&Event>) = chunk.iter().partition(for_alice);
            let gift = UnwrappedGift::from_gift_wrap(&alice, to_alice[0]).await.unwrap();
            assert_eq!(gift.sender, bot.public_key());
            assert_eq!(gift.rumor.created_at.as_secs(), 1_700_000_000 + n as u64);
            assert!(gift.rumor.tags.event_ids().any(|id| *id == parent));
            if n == 0 {
                assert_eq!(gift.rumor.id, Some(prepared.message_id));
            }
            texts.push(gift.rumor.content);
            assert!(UnwrappedGift::from_gift_wrap(&bob, to_bob[0]).await.is_ok());
        }
        assert_eq!(texts.concat(), "one two three four");
    }

    #[tokio::test]
    async fn nip04_goes_to_one_person_only() {
        let (bot, alice) = (Keys::generate(), Keys::generate());
        let to = Addressing {
            nip: Nip::Nip04,
            recipients: Participants::from([alice.public_key()]),
            reply_to: None,
        };
        let prepared = message(&bot, &to, "hi", 4000, Timestamp::now()).await.unwrap();
        let event = &prepared.chunks[0][0];
        assert_eq!(event.kind, Kind::EncryptedDirectMessage);
        assert_eq!(prepared.message_id, event.id);
        let text = nip04::decrypt(alice.secret_key(), &bot.public_key(), &event.content).unwrap();
        assert_eq!(text, "hi");
        let group = Addressing {
            recipients: Participants::from([alice.public_key(), Keys::generate().public_key()]),
            ..to
        };
        let err = message(&bot, &group, "hi", 4000, Timestamp::now()).await.unwrap_err();
        assert!(err.to_string().contains("use nip17"), "{err}");
    }
}
