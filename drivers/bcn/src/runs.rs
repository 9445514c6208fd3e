//! The runs this driver started for `chat.send`: which session key and group each belongs
//! to, the next `seq` of its `chat.event`s, and whether it has ended (final, error or
//! aborted). Pure bookkeeping behind one mutex; bounded, forgetting ended runs first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// Runs remembered at once. Beyond it the oldest ended run is forgotten (an abort for it is
/// then answered as for an unknown run); active runs are never forgotten.
pub const MAX_RUNS: usize = 4096;

/// One run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub session_key: String,
    pub group_id: Option<String>,
    /// The `seq` of the run's last `chat.event` (0: none yet).
    pub seq: u64,
    pub ended: Option<Ending>,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Final,
    Error,
    Aborted,
}

/// What a `chat.abort` finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCheck {
    /// No such run (or long forgotten): a protocol error.
    Unknown,
    /// The run belongs to another session key: a protocol error.
    OtherSession,
    /// Already ended: idempotent success with no ids.
    Ended,
    /// Running: cancel it.
    Active,
}

/// Where the next `chat.event` of a run goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub group_id: Option<String>,
    pub seq: u64,
}

/// The table of runs.
#[derive(Debug, Default)]
pub struct Runs {
    inner: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    runs: HashMap<String, Run>,
    order: VecDeque<String>,
}

impl Runs {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records a new run.
    pub fn start(&self, run_id: &str, session_key: &str, group_id: Option<String>) {
        let mut table = self.table();
        if table.runs.len() >= MAX_RUNS {
            let oldest_ended = table
                .order
                .iter()
                .position(|id| table.runs.get(id).is_none_or(|run| run.ended.is_some()));
            if let Some(position) = oldest_ended
                && let Some(id) = table.order.remove(position)
            {
                table.runs.remove(&id);
            }
        }
        let run = Run { session_key: session_key.to_owned(), group_id, seq: 0, ended: None };
        if table.runs.insert(run_id.to_owned(), run).is_none() {
            table.order.push_back(run_id.to_owned());
        }
    }

    /// A copy of a run.
    pub fn get(&self, run_id: &str) -> Option<Run> {
        self.table().runs.get(run_id).cloned()
    }

    /// The slot for the next event of an active run, ending it with `ending` if given;
    /// `None` when the run is unknown or has ended (late events are suppressed).
    pub fn next(&self, run_id: &str, ending: Option<Ending>) -> Option<Slot> {
        let mut table = self.table();
        let run = table.runs.get_mut(run_id)?;
        if run.ended.is_some() {
            return None;
        }
        run.seq += 1;
        run.ended = ending;
        Some(Slot { group_id: run.group_id.clone(), seq: run.seq })
    }

    /// Marks a run aborted without an event (its `aborted` event was sent or could not be).
    pub fn abort(&self, run_id: &str) {
        if let Some(run) = self.table().runs.get_mut(run_id)
            && run.ended.is_none()
        {
            run.ended = Some(Ending::Aborted);
        }
    }

    /// The group of the newest run of `session_key`, if one is remembered.
    pub fn group_of(&self, session_key: &str) -> Option<String> {
        let table = self.table();
        table
            .order
            .iter()
            .rev()
            .filter_map(|id| table.runs.get(id))
            .find(|run| run.session_key == session_key)
            .and_then(|run| run.group_id.clone())
    }

    /// Takes back the event `seq` that could not be sent: the run is as before it.
    pub fn undo(&self, run_id: &str, seq: u64) {
        if let Some(run) = self.table().runs.get_mut(run_id)
            && run.seq == seq
        {
            run.seq -= 1;
            run.ended = None;
        }
    }

    /// What an abort of `run_id` in `session_key` finds.
    pub fn check_abort(&self, run_id: &str, session_key: &str) -> AbortCheck {
        match self.table().runs.get(run_id) {
            None => AbortCheck::Unknown,
            Some(run) if run.session_key != session_key => AbortCheck::OtherSession,
            Some(run) if run.ended.is_some() => AbortCheck::Ended,
            Some(_) => AbortCheck::Active,
        }
    }

    /// Runs remembered.
    pub fn len(&self) -> usize {
        self.table().runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_count_up_per_run_and_stop_at_the_end() {
        let runs = Runs::default();
        runs.start("r1", "s1", Some("g".into()));
        runs.start("r2", "s1", None);
        assert_eq!(runs.next("r1", None), Some(Slot { group_id: Some("g".into()), seq: 1 }));
        assert_eq!(runs.next("r2", None).unwrap().seq, 1);
        assert_eq!(runs.next("r1", Some(Ending::Final)).unwrap().seq, 2);
        assert_eq!(runs.next("r1", None), None, "late events of an ended run are suppressed");
        assert_eq!(runs.next("nope", None), None);
    }

    #[test]
    fn aborts_are_checked_against_the_session_key() {
        let runs = Runs::default();
        runs.start("r1", "s1", None);
        assert_eq!(runs.check_abort("r1", "s2"), AbortCheck::OtherSession);
        assert_eq!(runs.check_abort("r9", "s1"), AbortCheck::Unknown);
        assert_eq!(runs.check_abort("r1", "s1"), AbortCheck::Active);
        runs.next("r1", Some(Ending::Aborted));
        assert_eq!(runs.check_abort("r1", "s1"), AbortCheck::Ended);
    }

    #[test]
    fn the_table_is_bounded_by_forgetting_ended_runs() {
        let runs = Runs::default();
        runs.start("active", "s", None);
        for n in 0..MAX_RUNS + 10 {
            let id = format!("r{n}");
            runs.start(&id, "s", None);
            runs.next(&id, Some(Ending::Final));
        }
        assert!(runs.len() <= MAX_RUNS);
        assert!(runs.get("active").is_some(), "an active run is never forgotten");
        assert!(runs.get("r0").is_none());
    }
}
