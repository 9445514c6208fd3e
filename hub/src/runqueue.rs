//! The run queue of one instance (pure): runs of one conversation session start one after
//! another in arrival order, at most `max_running` runs of the instance run at once across
//! sessions, and at most `max_waiting` accepted inbound wait for their turn.
//!
//! An entry is admitted on the reader, in arrival order, before the ledger records it; it can
//! start only once the caller made it [`ready`](RunQueue::ready) (recorded, with what starts
//! it). An entry admitted while its session is empty and a run slot is free *reserves* that
//! slot: it starts as soon as it is ready, and the caller knows at admission that it never
//! waits (the ledger records it as started). Every other entry waits: it counts against
//! `max_waiting` until it starts.
//!
//! The caller starts what [`ready`](RunQueue::ready), [`cancel`](RunQueue::cancel),
//! [`finish`](RunQueue::finish) and [`restore`](RunQueue::restore) return, in that order,
//! after releasing its lock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

use channeld_protocol::Id;

/// Where an event stands against the queue (asking changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// It may be admitted: it starts at once, or there is room to wait.
    Free,
    /// It would have to wait and `max` inbound already wait: `busy`.
    Full { max: usize },
    /// The event is already queued or running.
    Taken,
}

/// The answer to [`RunQueue::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted with a run slot of its own: it starts as soon as it is ready.
    Reserved,
    /// Admitted behind earlier runs of its session, or while every slot is taken.
    Waiting,
    /// Not admitted: `max` inbound already wait.
    Busy { max: usize },
    /// Not admitted: the event is already queued or running.
    Duplicate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Admitted, not ready yet, holding a run slot.
    Reserved,
    /// Admitted, not ready yet, waiting.
    Recording,
    /// Ready, waiting for its turn in its session and for a run slot.
    Ready,
    Running,
}

#[derive(Debug)]
struct Entry<K, T> {
    route: K,
    seq: u64,
    state: State,
    start: Option<T>,
}

/// The queue; `K` names a session (route), `T` is what starts a run.
#[derive(Debug)]
pub struct RunQueue<K, T> {
    max_running: usize,
    max_waiting: usize,
    next_seq: u64,
    entries: HashMap<Id, Entry<K, T>>,
    /// Each session's entries in arrival order; only the front may run.
    sessions: HashMap<K, VecDeque<Id>>,
    /// Session fronts that are ready and not running, by arrival: the next to start.
    startable: BTreeMap<u64, Id>,
    /// Entries running or holding a slot.
    running: usize,
    /// Entries admitted and not started (reserved ones excluded).
    waiting: usize,
}

impl<K: Hash + Eq + Clone, T> RunQueue<K, T> {
    pub fn new(max_running: usize, max_waiting: usize) -> Self {
        Self {
            max_running: max_running.max(1),
            max_waiting,
            next_seq: 0,
            entries: HashMap::new(),
            sessions: HashMap::new(),
            startable: BTreeMap::new(),
            running: 0,
            waiting: 0,
        }
    }

    /// Whether an inbound of session `route` would start at once.
    fn would_start(&self, route: &K) -> bool {
        self.running < self.max_running && self.sessions.get(route).is_none_or(VecDeque::is_empty)
    }

    /// Where `event_id` stands, without admitting it.
    pub fn slot(&self, event_id: &Id, route: &K) -> Slot {
        if self.entries.contains_key(event_id) {
            Slot::Taken
        } else if !self.would_start(route) && self.waiting >= self.max_waiting {
            Slot::Full { max: self.max_waiting }
        } else {
            Slot::Free
        }
    }

    /// Admits `event_id` at the back of its session.
    pub fn admit(&mut self, event_id: &Id, route: &K) -> Admission {
        match self.slot(event_id, route) {
            Slot::Taken => Admission::Duplicate,
            Slot::Full { max } => Admission::Busy { max },
            Slot::Free => {
                let reserved = self.would_start(route);
                let state = if reserved { State::Reserved } else { State::Recording };
                self.push(event_id, route, state, None);
                if reserved { Admission::Reserved } else { Admission::Waiting }
            }
        }
    }

    /// Queues a run restored after a restart (already ready), whatever the bound: the ledger
    /// accepted it before. Returns what starts now.
    pub fn restore(&mut self, event_id: &Id, route: &K, start: T) -> Vec<T> {
        if self.entries.contains_key(event_id) {
            return Vec::new();
        }
        self.push(event_id, route, State::Ready, Some(start));
        self.refresh_front(route);
        self.pump()
    }

    fn push(&mut self, event_id: &Id, route: &K, state: State, start: Option<T>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if state == State::Reserved {
            self.running += 1;
        } else {
            self.waiting += 1;
        }
        self.entries.insert(event_id.clone(), Entry { route: route.clone(), seq, state, start });
        self.sessions.entry(route.clone()).or_default().push_back(event_id.clone());
    }

    /// The admitted `event_id` is recorded: `start` starts it when its turn comes. Returns
    /// what starts now.
    pub fn ready(&mut self, event_id: &Id, start: T) -> Vec<T> {
        let Some(entry) = self.entries.get_mut(event_id) else { return Vec::new() };
        match entry.state {
            State::Reserved => {
                entry.state = State::Running;
                vec![start]
            }
            State::Recording => {
                entry.state = State::Ready;
                entry.start = Some(start);
                let route = entry.route.clone();
                self.refresh_front(&route);
                self.pump()
            }
            State::Ready | State::Running => Vec::new(),
        }
    }

    /// The admitted `event_id` does not run after all (a replay, a conflict, a ledger
    /// failure). Returns what starts now.
    pub fn cancel(&mut self, event_id: &Id) -> Vec<T> {
        match self.entries.get(event_id).map(|e| e.state) {
            Some(State::Reserved | State::Recording | State::Ready) => self.remove(event_id),
            Some(State::Running) | None => Vec::new(),
        }
    }

    /// The run of `event_id` ended. Returns what starts now.
    pub fn finish(&mut self, event_id: &Id) -> Vec<T> {
        match self.entries.get(event_id).map(|e| e.state) {
            Some(State::Running) => self.remove(event_id),
            _ => Vec::new(),
        }
    }

    fn remove(&mut self, event_id: &Id) -> Vec<T> {
        let Some(entry) = self.entries.remove(event_id) else { return Vec::new() };
        match entry.state {
            State::Reserved | State::Running => self.running -= 1,
            State::Recording | State::Ready => self.waiting -= 1,
        }
        self.startable.remove(&entry.seq);
        if let Some(session) = self.sessions.get_mut(&entry.route) {
            session.retain(|id| id != event_id);
            if session.is_empty() {
                self.sessions.remove(&entry.route);
            }
        }
        self.refresh_front(&entry.route);
        self.pump()
    }

    /// Makes the front of `route` startable if it is ready.
    fn refresh_front(&mut self, route: &K) {
        let Some(front) = self.sessions.get(route).and_then(VecDeque::front) else { return };
        if let Some(entry) = self.entries.get(front)
            && entry.state == State::Ready
        {
            self.startable.insert(entry.seq, front.clone());
        }
    }

    /// Starts startable fronts, oldest first, while there are free slots.
    fn pump(&mut self) -> Vec<T> {
        let mut started = Vec::new();
        while self.running < self.max_running {
            let Some((_, id)) = self.startable.pop_first() else { break };
            let Some(entry) = self.entries.get_mut(&id) else { continue };
            entry.state = State::Running;
            self.waiting -= 1;
            self.running += 1;
            started.extend(entry.start.take());
        }
        started
    }

    /// Runs going on (or about to start).
    pub fn running(&self) -> usize {
        self.running
    }

    /// Inbound accepted and waiting for their turn.
    pub fn waiting(&self) -> usize {
        self.waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(value: &str) -> Id {
        Id::new(value).unwrap()
    }

    /// Admits and readies `event` (whose start is its own name).
    fn arrive(
        queue: &mut RunQueue<&'static str, &'static str>,
        event: &'static str,
        route: &'static str,
    ) -> Vec<&'static str> {
        let admission = queue.admit(&id(event), &route);
        assert!(matches!(admission, Admission::Reserved | Admission::Waiting), "{admission:?}");
        queue.ready(&id(event), event)
    }

    #[test]
    fn a_session_runs_one_at_a_time_in_arrival_order() {
        let mut queue = RunQueue::new(4, 64);
        assert_eq!(arrive(&mut queue, "a", "s1"), ["a"]);
        assert!(arrive(&mut queue, "new", "s1").is_empty());
        assert!(arrive(&mut queue, "b", "s1").is_empty());
        assert!(arrive(&mut queue, "c", "s1").is_empty());
        assert_eq!((queue.running(), queue.waiting()), (1, 3));
        assert_eq!(queue.finish(&id("a")), ["new"]);
        assert_eq!(queue.finish(&id("new")), ["b"]);
        assert_eq!(queue.finish(&id("b")), ["c"]);
        assert!(queue.finish(&id("c")).is_empty());
        assert_eq!((queue.running(), queue.waiting()), (0, 0));
    }

    #[test]
    fn other_sessions_run_beside_a_slow_one_up_to_the_run_limit() {
        let mut queue = RunQueue::new(2, 64);
        assert_eq!(arrive(&mut queue, "a1", "s1"), ["a1"]);
        assert!(arrive(&mut queue, "a2", "s1").is_empty());
        assert_eq!(arrive(&mut queue, "b1", "s2"), ["b1"]);
        // Both slots taken: a third session waits, and is started before s1's second run
        // only if it arrived first.
        assert!(arrive(&mut queue, "c1", "s3").is_empty());
        assert_eq!(queue.finish(&id("b1")), ["c1"]);
        assert_eq!(queue.finish(&id("c1")), Vec::<&str>::new(), "a2 waits for a1, not a slot");
        assert_eq!(queue.finish(&id("a1")), ["a2"]);
    }

    #[test]
    fn the_oldest_ready_front_gets_a_freed_slot() {
        let mut queue = RunQueue::new(1, 64);
        assert_eq!(arrive(&mut queue, "x", "s0"), ["x"]);
        assert!(arrive(&mut queue, "b", "s2").is_empty());
        assert!(arrive(&mut queue, "a", "s1").is_empty());
        assert_eq!(queue.finish(&id("x")), ["b"]);
        assert_eq!(queue.finish(&id("b")), ["a"]);
    }

    #[test]
    fn an_entry_waits_for_its_record_even_when_it_is_its_turn() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(4, 64);
        assert_eq!(queue.admit(&id("a"), &"s1"), Admission::Reserved);
        assert_eq!(queue.admit(&id("b"), &"s1"), Admission::Waiting);
        // b is recorded before a: it still waits for a.
        assert!(queue.ready(&id("b"), "b").is_empty());
        assert_eq!(queue.ready(&id("a"), "a"), ["a"]);
        assert_eq!(queue.finish(&id("a")), ["b"]);
        // c is behind b's record: b finished, c is the front but not recorded yet.
        assert_eq!(queue.admit(&id("c"), &"s1"), Admission::Waiting);
        assert_eq!(queue.admit(&id("d"), &"s1"), Admission::Waiting);
        assert!(queue.ready(&id("d"), "d").is_empty());
        assert!(queue.finish(&id("b")).is_empty());
        assert_eq!(queue.ready(&id("c"), "c"), ["c"]);
    }

    #[test]
    fn a_cancelled_entry_lets_the_next_one_go_and_frees_its_place() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(4, 1);
        assert_eq!(queue.admit(&id("a"), &"s1"), Admission::Reserved);
        assert_eq!(queue.admit(&id("b"), &"s1"), Admission::Waiting);
        assert!(queue.ready(&id("b"), "b").is_empty());
        assert_eq!(queue.cancel(&id("a")), ["b"]);
        assert_eq!((queue.running(), queue.waiting()), (1, 0));
        assert_eq!(queue.admit(&id("c"), &"s1"), Admission::Waiting);
        assert_eq!(queue.cancel(&id("c")), Vec::<&str>::new());
        assert_eq!(queue.waiting(), 0);
        // A running entry is not cancelled; it finishes.
        assert!(queue.cancel(&id("b")).is_empty());
        assert_eq!(queue.running(), 1);
    }

    #[test]
    fn busy_only_when_the_waiting_room_is_full_and_duplicates_are_taken() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(1, 2);
        assert_eq!(arrive(&mut queue, "a", "s1"), ["a"]);
        arrive(&mut queue, "b", "s1");
        arrive(&mut queue, "c", "s2");
        assert_eq!(queue.slot(&id("d"), &"s3"), Slot::Full { max: 2 });
        assert_eq!(queue.admit(&id("d"), &"s3"), Admission::Busy { max: 2 });
        assert_eq!(queue.slot(&id("b"), &"s1"), Slot::Taken);
        assert_eq!(queue.admit(&id("a"), &"s1"), Admission::Duplicate);
        assert_eq!(queue.finish(&id("a")), ["b"]);
        assert_eq!(queue.admit(&id("d"), &"s3"), Admission::Waiting);
    }

    #[test]
    fn a_run_that_starts_at_once_needs_no_room_to_wait() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(2, 0);
        assert_eq!(queue.admit(&id("a"), &"s1"), Admission::Reserved);
        assert_eq!(queue.admit(&id("b"), &"s1"), Admission::Busy { max: 0 });
        assert_eq!(queue.admit(&id("c"), &"s2"), Admission::Reserved);
        assert_eq!(queue.admit(&id("d"), &"s3"), Admission::Busy { max: 0 });
    }

    #[test]
    fn restored_runs_keep_their_order_beyond_the_bound() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(1, 1);
        assert_eq!(queue.restore(&id("a"), &"s1", "a"), ["a"]);
        assert!(queue.restore(&id("b"), &"s1", "b").is_empty());
        assert!(queue.restore(&id("c"), &"s1", "c").is_empty());
        assert!(queue.restore(&id("c"), &"s1", "c").is_empty(), "restored once");
        assert_eq!(queue.waiting(), 2);
        assert_eq!(queue.admit(&id("d"), &"s1"), Admission::Busy { max: 1 });
        assert_eq!(queue.finish(&id("a")), ["b"]);
        assert_eq!(queue.finish(&id("b")), ["c"]);
    }
}
