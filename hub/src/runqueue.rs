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
//! A run that [`ended`](RunQueue::ended) (its outcome recorded) gives its slot to another
//! session and its event id back at once — a redelivery is then answered from the ledger, not
//! taken for the run in progress — but stays its session's front until
//! [`finish`](RunQueue::finish) (its reply handed over), so the session's next run cannot
//! overtake its reply. A started run is named by its [`Turn`].
//!
//! The caller starts what [`ready`](RunQueue::ready), [`cancel`](RunQueue::cancel),
//! [`ended`](RunQueue::ended), [`finish`](RunQueue::finish) and
//! [`restore`](RunQueue::restore) return, in that order, after releasing its lock.

use std::collections::BTreeSet;

// foldhash, not SipHash: these maps are read a dozen times per inbound (BENCHMARKS.md, fix 25).
use foldhash::HashMap;
use std::hash::Hash;

use channeld_protocol::Id;
use smallvec::{SmallVec, smallvec};

/// Where an event stands against the queue (asking changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// It may be admitted: it starts at once, or there is room to wait.
    Free,
    /// It would have to wait and `max` inbound already wait: `busy`.
    Full { max: usize },
    /// The event is already queued, or running and its outcome not recorded yet.
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

/// A started run's place in the queue, for [`RunQueue::ended`] and [`RunQueue::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Turn(u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Admitted, not ready yet, holding a run slot.
    Reserved,
    /// Admitted, not ready yet, waiting.
    Recording,
    /// Ready, waiting for its turn in its session and for a run slot.
    Ready,
    Running,
    /// Its run ended and gave up its slot and event id; its reply is being handed over.
    Ending,
}

#[derive(Debug)]
struct Entry<K, T> {
    event_id: Id,
    route: K,
    state: State,
    start: Option<T>,
}

/// The queue; `K` names a session (route), `T` is what starts a run.
#[derive(Debug)]
pub struct RunQueue<K, T> {
    max_running: usize,
    max_waiting: usize,
    next_seq: u64,
    /// Entries by arrival number.
    entries: HashMap<u64, Entry<K, T>>,
    /// The entries that hold their event id (all but the ending ones).
    ids: HashMap<Id, u64>,
    /// Each session's entries in arrival order; only the front may run.
    sessions: HashMap<K, Session>,
    /// Session fronts that are ready and not running, by arrival: the next to start.
    startable: BTreeSet<u64>,
    /// Entries running or holding a slot.
    running: usize,
    /// Entries admitted and not started (reserved ones excluded).
    waiting: usize,
}

/// One session's entries in arrival order. A chat's session mostly holds one entry at a time
/// (its next message comes after the reply) and is dropped once empty: the one entry is held
/// inline, so such a session allocates nothing.
type Session = SmallVec<[u64; 1]>;

/// Runs to start, each with its turn, in the order to start them. Mostly none or one (an
/// inbound that finds its slot free starts alone): the one is held inline.
pub type Starts<T> = SmallVec<[(Turn, T); 1]>;

impl<K: Hash + Eq + Clone, T> RunQueue<K, T> {
    pub fn new(max_running: usize, max_waiting: usize) -> Self {
        Self {
            max_running: max_running.max(1),
            max_waiting,
            next_seq: 0,
            entries: HashMap::default(),
            ids: HashMap::default(),
            sessions: HashMap::default(),
            startable: BTreeSet::new(),
            running: 0,
            waiting: 0,
        }
    }

    /// Whether an inbound of session `route` would start at once.
    fn would_start(&self, route: &K) -> bool {
        self.running < self.max_running
            && self.sessions.get(route).is_none_or(|session| session.is_empty())
    }

    /// Where `event_id` stands, without admitting it.
    pub fn slot(&self, event_id: &Id, route: &K) -> Slot {
        if self.ids.contains_key(event_id) {
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
    pub fn restore(&mut self, event_id: &Id, route: &K, start: T) -> Starts<T> {
        if self.ids.contains_key(event_id) {
            return Starts::new();
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
        let entry = Entry { event_id: event_id.clone(), route: route.clone(), state, start };
        self.entries.insert(seq, entry);
        self.ids.insert(event_id.clone(), seq);
        self.sessions.entry(route.clone()).or_default().push(seq);
    }

    /// The admitted `event_id` is recorded: `start` starts it when its turn comes. Returns
    /// what starts now.
    pub fn ready(&mut self, event_id: &Id, start: T) -> Starts<T> {
        let Some(&seq) = self.ids.get(event_id) else { return Starts::new() };
        let Some(entry) = self.entries.get_mut(&seq) else { return Starts::new() };
        match entry.state {
            State::Reserved => {
                entry.state = State::Running;
                smallvec![(Turn(seq), start)]
            }
            State::Recording => {
                entry.state = State::Ready;
                entry.start = Some(start);
                let route = entry.route.clone();
                self.refresh_front(&route);
                self.pump()
            }
            State::Ready | State::Running | State::Ending => Starts::new(),
        }
    }

    /// The admitted `event_id` does not run after all (a replay, a conflict, a ledger
    /// failure). Returns what starts now.
    pub fn cancel(&mut self, event_id: &Id) -> Starts<T> {
        let Some(&seq) = self.ids.get(event_id) else { return Starts::new() };
        match self.entries.get(&seq).map(|e| e.state) {
            Some(State::Reserved | State::Recording | State::Ready) => self.remove(seq),
            _ => Starts::new(),
        }
    }

    /// Removes `event_id` if it is ready and waiting for its turn (a cancel); `None` when it
    /// is not waiting (being recorded, running, unknown). Returns what starts now.
    pub fn withdraw(&mut self, event_id: &Id) -> Option<Starts<T>> {
        let seq = *self.ids.get(event_id)?;
        match self.entries.get(&seq).map(|e| e.state) {
            Some(State::Ready) => Some(self.remove(seq)),
            _ => None,
        }
    }

    /// The run of `turn` ended (its outcome is recorded): its slot goes to the next waiting
    /// run of another session and its event id may be admitted again, while its own session
    /// waits for [`finish`](RunQueue::finish). Returns what starts now.
    pub fn ended(&mut self, turn: Turn) -> Starts<T> {
        let Some(entry) = self.entries.get_mut(&turn.0) else { return Starts::new() };
        if entry.state != State::Running {
            return Starts::new();
        }
        entry.state = State::Ending;
        let event_id = entry.event_id.clone();
        self.running -= 1;
        if self.ids.get(&event_id) == Some(&turn.0) {
            self.ids.remove(&event_id);
        }
        self.pump()
    }

    /// The turn is over (its reply handed over): the next run of its session may start.
    /// Returns what starts now.
    pub fn finish(&mut self, turn: Turn) -> Starts<T> {
        match self.entries.get(&turn.0).map(|e| e.state) {
            Some(State::Running | State::Ending) => self.remove(turn.0),
            _ => Starts::new(),
        }
    }

    fn remove(&mut self, seq: u64) -> Starts<T> {
        let Some(entry) = self.entries.remove(&seq) else { return Starts::new() };
        match entry.state {
            State::Reserved | State::Running => self.running -= 1,
            State::Recording | State::Ready => self.waiting -= 1,
            State::Ending => {}
        }
        if self.ids.get(&entry.event_id) == Some(&seq) {
            self.ids.remove(&entry.event_id);
        }
        self.startable.remove(&seq);
        if let Some(session) = self.sessions.get_mut(&entry.route) {
            session.retain(|queued| *queued != seq);
            if session.is_empty() {
                self.sessions.remove(&entry.route);
            }
        }
        self.refresh_front(&entry.route);
        self.pump()
    }

    /// Makes the front of `route` startable if it is ready.
    fn refresh_front(&mut self, route: &K) {
        let Some(&front) = self.sessions.get(route).and_then(|session| session.first()) else {
            return;
        };
        if self.entries.get(&front).is_some_and(|entry| entry.state == State::Ready) {
            self.startable.insert(front);
        }
    }

    /// Starts startable fronts, oldest first, while there are free slots.
    fn pump(&mut self) -> Starts<T> {
        let mut started = Starts::new();
        while self.running < self.max_running {
            let Some(seq) = self.startable.pop_first() else { break };
            let Some(entry) = self.entries.get_mut(&seq) else { continue };
            entry.state = State::Running;
            self.waiting -= 1;
            self.running += 1;
            if let Some(start) = entry.start.take() {
                started.push((Turn(seq), start));
            }
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

    /// A queue whose runs are named by their event ids, remembering each started run's turn.
    struct Harness {
        queue: RunQueue<&'static str, &'static str>,
        turns: HashMap<&'static str, Turn>,
    }

    impl Harness {
        fn new(max_running: usize, max_waiting: usize) -> Self {
            Self { queue: RunQueue::new(max_running, max_waiting), turns: HashMap::default() }
        }

        fn started(&mut self, starts: Starts<&'static str>) -> Vec<&'static str> {
            starts
                .into_iter()
                .map(|(turn, name)| {
                    self.turns.insert(name, turn);
                    name
                })
                .collect()
        }

        fn admit(&mut self, event: &'static str, route: &'static str) -> Admission {
            self.queue.admit(&id(event), &route)
        }

        fn ready(&mut self, event: &'static str) -> Vec<&'static str> {
            let starts = self.queue.ready(&id(event), event);
            self.started(starts)
        }

        /// Admits and readies `event`.
        fn arrive(&mut self, event: &'static str, route: &'static str) -> Vec<&'static str> {
            let admission = self.admit(event, route);
            assert!(matches!(admission, Admission::Reserved | Admission::Waiting), "{admission:?}");
            self.ready(event)
        }

        fn restore(&mut self, event: &'static str, route: &'static str) -> Vec<&'static str> {
            let starts = self.queue.restore(&id(event), &route, event);
            self.started(starts)
        }

        fn cancel(&mut self, event: &'static str) -> Vec<&'static str> {
            let starts = self.queue.cancel(&id(event));
            self.started(starts)
        }

        fn ended(&mut self, event: &'static str) -> Vec<&'static str> {
            let starts = self.queue.ended(self.turns[event]);
            self.started(starts)
        }

        fn finish(&mut self, event: &'static str) -> Vec<&'static str> {
            let starts = self.queue.finish(self.turns[event]);
            self.started(starts)
        }

        fn counts(&self) -> (usize, usize) {
            (self.queue.running(), self.queue.waiting())
        }
    }

    const NONE: [&str; 0] = [];

    #[test]
    fn a_session_runs_one_at_a_time_in_arrival_order() {
        let mut q = Harness::new(4, 64);
        assert_eq!(q.arrive("a", "s1"), ["a"]);
        assert_eq!(q.arrive("new", "s1"), NONE);
        assert_eq!(q.arrive("b", "s1"), NONE);
        assert_eq!(q.arrive("c", "s1"), NONE);
        assert_eq!(q.counts(), (1, 3));
        assert_eq!(q.finish("a"), ["new"]);
        assert_eq!(q.finish("new"), ["b"]);
        assert_eq!(q.finish("b"), ["c"]);
        assert_eq!(q.finish("c"), NONE);
        assert_eq!(q.counts(), (0, 0));
    }

    #[test]
    fn other_sessions_run_beside_a_slow_one_up_to_the_run_limit() {
        let mut q = Harness::new(2, 64);
        assert_eq!(q.arrive("a1", "s1"), ["a1"]);
        assert_eq!(q.arrive("a2", "s1"), NONE);
        assert_eq!(q.arrive("b1", "s2"), ["b1"]);
        // Both slots taken: a third session waits for a slot.
        assert_eq!(q.arrive("c1", "s3"), NONE);
        assert_eq!(q.finish("b1"), ["c1"]);
        assert_eq!(q.finish("c1"), NONE, "a2 waits for a1, not for a slot");
        assert_eq!(q.finish("a1"), ["a2"]);
    }

    #[test]
    fn the_oldest_ready_front_gets_a_freed_slot() {
        let mut q = Harness::new(1, 64);
        assert_eq!(q.arrive("x", "s0"), ["x"]);
        assert_eq!(q.arrive("b", "s2"), NONE);
        assert_eq!(q.arrive("a", "s1"), NONE);
        assert_eq!(q.finish("x"), ["b"]);
        assert_eq!(q.finish("b"), ["a"]);
    }

    #[test]
    fn an_entry_waits_for_its_record_even_when_it_is_its_turn() {
        let mut q = Harness::new(4, 64);
        assert_eq!(q.admit("a", "s1"), Admission::Reserved);
        assert_eq!(q.admit("b", "s1"), Admission::Waiting);
        // b is recorded before a: it still waits for a.
        assert_eq!(q.ready("b"), NONE);
        assert_eq!(q.ready("a"), ["a"]);
        assert_eq!(q.finish("a"), ["b"]);
        // c is the front once b finished, but not recorded yet.
        assert_eq!(q.admit("c", "s1"), Admission::Waiting);
        assert_eq!(q.admit("d", "s1"), Admission::Waiting);
        assert_eq!(q.ready("d"), NONE);
        assert_eq!(q.finish("b"), NONE);
        assert_eq!(q.ready("c"), ["c"]);
    }

    #[test]
    fn a_cancelled_entry_lets_the_next_one_go_and_frees_its_place() {
        let mut q = Harness::new(4, 1);
        assert_eq!(q.admit("a", "s1"), Admission::Reserved);
        assert_eq!(q.admit("b", "s1"), Admission::Waiting);
        assert_eq!(q.ready("b"), NONE);
        assert_eq!(q.cancel("a"), ["b"]);
        assert_eq!(q.counts(), (1, 0));
        assert_eq!(q.admit("c", "s1"), Admission::Waiting);
        assert_eq!(q.cancel("c"), NONE);
        assert_eq!(q.counts(), (1, 0));
        // A running entry is not cancelled; it finishes.
        assert_eq!(q.cancel("b"), NONE);
        assert_eq!(q.counts(), (1, 0));
    }

    #[test]
    fn an_ended_run_frees_its_slot_and_its_id_but_not_its_session() {
        let mut q = Harness::new(1, 64);
        assert_eq!(q.arrive("a1", "s1"), ["a1"]);
        assert_eq!(q.arrive("a2", "s1"), NONE);
        assert_eq!(q.arrive("b1", "s2"), NONE);
        assert_eq!(q.queue.slot(&id("a1"), &"s1"), Slot::Taken);
        // a1's outcome is recorded: b1 takes the slot while a1's reply goes out.
        assert_eq!(q.ended("a1"), ["b1"]);
        assert_eq!(q.ended("a1"), NONE, "once");
        assert_eq!(q.counts(), (1, 1));
        // A redelivery of a1 is no longer taken for its run (the ledger answers it).
        assert_eq!(q.queue.slot(&id("a1"), &"s1"), Slot::Free);
        // a2 waits for a1's turn to end and for a slot.
        assert_eq!(q.finish("a1"), NONE);
        assert_eq!(q.finish("b1"), ["a2"]);
        // A new session starts at once beside an ending run; its own session waits.
        assert_eq!(q.ended("a2"), NONE);
        assert_eq!(q.admit("c1", "s3"), Admission::Reserved);
        assert_eq!(q.admit("a3", "s1"), Admission::Waiting);
        assert_eq!(q.ready("a3"), NONE);
        assert_eq!(q.ready("c1"), ["c1"]);
        assert_eq!(q.finish("a2"), NONE, "c1 holds the one slot");
        assert_eq!(q.finish("c1"), ["a3"]);
    }

    #[test]
    fn an_ended_runs_event_id_admitted_again_is_a_new_entry() {
        let mut q = Harness::new(2, 64);
        assert_eq!(q.arrive("a", "s1"), ["a"]);
        let first = q.turns["a"];
        assert_eq!(q.ended("a"), NONE);
        // Without a ledger a redelivery runs again, after the first run's turn.
        assert_eq!(q.admit("a", "s1"), Admission::Waiting);
        assert_eq!(q.ready("a"), NONE);
        assert_eq!(q.queue.finish(first).into_iter().map(|(_, n)| n).collect::<Vec<_>>(), ["a"]);
        assert_eq!(q.counts(), (1, 0));
    }

    #[test]
    fn busy_only_when_the_waiting_room_is_full_and_duplicates_are_taken() {
        let mut q = Harness::new(1, 2);
        assert_eq!(q.arrive("a", "s1"), ["a"]);
        q.arrive("b", "s1");
        q.arrive("c", "s2");
        assert_eq!(q.queue.slot(&id("d"), &"s3"), Slot::Full { max: 2 });
        assert_eq!(q.admit("d", "s3"), Admission::Busy { max: 2 });
        assert_eq!(q.queue.slot(&id("b"), &"s1"), Slot::Taken);
        assert_eq!(q.admit("a", "s1"), Admission::Duplicate);
        assert_eq!(q.finish("a"), ["b"]);
        assert_eq!(q.admit("d", "s3"), Admission::Waiting);
    }

    #[test]
    fn a_run_that_starts_at_once_needs_no_room_to_wait() {
        let mut q = Harness::new(2, 0);
        assert_eq!(q.admit("a", "s1"), Admission::Reserved);
        assert_eq!(q.admit("b", "s1"), Admission::Busy { max: 0 });
        assert_eq!(q.admit("c", "s2"), Admission::Reserved);
        assert_eq!(q.admit("d", "s3"), Admission::Busy { max: 0 });
    }

    #[test]
    fn only_a_waiting_run_can_be_withdrawn_and_the_next_one_goes() {
        let mut q = Harness::new(1, 64);
        assert_eq!(q.arrive("a", "s1"), ["a"]);
        assert_eq!(q.arrive("b", "s1"), NONE);
        assert_eq!(q.arrive("c", "s1"), NONE);
        assert!(q.queue.withdraw(&id("a")).is_none(), "a runs");
        assert!(q.queue.withdraw(&id("nope")).is_none());
        let starts = q.queue.withdraw(&id("b")).expect("b waits");
        assert!(starts.is_empty());
        assert_eq!(q.counts(), (1, 1));
        assert_eq!(q.finish("a"), ["c"], "b is gone: c is next");
        assert_eq!(q.admit("d", "s1"), Admission::Waiting);
        assert!(q.queue.withdraw(&id("d")).is_none(), "d is not recorded yet");
    }

    #[test]
    fn restored_runs_keep_their_order_beyond_the_bound() {
        let mut q = Harness::new(1, 1);
        assert_eq!(q.restore("a", "s1"), ["a"]);
        assert_eq!(q.restore("b", "s1"), NONE);
        assert_eq!(q.restore("c", "s1"), NONE);
        assert_eq!(q.restore("c", "s1"), NONE, "restored once");
        assert_eq!(q.counts(), (1, 2));
        assert_eq!(q.admit("d", "s1"), Admission::Busy { max: 1 });
        assert_eq!(q.finish("a"), ["b"]);
        assert_eq!(q.finish("b"), ["c"]);
    }

    /// A chat's session, one message at a time, and the run each message starts: nothing in
    /// the queue goes to the heap.
    #[test]
    fn one_message_at_a_time_spills_nothing() {
        let mut queue: RunQueue<&str, &str> = RunQueue::new(4, 4);
        for n in 0..50 {
            let event = id(&format!("e{n}"));
            assert_eq!(queue.admit(&event, &"s1"), Admission::Reserved);
            assert!(!queue.sessions[&"s1"].spilled());
            let starts = queue.ready(&event, "run");
            assert!(!starts.spilled());
            let (turn, _) = starts.into_iter().next().expect("it starts at once");
            assert!(queue.ended(turn).is_empty());
            assert!(queue.finish(turn).is_empty());
        }
        assert!(queue.sessions.is_empty());
    }
}
