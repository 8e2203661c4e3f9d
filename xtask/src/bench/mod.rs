//! `cargo xtask bench`: the framework side by side with what it replaces, in one run on one
//! machine, so that what is reported is a ratio (absolute figures drift with the machine).
//!
//! The contenders, all doing the same writes as `credit` (a marker in the inbox table, a balance
//! upsert in `accounts` and an outbox row announcing it, one transaction per message unless
//! batched):
//! 1. `loop`: the database's limit, a hand-written sqlx loop at concurrency C, no NATS
//!    (`baseline loop`), the same transaction as pgbench would run it;
//! 2. `handwritten`: a hand-written async-nats + sqlx consumer with a hand-written relay that
//!    publishes the outbox rows and marks them sent (`baseline consumer`);
//! 3. `inbox`: `credit`, one transaction per message;
//! 4. `inbox-batched`: `credit` with `CREDIT_BATCH` (its handler's lane is the account).
//!
//! Each runs on every workload: `hot` (credits round-robin over 40 accounts, where concurrent
//! transactions meet on the same rows) and `spread` (1,000 accounts); and with 1 and 3 consumer
//! processes on one durable consumer (the loop instead runs at 1 and 3 times the concurrency,
//! the database's limit at the same total concurrency). Every run reports the deadlocks the
//! database counted (PostgreSQL: the run's database; MySQL: the server's `Innodb_deadlocks`) and
//! `credit`'s batch conflicts and retries.
//!
//! Each run gets a fresh database and a fresh stream on one private nats-server. A consumer run
//! drains a backlog of N messages, published while its processes, started and pulling, are
//! frozen (SIGSTOP), and timed from the moment they are let go (SIGCONT) until every message is
//! acked and every outbox row relayed (throughput, CPU per message of the consumer process and of
//! nats-server, from `/proc/<pid>/stat`, which holds what getrusage reports; peak RSS, the
//! kernel's `VmHWM`), then takes a paced load (publish to commit latency: the time from a
//! message's publish to the moment its ack, sent after the commit, reaches a subscriber of the
//! consumer's ack subjects), and is checked: every message's credit applied exactly once. Runs
//! alternate between contenders, round after round; the report takes each figure's median.
//!
//! `--db-latency-us` puts a delay each way between every contender and the database server
//! (`latency.rs`), as a network would.
//!
//! Results go to `target/bench/results.json`, `results.md` and `chart.svg`; `--save` copies
//! them to `docs/bench/`, which the README shows.

mod chart;
mod latency;
mod measure;
mod options;
mod results;
mod runs;

pub use options::{Contender, Options, Workload};

use inbox_testkit::PrivateNats;
use measure::{clock_tick, summary};
use results::{backend_report, machine, table};
use runs::{Shape, build, consumer_run, loop_run};
use serde_json::json;

/// Runs the bench.
pub async fn run(options: Options) -> Result<(), String> {
    let binaries = build()?;
    let out = crate::workspace::root().join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    crate::services::ensure(&crate::services::needed(&options.backends)).await?;
    let nats = PrivateNats::start().await?;
    let tick = clock_tick()?;
    let mut report = Vec::new();
    for &backend in &options.backends {
        let mut runs = Vec::new();
        for round in 1..=options.rounds {
            for &workload in &options.workloads {
                for &processes in &options.processes {
                    let shape = Shape {
                        workload,
                        processes,
                        round,
                    };
                    for &contender in &options.contenders {
                        eprintln!(
                            "bench: {} round {round}, {} ({} accounts), {processes} process(es): {}",
                            backend.name(),
                            workload.name(),
                            workload.accounts(),
                            contender.describe()
                        );
                        let run = match contender {
                            Contender::Loop => {
                                loop_run(&options, backend, &binaries, tick, 0, shape).await
                            }
                            _ => {
                                let on = (&binaries, &nats, tick);
                                consumer_run(&options, backend, contender, shape, on).await
                            }
                        }
                        .map_err(|e| format!("{} {}: {e}", backend.name(), contender.name()))?;
                        eprintln!("bench:   {}", summary(&run));
                        runs.push(run);
                    }
                }
            }
        }
        let mut scale = Vec::new();
        for &rows in &options.inbox_rows {
            eprintln!(
                "bench: {} claim latency with {rows} markers",
                backend.name()
            );
            let shape = Shape {
                workload: Workload::Spread,
                processes: 1,
                round: 0,
            };
            let run = loop_run(&options, backend, &binaries, tick, rows, shape).await?;
            eprintln!("bench:   {}", summary(&run));
            scale.push((rows, run));
        }
        report.push(backend_report(backend, &options, &runs, &scale));
    }
    let results = json!({
        "machine": machine(),
        "messages": options.messages,
        "concurrency": options.concurrency,
        "rounds": options.rounds,
        "batch": options.batch,
        "workloads": options.workloads.iter().map(|w| json!({"name": w.name(), "accounts": w.accounts()})).collect::<Vec<_>>(),
        "processes": options.processes,
        "latency": { "messages": options.latency_messages, "rate_per_s": options.rate },
        "db_latency_us": options.db_latency.as_micros() as u64,
        "backends": report,
    });
    let table = table(&results);
    print!("{table}");
    let chart = chart::chart(&results);
    let files = [
        (
            "results.json",
            serde_json::to_string_pretty(&results).expect("json"),
        ),
        ("results.md", table),
        ("chart.svg", chart),
    ];
    let mut dirs = vec![out];
    if options.save {
        dirs.push(crate::workspace::root().join("docs/bench"));
    }
    for dir in dirs {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for (name, text) in &files {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        eprintln!("bench: results in {}", dir.display());
    }
    Ok(())
}
