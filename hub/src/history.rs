//! Conversation history as drivers (extension `history`) and the control op `history` see
//! it: the request checked, the ledger asked (`ledger/history.rs` keeps the entries), and
//! the answer fitted to one line by the pure [`fit`]: the oldest entries are left out first.

use std::sync::Arc;

use channeld_protocol::Frame;
use channeld_protocol::ext::{
    DEFAULT_HISTORY_LIMIT, HistoryEntry, HistoryRequest, HistoryResult, MAX_HISTORY_LIMIT,
};
use tracing::warn;

use crate::hub::Hub;
use crate::instance::Instance;
use crate::ledger::LedgerError;

/// Bytes of a line kept for everything around the entries (envelope, ids, keys).
const LINE_SLACK: usize = 2048;

/// Why history cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    #[error("limit must be 1-{MAX_HISTORY_LIMIT}, not {0}")]
    InvalidLimit(u32),
    #[error("{0} keeps no history (history = false, or the ledger is off)")]
    Off(String),
    #[error("the history could not be read: {0}")]
    Ledger(LedgerError),
}

impl HistoryError {
    /// The wire code (`error` frame or control error).
    pub fn code(&self) -> &'static str {
        match self {
            HistoryError::InvalidLimit(_) => "invalid_request",
            HistoryError::Off(_) => "history_off",
            HistoryError::Ledger(_) => "ledger_unavailable",
        }
    }

    pub fn retryable(&self) -> bool {
        matches!(self, HistoryError::Ledger(_))
    }
}

/// The newest `limit` entries of a conversation of `inst`, oldest first.
pub async fn read(
    hub: &Hub,
    inst: &Instance,
    conversation: String,
    thread: Option<String>,
    limit: Option<u32>,
) -> Result<Vec<HistoryEntry>, HistoryError> {
    let limit = limit.unwrap_or(DEFAULT_HISTORY_LIMIT);
    if limit == 0 || limit > MAX_HISTORY_LIMIT {
        return Err(HistoryError::InvalidLimit(limit));
    }
    let Some(cap) = inst.policy().history.filter(|_| hub.ledger.is_on()) else {
        return Err(HistoryError::Off(inst.config.id.to_string()));
    };
    let instance = inst.config.id.to_string();
    // The ledger may hold a few entries beyond the cap (it trims in steps): never shown.
    let limit = (limit as usize).min(cap.max(1));
    let entries = hub
        .ledger
        .history_recent(instance, conversation, thread, limit)
        .await
        .map_err(HistoryError::Ledger)?;
    Ok(entries.iter().map(|entry| entry.to_wire()).collect())
}

/// The answer to a driver's `history_request`: `history_result`, or an `error` frame with
/// the request's id.
pub async fn answer(hub: &Arc<Hub>, inst: &Instance, request: HistoryRequest) -> Frame {
    let HistoryRequest { request_id, conversation, thread, limit } = request;
    let read =
        read(hub, inst, conversation.to_string(), thread.map(|t| t.to_string()), limit).await;
    match read {
        Ok(entries) => {
            let (entries, truncated) = fit(entries, channeld_protocol::MAX_LINE_BYTES);
            Frame::HistoryResult(HistoryResult { request_id, entries, truncated })
        }
        Err(err) => {
            if let HistoryError::Ledger(cause) = &err {
                warn!(instance = %inst.config.id, error = %cause, "history not read");
            }
            Frame::error(Some(request_id), err.code(), err.to_string(), err.retryable())
        }
    }
}

/// Keeps the newest entries whose JSON fits in `line` bytes (less the slack for the rest of
/// the line), oldest first; true when older ones were left out. An entry too long to fit
/// alone has its text cut at a character boundary. Pure.
pub fn fit(entries: Vec<HistoryEntry>, line: usize) -> (Vec<HistoryEntry>, bool) {
    let budget = line.saturating_sub(LINE_SLACK);
    let total = entries.len();
    let mut used = 0;
    let mut kept: Vec<HistoryEntry> = Vec::new();
    for mut entry in entries.into_iter().rev() {
        let size = encoded_len(&entry) + 1;
        if used + size > budget {
            if kept.is_empty() {
                cut_to(&mut entry, budget);
                kept.push(entry);
            }
            break;
        }
        used += size;
        kept.push(entry);
    }
    kept.reverse();
    let truncated = kept.len() < total;
    (kept, truncated)
}

fn encoded_len(entry: &HistoryEntry) -> usize {
    serde_json::to_vec(entry).map_or(usize::MAX / 2, |json| json.len())
}

/// Cuts the entry's text until its JSON fits in `budget` bytes (escaping at most sextuples a
/// character, so a cut to a sixth of the room left always fits).
fn cut_to(entry: &mut HistoryEntry, budget: usize) {
    let text = std::mem::take(&mut entry.text);
    let room = budget.saturating_sub(encoded_len(entry)) / 6;
    let end =
        text.char_indices().map(|(at, c)| at + c.len_utf8()).take_while(|end| *end <= room).last();
    entry.text = text[..end.unwrap_or(0)].to_owned();
}

#[cfg(test)]
mod tests {
    use channeld_protocol::ext::HistoryRole;

    use super::*;

    fn entry(id: i64, text: String) -> HistoryEntry {
        HistoryEntry {
            id,
            role: HistoryRole::User,
            text,
            at_ms: 1,
            sender: Some("alice".into()),
            message_id: None,
            event_id: None,
        }
    }

    #[test]
    fn everything_that_fits_is_kept_in_order() {
        let entries: Vec<_> = (0..5).map(|n| entry(n, format!("t{n}"))).collect();
        let (kept, truncated) = fit(entries.clone(), 64 * 1024);
        assert_eq!(kept, entries);
        assert!(!truncated);
    }

    #[test]
    fn the_oldest_entries_are_left_out_first() {
        let entries: Vec<_> = (0..10).map(|n| entry(n, "x".repeat(1000))).collect();
        let (kept, truncated) = fit(entries, LINE_SLACK + 3500);
        assert!(truncated);
        assert_eq!(kept.iter().map(|e| e.id).collect::<Vec<_>>(), [7, 8, 9]);
    }

    #[test]
    fn one_entry_too_long_alone_is_cut_to_fit() {
        let (kept, truncated) = fit(vec![entry(1, "\"é".repeat(10_000))], LINE_SLACK + 1000);
        assert!(!truncated);
        assert_eq!(kept.len(), 1);
        assert!(encoded_len(&kept[0]) <= 1000);
        assert!("\"é".repeat(10_000).starts_with(&kept[0].text));
        assert!(!kept[0].text.is_empty());
    }
}
