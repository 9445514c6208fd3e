//! Corking: a task that queues several ledger calls in a row (a driver's reader with more
//! frames in its buffer) holds them and sends them together when it would wait, so the ledger
//! thread takes them as one batch and commits once, instead of waking for the first call
//! alone and committing the rest after it.

use std::cell::RefCell;
use std::future::Future;

use tokio::sync::mpsc::Sender;

use super::store::{Commit, Job, Message};

/// The most calls a task holds; queuing one more sends them first (and that one after them).
const LIMIT: usize = 64;

tokio::task_local! {
    static HELD: RefCell<Held>;
}

/// The calls a corked task queued and has not sent yet, in order, with the queue of the
/// ledger each is for.
#[derive(Default)]
struct Held {
    jobs: Vec<(Sender<Message>, Job, Commit)>,
}

impl Drop for Held {
    /// A corked task dropped while it held calls (aborted) still queues them if there is
    /// room; a call that does not fit is answered `Unavailable`, as when the thread is gone.
    fn drop(&mut self) {
        for (tx, message) in messages(&mut self.jobs) {
            let _ = tx.try_send(message);
        }
    }
}

/// Runs `future` corked: the ledger calls it queues are held in the task until it
/// [`release`]s them, awaits an answer ([`super::Pending::answer`] releases first) or holds
/// [`LIMIT`] calls. The future releases before anything that may wait for a held call (its
/// next read from a socket) and before it ends; what it still holds if it is dropped is
/// queued then, where there is room. A plain function: the future is stored once.
pub fn corked<F: Future>(future: F) -> impl Future<Output = F::Output> {
    HELD.scope(RefCell::default(), future)
}

/// Holds a call when the task is corked and has room; gives it back otherwise.
pub(super) fn hold(tx: &Sender<Message>, job: Job, commit: Commit) -> Option<(Job, Commit)> {
    let mut call = Some((job, commit));
    let _ = HELD.try_with(|held| {
        let mut held = held.borrow_mut();
        if held.jobs.len() < LIMIT
            && let Some((job, commit)) = call.take()
        {
            held.jobs.push((tx.clone(), job, commit));
        }
    });
    call
}

/// Sends the calls the task holds, in the order it queued them: one message per ledger, so
/// the ledger thread takes them into one batch (waiting for room in its queue). Nothing to
/// do outside a corked task. The sending is boxed: most callers hold nothing, and every
/// ledger call's future holds this one.
pub async fn release() {
    let Ok(jobs) = HELD.try_with(|held| std::mem::take(&mut held.borrow_mut().jobs)) else {
        return;
    };
    if jobs.is_empty() {
        return;
    }
    Box::pin(send(jobs)).await;
}

async fn send(mut jobs: Vec<(Sender<Message>, Job, Commit)>) {
    for (tx, message) in messages(&mut jobs) {
        // A closed queue drops the calls: their callers hear `Unavailable`.
        let _ = tx.send(message).await;
    }
    // The allocation is kept for the next calls.
    let _ = HELD.try_with(|held| {
        let mut held = held.borrow_mut();
        if held.jobs.is_empty() {
            held.jobs = jobs;
        }
    });
}

/// Takes the held calls as messages: each run of calls for one ledger becomes one.
fn messages(jobs: &mut Vec<(Sender<Message>, Job, Commit)>) -> Vec<(Sender<Message>, Message)> {
    let mut messages: Vec<(Sender<Message>, Message)> = Vec::new();
    for (tx, job, commit) in jobs.drain(..) {
        match messages.last_mut() {
            Some((last, Message::Jobs(group))) if last.same_channel(&tx) => {
                group.push((job, commit));
            }
            Some((last, Message::Job(..))) if last.same_channel(&tx) => {
                let Some((_, Message::Job(first, first_commit))) = messages.pop() else {
                    unreachable!("matched just above")
                };
                messages.push((tx, Message::Jobs(vec![(first, first_commit), (job, commit)])));
            }
            _ => messages.push((tx, Message::Job(job, commit))),
        }
    }
    messages
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rusqlite::Connection;

    use super::super::{Commit, DB_FILE, Durability, Ledger, Pending};
    use super::*;

    /// Queues a write, waits long enough for the ledger thread to commit it alone, then
    /// queues a call that counts, from a second connection, the committed copies of that
    /// write: 0 when both calls share one transaction.
    async fn two_calls(ledger: &Ledger, dir: &std::path::Path) -> (Pending<()>, Pending<i64>) {
        let write = ledger
            .queue_with(Commit::Deferred, |txn| {
                txn.execute("INSERT INTO meta (key, value) VALUES ('cork', 'a')", [])?;
                Ok(())
            })
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let path = dir.join(DB_FILE);
        let count = ledger
            .queue_with(Commit::Deferred, move |_txn| {
                let other = Connection::open(&path)?;
                Ok(other.query_row("SELECT count(*) FROM meta WHERE key = 'cork'", [], |row| {
                    row.get::<_, i64>(0)
                })?)
            })
            .await;
        (write, count)
    }

    #[tokio::test]
    async fn a_corked_task_s_calls_share_one_commit() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), Durability::Full).unwrap();
        // Not corked: the first call was committed by itself before the second ran.
        let (write, count) = two_calls(&ledger, dir.path()).await;
        write.answer().await.unwrap();
        assert_eq!(count.answer().await.unwrap(), 1);
        ledger
            .call(|txn| Ok(txn.execute("DELETE FROM meta WHERE key = 'cork'", [])?))
            .await
            .unwrap();
        // Corked: both are sent when the task ends, and run in one transaction.
        let (write, count) = corked(async {
            let calls = two_calls(&ledger, dir.path()).await;
            release().await;
            calls
        })
        .await;
        write.answer().await.unwrap();
        assert_eq!(count.answer().await.unwrap(), 0);
        ledger.close().await;
    }

    #[tokio::test]
    async fn an_answer_awaited_in_a_corked_task_releases_what_it_holds() {
        let ledger = Ledger::in_memory().unwrap();
        let answered = corked(async {
            let first = ledger.queue_with(Commit::Deferred, |_| Ok(1)).await;
            let second = ledger.queue_with(Commit::Deferred, |_| Ok(2)).await;
            // Would wait forever if the calls stayed held.
            tokio::time::timeout(Duration::from_secs(10), async {
                (first.answer().await.unwrap(), second.answer().await.unwrap())
            })
            .await
        })
        .await;
        assert_eq!(answered, Ok((1, 2)));
    }

    #[tokio::test]
    async fn a_corked_task_dropped_while_it_holds_calls_still_queues_them() {
        let ledger = Ledger::in_memory().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stuck = corked(async {
            let _ = tx.send(ledger.queue_with(Commit::Deferred, |_| Ok(7)).await);
            std::future::pending::<()>().await;
        });
        assert!(tokio::time::timeout(Duration::from_millis(50), stuck).await.is_err());
        assert_eq!(rx.await.unwrap().answer().await, Ok(7));
    }

    #[tokio::test]
    async fn a_corked_task_holds_at_most_limit_calls() {
        let ledger = Ledger::in_memory().unwrap();
        let (counted, pending) = corked(async {
            let mut pending = Vec::new();
            for n in 0..=LIMIT {
                pending.push(ledger.queue_with(Commit::Deferred, move |_| Ok(n)).await);
            }
            let counted = HELD.with(|held| held.borrow().jobs.len());
            release().await;
            (counted, pending)
        })
        .await;
        // The call past the limit sent the first LIMIT, then itself.
        assert_eq!(counted, 0);
        for (n, call) in pending.into_iter().enumerate() {
            assert_eq!(call.answer().await.unwrap(), n);
        }
    }
}
