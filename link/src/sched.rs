//! The CPU scheduling policy of a process that moves its threads to `SCHED_BATCH` (the hub,
//! `hub.cpu_scheduling = "batch"`), and the processes it starts, which go back to the policy
//! it was started with.
//!
//! A woken `SCHED_BATCH` thread does not preempt the one running on its CPU: it runs when that
//! one blocks or its time slice ends. The hub's threads hand work to each other per message
//! (the async worker to the ledger thread, the ledger thread's answers back); under the
//! default policy each hand-over on a busy CPU preempts the thread that made it, halfway
//! through its batch. The price is latency when every CPU is busy with other work: a woken
//! hub thread waits for the running task's slice (a few milliseconds) instead of taking the
//! CPU at once.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether [`batch_threads`] moved this process's threads; [`restore_in_child`] reads it.
static BATCHED: AtomicBool = AtomicBool::new(false);

/// What [`batch_threads`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batched {
    /// These many threads now run under `SCHED_BATCH`; threads they start inherit it.
    Moved { threads: usize },
    /// The process was started under another policy than the default (`SCHED_OTHER`), set
    /// from outside (systemd's `CPUSchedulingPolicy=`, `chrt`): left as it is.
    LeftAsStarted { policy: i32 },
}

/// The policy of thread `tid` (of any process; `0` for the calling thread): `libc::SCHED_*`,
/// without the reset-on-fork flag.
pub fn policy_of(tid: i32) -> std::io::Result<i32> {
    // SAFETY: plain syscall on a thread of this process.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(policy & !libc::SCHED_RESET_ON_FORK)
}

/// Moves every thread of this process to `SCHED_BATCH` when the process runs under the
/// default policy; threads started afterwards inherit it from the thread that starts them.
/// Call it early, while the threads are the ones the process starts with. Processes started
/// afterwards get the default policy back when they call [`restore_in_child`] before `exec`.
/// Needs no privilege.
pub fn batch_threads() -> std::io::Result<Batched> {
    let policy = policy_of(0)?;
    if policy != libc::SCHED_OTHER {
        return Ok(Batched::LeftAsStarted { policy });
    }
    // Before the first move: a child forked meanwhile goes back to the default either way.
    BATCHED.store(true, Ordering::Relaxed);
    let param = libc::sched_param { sched_priority: 0 };
    let mut threads = 0;
    for entry in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?.file_name().to_str().and_then(|name| name.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: plain syscall on a thread of this process, with a parameter we own.
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_BATCH, &param) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ESRCH) {
                // The thread ended since the listing.
                continue;
            }
            return Err(err);
        }
        threads += 1;
    }
    Ok(Batched::Moved { threads })
}

/// In a child between `fork` and `exec` (async-signal-safe: one atomic load, one syscall):
/// back to the default policy when this process moved its threads to `SCHED_BATCH`, so the
/// programs it starts (drivers, agents) run as they would have without it.
pub fn restore_in_child() -> std::io::Result<()> {
    if !BATCHED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread, with a parameter we own.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    use super::*;

    /// The policy of every thread of this process.
    fn thread_policies() -> Vec<i32> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|entry| entry.unwrap().file_name().to_str()?.parse().ok())
            .map(|tid| policy_of(tid).unwrap())
            .collect()
    }

    /// One test for the whole sequence: it changes this test process's policy (each test runs
    /// in a process of its own under nextest; under `cargo test` nothing else here asserts a
    /// policy).
    #[test]
    fn threads_batch_and_children_return_to_the_default() {
        assert_eq!(policy_of(0).unwrap(), libc::SCHED_OTHER, "the test starts under the default");
        // A thread started before the move is moved too; one started after inherits it.
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let before = std::thread::spawn(move || stopped.recv());
        let Batched::Moved { threads } = batch_threads().unwrap() else {
            panic!("the default policy is moved")
        };
        assert!(threads >= 2, "{threads} threads moved");
        let after = std::thread::spawn(|| policy_of(0).unwrap()).join().unwrap();
        assert_eq!(after, libc::SCHED_BATCH);
        assert!(
            thread_policies().iter().all(|&p| p == libc::SCHED_BATCH),
            "{:?}",
            thread_policies()
        );
        stop.send(()).unwrap();
        before.join().unwrap().unwrap();

        // A child that restores runs under the default; one that does not inherits the batch.
        let child_policy = |restore: bool| {
            let mut command = Command::new("sleep");
            command.arg("5");
            if restore {
                // SAFETY: restore_in_child is async-signal-safe.
                unsafe { command.pre_exec(restore_in_child) };
            }
            let mut child = command.spawn().unwrap();
            let policy = policy_of(i32::try_from(child.id()).unwrap()).unwrap();
            child.kill().unwrap();
            child.wait().unwrap();
            policy
        };
        assert_eq!(child_policy(true), libc::SCHED_OTHER);
        assert_eq!(child_policy(false), libc::SCHED_BATCH);

        // A policy set from outside is left as it is.
        assert_eq!(batch_threads().unwrap(), Batched::LeftAsStarted { policy: libc::SCHED_BATCH });
    }
}
