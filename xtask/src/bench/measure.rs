//! What one run of a contender measures, and how: CPU time and peak memory from `/proc`,
//! percentiles and medians.

use super::options::{Contender, Workload};

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Run {
    /// Who ran.
    pub contender: Contender,
    /// On which workload.
    pub workload: Workload,
    /// In how many consumer processes (the loop: at that many times the concurrency).
    pub processes: usize,
    /// In which round (0 for the claim-latency runs at an inbox size).
    pub round: usize,
    /// Throughput draining the backlog.
    pub msgs_per_s: f64,
    /// Publish-to-commit latency of the paced messages, median (one process only).
    pub latency_p50_us: Option<f64>,
    /// The same, 99th percentile.
    pub latency_p99_us: Option<f64>,
    /// The consumer processes' CPU time per message, all of them together.
    pub consumer_cpu_us: f64,
    /// nats-server's CPU time per message (none for the loop, which has no NATS).
    pub nats_cpu_us: Option<f64>,
    /// The database server's CPU time per message, all its processes together (none for
    /// SQLite, which runs in the consumer's process).
    pub db_cpu_us: Option<f64>,
    /// The largest peak RSS of the consumer processes.
    pub peak_rss_mib: f64,
    /// The loop's median claim time.
    pub claim_p50_us: Option<f64>,
    /// Deadlocks the database counted during the run (PostgreSQL: the run's database;
    /// MySQL/MariaDB: the server's `Innodb_deadlocks`); `None` for SQLite.
    pub deadlocks: Option<u64>,
    /// `credit`'s batches: tries ended by a conflict, and tries again, over every process.
    pub conflicts: Option<(u64, u64)>,
    /// How long the relays went on after the consumer was drained (every message acked) until
    /// the last outbox row was sent: when it is a large part of the run, the relay bounds it.
    /// None for the loop, which relays nothing.
    pub relay_tail_ms: Option<f64>,
}

/// The run's figures on one line, as the bench reports its progress.
pub fn summary(run: &Run) -> String {
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.1} ms", v / 1000.0));
    format!(
        "{:.0} msg/s, p50 {}, p99 {}, consumer {:.0} us/msg, nats-server {}, database {}, peak RSS {:.1} MiB, deadlocks {}, conflicts/retries {}{}{}",
        run.msgs_per_s,
        ms(run.latency_p50_us),
        ms(run.latency_p99_us),
        run.consumer_cpu_us,
        run.nats_cpu_us
            .map_or("-".to_owned(), |c| format!("{c:.0} us/msg")),
        run.db_cpu_us
            .map_or("-".to_owned(), |c| format!("{c:.0} us/msg")),
        run.peak_rss_mib,
        run.deadlocks.map_or("-".to_owned(), |d| d.to_string()),
        run.conflicts
            .map_or("-".to_owned(), |(c, r)| format!("{c}/{r}")),
        run.claim_p50_us
            .map_or(String::new(), |c| format!(", claim p50 {c:.0} us")),
        run.relay_tail_ms
            .map_or(String::new(), |t| format!(", relay tail {t:.0} ms")),
    )
}

/// CPU time and peak memory of a process, from `/proc`.
pub struct Usage {
    /// User and system CPU time, in seconds.
    pub cpu_s: f64,
    /// Peak resident memory (`VmHWM`).
    pub peak_rss_mib: f64,
}

/// The CPU time and peak memory of process `pid` so far; `tick` is [`clock_tick`]'s.
pub fn usage(pid: u32, tick: f64) -> Result<Usage, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    // The fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let (Some(user), Some(system)) = (ticks(11), ticks(12)) else {
        return Err(format!("/proc/{pid}/stat: no utime and stime in {stat:?}"));
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let hwm_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .ok_or_else(|| format!("/proc/{pid}/status: no VmHWM"))?;
    Ok(Usage {
        cpu_s: (user + system) / tick,
        peak_rss_mib: hwm_kib / 1024.0,
    })
}

/// The CPU time, in seconds, of every process whose name (`/proc/<pid>/comm`) is one of
/// `names`: a database server's, all its processes (PostgreSQL's backends) together. A process
/// that ends while the list is read is left out; one that ended during a run takes its CPU time
/// with it, so the figure is a floor (the contenders' connections live for the whole run).
pub fn server_cpu(names: &[&str], tick: f64) -> Result<f64, String> {
    let proc = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    let mut cpu = 0.0;
    for entry in proc.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        if names.contains(&comm.trim_end()) {
            // Gone since listed: left out.
            if let Ok(u) = usage(pid, tick) {
                cpu += u.cpu_s;
            }
        }
    }
    Ok(cpu)
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s CPU times.
pub fn clock_tick() -> Result<f64, String> {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))
}

/// The p50 and p99 of `samples` (0 when there are none).
pub fn percentiles(mut samples: Vec<f64>) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

/// The median of `values` (NaN when there are none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentiles(v), (51.0, 99.0));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
    }

    #[test]
    fn server_cpu_counts_the_named_processes() {
        let tick = clock_tick().unwrap();
        let comm = std::fs::read_to_string("/proc/self/comm").unwrap();
        // This test's own thread busy for a while: its process is counted, nothing else is.
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(start.elapsed());
        }
        let mine = server_cpu(&[comm.trim_end()], tick).unwrap();
        assert!(mine > 0.0, "{comm:?} used no CPU");
        assert_eq!(server_cpu(&["no-such-process-name"], tick).unwrap(), 0.0);
    }

    #[test]
    fn usage_of_this_process_is_read() {
        let u = usage(std::process::id(), clock_tick().unwrap()).unwrap();
        assert!(u.peak_rss_mib > 0.0);
        assert!(u.cpu_s >= 0.0);
    }
}
