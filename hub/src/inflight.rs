//! Bookkeeping of inbound runs in flight on one driver connection (pure).

use std::collections::HashSet;

use channeld_protocol::Id;

/// The answer to a new inbound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admitted,
    /// The connection already has `max` runs; the driver should retry.
    Busy {
        max: usize,
    },
    /// A run for this event id is already active on this connection.
    Duplicate,
}

/// Where an event stands against a connection's in-flight limit (asking changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A run may start: there is room.
    Free,
    /// The connection already has `max` runs.
    Full { max: usize },
    /// A run for this event id is already active on this connection.
    Taken,
}

/// At most `max` active event ids.
#[derive(Debug)]
pub struct InflightTable {
    max: usize,
    active: HashSet<Id>,
}

impl InflightTable {
    pub fn new(max: usize) -> Self {
        Self { max, active: HashSet::new() }
    }

    /// Where `event_id` stands, without taking a slot.
    pub fn slot(&self, event_id: &Id) -> Slot {
        if self.active.contains(event_id) {
            Slot::Taken
        } else if self.active.len() >= self.max {
            Slot::Full { max: self.max }
        } else {
            Slot::Free
        }
    }

    /// Takes a slot for `event_id` if it is free.
    pub fn admit(&mut self, event_id: &Id) -> Admission {
        match self.slot(event_id) {
            Slot::Taken => Admission::Duplicate,
            Slot::Full { max } => Admission::Busy { max },
            Slot::Free => {
                self.active.insert(event_id.clone());
                Admission::Admitted
            }
        }
    }

    pub fn finish(&mut self, event_id: &Id) {
        self.active.remove(event_id);
    }

    pub fn len(&self) -> usize {
        self.active.len()
    }

    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(value: &str) -> Id {
        Id::new(value).unwrap()
    }

    #[test]
    fn fifth_run_is_busy_and_a_finished_slot_is_reused() {
        let mut table = InflightTable::new(4);
        for n in 0..4 {
            assert_eq!(table.admit(&id(&format!("e{n}"))), Admission::Admitted);
        }
        assert_eq!(table.slot(&id("e4")), Slot::Full { max: 4 });
        assert_eq!(table.slot(&id("e0")), Slot::Taken);
        assert_eq!(table.admit(&id("e4")), Admission::Busy { max: 4 });
        assert_eq!(table.admit(&id("e0")), Admission::Duplicate);
        table.finish(&id("e0"));
        assert_eq!(table.admit(&id("e4")), Admission::Admitted);
        assert_eq!(table.len(), 4);
    }
}
