//! Wire types and framing for the `cortexfs.channel.socket/v1` JSONL ABI, plus channeld's
//! negotiated extensions.
//!
//! This crate is pure: it does no I/O and depends on no async runtime. The hub, the driver SDK
//! and `channelctl` all speak the wire through these types; nothing else defines a frame.
//!
//! * [`frame`]: the envelope, every frame variant, [`encode`](frame::encode) and
//!   [`decode`](frame::decode).
//! * [`types`]: payloads carried inside frames (messages, targets, effects, commands, health).
//! * [`ids`]: validated identifiers (bounded ids and channel ids).
//! * [`framing`]: the bounded line framer that enforces [`MAX_LINE_BYTES`] while reading.
//! * [`ext`]: extension names and the pure negotiation of what each side may send.
//! * [`acecode`]: ACECode's channel platform plugin protocol (manifest, stdio frames), which
//!   `channeld-acecode` hosts and the SDK's `--acecode` transport speaks.

pub mod acecode;
pub mod ext;
pub mod frame;
pub mod framing;
pub mod ids;
pub mod types;

pub use frame::{DecodeError, EncodeError, Frame, decode, encode, encode_into, encode_outbound};
pub use ids::{ChannelId, Id, IdError};

/// The ABI string every envelope carries in its `abi` field.
pub const ABI: &str = "cortexfs.channel.socket/v1";

/// The largest line either side may send, newline included.
pub const MAX_LINE_BYTES: usize = 256 * 1024;

/// The largest identifier, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// The longest channel id, in characters.
pub const MAX_CHANNEL_ID_CHARS: usize = 64;
