//! The 250-byte message every row carries: as message text through the hub, as a JSON
//! envelope (id, sender, chat, text) through mosquitto.

use serde::{Deserialize, Serialize};

/// Size of the payload in bytes.
pub const PAYLOAD_BYTES: usize = 250;

/// 250 bytes of plain ASCII text (no characters JSON would escape).
pub fn text() -> String {
    filler(PAYLOAD_BYTES)
}

fn filler(len: usize) -> String {
    const WORDS: &str = "the hub relays this benchmark message to a driver and back ";
    WORDS.chars().cycle().take(len).collect()
}

/// The MQTT payload: what a driver-side envelope looks like.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope {
    pub id: String,
    pub sender: String,
    pub chat: String,
    pub text: String,
}

/// The envelope for request `seq`, serialised to exactly [`PAYLOAD_BYTES`] bytes.
pub fn envelope(seq: u64) -> Vec<u8> {
    let mut env = Envelope {
        id: format!("{seq:020}"),
        sender: "bench".into(),
        chat: "room-1".into(),
        text: String::new(),
    };
    let bare = serde_json::to_vec(&env).expect("envelope serialises").len();
    env.text = filler(PAYLOAD_BYTES - bare);
    serde_json::to_vec(&env).expect("envelope serialises")
}

/// The sequence number carried by an envelope.
pub fn envelope_seq(bytes: &[u8]) -> Option<u64> {
    let env: Envelope = serde_json::from_slice(bytes).ok()?;
    env.id.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_250_bytes() {
        assert_eq!(text().len(), PAYLOAD_BYTES);
        let env = envelope(42);
        assert_eq!(env.len(), PAYLOAD_BYTES);
        assert_eq!(envelope_seq(&env), Some(42));
        assert_eq!(envelope(u64::MAX).len(), PAYLOAD_BYTES);
    }
}
