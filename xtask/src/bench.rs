//! `cargo xtask bench`: the framework side by side with what it replaces, in one run on one
//! machine, so that what is reported is a ratio (absolute figures drift with the machine).
//!
//! The contenders, all doing the same writes (a marker in the inbox table and a balance upsert in
//! `accounts`, one transaction per message unless batched):
//! 1. `loop`: the database's limit, a hand-written sqlx loop at concurrency C, no NATS
//!    (`baseline loop`);
//! 2. `handwritten`: a hand-written async-nats + sqlx consumer (`baseline consumer`);
//! 3. `inbox`: `credit`, one transaction per message;
//! 4. `inbox-batched`: `credit` with `CREDIT_BATCH`.
//!
//! Each run gets a fresh database and a fresh stream on one private nats-server. A consumer run
//! drains a backlog of N messages (throughput, CPU per message of the consumer process and of
//! nats-server, from `/proc/<pid>/stat`, which holds what getrusage reports; peak RSS, the
//! kernel's `VmHWM`), then takes a paced load (publish to commit latency: the time from a
//! message's publish to the moment its ack, sent after the commit, reaches a subscriber of the
//! consumer's ack subjects), and is checked: every message's credit applied exactly once. Runs
//! alternate between contenders, round after round; the report takes each figure's median.
//!
//! Results go to `target/bench/results.json`, `results.md` and `chart.svg`; `--save` copies
//! them to `docs/bench/`, which the README shows.

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt;
use inbox_testkit::{Backend, Database, PrivateNats, publish_and_wait, unique};
use serde_json::{Value, json};
use sqlx::any::AnyPoolOptions;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

/// How many accounts the credits spread over.
const ACCOUNTS: usize = 1000;
/// How long any one wait of a run may take.
const DEADLINE: Duration = Duration::from_secs(1800);

/// What `cargo xtask bench` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    backends: Vec<Backend>,
    messages: usize,
    concurrency: usize,
    rounds: usize,
    batch: usize,
    latency_messages: usize,
    rate: u32,
    inbox_rows: Vec<u64>,
    contenders: Vec<Contender>,
    save: bool,
}

/// One contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    Loop,
    Handwritten,
    Inbox,
    InboxBatched,
}

impl Contender {
    /// The contender named `word` (`loop`, `handwritten`, `inbox`, `inbox-batched`).
    pub fn parse(word: &str) -> Result<Contender, String> {
        Contender::ALL
            .into_iter()
            .find(|c| c.name() == word)
            .ok_or_else(|| {
                format!("no contender {word:?}: loop, handwritten, inbox or inbox-batched")
            })
    }

    const ALL: [Contender; 4] = [
        Contender::Loop,
        Contender::Handwritten,
        Contender::Inbox,
        Contender::InboxBatched,
    ];

    fn name(self) -> &'static str {
        match self {
            Contender::Loop => "loop",
            Contender::Handwritten => "handwritten",
            Contender::Inbox => "inbox",
            Contender::InboxBatched => "inbox-batched",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Contender::Loop => "1. sqlx loop, no NATS (the database's limit)",
            Contender::Handwritten => "2. hand-written async-nats + sqlx consumer",
            Contender::Inbox => "3. inbox, a transaction per message",
            Contender::InboxBatched => "4. inbox, batched",
        }
    }
}

impl Options {
    /// The options `cargo xtask bench` was given (see `cli.rs`).
    pub fn from_args(args: &crate::cli::BenchArgs) -> Options {
        Options {
            backends: args.db.0.clone(),
            messages: args.messages as usize,
            concurrency: args.concurrency as usize,
            rounds: args.rounds as usize,
            batch: args.batch as usize,
            latency_messages: args.latency_messages as usize,
            rate: args.rate,
            inbox_rows: args.inbox_rows.clone(),
            contenders: match args.only.as_slice() {
                [] => Contender::ALL.to_vec(),
                only => only.to_vec(),
            },
            save: args.save,
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone)]
struct Run {
    contender: Contender,
    round: usize,
    msgs_per_s: f64,
    latency_p50_us: f64,
    latency_p99_us: f64,
    consumer_cpu_us: f64,
    nats_cpu_us: Option<f64>,
    peak_rss_mib: f64,
    claim_p50_us: Option<f64>,
}

/// Runs the bench.
pub async fn run(options: Options) -> Result<(), String> {
    let binaries = build()?;
    let out = crate::workspace_root().join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    crate::services::ensure(&crate::services::needed(&options.backends)).await?;
    let nats = PrivateNats::start().await?;
    let tick = clock_tick()?;
    let mut report = Vec::new();
    for &backend in &options.backends {
        let mut runs = Vec::new();
        for round in 1..=options.rounds {
            for &contender in &options.contenders {
                eprintln!(
                    "bench: {} round {round}: {}",
                    backend.name(),
                    contender.describe()
                );
                let run = match contender {
                    Contender::Loop => loop_run(&options, backend, &binaries, tick, 0, round).await,
                    _ => {
                        let on = (&binaries, &nats, tick);
                        consumer_run(&options, backend, contender, round, on).await
                    }
                }
                .map_err(|e| format!("{} {}: {e}", backend.name(), contender.name()))?;
                eprintln!("bench:   {}", summary(&run));
                runs.push(run);
            }
        }
        let mut scale = Vec::new();
        for &rows in &options.inbox_rows {
            eprintln!(
                "bench: {} claim latency with {rows} markers",
                backend.name()
            );
            let run = loop_run(&options, backend, &binaries, tick, rows, 0).await?;
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
        "latency": { "messages": options.latency_messages, "rate_per_s": options.rate },
        "backends": report,
    });
    let table = table(&results);
    print!("{table}");
    let chart = chart(&results);
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
        dirs.push(crate::workspace_root().join("docs/bench"));
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

/// The binaries the contenders run, built in release mode.
struct Binaries {
    credit: PathBuf,
    baseline: PathBuf,
}

fn build() -> Result<Binaries, String> {
    crate::cargo_step(
        "building the contenders",
        &[
            "build",
            "--quiet",
            "--release",
            "-p",
            "inbox-examples",
            "--bin",
            "credit",
            "--bin",
            "baseline",
        ],
    )?;
    let release = crate::workspace_root().join("target/release");
    Ok(Binaries {
        credit: release.join("credit"),
        baseline: release.join("baseline"),
    })
}

fn summary(run: &Run) -> String {
    format!(
        "{:.0} msg/s, p50 {:.1} ms, p99 {:.1} ms, consumer {:.0} us/msg, nats-server {}, peak RSS {:.1} MiB{}",
        run.msgs_per_s,
        run.latency_p50_us / 1000.0,
        run.latency_p99_us / 1000.0,
        run.consumer_cpu_us,
        run.nats_cpu_us
            .map_or("-".to_owned(), |c| format!("{c:.0} us/msg")),
        run.peak_rss_mib,
        run.claim_p50_us
            .map_or(String::new(), |c| format!(", claim p50 {c:.0} us")),
    )
}

/// Contender 1, also run at several inbox sizes (`rows` markers loaded first).
async fn loop_run(
    options: &Options,
    backend: Backend,
    binaries: &Binaries,
    tick: f64,
    rows: u64,
    round: usize,
) -> Result<Run, String> {
    let db = Database::create(backend, "inbox_bench_").await?;
    let result = async {
        let mut child = Command::new(&binaries.baseline)
            .arg("loop")
            .env("DATABASE_URL", &db.url)
            .env("BENCH_CONCURRENCY", options.concurrency.to_string())
            .env("BENCH_MESSAGES", options.messages.to_string())
            .env("BENCH_ACCOUNTS", ACCOUNTS.to_string())
            .env("BENCH_INBOX_ROWS", rows.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{}: {e}", binaries.baseline.display()))?;
        let pid = child.id().ok_or("baseline exited at once")?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        expect_line(&mut lines, "ready").await?;
        let before = usage(pid, tick)?;
        let done = expect_line(&mut lines, "done ").await?;
        let after = usage(pid, tick)?;
        drop(child.stdin.take());
        let _ = child.wait().await;
        let done: Value = serde_json::from_str(&done).map_err(|e| format!("{done}: {e}"))?;
        let field = |name: &str| {
            done[name]
                .as_f64()
                .ok_or_else(|| format!("no {name} in {done}"))
        };
        let n = options.messages as f64;
        Ok(Run {
            contender: Contender::Loop,
            round,
            msgs_per_s: n / field("elapsed_s")?,
            latency_p50_us: field("latency_p50_us")?,
            latency_p99_us: field("latency_p99_us")?,
            consumer_cpu_us: (after.cpu_s - before.cpu_s) * 1e6 / n,
            nats_cpu_us: None,
            peak_rss_mib: after.peak_rss_mib,
            claim_p50_us: Some(field("claim_p50_us")?),
        })
    }
    .await;
    db.remove().await?;
    result
}

/// Reads lines until one starts with `prefix`, returning the rest of it.
async fn expect_line(
    lines: &mut tokio::io::Lines<BufReader<ChildStdout>>,
    prefix: &str,
) -> Result<String, String> {
    let read = async {
        while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.to_owned());
            }
        }
        Err(format!("the contender exited before printing {prefix:?}"))
    };
    tokio::time::timeout(DEADLINE, read)
        .await
        .map_err(|_| format!("no {prefix:?} line within {DEADLINE:?}"))?
}

/// Contenders 2 to 4.
async fn consumer_run(
    options: &Options,
    backend: Backend,
    contender: Contender,
    round: usize,
    (binaries, nats, tick): (&Binaries, &PrivateNats, f64),
) -> Result<Run, String> {
    let db = Database::create(backend, "inbox_bench_").await?;
    let name = unique("BENCH_");
    let subject = format!("bench.{name}");
    let durable = "bench";
    let client = inbox_testkit::connect(&nats.url).await?;
    let js = jetstream::new(client.clone());
    let result = async {
        let stream = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                max_age: Duration::from_secs(3 * 24 * 3600),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create stream: {e}"))?;
        // The configuration `credit` creates.
        stream
            .create_consumer(pull::Config {
                durable_name: Some(durable.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                max_deliver: 10,
                filter_subject: subject.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create consumer: {e}"))?;
        let n = options.messages;
        publish_and_wait(&js, &subject, (0..n).map(|i| request(&name, i))).await?;
        let mut child = spawn_contender(options, backend, contender, binaries, nats, &db, &name)?;
        let pid = child.id().ok_or("the contender exited at once")?;
        let nats_pid = nats.pid().ok_or("the private nats-server is not running")?;
        let mut consumer: jetstream::consumer::PullConsumer = js
            .get_stream(&name)
            .await
            .map_err(|e| e.to_string())?
            .get_consumer(durable)
            .await
            .map_err(|e| e.to_string())?;
        // The drain starts at the first delivery and ends when nothing is pending or unacked.
        let started = Instant::now();
        let (t0, acked0, me0, server0) = loop {
            let info = consumer.info().await.map_err(|e| e.to_string())?;
            if info.delivered.consumer_sequence > 0 {
                break (
                    Instant::now(),
                    info.ack_floor.stream_sequence,
                    usage(pid, tick)?,
                    usage(nats_pid, tick)?,
                );
            }
            if started.elapsed() > DEADLINE || child.try_wait().ok().flatten().is_some() {
                return Err("the contender never took a message".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let (t1, me1, server1) = loop {
            let info = consumer.info().await.map_err(|e| e.to_string())?;
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                break (Instant::now(), usage(pid, tick)?, usage(nats_pid, tick)?);
            }
            if t0.elapsed() > DEADLINE || child.try_wait().ok().flatten().is_some() {
                return Err(format!("not drained: {info:?}"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let drained = (n as u64 - acked0) as f64;
        let latencies = paced(&client, &js, options, &name, &subject, n).await?;
        stop(&mut child, contender).await?;
        check_applied(backend, &db.url, n + options.latency_messages).await?;
        let (p50, p99) = percentiles(latencies);
        Ok(Run {
            contender,
            round,
            msgs_per_s: drained / (t1 - t0).as_secs_f64(),
            latency_p50_us: p50,
            latency_p99_us: p99,
            consumer_cpu_us: (me1.cpu_s - me0.cpu_s) * 1e6 / drained,
            nats_cpu_us: Some((server1.cpu_s - server0.cpu_s) * 1e6 / drained),
            peak_rss_mib: me1.peak_rss_mib,
            claim_p50_us: None,
        })
    }
    .await;
    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(format!("{name}_EVENTS")).await;
    db.remove().await?;
    result
}

fn spawn_contender(
    options: &Options,
    backend: Backend,
    contender: Contender,
    binaries: &Binaries,
    nats: &PrivateNats,
    db: &Database,
    stream: &str,
) -> Result<Child, String> {
    let (binary, mut command) = match contender {
        Contender::Handwritten => {
            let mut c = Command::new(&binaries.baseline);
            c.arg("consumer");
            (&binaries.baseline, c)
        }
        _ => (&binaries.credit, Command::new(&binaries.credit)),
    };
    let url = match backend {
        // `credit` creates the file; the baseline's pool may too.
        Backend::Sqlite => format!("{}?mode=rwc", db.url),
        _ => db.url.clone(),
    };
    command
        .env("DATABASE_URL", url)
        .env("NATS_URL", &nats.url)
        .env("CREDIT_STREAM", stream)
        .env("CREDIT_SUBJECT", format!("bench.{stream}"))
        .env("CREDIT_EVENTS_STREAM", format!("{stream}_EVENTS"))
        .env("CREDIT_EVENTS_SUBJECT", format!("bench.events.{stream}"))
        .env("CREDIT_CONSUMER", "bench")
        .env("CREDIT_CONCURRENCY", options.concurrency.to_string())
        .env("BENCH_CONCURRENCY", options.concurrency.to_string())
        .env("RUST_LOG", "warn")
        .env("CREDIT_ACK", std::env::var("BENCH_ACK").unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    if contender == Contender::InboxBatched {
        command.env("CREDIT_BATCH", options.batch.to_string());
    }
    command
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))
}

/// Stops a contender: `credit` drains on SIGTERM, the baseline when its stdin closes.
async fn stop(child: &mut Child, contender: Contender) -> Result<(), String> {
    drop(child.stdin.take());
    if contender != Contender::Handwritten
        && let Some(pid) = child.id()
    {
        let _ = inbox_testkit::terminate(pid);
    }
    match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(format!("the contender exited with {status}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the contender did not stop within 60 s".into()),
    }
}

fn request(run: &str, i: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": format!("{run}-{i}"),
        "account": i % ACCOUNTS,
        "amount": 1,
    }))
    .expect("json")
}

/// Publishes `options.latency_messages` more requests at `options.rate` a second, one at a time,
/// and returns each one's latency in microseconds: from its publish to the moment its ack (sent
/// after its commit) reaches a subscriber of the consumer's ack subjects.
async fn paced(
    client: &async_nats::Client,
    js: &jetstream::Context,
    options: &Options,
    stream: &str,
    subject: &str,
    first: usize,
) -> Result<Vec<f64>, String> {
    let mut acks = client
        .subscribe(format!("$JS.ACK.{stream}.bench.>"))
        .await
        .map_err(|e| e.to_string())?;
    client.flush().await.map_err(|e| e.to_string())?;
    let published: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let seen: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let total = options.latency_messages;
    let watcher = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Some(ack) = acks.next().await {
                // $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
                let at = Instant::now();
                let Some(seq) = ack.subject.split('.').nth(5).and_then(|s| s.parse().ok()) else {
                    continue;
                };
                let mut seen = seen.lock().expect("lock");
                seen.entry(seq).or_insert(at);
                if seen.len() >= total {
                    break;
                }
            }
        })
    };
    let every = Duration::from_secs_f64(1.0 / f64::from(options.rate));
    let start = tokio::time::Instant::now();
    for i in 0..total {
        tokio::time::sleep_until(start + every * i as u32).await;
        let at = Instant::now();
        let ack = js
            .publish(subject.to_owned(), request(stream, first + i).into())
            .await
            .map_err(|e| format!("publish: {e}"))?
            .await
            .map_err(|e| format!("publish ack: {e}"))?;
        published.lock().expect("lock").insert(ack.sequence, at);
    }
    tokio::time::timeout(Duration::from_secs(120), watcher)
        .await
        .map_err(|_| {
            let seen = seen.lock().expect("lock").len();
            format!("only {seen} of {total} paced messages were acked within 120 s")
        })?
        .map_err(|e| e.to_string())?;
    let published = published.lock().expect("lock");
    let seen = seen.lock().expect("lock");
    Ok(published
        .iter()
        .filter_map(|(seq, at)| Some(seen.get(seq)?.saturating_duration_since(*at)))
        .map(|d| d.as_secs_f64() * 1e6)
        .collect())
}

/// Fails unless every request's credit was applied exactly once: `n` markers and a balance sum
/// of `n` (each request credits 1).
async fn check_applied(backend: Backend, url: &str, n: usize) -> Result<(), String> {
    sqlx::any::install_default_drivers();
    let url = match backend {
        Backend::Sqlite => format!("{url}?mode=ro"),
        _ => url.to_owned(),
    };
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let scalar = async |sql: &str| {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.to_owned()).into_sql_str())
            .fetch_one(&pool)
            .await
            .map_err(|e| format!("{sql}: {e}"))
    };
    let markers = scalar("SELECT count(*) FROM inbox WHERE consumer = 'credit'").await?;
    let sum = scalar("SELECT CAST(COALESCE(SUM(balance), 0) AS BIGINT) FROM accounts").await;
    // MySQL casts to SIGNED, not BIGINT.
    let sum = match sum {
        Ok(sum) => sum,
        Err(_) => scalar("SELECT CAST(COALESCE(SUM(balance), 0) AS SIGNED) FROM accounts").await?,
    };
    pool.close().await;
    if markers as usize == n && sum as usize == n {
        Ok(())
    } else {
        Err(format!(
            "not exactly once: {markers} markers and a balance sum of {sum} for {n} requests"
        ))
    }
}

/// CPU time and peak memory of a process, from `/proc`.
struct Usage {
    cpu_s: f64,
    peak_rss_mib: f64,
}

fn usage(pid: u32, tick: f64) -> Result<Usage, String> {
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

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s CPU times.
fn clock_tick() -> Result<f64, String> {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("getconf CLK_TCK: {e}"))
}

fn percentiles(mut samples: Vec<f64>) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One backend's medians per contender, the ratios to contender 1, and every run.
fn backend_report(
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

fn machine() -> Value {
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
fn table(results: &Value) -> String {
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

/// Throughput per backend and contender, as ratios to contender 1, as an SVG bar chart.
fn chart(results: &Value) -> String {
    let backends: Vec<&Value> = results["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let colors = ["#9e9e9e", "#f4a261", "#2a9d8f", "#264653"];
    let (bar, gap, top, left, height) = (26.0, 40.0, 40.0, 60.0, 240.0);
    let per_group = 4.0 * bar;
    let width = left + backends.len() as f64 * (per_group + gap) + 200.0;
    let max = backends
        .iter()
        .flat_map(|b| b["contenders"].as_array().into_iter().flatten())
        .filter_map(|c| c["ratio_to_loop"].as_f64())
        .fold(1.0_f64, f64::max)
        .ceil();
    let y = |ratio: f64| top + height - ratio / max * height;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <text x=\"{left}\" y=\"20\" font-size=\"14\">msgs/s as a ratio to a plain sqlx loop (1.0), {} messages</text>\n",
        top + height + 50.0,
        results["messages"]
    );
    for step in 0..=(max as usize) {
        let yy = y(step as f64);
        svg += &format!(
            "<line x1=\"{left}\" x2=\"{:.0}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{:.0}\" y=\"{:.1}\" text-anchor=\"end\">{step}.0x</text>\n",
            width - 200.0,
            left - 6.0,
            yy + 4.0
        );
    }
    for (g, b) in backends.iter().enumerate() {
        let x0 = left + gap / 2.0 + g as f64 * (per_group + gap);
        for (i, c) in b["contenders"].as_array().into_iter().flatten().enumerate() {
            let Some(ratio) = c["ratio_to_loop"].as_f64() else {
                continue;
            };
            let color = colors[Contender::ALL
                .iter()
                .position(|k| Some(k.name()) == c["contender"].as_str())
                .unwrap_or(0)];
            let x = x0 + i as f64 * bar;
            svg += &format!(
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{ratio:.2}</text>\n",
                y(ratio),
                bar - 4.0,
                top + height - y(ratio),
                x + (bar - 4.0) / 2.0,
                y(ratio) - 3.0
            );
        }
        svg += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            x0 + per_group / 2.0,
            top + height + 18.0,
            b["backend"].as_str().unwrap_or("")
        );
    }
    for (i, c) in Contender::ALL.iter().enumerate() {
        let (x, yy) = (width - 190.0, top + 10.0 + i as f64 * 20.0);
        svg += &format!(
            "<rect x=\"{x:.0}\" y=\"{:.0}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0}\" y=\"{:.0}\">{}</text>\n",
            yy - 10.0,
            colors[i],
            x + 18.0,
            yy,
            c.name()
        );
    }
    svg + "</svg>\n"
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
    fn usage_of_this_process_is_read() {
        let u = usage(std::process::id(), clock_tick().unwrap()).unwrap();
        assert!(u.peak_rss_mib > 0.0);
        assert!(u.cpu_s >= 0.0);
    }
}
