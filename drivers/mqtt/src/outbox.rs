//! Matches outbound publishes to their PUBACKs. Pure bookkeeping over rumqttc's events.
//!
//! rumqttc assigns a packet id when its event loop takes a publish from the request channel
//! and reports it as `Outgoing::Publish(pkid)`, in channel order. Posts are submitted one at a
//! time, each registered here just before it enters the channel, so the n-th unassigned
//! waiter is the n-th publish rumqttc takes. A PUBACK then resolves the waiter of its pkid.
//!
//! Each broker connection has its own rumqttc client, event loop and outbox; when the
//! connection drops, the event loop is dropped with whatever it still held, so nothing is
//! replayed behind the hub's back. [`Outbox::connection_lost`] then answers every waiter:
//! the ones never written are certainly not on the broker (failed), the ones written without
//! a PUBACK may be (unknown). The hub decides what to do with either outcome.

use std::collections::{HashMap, VecDeque};

/// A packet id that does not belong to any waiting publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OutboxError {
    #[error("publish {0} was not submitted through the outbox")]
    Unmatched(u16),
}

/// What a lost connection means for the waiting publishes.
#[derive(Debug, PartialEq, Eq)]
pub struct Lost<W> {
    /// Never written to the broker.
    pub failed: Vec<W>,
    /// Written, but no PUBACK arrived: the broker may or may not have the message.
    pub unknown: Vec<W>,
}

/// Waiters for submitted publishes, by stage.
#[derive(Debug)]
pub struct Outbox<W> {
    /// Submitted to rumqttc, no packet id yet, in submission order.
    unassigned: VecDeque<W>,
    /// Given a packet id that is still in use: rumqttc holds it until that id is acked.
    collided: Option<(u16, W)>,
    /// Written with this packet id, waiting for its PUBACK.
    inflight: HashMap<u16, W>,
}

impl<W> Default for Outbox<W> {
    fn default() -> Self {
        Self { unassigned: VecDeque::new(), collided: None, inflight: HashMap::new() }
    }
}

impl<W> Outbox<W> {
    /// Registers a publish about to enter rumqttc's request channel.
    pub fn submit(&mut self, waiter: W) {
        self.unassigned.push_back(waiter);
    }

    /// `Outgoing::Publish(pkid)`: the next submission was written with `pkid` (or a collided
    /// one finally was).
    pub fn sent(&mut self, pkid: u16) -> Result<(), OutboxError> {
        if self.collided.as_ref().is_some_and(|(id, _)| *id == pkid) {
            if let Some((_, waiter)) = self.collided.take() {
                self.inflight.insert(pkid, waiter);
            }
            return Ok(());
        }
        let waiter = self.unassigned.pop_front().ok_or(OutboxError::Unmatched(pkid))?;
        self.inflight.insert(pkid, waiter);
        Ok(())
    }

    /// `Outgoing::AwaitAck(pkid)`: the next submission got a packet id still in flight; rumqttc
    /// sends it once that id is acked.
    pub fn collided(&mut self, pkid: u16) -> Result<(), OutboxError> {
        let waiter = self.unassigned.pop_front().ok_or(OutboxError::Unmatched(pkid))?;
        self.collided = Some((pkid, waiter));
        Ok(())
    }

    /// A PUBACK: the waiter of `pkid`, if any.
    pub fn acked(&mut self, pkid: u16) -> Option<W> {
        self.inflight.remove(&pkid)
    }

    /// The connection dropped (and its event loop with it): every waiter is answered. The
    /// ones without a packet id were never written; a collided one waited for its packet id
    /// and was not written either.
    pub fn connection_lost(&mut self) -> Lost<W> {
        let mut failed: Vec<W> = self.unassigned.drain(..).collect();
        failed.extend(self.collided.take().map(|(_, waiter)| waiter));
        let mut unknown: Vec<(u16, W)> = self.inflight.drain().collect();
        unknown.sort_by_key(|(pkid, _)| *pkid);
        Lost { failed, unknown: unknown.into_iter().map(|(_, waiter)| waiter).collect() }
    }

    /// Publishes waiting at any stage.
    pub fn len(&self) -> usize {
        self.unassigned.len() + usize::from(self.collided.is_some()) + self.inflight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pubacks_resolve_publishes_in_submission_order() {
        let mut outbox = Outbox::default();
        outbox.submit("a");
        outbox.submit("b");
        outbox.sent(7).unwrap();
        outbox.sent(8).unwrap();
        assert_eq!(outbox.acked(8), Some("b"));
        assert_eq!(outbox.acked(8), None, "a PUBACK resolves once");
        assert_eq!(outbox.acked(7), Some("a"));
        assert!(outbox.is_empty());
    }

    #[test]
    fn a_publish_nobody_submitted_is_reported() {
        let mut outbox: Outbox<&str> = Outbox::default();
        assert_eq!(outbox.sent(3), Err(OutboxError::Unmatched(3)));
        assert_eq!(outbox.acked(3), None);
    }

    #[test]
    fn a_collided_publish_waits_for_its_packet_id() {
        let mut outbox = Outbox::default();
        outbox.submit("a");
        outbox.submit("b");
        outbox.sent(1).unwrap();
        outbox.collided(1).unwrap();
        assert_eq!(outbox.len(), 2);
        assert_eq!(outbox.acked(1), Some("a"));
        outbox.sent(1).unwrap();
        assert_eq!(outbox.acked(1), Some("b"));
    }

    #[test]
    fn a_lost_connection_fails_unsent_and_leaves_written_unknown() {
        let mut outbox = Outbox::default();
        for waiter in ["written-2", "written-1", "collided", "queued"] {
            outbox.submit(waiter);
        }
        outbox.sent(2).unwrap();
        outbox.sent(1).unwrap();
        outbox.collided(1).unwrap();
        // "queued" was still in rumqttc's channel when the event loop went away.
        let lost = outbox.connection_lost();
        assert_eq!(lost.failed, vec!["queued", "collided"]);
        assert_eq!(lost.unknown, vec!["written-1", "written-2"]);
        assert!(outbox.is_empty());
    }
}
