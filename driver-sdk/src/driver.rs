//! The `Driver` trait each platform driver implements, and the requests the SDK hands it.

use std::future::Future;

use channeld_protocol::types::{
    Actions, Capabilities, Command, DeliveryReceipt, Effect, Health, MessageTarget, OutboundMessage,
};
use channeld_protocol::{Id, ext::Extensions};
use tokio_util::sync::CancellationToken;

use crate::hub::Hub;

/// What a driver declares in its `hello`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Declaration {
    pub capabilities: Capabilities,
    pub actions: Actions,
}

/// Why a post failed. The distinction matters: a failed post was certainly not shown, an
/// unknown one may have been.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The platform refused or could not be reached before sending; nothing was posted.
    #[error("post failed: {reason}")]
    Failed { reason: String, retryable: bool },
    /// The request may have reached the platform (timeout after sending, connection lost
    /// mid-request): the message may or may not be visible.
    #[error("post outcome unknown: {reason}")]
    Unknown { reason: String },
}

impl PostError {
    pub fn failed(reason: impl Into<String>, retryable: bool) -> Self {
        PostError::Failed { reason: reason.into(), retryable }
    }

    pub fn unknown(reason: impl Into<String>) -> Self {
        PostError::Unknown { reason: reason.into() }
    }

    /// The wire code of the `error` frame that reports it.
    pub fn code(&self) -> &'static str {
        match self {
            PostError::Failed { .. } => "send_failed",
            PostError::Unknown { .. } => "send_unknown",
        }
    }
}

/// Why an effect was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EffectError {
    #[error("effect not supported by this driver")]
    Unsupported,
    #[error("effect failed: {0}")]
    Failed(String),
}

/// A fatal driver error: the process exits non-zero and its supervisor restarts it.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// Settings are wrong; restarting will not help (exit status 78, `EX_CONFIG`).
    #[error("configuration: {0}")]
    Config(String),
    /// The platform failed in a way the driver cannot recover from by itself.
    #[error("platform: {0}")]
    Platform(String),
}

/// Which hub frame a post answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostKind {
    /// A `deliver`: the reply to the inbound with this event id.
    Reply { event_id: Id },
    /// An `outbound`: a proactive send.
    Proactive { request_id: Id },
}

/// A message to post on the platform.
#[derive(Debug, Clone, PartialEq)]
pub struct Post {
    pub kind: PostKind,
    pub message: OutboundMessage,
}

/// A live effect to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct EffectRequest {
    pub request_id: Id,
    pub target: MessageTarget,
    pub effect: Effect,
}

pub use channeld_protocol::types::CommandAnswer;

/// A runtime command to present to a person.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandRequest {
    pub request_id: Id,
    pub session: Id,
    pub command_id: Id,
    pub command: Command,
    pub target: Option<MessageTarget>,
}

/// A platform driver. The SDK owns the hub connection; the driver owns its platform.
///
/// `run` is the platform's input side: it reports messages through [`Hub`] until `shutdown`
/// fires (stop taking input) or the platform's input ends. The other methods answer hub frames
/// and may run concurrently.
pub trait Driver: Send + Sync + 'static {
    /// Declared in `hello`; the SDK refuses anything undeclared before it reaches the driver.
    fn declaration(&self) -> Declaration;

    /// Receives platform input until `shutdown` is cancelled or the input ends.
    fn run(
        &self,
        hub: Hub,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), DriverError>> + Send;

    /// Posts a reply or a proactive message and returns the platform's receipt.
    fn post(&self, post: Post) -> impl Future<Output = Result<DeliveryReceipt, PostError>> + Send;

    /// Applies a declared effect. The default supports none.
    fn effect(
        &self,
        request: EffectRequest,
    ) -> impl Future<Output = Result<(), EffectError>> + Send {
        let _ = request;
        async { Err(EffectError::Unsupported) }
    }

    /// Presents a command and returns the person's answer. Only called when `commands` was
    /// declared (and `tool_control` for `invoke`). The default rejects: a driver without an
    /// interactive surface never approves anything.
    fn command(&self, request: CommandRequest) -> impl Future<Output = CommandAnswer> + Send {
        let _ = request;
        async { CommandAnswer::rejected("driver has no interactive surface") }
    }

    /// A sanitised health report: never a secret in `detail`.
    fn health(&self) -> Health {
        Health::ready()
    }

    /// Extensions this driver wants. The SDK implements all of them; override to test
    /// reference behaviour.
    fn extensions(&self) -> Extensions {
        Extensions::all()
    }
}
