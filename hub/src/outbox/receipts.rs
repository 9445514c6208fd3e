//! A driver's answers to what the hub handed it: a `receipt` completes the wait of the
//! `outbound` it names, an `error` frame ends it as failed (or unknown, for `send_unknown`).
//! Both count only on the connection that got the `outbound`. An answer no outbound waits for
//! is given back: with `reply_receipt` it may answer a reply (the courier's).

use channeld_protocol::Id;
use channeld_protocol::frame::{ErrorFrame, Receipt};
use tracing::warn;

use crate::connection::Connection;
use crate::instance::Instance;
use crate::send;

/// Completes the wait of the outbound this receipt answers. Gives the receipt back when no
/// outbound on `conn` waits for it: it may answer a reply (`reply_receipt`).
pub fn on_receipt(inst: &Instance, conn: &Connection, receipt: Receipt) -> Option<Receipt> {
    send::complete(inst, conn, receipt)
}

/// An `error` frame from a driver: it ends the wait of the outbound it names, and is the
/// instance's latest error in `channelctl status` either way. Given back when no outbound
/// waits for it and the driver answers replies (`reply_receipt`): it may answer a reply.
pub fn on_error(inst: &Instance, conn: &Connection, err: ErrorFrame) -> Option<ErrorFrame> {
    inst.record_error(format!("{}: {}", err.code, err.message));
    if conn.fail_receipt(&err) {
        return None;
    }
    if conn.declaration.extensions.reply_receipt && err.request_id.is_some() {
        return Some(err);
    }
    warn!(
        instance = %inst.config.id,
        request_id = ?err.request_id.as_ref().map(Id::as_str),
        code = %err.code,
        message = %err.message,
        "error from driver"
    );
    None
}
