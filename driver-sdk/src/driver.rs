//! The `Driver` trait each platform driver implements, what it declares, and the requests the
//! SDK hands it.

use std::future::Future;

use channeld_protocol::Id;
use channeld_protocol::ext::{Extensions, StreamFrame, valid_operator_action_name};
use channeld_protocol::types::UnmetRequirement;
use channeld_protocol::types::{
    Actions, Capabilities, Command, DeliveryReceipt, Effect, MessageTarget, OutboundMessage,
};
use tokio_util::sync::CancellationToken;

use crate::config::ConfigError;
use crate::hub::{Hub, HubError};
use crate::inbound::InboundError;

/// What a driver declares in its `hello`: the hub gates what it sends by it, and the SDK
/// refuses anything undeclared before it reaches the driver.
///
/// ```
/// # use channeld_driver_sdk::Declaration;
/// # use channeld_driver_sdk::protocol::types::{Actions, Capabilities};
/// let declaration = Declaration::new(Capabilities { receive: true, send: true, ..Default::default() })
///     .with_actions(Actions { typing: true, ..Default::default() })
///     .with_operator_actions(["resume"]);
/// assert!(declaration.check().is_ok());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Declaration {
    /// What the driver can do; each flag is documented on
    /// [`Capabilities`](channeld_protocol::types::Capabilities), and the flags that need
    /// others are listed in `Capabilities::REQUIRES`.
    pub capabilities: Capabilities,
    /// The live effects it applies (each effect needs the action of the same name).
    pub actions: Actions,
    /// The operator actions it performs (extension `operator_action`), e.g. `resume`:
    /// lowercase words of `[a-z0-9_]`, see [`Driver::operator_action`].
    pub operator_actions: Vec<String>,
}

/// Why a declaration is inconsistent. The SDK checks it before the first `hello` and the
/// driver exits 78 with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeclarationError {
    #[error("declared capability {0}")]
    Capability(UnmetRequirement),
    #[error(
        "operator action name {0:?} is not a lowercase word of [a-z0-9_] (at most 64 characters)"
    )]
    OperatorActionName(String),
    #[error("operator action {0} is declared twice")]
    DuplicateOperatorAction(String),
}

impl Declaration {
    pub fn new(capabilities: Capabilities) -> Self {
        Self { capabilities, ..Self::default() }
    }

    pub fn with_actions(mut self, actions: Actions) -> Self {
        self.actions = actions;
        self
    }

    pub fn with_operator_actions<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.operator_actions = names.into_iter().map(Into::into).collect();
        self
    }

    /// Checks the capability dependency rules and the operator action names.
    pub fn check(&self) -> Result<(), DeclarationError> {
        if let Some(unmet) = self.capabilities.unmet_requirements().into_iter().next() {
            return Err(DeclarationError::Capability(unmet));
        }
        for (i, name) in self.operator_actions.iter().enumerate() {
            if !valid_operator_action_name(name) {
                return Err(DeclarationError::OperatorActionName(name.clone()));
            }
            if self.operator_actions[..i].contains(name) {
                return Err(DeclarationError::DuplicateOperatorAction(name.clone()));
            }
        }
        Ok(())
    }
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

/// Why an operator action was not performed. Each variant is a machine-readable `code` in
/// the `operator_action_result` the hub gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OperatorActionError {
    /// The driver has no such action (the default for every name).
    #[error("this driver has no operator action of that name")]
    Unsupported,
    /// The arguments do not fit the action.
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    /// The action was tried and failed; the message says why (never a secret).
    #[error("{0}")]
    Failed(String),
}

impl OperatorActionError {
    /// The `code` of the `operator_action_result`.
    pub fn code(&self) -> &'static str {
        match self {
            OperatorActionError::Unsupported => "unsupported",
            OperatorActionError::InvalidArgs(_) => "invalid_args",
            OperatorActionError::Failed(_) => "failed",
        }
    }
}

/// A fatal driver error: the process exits non-zero (78 for [`DriverError::Config`], which
/// is not restarted; 1 otherwise, which its supervisor restarts). `?` converts the SDK's
/// errors into it, so `run` and the `main` builder can propagate them.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// Settings are wrong; restarting will not help (exit status 78, `EX_CONFIG`).
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// The platform failed in a way the driver cannot recover from by itself.
    #[error("platform: {0}")]
    Platform(String),
    /// The hub handle refused a message. [`HubError::ShuttingDown`] returned from `run` counts
    /// as a clean stop: it only happens once the SDK asked `run` to stop.
    #[error(transparent)]
    Hub(#[from] HubError),
    /// A platform message could not be turned into an inbound.
    #[error("message: {0}")]
    Message(#[from] InboundError),
    /// Local I/O failed (a file, a pipe).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl DriverError {
    /// `DriverError::Platform` from anything printable.
    pub fn platform(reason: impl std::fmt::Display) -> Self {
        DriverError::Platform(reason.to_string())
    }
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

/// An operator's request (extension `operator_action`), e.g. `channelctl resume INSTANCE`.
#[derive(Debug, Clone, PartialEq)]
pub struct OperatorAction {
    /// One of the names in [`Declaration::operator_actions`] (the SDK refuses others).
    pub name: String,
    /// The action's arguments: a JSON object, `{}` when there are none.
    pub args: serde_json::Value,
}

/// A platform driver. The SDK owns the hub connection; the driver owns its platform.
///
/// # Lifecycle
///
/// 1. `main` builds the driver from its settings (see [`crate::main`]). Do not connect to
///    the platform yet: the hub may refuse this driver.
/// 2. The SDK connects to the hub and says `hello`. Only once the hub has **accepted** it
///    (its `hello_ack`; a reference hub that sends none, after a short wait) does the SDK call
///    [`run`](Driver::run). `run` connects to the platform and reports its input through the
///    [`Hub`] handle until `shutdown` fires or the input ends.
/// 3. `shutdown` fires when the process is stopping (SIGTERM) **and** when the hub refuses
///    this driver on a reconnect (`already_connected`: another process now serves the
///    instance). Either way `run` must stop taking platform input and settle what it holds
///    ([`PendingAcks::drain`](crate::PendingAcks::drain)). If posts travel on the connection
///    `run` holds, it then awaits [`Hub::requests_done`] (replies still being posted during a
///    drain finish first; after a refusal it resolves at once). Then it disconnects from the
///    platform and returns. A `run` still busy a drain deadline after that is aborted and the
///    process exits non-zero.
/// 4. After a refusal the SDK keeps retrying the hub; when it accepts the driver again, `run`
///    is called **again** with a fresh token: keep per-connection state inside `run`. A plain
///    loss of the hub connection (hub restart) does not stop `run`: inbound messages wait in
///    the SDK (bounded) and are resent when the hub is back.
/// 5. `post`, `effect`, `command` and `operator_action` answer hub frames; they may run
///    concurrently with each other and with `run`, and only while a hub session is up.
pub trait Driver: Send + Sync + 'static {
    /// The log filter when `CHANNELD_LOG` is not set, e.g. `"info,noisy_crate=warn"`.
    const LOG_FILTER: &'static str = "info";

    /// Declared in `hello`; checked ([`Declaration::check`]) before the first one.
    fn declaration(&self) -> Declaration;

    /// Connects to the platform and receives its input until `shutdown` is cancelled or the
    /// input ends (see the lifecycle above). Report the platform link's state with
    /// [`Hub::link_state`] so the hub shows the right health.
    fn run(
        &self,
        hub: Hub,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), DriverError>> + Send;

    /// Posts a reply or a proactive message and returns the platform's receipt.
    ///
    /// The receipt's `message_id` is the platform's id of the posted message: what an `edit`,
    /// `delete` or `reaction` effect and a later `reply_to` name. It must differ between
    /// posts of different requests on this channel. A redelivered request (same
    /// `request_id`) is answered by the SDK with the first receipt without calling `post`
    /// again; when the platform itself deduplicates (an idempotency key), return the same id
    /// for the same request. The conformance suite checks both.
    ///
    /// `Err(PostError::Failed)` means certainly not posted; `Err(PostError::Unknown)` means it
    /// may have been (never retried automatically).
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

    /// Performs an operator action the driver declared in
    /// [`Declaration::operator_actions`] (the SDK answers any other name `unsupported`
    /// itself) and returns what it produced (`Value::Null` for nothing). The default
    /// supports none.
    fn operator_action(
        &self,
        request: OperatorAction,
    ) -> impl Future<Output = Result<serde_json::Value, OperatorActionError>> + Send {
        let _ = request;
        async { Err(OperatorActionError::Unsupported) }
    }

    /// A step of a run's streamed output (extension `stream`, negotiated only when
    /// [`extensions`](Self::extensions) asks for it): a delta, a tool report or the run's
    /// end, in order (the SDK awaits each before reading on). The final reply still comes
    /// as a post, its `metadata.stream_seq` the seq it takes. The default ignores them.
    fn stream(&self, frame: StreamFrame) -> impl Future<Output = ()> + Send {
        let _ = frame;
        async {}
    }

    /// Extensions this driver wants. The SDK implements all of them; `stream` is left out
    /// unless a driver that handles [`stream`](Self::stream) asks for it. Override to test
    /// reference behaviour.
    fn extensions(&self) -> Extensions {
        Extensions { stream: false, ..Extensions::all() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declarations_are_checked_against_the_capability_rules_and_action_names() {
        let caps = Capabilities { receive: true, choices: true, ..Default::default() };
        let err = Declaration::new(caps).check().unwrap_err();
        assert_eq!(err.to_string(), "declared capability choices needs commands");
        let base = Declaration::new(Capabilities { receive: true, ..Default::default() });
        let err = base.clone().with_operator_actions(["Resume"]).check().unwrap_err();
        assert!(matches!(err, DeclarationError::OperatorActionName(name) if name == "Resume"));
        let err = base.clone().with_operator_actions(["resume", "resume"]).check().unwrap_err();
        assert_eq!(err, DeclarationError::DuplicateOperatorAction("resume".into()));
        assert!(base.with_operator_actions(["resume", "relogin"]).check().is_ok());
    }
}
