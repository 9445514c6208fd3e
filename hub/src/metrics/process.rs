//! Process metrics in the standard names every Prometheus client exports
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`, …),
//! read from `/proc/self` at each scrape. `prometheus-client` has no process collector; on a
//! system without `/proc` the collector exports nothing.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// What `/proc/self` says about this process.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSample {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub start_time_seconds: f64,
    pub threads: u64,
}

/// Parses `/proc/self/stat` (`ticks` per second, `page` bytes, `boot_time` seconds since the
/// epoch). The command name may hold spaces and parentheses: fields are counted after the
/// last `)`. Pure.
pub fn parse_stat(stat: &str, ticks: f64, page: u64, boot_time: u64) -> Option<ProcessSample> {
    let after = &stat[stat.rfind(')')? + 1..];
    // `after` starts at field 3 (state); utime is field 14.
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let (utime, stime) = (field(14)?, field(15)?);
    Some(ProcessSample {
        cpu_seconds: (utime + stime) as f64 / ticks,
        threads: field(20)?,
        start_time_seconds: boot_time as f64 + field(22)? as f64 / ticks,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)? * page,
    })
}

/// `btime` of `/proc/stat`: when the machine booted, in seconds since the epoch. Pure.
pub fn parse_boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

/// Reads the process metrics at each scrape.
#[derive(Debug)]
pub struct ProcessCollector {
    ticks: f64,
    page: u64,
    boot_time: Option<u64>,
}

impl Default for ProcessCollector {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessCollector {
    pub fn new() -> Self {
        // SAFETY: sysconf reads a constant of the system.
        let (ticks, page) =
            unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        Self {
            ticks: if ticks > 0 { ticks as f64 } else { 100.0 },
            page: if page > 0 { page as u64 } else { 4096 },
            boot_time: std::fs::read_to_string("/proc/stat")
                .ok()
                .as_deref()
                .and_then(parse_boot_time),
        }
    }

    fn sample(&self) -> Option<ProcessSample> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        parse_stat(&stat, self.ticks, self.page, self.boot_time?)
    }
}

fn open_fds() -> Option<u64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

fn max_fds() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    ok.then_some(limit.rlim_cur)
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(sample) = self.sample() {
            let cpu = ConstCounter::new(sample.cpu_seconds);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent",
                Some(&Unit::Seconds),
                cpu.metric_type(),
            )?)?;
            gauge(
                &mut encoder,
                "process_resident_memory",
                "Resident memory size",
                Some(&Unit::Bytes),
                sample.resident_bytes as f64,
            )?;
            gauge(
                &mut encoder,
                "process_virtual_memory",
                "Virtual memory size",
                Some(&Unit::Bytes),
                sample.virtual_bytes as f64,
            )?;
            gauge(
                &mut encoder,
                "process_start_time",
                "Start time of the process since the Unix epoch",
                Some(&Unit::Seconds),
                sample.start_time_seconds,
            )?;
            gauge(&mut encoder, "process_threads", "OS threads", None, sample.threads as f64)?;
        }
        if let Some(open) = open_fds() {
            // The directory handle used to count is itself one of them.
            let open = open.saturating_sub(1);
            gauge(&mut encoder, "process_open_fds", "Open file descriptors", None, open as f64)?;
        }
        if let Some(max) = max_fds() {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                max as f64,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with spaces and a parenthesis, as a process may call itself.
        let stat = "4242 (chan (d) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 50 0 0 20 0 3 0 \
                    1000 123456789 2000 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 \
                    0 0";
        let sample = parse_stat(stat, 100.0, 4096, 1_700_000_000).expect("parsed");
        assert_eq!(sample.cpu_seconds, 2.0);
        assert_eq!(sample.threads, 3);
        assert_eq!(sample.start_time_seconds, 1_700_000_010.0);
        assert_eq!(sample.virtual_bytes, 123_456_789);
        assert_eq!(sample.resident_bytes, 2000 * 4096);
    }

    #[test]
    fn boot_time_comes_from_btime() {
        assert_eq!(
            parse_boot_time("cpu 1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        assert_eq!(parse_boot_time("cpu 1 2 3\n"), None);
    }

    #[test]
    fn this_process_is_sampled() {
        let sample = ProcessCollector::new().sample().expect("/proc/self/stat readable");
        assert!(sample.resident_bytes > 0);
        assert!(sample.threads >= 1);
    }
}
