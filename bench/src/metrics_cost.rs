//! `channeld-bench metrics-cost`: the hub's CPU time per inbound message (driver → echo →
//! deliver) with metrics off and on (`hub.metrics_listen` set: every message counted in the
//! Prometheus families), in alternating runs so drift on a shared machine hits both alike.
//! Scrapes are not part of it: one scrape a few seconds costs the same whatever the traffic.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::driver::DriverProc;
use crate::hub::{HubProc, HubSpec, MAIN_INSTANCE, any_health};
use crate::procs::cpu_time;
use crate::stats::Plan;

/// One run: hub CPU µs per message and how many messages it took.
fn run(bin_dir: &Path, metrics: bool, ledger: bool, measure: Duration) -> Result<(f64, u64)> {
    let dir = tempfile::Builder::new().prefix("channeld-bench-metrics-").tempdir()?;
    let spec = HubSpec { ledger, extra_instances: Vec::new(), durability_normal: false, metrics };
    let mut hub = HubProc::start(bin_dir, dir.path(), &spec)?;
    let mut driver = DriverProc::start(
        MAIN_INSTANCE,
        &hub.socket(MAIN_INSTANCE),
        &dir.path().join("driver.log"),
    )?;
    hub.wait_connected(&[MAIN_INSTANCE], Duration::from_secs(120), any_health)?;
    // Warm up (connections, caches), then measure.
    driver.inbound(Plan { window: 64, warmup: 0, measure: Duration::from_millis(300) }, "warm")?;
    let before = cpu_time(hub.pid())?;
    let sample = driver.inbound(Plan { window: 64, warmup: 0, measure }, "measure")?;
    let spent = cpu_time(hub.pid())? - before;
    driver.stop()?;
    hub.proc.stop(Duration::from_secs(60))?;
    Ok((spent.as_secs_f64() * 1e6 / sample.total.max(1) as f64, sample.total))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs `reps` pairs (off, on) for each ledger setting and prints the medians.
pub fn metrics_cost(bin_dir: &Path, reps: usize, measure: Duration) -> Result<()> {
    println!("| ledger | metrics off, hub CPU µs/msg | metrics on, hub CPU µs/msg | difference |");
    println!("|---|---|---|---|");
    for ledger in [false, true] {
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for rep in 0..reps {
            for metrics in [false, true] {
                let (cpu, messages) = run(bin_dir, metrics, ledger, measure)?;
                eprintln!(
                    "channeld-bench [metrics-cost] ledger={ledger} metrics={metrics} rep {rep}: {cpu:.2} µs/msg ({messages} messages)"
                );
                if metrics { on.push(cpu) } else { off.push(cpu) }
            }
        }
        let (off, on) = (median(&mut off), median(&mut on));
        let ledger = if ledger { "on" } else { "off" };
        println!("| {ledger} | {off:.2} | {on:.2} | {:+.1} % |", (on - off) / off * 100.0);
    }
    Ok(())
}
