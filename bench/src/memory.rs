//! Resident size of idle driver processes, one per family that can run here, each connected
//! to a hub (and to its broker, for the broker families) and then left alone.

use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::broker::{Mosquitto, RabbitMq};
use crate::hub::{HubProc, HubSpec, MAIN_INSTANCE, any_health, transport_connected};
use crate::procs::{Proc, rss_kib};
use crate::report::DriverMemory;

/// How long a driver sits idle after connecting before its resident size is read.
fn idle_period(quick: bool) -> Duration {
    if quick { Duration::from_millis(100) } else { Duration::from_secs(2) }
}

/// Measures every driver family found in `bin_dir`. AMQP needs RabbitMQ, started only with
/// `with_rabbitmq` (it takes seconds to boot).
pub fn run_memory(bin_dir: &Path, quick: bool, with_rabbitmq: bool) -> Result<Vec<DriverMemory>> {
    let dir = tempfile::Builder::new().prefix("channeld-bench-mem-").tempdir()?;
    let broker_dir = dir.path().join("mosquitto");
    std::fs::create_dir_all(&broker_dir)?;
    let mut broker = Mosquitto::start(&broker_dir, false)?;
    let hub_dir = dir.path().join("hub");
    std::fs::create_dir_all(&hub_dir)?;
    let families = ["console.idle", "mqtt.idle", "amqp.idle"];
    let spec = HubSpec {
        ledger: false,
        extra_instances: families.iter().map(|s| s.to_string()).collect(),
        durability_normal: false,
        metrics: false,
    };
    let mut hub = HubProc::start(bin_dir, &hub_dir, &spec)?;
    let mut results = Vec::new();
    let idle = idle_period(quick);

    let exe = std::env::current_exe()?;
    let mut bench = spawn(&exe, &["driver"], MAIN_INSTANCE, &hub, &hub_dir, &[])?;
    results.push(measure(
        &mut hub,
        &mut bench,
        "bench (minimal SDK driver)",
        &exe,
        any_health,
        idle,
        "",
    )?);

    match bin_dir.join("channeld-console") {
        path if path.is_file() => {
            let mut console = spawn(&path, &[], "console.idle", &hub, &hub_dir, &[])?;
            let note = "stdin open, nothing typed";
            results.push(measure(
                &mut hub,
                &mut console,
                "console",
                &path,
                any_health,
                idle,
                note,
            )?);
        }
        path => results.push(missing("console", &path)),
    }

    match bin_dir.join("channeld-mqtt") {
        path if path.is_file() => {
            let url = format!("mqtt://127.0.0.1:{}", broker.port);
            let env = [("CHANNELD_MQTT_URL", url.as_str())];
            let mut mqtt = spawn(&path, &[], "mqtt.idle", &hub, &hub_dir, &env)?;
            let note = "connected to the bench's mosquitto, subscribed";
            results.push(measure(
                &mut hub,
                &mut mqtt,
                "mqtt",
                &path,
                transport_connected,
                idle,
                note,
            )?);
        }
        path => results.push(missing("mqtt", &path)),
    }

    match bin_dir.join("channeld-amqp") {
        path if !path.is_file() => results.push(missing("amqp", &path)),
        path if !with_rabbitmq => results.push(DriverMemory {
            family: "amqp".into(),
            binary: path.display().to_string(),
            rss_kib: None,
            threads: None,
            rss_anon_kib: None,
            note: "not measured by default: RabbitMQ needs ~11 s to boot here; `scripts/bench --amqp` includes it".into(),
        }),
        path => {
            let rabbit_dir = dir.path().join("rabbitmq");
            std::fs::create_dir_all(&rabbit_dir)?;
            match RabbitMq::start(&rabbit_dir) {
                Ok(rabbit) => {
                    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
                    let env = [("CHANNELD_AMQP_URL", url.as_str()), ("CHANNELD_AMQP_QUEUE", "bench-idle")];
                    let mut amqp = spawn(&path, &[], "amqp.idle", &hub, &hub_dir, &env)?;
                    let note = "connected to a RabbitMQ the bench started, consuming";
                    results.push(measure(&mut hub, &mut amqp, "amqp", &path, transport_connected, idle, note)?);
                    amqp.proc.stop(Duration::from_secs(10))?;
                    drop(rabbit);
                }
                Err(err) => results.push(DriverMemory {
                    family: "amqp".into(),
                    binary: path.display().to_string(),
                    rss_kib: None,
                    threads: None,
                    rss_anon_kib: None,
                    note: format!("not measured: {err:#}"),
                }),
            }
        }
    }
    hub.proc.stop(Duration::from_secs(15))?;
    broker.proc.stop(Duration::from_secs(5))?;
    Ok(results)
}

/// A driver process; its stdin stays open (the console driver ends at end of input).
struct Spawned {
    proc: Proc,
    _stdin: Option<ChildStdin>,
}

fn spawn(
    binary: &Path,
    args: &[&str],
    instance: &str,
    hub: &HubProc,
    dir: &Path,
    env: &[(&str, &str)],
) -> Result<Spawned> {
    let log = dir.join(format!("{instance}.log"));
    let mut child: Child = Command::new(binary)
        .args(args)
        .env("CHANNELD_CHANNEL_ID", instance)
        .env("CHANNELD_SOCKET", hub.socket(instance))
        .env("CHANNELD_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("start {}", binary.display()))?;
    let stdin = child.stdin.take();
    Ok(Spawned { proc: Proc::new(instance, child, Some(log)), _stdin: stdin })
}

fn measure(
    hub: &mut HubProc,
    driver: &mut Spawned,
    family: &str,
    binary: &Path,
    healthy: fn(&Value) -> bool,
    idle: Duration,
    note: &str,
) -> Result<DriverMemory> {
    let instance = driver.proc.name.clone();
    hub.wait_connected(&[instance.as_str()], Duration::from_secs(30), healthy)
        .with_context(|| format!("{family} driver{}", driver.proc.log_tail()))?;
    // Idle time, not synchronisation: the driver is connected; this lets it settle.
    std::thread::sleep(idle);
    driver.proc.check_alive()?;
    let rss = rss_kib(driver.proc.pid())?;
    eprintln!("channeld-bench [memory] idle {family} driver: {:.1} MiB", rss as f64 / 1024.0);
    Ok(DriverMemory {
        family: family.into(),
        binary: binary.display().to_string(),
        rss_kib: Some(rss),
        threads: crate::procs::threads(driver.proc.pid()).ok(),
        rss_anon_kib: crate::procs::rss_anon_kib(driver.proc.pid()).ok(),
        note: note.into(),
    })
}

fn missing(family: &str, path: &Path) -> DriverMemory {
    DriverMemory {
        family: family.into(),
        binary: path.display().to_string(),
        rss_kib: None,
        threads: None,
        rss_anon_kib: None,
        note: format!("not measured: {} is not built", path.display()),
    }
}
