//! The bench's results: medians and ratios per backend, the machine, and the Markdown table.

use super::measure::{Run, median};
use super::options::{Contender, Options};
use inbox_testkit::Backend;
use serde_json::{Value, json};

/// One backend's medians per contender, the ratios to contender 1, and every run.
pub fn backend_report(
    backend: Backend,
    options: &Options,
    runs: &[Run],
    scale: &[(u64, Run)],
) -> Value {
    let med = |c: Contender, f: &dyn Fn(&Run) -> Option<f64>| {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| r.contender == c)
            .filter_map(f)
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    let base = med(Contender::Loop, &|r| Some(r.msgs_per_s));
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
                "latency_p50_us": med(c, &|r| Some(r.latency_p50_us)),
                "latency_p99_us": med(c, &|r| Some(r.latency_p99_us)),
                "consumer_cpu_us_per_msg": med(c, &|r| Some(r.consumer_cpu_us)),
                "nats_cpu_us_per_msg": med(c, &|r| r.nats_cpu_us),
                "peak_rss_mib": med(c, &|r| Some(r.peak_rss_mib)),
            })
        })
        .collect();
    let all: Vec<Value> = runs
        .iter()
        .map(|r| {
            json!({
                "contender": r.contender.name(),
                "round": r.round,
                "msgs_per_s": r.msgs_per_s,
                "latency_p50_us": r.latency_p50_us,
                "latency_p99_us": r.latency_p99_us,
                "consumer_cpu_us_per_msg": r.consumer_cpu_us,
                "nats_cpu_us_per_msg": r.nats_cpu_us,
                "peak_rss_mib": r.peak_rss_mib,
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
        "contenders": contenders,
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

/// The results as a Markdown table.
pub fn table(results: &Value) -> String {
    let mut out = String::new();
    let n = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or("-".to_owned(), |x| format!("{x:.digits$}"))
    };
    for b in results["backends"].as_array().into_iter().flatten() {
        out += &format!(
            "\n**{}** ({} messages, concurrency {}, median of {} rounds)\n\n",
            b["backend"].as_str().unwrap_or(""),
            results["messages"],
            b["concurrency"],
            results["rounds"]
        );
        out += "| contender | msgs/s | x loop | p50 ms | p99 ms | consumer CPU us/msg | nats-server CPU us/msg | peak RSS MiB |\n";
        out += "|---|---:|---:|---:|---:|---:|---:|---:|\n";
        for c in b["contenders"].as_array().into_iter().flatten() {
            let ms = |v: &Value| {
                v.as_f64()
                    .map_or("-".to_owned(), |x| format!("{:.1}", x / 1000.0))
            };
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                c["describe"].as_str().unwrap_or(""),
                n(&c["msgs_per_s"], 0),
                n(&c["ratio_to_loop"], 2),
                ms(&c["latency_p50_us"]),
                ms(&c["latency_p99_us"]),
                n(&c["consumer_cpu_us_per_msg"], 0),
                n(&c["nats_cpu_us_per_msg"], 0),
                n(&c["peak_rss_mib"], 1),
            );
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
