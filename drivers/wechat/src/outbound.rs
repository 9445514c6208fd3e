//! Posting replies and proactive messages: the user's latest context token on every request,
//! one text item per `sendmessage`, long text in ordered chunks, and an honest receipt.
//!
//! No context token, `ret: -2` or any other refusal is a failed send with the code and what
//! to do; a token the server refused is not presented again until the user writes anew, and
//! nothing is retried here. A request that may have reached the server without an answer is
//! reported as unknown. A reply's progress is persisted around every part: before a part
//! leaves it is marked in doubt, after the answer it counts as posted. A reply the hub delivers
//! again (after a crash, or for a duplicate inbound) is answered with its receipt when it was
//! posted, resumes after the last part posted when it was cut short, and is reported unknown
//! — never sent again — when the driver died while a part was on its way.

use std::sync::Arc;

use channeld_driver_sdk::protocol::Id;
use channeld_driver_sdk::protocol::types::DeliveryReceipt;
use channeld_driver_sdk::{Post, PostError, PostKind};
use sha2::{Digest, Sha256};
use tracing::{debug, warn};

use crate::client::{CallError, IlinkClient};
use crate::config::WechatConfig;
use crate::convert;
use crate::ilink::{CONTEXT_REFUSED, OutgoingMessage};
use crate::session::{Auth, Session};
use crate::state::ReplyProgress;
use crate::store::{ContextFor, Store, now_ms};
use crate::typing::Typing;

/// Posts messages for the driver.
#[derive(Debug)]
pub struct Outbound {
    pub client: IlinkClient,
    pub session: Arc<Session>,
    pub store: Arc<Store>,
    pub config: Arc<WechatConfig>,
    pub typing: Arc<Typing>,
}

impl Outbound {
    pub async fn post(&self, post: Post) -> Result<DeliveryReceipt, PostError> {
        let target = post.message.target.clone();
        if target.channel != self.config.channel {
            return Err(PostError::failed(format!("target is channel {}", target.channel), false));
        }
        let user = target.conversation.as_str().to_owned();
        let event_id = match &post.kind {
            PostKind::Reply { event_id } => Some(event_id.as_str().to_owned()),
            PostKind::Proactive { .. } => None,
        };
        if let Some(event_id) = &event_id {
            self.typing.reply_started(event_id);
        }
        let result = self.send(&user, event_id.as_deref(), &post).await;
        self.typing.answered(&user, event_id.as_deref());
        let message_id = result?;
        let message_id = Id::new(message_id).map_err(|err| {
            PostError::unknown(format!("posted, but the client id is unusable: {err}"))
        })?;
        Ok(DeliveryReceipt {
            channel: self.config.channel.clone(),
            message_id,
            target,
            timestamp_ms: Some(now_ms()),
        })
    }

    /// Posts every part not posted yet; returns the client id of the last part.
    async fn send(
        &self,
        user: &str,
        event_id: Option<&str>,
        post: &Post,
    ) -> Result<String, PostError> {
        let text = convert::outbound_text(&post.message, self.config.markdown)
            .map_err(|err| PostError::failed(err.to_string(), false))?;
        let parts = convert::chunks(&text, self.config.chunk_chars);
        let digest = digest(&text, self.config.chunk_chars);
        let mut progress = ReplyProgress {
            digest: digest.clone(),
            posted: 0,
            total: parts.len() as u32,
            last_client_id: String::new(),
            in_doubt: None,
        };
        if let Some(event_id) = event_id
            && let Some(earlier) = self.store.reply(event_id).filter(|p| p.digest == digest)
        {
            if let Some(client_id) = &earlier.in_doubt {
                return Err(PostError::unknown(format!(
                    "an earlier attempt to post part {} of {} (client id {client_id}) ended without an answer; it may or may not have been posted, so it is not sent again",
                    earlier.posted + 1,
                    earlier.total
                )));
            }
            if earlier.done() {
                debug!(event_id, "reply already posted; answering with its receipt");
                return Ok(earlier.last_client_id);
            }
            debug!(event_id, posted = earlier.posted, total = earlier.total, "resuming a reply");
            progress = earlier;
        }
        let credentials = self.session.current().ok_or_else(|| match self.session.auth() {
            Auth::Missing => PostError::failed(
                "no bot token: run `channeld-wechat login` or install the wechat-bot-token credential",
                false,
            ),
            _ => PostError::failed(
                "the bot token expired (auth_expired): log in again (`channeld-wechat login`)",
                true,
            ),
        })?;
        let context = match self.store.context_for(user) {
            ContextFor::Token(token) => token,
            ContextFor::Missing => {
                return Err(PostError::failed(
                    format!(
                        "no context token for {user}: WeChat delivers only to a user who wrote to the bot first"
                    ),
                    false,
                ));
            }
            ContextFor::Refused(code) => {
                return Err(PostError::failed(
                    format!(
                        "WeChat refused the last context token for {user} (ret {code}); the user must write to the bot again"
                    ),
                    false,
                ));
            }
        };
        for (index, part) in parts.iter().enumerate().skip(progress.posted as usize) {
            let client_id = client_id();
            // A reply's part is marked in doubt on disk before it leaves: if the driver dies
            // before the answer, the redelivered reply is reported unknown, not posted twice.
            if let Some(event_id) = event_id {
                progress.in_doubt = Some(client_id.clone());
                self.store.record_reply(event_id, progress.clone()).await.map_err(|err| {
                    PostError::failed(
                        format!("cannot record the reply before posting it: {err}"),
                        true,
                    )
                })?;
            }
            let message = OutgoingMessage::text(user, &client_id, &context, part);
            let sent = self
                .client
                .send_text(
                    &credentials.base_url,
                    &credentials.token,
                    message,
                    self.config.send_timeout,
                )
                .await;
            match sent {
                Ok(()) => {
                    progress.posted += 1;
                    progress.last_client_id = client_id;
                    progress.in_doubt = None;
                }
                Err(err) => {
                    if !err.may_have_acted() {
                        progress.in_doubt = None;
                    }
                    let failure = self
                        .failure(err, user, &context, &credentials.token, index, &progress)
                        .await;
                    self.save_progress(event_id, &progress).await;
                    return Err(failure);
                }
            }
            self.save_progress(event_id, &progress).await;
        }
        Ok(progress.last_client_id)
    }

    /// Persists a reply's progress; a failure leaves the older record (more conservative:
    /// a part recorded in doubt stays in doubt).
    async fn save_progress(&self, event_id: Option<&str>, progress: &ReplyProgress) {
        if let Some(event_id) = event_id
            && let Err(err) = self.store.record_reply(event_id, progress.clone()).await
        {
            warn!(event_id, error = %err, "reply progress not saved");
        }
    }

    /// The post error for a part that failed, after updating what the failure teaches.
    async fn failure(
        &self,
        err: CallError,
        user: &str,
        context: &str,
        token: &channeld_driver_sdk::Secret,
        index: usize,
        progress: &ReplyProgress,
    ) -> PostError {
        let total = progress.total;
        let earlier = if progress.posted > 0 {
            format!(" ({} of {total} parts were posted)", progress.posted)
        } else {
            String::new()
        };
        let part =
            if total > 1 { format!("part {} of {total}: ", index + 1) } else { String::new() };
        if err.session_expired() {
            self.session.expired(token);
            return PostError::failed(
                format!("{part}the bot token expired (auth_expired): log in again{earlier}"),
                progress.posted == 0,
            );
        }
        if let Some(failure) = err.failure() {
            if let Err(save) = self.store.refuse_context(user, context, failure.code).await {
                warn!(user, error = %save, "refused context token not saved");
            }
            let why = if failure.code == CONTEXT_REFUSED {
                "the context token is missing, stale or used up (about ten replies per user message, for about a day); the user must write to the bot again"
            } else {
                "not retried with the same context token; the user must write to the bot again"
            };
            return PostError::failed(
                format!("{part}WeChat refused the message with {failure}: {why}{earlier}"),
                false,
            );
        }
        if err.may_have_acted() {
            return PostError::unknown(format!(
                "{part}{err}: it may or may not have been posted{earlier}"
            ));
        }
        PostError::failed(format!("{part}{err}{earlier}"), progress.posted == 0)
    }
}

/// A new `client_id` for one request.
fn client_id() -> String {
    format!("channeld-wechat-{}-{:016x}", now_ms(), fastrand::u64(..))
}

/// Identifies a reply text and how it was cut, so a different reply starts over.
fn digest(text: &str, chunk_chars: usize) -> String {
    let hash = Sha256::new().chain_update(chunk_chars.to_le_bytes()).chain_update(text).finalize();
    hash.iter().take(16).map(|b| format!("{b:02x}")).collect()
}
