//! The bench's results: medians and ratios per backend, the machine, and the Markdown table.

use super::measure::{Run, median};
use super::options::{Contender, Options};
use inbox_testkit::Backend;
use serde_json::{Value, json};

/// One backend's medians per workload, process count and contender, the ratios to the loop
/// (the database's limit at the same total concurrency) and to the hand-written consumer, and
/// every run.
pub fn backend_report(
    backend: Backend,
    options: &Options,
    runs: &[Run],
    scale: &[(u64, Run)],
) -> Value {
    let mut groups = Vec::new();
    for &workload in &options.workloads {
        for &processes in &options.processes {
            let of = |c: Contender| {
                runs.iter()
                    .filter(move |r| {
                        r.contender == c && r.workload == workload && r.processes == processes
                    })
                    .collect::<Vec<_>>()
            };
            let med = |c: Contender, f: &dyn Fn(&Run) -> Option<f64>| {
                let v: Vec<f64> = of(c).into_iter().filter_map(f).collect();
                (!v.is_empty()).then(|| median(v))
            };
            let sum = |c: Contender, f: &dyn Fn(&Run) -> Option<u64>| {
                let v: Vec<u64> = of(c).into_iter().filter_map(f).collect();
                (!v.is_empty()).then(|| v.iter().sum::<u64>())
            };
            let base = med(Contender::Loop, &|r| Some(r.msgs_per_s));
            let hand = med(Contender::Handwritten, &|r| Some(r.msgs_per_s));
            let contenders: Vec<Value> = options
                .contenders
                .iter()
                .map(|&c| {
                    let rate = med(c, &|r| Some(r.msgs_per_s));
                    json!({
                        "contender": c.name(),
                        "describe": c.describe(),
                        "msgs_per_s": rate,
                        "ratio_to_loop": rate.zip(base).map(|(r, b)| r / b),
                        "ratio_to_handwritten": rate.zip(hand).map(|(r, h)| r / h),
                        "latency_p50_us": med(c, &|r| r.latency_p50_us),
                        "latency_p99_us": med(c, &|r| r.latency_p99_us),
                        "consumer_cpu_us_per_msg": med(c, &|r| Some(r.consumer_cpu_us)),
                        "nats_cpu_us_per_msg": med(c, &|r| r.nats_cpu_us),
                        "db_cpu_us_per_msg": med(c, &|r| r.db_cpu_us),
                        "peak_rss_mib": med(c, &|r| Some(r.peak_rss_mib)),
                        "deadlocks": sum(c, &|r| r.deadlocks),
                        "conflicts": sum(c, &|r| r.conflicts.map(|(c, _)| c)),
                        "batch_retries": sum(c, &|r| r.conflicts.map(|(_, r)| r)),
                        "relay_tail_ms": med(c, &|r| r.relay_tail_ms),
                    })
                })
                .collect();
            groups.push(json!({
                "workload": workload.name(),
                "accounts": workload.accounts(),
                "processes": processes,
                "contenders": contenders,
            }));
        }
    }
    let all: Vec<Value> = runs
        .iter()
        .map(|r| {
            json!({
                "contender": r.contender.name(),
                "workload": r.workload.name(),
                "processes": r.processes,
                "round": r.round,
                "msgs_per_s": r.msgs_per_s,
                "latency_p50_us": r.latency_p50_us,
                "latency_p99_us": r.latency_p99_us,
                "consumer_cpu_us_per_msg": r.consumer_cpu_us,
                "nats_cpu_us_per_msg": r.nats_cpu_us,
                "db_cpu_us_per_msg": r.db_cpu_us,
                "peak_rss_mib": r.peak_rss_mib,
                "deadlocks": r.deadlocks,
                "conflicts": r.conflicts.map(|(c, _)| c),
                "batch_retries": r.conflicts.map(|(_, r)| r),
                "relay_tail_ms": r.relay_tail_ms,
            })
        })
        .collect();
    let scale: Vec<Value> = scale
        .iter()
        .map(|(rows, r)| {
            json!({
                "inbox_rows": rows,
                "claim_p50_us": r.claim_p50_us,
                "msgs_per_s": r.msgs_per_s,
            })
        })
        .collect();
    json!({
        "backend": backend.name(),
        "concurrency": if backend == Backend::Sqlite { 1 } else { options.concurrency },
        "groups": groups,
        "claim_scale": scale,
        "runs": all,
    })
}

/// The machine the figures come from: its CPU model and core count.
pub fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
    })
}

/// The results as Markdown tables, one per backend.
pub fn table(results: &Value) -> String {
    let mut out = String::new();
    let n = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or("-".to_owned(), |x| format!("{x:.digits$}"))
    };
    let ms = |v: &Value| {
        v.as_f64()
            .map_or("-".to_owned(), |x| format!("{:.1}", x / 1000.0))
    };
    for b in results["backends"].as_array().into_iter().flatten() {
        out += &format!(
            "\n**{}** ({} messages per run, concurrency {} per process, batches of {}, median of {} rounds{})\n\n",
            b["backend"].as_str().unwrap_or(""),
            results["messages"],
            b["concurrency"],
            results["batch"],
            results["rounds"],
            match results["db_latency_us"].as_u64() {
                Some(us) if us > 0 && b["backend"] != "sqlite" => {
                    format!(", {us} µs each way to the database")
                }
                _ => String::new(),
            }
        );
        out += "| workload | processes | contender | msgs/s | x loop | x hand-written | p50 ms | p99 ms | consumer CPU us/msg | nats-server CPU us/msg | database CPU us/msg | peak RSS MiB | deadlocks | conflicts / retries |\n";
        out += "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for g in b["groups"].as_array().into_iter().flatten() {
            for c in g["contenders"].as_array().into_iter().flatten() {
                let conflicts = match (c["conflicts"].as_u64(), c["batch_retries"].as_u64()) {
                    (Some(c), Some(r)) => format!("{c} / {r}"),
                    _ => "-".to_owned(),
                };
                out += &format!(
                    "| {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    g["workload"].as_str().unwrap_or(""),
                    g["accounts"],
                    g["processes"],
                    c["describe"].as_str().unwrap_or(""),
                    n(&c["msgs_per_s"], 0),
                    n(&c["ratio_to_loop"], 2),
                    n(&c["ratio_to_handwritten"], 2),
                    ms(&c["latency_p50_us"]),
                    ms(&c["latency_p99_us"]),
                    n(&c["consumer_cpu_us_per_msg"], 0),
                    n(&c["nats_cpu_us_per_msg"], 0),
                    n(&c["db_cpu_us_per_msg"], 0),
                    n(&c["peak_rss_mib"], 1),
                    c["deadlocks"]
                        .as_u64()
                        .map_or("-".to_owned(), |d| d.to_string()),
                    conflicts,
                );
            }
        }
        let scale = b["claim_scale"].as_array().cloned().unwrap_or_default();
        if !scale.is_empty() {
            out += "\n| markers in the inbox | claim p50 us | loop msgs/s |\n|---:|---:|---:|\n";
            for s in scale {
                out += &format!(
                    "| {} | {} | {} |\n",
                    s["inbox_rows"],
                    n(&s["claim_p50_us"], 0),
                    n(&s["msgs_per_s"], 0)
                );
            }
        }
    }
    out
}
