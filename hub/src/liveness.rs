//! Liveness probes for the systemd watchdog: a hub is alive when the parts that must make
//! progress answer — each accept loop between accepts, and the ledger thread by committing a
//! batch. A wedged part stops the watchdog pings, so systemd restarts the hub.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::ledger::Ledger;

/// Asks one part of the hub whether it is alive.
#[derive(Debug, Clone)]
pub struct Probe {
    name: String,
    /// Capacity 1: a question still unanswered when the next is asked is itself a "no".
    tx: mpsc::Sender<oneshot::Sender<()>>,
}

/// Held by the part being asked; it answers between units of work.
#[derive(Debug)]
pub struct Responder {
    rx: mpsc::Receiver<oneshot::Sender<()>>,
}

/// A probe for the part called `name`, and the responder that part keeps.
pub fn pair(name: impl Into<String>) -> (Probe, Responder) {
    let (tx, rx) = mpsc::channel(1);
    (Probe { name: name.into(), tx }, Responder { rx })
}

impl Responder {
    /// Waits for a question and answers it. Cancel-safe, so it can sit in a `select!` next
    /// to the part's real work. Never returns once nobody can ask any more.
    pub async fn answer(&mut self) {
        match self.rx.recv().await {
            Some(question) => {
                let _ = question.send(());
            }
            None => std::future::pending().await,
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
        self.list.lock().unwrap_or_else(|p| p.into_inner()).retain(|probe| probe.name != name);
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
        let mut answers = Vec::with_capacity(probes.len());
        for probe in &probes {
            let (question, answer) = oneshot::channel();
            match probe.tx.try_send(question) {
                Ok(()) => answers.push((probe, answer)),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    return Err(Stalled::Silent(probe.name.clone(), limit));
                }
                Err(mpsc::error::TrySendError::Closed(_)) if stopping => {}
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    return Err(Stalled::Gone(probe.name.clone()));
                }
            }
        }
        for (probe, answer) in answers {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, answer).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) if stopping => {}
                Ok(Err(_)) => return Err(Stalled::Gone(probe.name.clone())),
                Err(_) => return Err(Stalled::Silent(probe.name.clone(), limit)),
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
