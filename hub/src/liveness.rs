//! Liveness probes for the systemd watchdog: a hub is alive when the parts that must make
//! progress answer — each accept loop between accepts, and the ledger thread by committing a
//! batch. A wedged part stops the watchdog pings, so systemd restarts the hub.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::ledger::Ledger;

/// Asks one part of the hub whether it is alive.
#[derive(Debug, Clone)]
pub struct Probe {
    name: Arc<str>,
    shared: Arc<Shared>,
}

/// Held by the part being asked; it answers between units of work.
#[derive(Debug)]
pub struct Responder {
    shared: Arc<Shared>,
}

/// What a probe and its responder share: a few counters and two wake-ups, so that a hub with
/// thousands of instances keeps a small allocation per accept loop (not a channel).
#[derive(Debug, Default)]
struct Shared {
    /// Questions asked so far. One still unanswered when the next is asked is itself a "no".
    asked: AtomicU64,
    /// The newest question answered.
    answered: AtomicU64,
    /// The responder was dropped: its part ended.
    gone: AtomicBool,
    /// Wakes the responder when asked.
    question: Notify,
    /// Wakes the asker when answered or gone.
    answer: Notify,
}

/// A probe for the part called `name`, and the responder that part keeps.
pub fn pair(name: impl Into<Arc<str>>) -> (Probe, Responder) {
    let shared = Arc::new(Shared::default());
    (Probe { name: name.into(), shared: shared.clone() }, Responder { shared })
}

impl Responder {
    /// Waits for a question and answers it. Cancel-safe, so it can sit in a `select!` next
    /// to the part's real work: it answers only in the poll that returns.
    pub async fn answer(&mut self) {
        let shared = &self.shared;
        loop {
            let asked = std::pin::pin!(shared.question.notified());
            let newest = shared.asked.load(Ordering::Acquire);
            if newest > shared.answered.load(Ordering::Acquire) {
                shared.answered.store(newest, Ordering::Release);
                shared.answer.notify_waiters();
                return;
            }
            asked.await;
        }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.shared.gone.store(true, Ordering::Release);
        self.shared.answer.notify_waiters();
    }
}

impl Probe {
    /// Asks its part; `Err` when the previous question is still unanswered (`Silent`) or the
    /// part ended (`Gone`). The number to wait for otherwise.
    fn ask(&self, limit: Duration) -> Result<u64, Stalled> {
        let shared = &self.shared;
        if shared.gone.load(Ordering::Acquire) {
            return Err(Stalled::Gone(self.name.to_string()));
        }
        let asked = shared.asked.load(Ordering::Acquire);
        if shared.answered.load(Ordering::Acquire) < asked {
            return Err(Stalled::Silent(self.name.to_string(), limit));
        }
        shared.asked.store(asked + 1, Ordering::Release);
        shared.question.notify_one();
        Ok(asked + 1)
    }

    /// Waits until question `number` is answered (`Ok(true)`), the part is gone
    /// (`Ok(false)`), or `deadline` passed (`Err`).
    async fn answered(&self, number: u64, deadline: Instant) -> Result<bool, ()> {
        let shared = &self.shared;
        loop {
            let mut woken = std::pin::pin!(shared.answer.notified());
            woken.as_mut().enable();
            if shared.answered.load(Ordering::Acquire) >= number {
                return Ok(true);
            }
            if shared.gone.load(Ordering::Acquire) {
                return Ok(false);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::timeout(left, woken).await.map_err(drop)?;
        }
    }
}

/// Why the hub is not (known to be) alive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Stalled {
    #[error("{0} did not answer within {1:?}")]
    Silent(String, Duration),
    #[error("{0} has stopped")]
    Gone(String),
    #[error("the ledger did not commit within {0:?}")]
    Ledger(Duration),
}

/// The parts the watchdog asks: accept loops come with their instances (a reload adds and
/// retires them) and go with them.
#[derive(Debug, Default)]
pub struct Probes {
    list: Mutex<Vec<Probe>>,
}

impl Probes {
    pub fn add(&self, probe: Probe) {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).push(probe);
    }

    /// Stops asking the part called `name` (it ended on purpose).
    pub fn retire(&self, name: &str) {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).retain(|probe| &*probe.name != name);
    }

    fn current(&self) -> Vec<Probe> {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Every part the watchdog asks.
#[derive(Debug)]
pub struct Liveness {
    probes: Arc<Probes>,
    ledger: Ledger,
}

impl Liveness {
    pub fn new(probes: Arc<Probes>, ledger: Ledger) -> Self {
        Self { probes, ledger }
    }

    /// Asks every part, allowing `limit` in all. While `stopping`, parts that ended (accept
    /// loops stop first in a shutdown) are no longer required.
    pub async fn check(&self, limit: Duration, stopping: bool) -> Result<(), Stalled> {
        let deadline = Instant::now() + limit;
        let probes = self.probes.current();
        let mut asked = Vec::with_capacity(probes.len());
        for probe in &probes {
            match probe.ask(limit) {
                Ok(number) => asked.push((probe, number)),
                Err(Stalled::Gone(_)) if stopping => {}
                Err(stalled) => return Err(stalled),
            }
        }
        for (probe, number) in asked {
            match probe.answered(number, deadline).await {
                Ok(true) => {}
                Ok(false) if stopping => {}
                Ok(false) => return Err(Stalled::Gone(probe.name.to_string())),
                Err(()) => return Err(Stalled::Silent(probe.name.to_string(), limit)),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.ledger.ping()).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Stalled::Ledger(limit)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_millis(200);

    fn probes(list: Vec<Probe>) -> Arc<Probes> {
        let probes = Arc::new(Probes::default());
        for probe in list {
            probes.add(probe);
        }
        probes
    }

    #[tokio::test]
    async fn a_retired_part_is_no_longer_asked() {
        let (probe, responder) = pair("the accept loop of a.b");
        let probes = probes(vec![probe]);
        let liveness = Liveness::new(probes.clone(), Ledger::off());
        // The instance was removed: its accept loop ended on purpose.
        drop(responder);
        assert!(matches!(liveness.check(LIMIT, false).await, Err(Stalled::Gone(_))));
        probes.retire("the accept loop of a.b");
        liveness.check(LIMIT, false).await.unwrap();
    }

    #[tokio::test]
    async fn a_hub_whose_parts_answer_is_alive() {
        let (probe, mut responder) = pair("accept loop");
        let part = tokio::spawn(async move {
            loop {
                responder.answer().await;
            }
        });
        let liveness = Liveness::new(probes(vec![probe]), Ledger::in_memory().unwrap());
        for _ in 0..3 {
            liveness.check(LIMIT, false).await.unwrap();
        }
        part.abort();
        let _ = part.await;
    }

    /// The answer sits in a `select!` beside the part's work, which wins most polls: a
    /// question is answered all the same (the answer is cancel-safe).
    #[tokio::test]
    async fn a_part_that_answers_between_units_of_work_is_alive() {
        let (probe, mut responder) = pair("busy accept loop");
        let part = tokio::spawn(async move {
            let mut work = tokio::time::interval(Duration::from_millis(1));
            loop {
                tokio::select! {
                    _ = work.tick() => {}
                    () = responder.answer() => {}
                }
            }
        });
        let liveness = Liveness::new(probes(vec![probe]), Ledger::off());
        for _ in 0..20 {
            liveness.check(LIMIT, false).await.unwrap();
        }
        part.abort();
        let _ = part.await;
        // The part ended: the next question finds it gone.
        assert!(matches!(liveness.check(LIMIT, false).await, Err(Stalled::Gone(_))));
    }

    #[tokio::test]
    async fn a_part_that_stops_answering_stalls_the_hub() {
        // The responder exists but its loop is stuck elsewhere: it never answers.
        let (probe, _responder) = pair("accept loop test.one");
        let liveness = Liveness::new(probes(vec![probe]), Ledger::off());
        assert_eq!(
            liveness.check(LIMIT, false).await,
            Err(Stalled::Silent("accept loop test.one".into(), LIMIT))
        );
        // The unanswered question is still pending: asking again fails at once.
        assert!(matches!(liveness.check(LIMIT, false).await, Err(Stalled::Silent(..))));
    }

    #[tokio::test]
    async fn a_part_that_ended_stalls_the_hub_unless_it_is_stopping() {
        let (probe, responder) = pair("control accept loop");
        drop(responder);
        let liveness = Liveness::new(probes(vec![probe]), Ledger::off());
        assert_eq!(
            liveness.check(LIMIT, false).await,
            Err(Stalled::Gone("control accept loop".into()))
        );
        liveness.check(LIMIT, true).await.unwrap();
    }

    #[tokio::test]
    async fn a_ledger_that_stopped_committing_stalls_the_hub() {
        let ledger = Ledger::in_memory().unwrap();
        ledger.close().await;
        let liveness = Liveness::new(Arc::default(), ledger);
        assert_eq!(liveness.check(LIMIT, false).await, Err(Stalled::Ledger(LIMIT)));
    }
}
