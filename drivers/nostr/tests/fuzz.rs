//! Property fuzzing of the Nostr driver's convert layer and state file: a gift-wrapped
//! rumor is JSON the sender wrote, so rumors (direct messages, reactions, replies) are
//! mutated (hostile values, removed keys, changed types, text cut short) and converted as
//! `inbox.rs` does; conversation ids and NIP-04 plaintexts are arbitrary text; the state
//! file is read back after damage. Nothing panics, a rumor converts the same way every
//! time, and what reaches the hub is bounded by what came in.

use channeld_driver_sdk::protocol::ChannelId;
use channeld_nostr::convert::{chunks, from_nip04, from_rumor, parse_conversation, report};
use channeld_nostr::state::State;
use channeld_tests::fuzz::{mutated_bytes, seeds};
use nostr_sdk::{EventBuilder, JsonUtil, Keys, Kind, RelayUrl, Tag, UnsignedEvent};
use proptest::prelude::*;

fn keys(n: u8) -> Keys {
    Keys::parse(&format!("{n:02x}{}", "11".repeat(31))).unwrap()
}

/// Rumors alice could wrap for the bot (keys(1)): a message, a reply, a reaction.
fn rumors() -> Vec<serde_json::Value> {
    let me = keys(1).public_key();
    let alice = keys(2).public_key();
    let mut message = EventBuilder::private_msg_rumor(me, "hello there").build(alice);
    let message_id = message.id();
    let mut reply =
        EventBuilder::private_msg_rumor(me, "and again").tag(Tag::event(message_id)).build(alice);
    reply.ensure_id();
    let mut reaction = EventBuilder::new(Kind::Reaction, "+")
        .tag(Tag::event(message_id))
        .tag(Tag::public_key(me))
        .build(alice);
    reaction.ensure_id();
    let texts: Vec<String> = [message, reply, reaction].iter().map(JsonUtil::as_json).collect();
    seeds(&texts.iter().map(String::as_str).collect::<Vec<_>>())
}

fn convert(rumor: &UnsignedEvent) -> Option<Vec<u8>> {
    let me = keys(1).public_key();
    let channel = ChannelId::new("nostr.fuzz").unwrap();
    let relay = RelayUrl::parse("wss://relay.example.com").unwrap();
    let incoming = from_rumor(&me, rumor.pubkey, rumor).ok()?;
    let report = report(&channel, &incoming, &relay).ok()?;
    Some(format!("{report:?}").into_bytes())
}

proptest! {
    #[test]
    fn fuzz_any_rumor_converts_or_is_skipped(bytes in mutated_bytes(rumors())) {
        let Ok(text) = std::str::from_utf8(&bytes) else { return Ok(()) };
        let Ok(rumor) = UnsignedEvent::from_json(text) else { return Ok(()) };
        // As sent (a mutated rumor mostly fails its id check), then with its id recomputed,
        // so the content rules see the mutation too.
        let mut recomputed = rumor.clone();
        recomputed.id = None;
        recomputed.ensure_id();
        for rumor in [rumor, recomputed] {
            let first = convert(&rumor);
            prop_assert_eq!(&first, &convert(&rumor));
            if let Some(report) = first {
                prop_assert!(report.len() <= 4 * bytes.len() + 4096, "{} from {}", report.len(), bytes.len());
            }
        }
    }

    #[test]
    fn fuzz_any_nip04_plaintext_converts_or_is_skipped(plaintext in "(\\PC|\n){0,300}") {
        let me = keys(1).public_key();
        let event = EventBuilder::new(Kind::EncryptedDirectMessage, "ciphertext")
            .tag(Tag::public_key(me))
            .sign_with_keys(&keys(2))
            .unwrap();
        let channel = ChannelId::new("nostr.fuzz").unwrap();
        let relay = RelayUrl::parse("wss://relay.example.com").unwrap();
        if let Ok(incoming) = from_nip04(&me, &event, &plaintext) {
            let _ = report(&channel, &incoming, &relay);
        }
    }

    #[test]
    fn fuzz_any_conversation_id_parses_or_is_refused(
        raw in "(npub1[02-9ac-hj-np-z]{0,60}|[0-9a-f]{0,64}|group-\\PC{0,10}|,| |\\PC{0,10}){0,5}",
    ) {
        let me = keys(1).public_key();
        if let Ok(Some(participants)) = parse_conversation(&raw, &me) {
            prop_assert!(!participants.is_empty() && !participants.contains(&me));
        }
    }

    #[test]
    fn fuzz_chunks_join_back_within_the_limit(text in "(\\PC|\n| ){0,300}", max in 0usize..64) {
        let pieces = chunks(&text, max);
        prop_assert_eq!(pieces.concat(), text.clone());
        for piece in &pieces {
            prop_assert!(piece.len() <= max.max(4), "{} > {}", piece.len(), max.max(4));
        }
    }

    #[test]
    fn fuzz_a_damaged_state_file_is_read_or_refused(bytes in mutated_bytes(state_seeds())) {
        if let Ok(state) = State::from_json(&bytes) {
            let again = State::from_json(&state.to_json()).expect("what it wrote reads back");
            prop_assert_eq!(again, state);
        }
    }
}

fn state_seeds() -> Vec<serde_json::Value> {
    let mut state = State::fresh(1_700_000_000);
    state.mark_seen("a".repeat(64), 1_700_000_001, None);
    state.record_reply("b".repeat(64), "c".repeat(64), 1_700_000_002);
    let text = String::from_utf8(state.to_json()).unwrap();
    seeds(&[&text])
}
