//! The contenders' runs: building them, running each on a fresh database (the loop alone, the
//! consumers on a backlog and then paced messages), and checking every credit applied once.

use super::latency::through;
use super::measure::{Run, Usage, percentiles, server_cpu, usage};
use super::options::{Contender, Options, Workload};
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

/// How long any one wait of a run may take.
const DEADLINE: Duration = Duration::from_secs(1800);

/// The binaries the contenders run, built in release mode.
pub struct Binaries {
    /// The `credit` example.
    credit: PathBuf,
    /// The `baseline` example: the loop and the hand-written consumer.
    baseline: PathBuf,
}

/// Builds `credit` and `baseline` in release mode, in one cargo call.
pub fn build() -> Result<Binaries, String> {
    crate::workspace::cargo_step(
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
    let release = crate::workspace::root().join("target/release");
    Ok(Binaries {
        credit: release.join("credit"),
        baseline: release.join("baseline"),
    })
}

/// What a run is of: the workload, the processes (the loop: times the concurrency), the round.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub workload: Workload,
    pub processes: usize,
    pub round: usize,
}

/// The CPU time of `backend`'s server so far, all its processes together, in seconds; `None`
/// for SQLite, which runs inside the contender. The server is the machine's: what else it
/// serves meanwhile counts too (nothing, while the bench runs alone).
fn db_cpu(backend: Backend, tick: f64) -> Result<Option<f64>, String> {
    let names: &[&str] = match backend {
        Backend::Postgres => &["postgres"],
        Backend::MySql => &["mariadbd", "mysqld"],
        Backend::Sqlite => return Ok(None),
    };
    server_cpu(names, tick).map(Some)
}

/// CPU seconds spent between `before` and `after`, in microseconds per message of `n`.
fn per_message(before: Option<f64>, after: Option<f64>, n: f64) -> Option<f64> {
    Some((after? - before?) * 1e6 / n)
}

/// Contender 1, also run at several inbox sizes (`rows` markers loaded first).
pub async fn loop_run(
    options: &Options,
    backend: Backend,
    binaries: &Binaries,
    tick: f64,
    rows: u64,
    shape: Shape,
) -> Result<Run, String> {
    let db = Database::create(backend, "inbox_bench_").await?;
    let deadlocks = Deadlocks::before(backend, &db).await?;
    let result = async {
        let mut child = Command::new(&binaries.baseline)
            .arg("loop")
            .env("DATABASE_URL", through(&db.url, options.db_latency)?)
            .env(
                "BENCH_CONCURRENCY",
                (options.concurrency * shape.processes).to_string(),
            )
            .env("BENCH_MESSAGES", options.messages.to_string())
            .env("BENCH_ACCOUNTS", shape.workload.accounts().to_string())
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
        let db_before = db_cpu(backend, tick)?;
        let done = expect_line(&mut lines, "done ").await?;
        let after = usage(pid, tick)?;
        let db_after = db_cpu(backend, tick)?;
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
            workload: shape.workload,
            processes: shape.processes,
            round: shape.round,
            msgs_per_s: n / field("elapsed_s")?,
            latency_p50_us: Some(field("latency_p50_us")?),
            latency_p99_us: Some(field("latency_p99_us")?),
            consumer_cpu_us: (after.cpu_s - before.cpu_s) * 1e6 / n,
            nats_cpu_us: None,
            db_cpu_us: per_message(db_before, db_after, n),
            peak_rss_mib: after.peak_rss_mib,
            claim_p50_us: Some(field("claim_p50_us")?),
            deadlocks: None,
            conflicts: None,
            relay_tail_ms: None,
        })
    }
    .await;
    let result = match result {
        Ok(run) => deadlocks.after(&db).await.map(|d| Run {
            deadlocks: d,
            ..run
        }),
        Err(e) => Err(e),
    };
    db.remove().await?;
    result
}

/// The deadlocks a database counts, read before and after a run.
enum Deadlocks {
    /// The run's own database, fresh: its `pg_stat_database.deadlocks`.
    Postgres,
    /// The server's `Innodb_deadlocks` before the run (the bench runs alone on it), when the
    /// server counts them (MariaDB does, MySQL 8 does not).
    MySql(Option<u64>),
    /// SQLite has one writer and no deadlocks.
    None,
}

impl Deadlocks {
    async fn before(backend: Backend, db: &Database) -> Result<Deadlocks, String> {
        Ok(match backend {
            Backend::Postgres => Deadlocks::Postgres,
            Backend::MySql => {
                let pool = any_pool(&db.url).await?;
                let before = innodb_deadlocks(&pool).await;
                pool.close().await;
                Deadlocks::MySql(before?)
            }
            Backend::Sqlite => Deadlocks::None,
        })
    }

    /// The deadlocks since [`Deadlocks::before`], once the contenders have exited.
    async fn after(&self, db: &Database) -> Result<Option<u64>, String> {
        let pool = match self {
            Deadlocks::None => return Ok(None),
            _ => any_pool(&db.url).await?,
        };
        let count = match self {
            Deadlocks::Postgres => {
                // A session adds its deadlocks to the database's count when it ends.
                let sessions = "SELECT CAST(count(*) AS BIGINT) FROM pg_stat_activity \
                                WHERE datname = current_database() AND pid <> pg_backend_pid()";
                let deadline = Instant::now() + Duration::from_secs(30);
                while scalar(&pool, sessions).await? > 0 {
                    if Instant::now() > deadline {
                        return Err("the contenders' sessions did not end within 30 s".into());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let sql =
                    "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()";
                scalar(&pool, sql).await? as u64
            }
            Deadlocks::MySql(before) => match (before, innodb_deadlocks(&pool).await?) {
                (Some(before), Some(after)) => after.saturating_sub(*before),
                _ => {
                    pool.close().await;
                    return Ok(None);
                }
            },
            Deadlocks::None => unreachable!(),
        };
        pool.close().await;
        Ok(Some(count))
    }
}

/// Whether every outbox row of a run is sent, asked on a connection of its own.
struct Relayed(sqlx::AnyPool);

impl Relayed {
    async fn open(backend: Backend, url: &str) -> Result<Relayed, String> {
        let url = match backend {
            Backend::Sqlite => format!("{url}?mode=ro"),
            _ => url.to_owned(),
        };
        Ok(Relayed(any_pool(&url).await?))
    }

    async fn all(&self) -> Result<bool, String> {
        let sql = "SELECT count(*) FROM outbox WHERE sent_at IS NULL";
        Ok(scalar(&self.0, sql).await? == 0)
    }

    async fn close(self) {
        self.0.close().await;
    }
}

/// One connection to `url` through sqlx's `Any` driver.
async fn any_pool(url: &str) -> Result<sqlx::AnyPool, String> {
    sqlx::any::install_default_drivers();
    AnyPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))
}

/// The one number `sql` returns.
async fn scalar(pool: &sqlx::AnyPool, sql: &str) -> Result<i64, String> {
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.to_owned()).into_sql_str())
        .fetch_one(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))
}

/// MariaDB's `Innodb_deadlocks` (`None` where the server does not count them).
async fn innodb_deadlocks(pool: &sqlx::AnyPool) -> Result<Option<u64>, String> {
    let sql = "SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'";
    let row: Option<(String, String)> = sqlx::query_as(sql)
        .fetch_optional(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))?;
    Ok(row.and_then(|(_, v)| v.parse().ok()))
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

/// Sends signal `name` to every process of `pids`.
fn signal_all(pids: &[u32], name: &str) -> Result<(), String> {
    pids.iter()
        .try_for_each(|&pid| inbox_testkit::signal(pid, name))
}

/// Contenders 2 to 4, in `shape.processes` processes on one durable consumer.
pub async fn consumer_run(
    options: &Options,
    backend: Backend,
    contender: Contender,
    shape: Shape,
    (binaries, nats, tick): (&Binaries, &PrivateNats, f64),
) -> Result<Run, String> {
    let db = Database::create(backend, "inbox_bench_").await?;
    let deadlocks = Deadlocks::before(backend, &db).await?;
    let name = unique("BENCH_");
    let subject = format!("bench.{name}");
    let durable = "bench";
    let client = inbox_testkit::connect(&nats.url).await?;
    let js = jetstream::new(client.clone());
    let accounts = shape.workload.accounts();
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
        // The configuration `credit` creates, with the same environment.
        stream
            .create_consumer(pull::Config {
                durable_name: Some(durable.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                max_deliver: 10,
                filter_subject: subject.clone(),
                max_ack_pending: max_ack_pending(options, contender),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create consumer: {e}"))?;
        let n = options.messages;
        let mut children = Vec::new();
        for _ in 0..shape.processes {
            children.push(spawn_contender(
                options, backend, contender, binaries, nats, &db, &name,
            )?);
        }
        // Every process started (connected, migrated, pulling) and then frozen (SIGSTOP) while
        // the backlog is published, so that neither their start-up nor the publishing falls inside
        // the measured drain, and every message is counted: a consumer that ran meanwhile would
        // take most of the backlog before the clock started (`BENCH_WRAP` must `exec`).
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer(durable)
            .await
            .map_err(|e| e.to_string())?;
        let exited = |children: &mut Vec<Child>| {
            children
                .iter_mut()
                .any(|c| c.try_wait().ok().flatten().is_some())
        };
        let started = Instant::now();
        loop {
            let info = consumer.info().await.map_err(|e| e.to_string())?;
            if info.num_waiting as usize >= shape.processes {
                break;
            }
            if started.elapsed() > DEADLINE || exited(&mut children) {
                return Err("the contenders never pulled".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pids: Vec<u32> = children
            .iter()
            .map(|c| c.id().ok_or("a contender exited at once"))
            .collect::<Result<_, _>>()?;
        // What tells that every outbox row was relayed: the relays' work is part of the run.
        let relayed = Relayed::open(backend, &db.url).await?;
        // A run that fails while they are frozen kills them (`kill_on_drop`).
        signal_all(&pids, "STOP")?;
        publish_and_wait(&js, &subject, (0..n).map(|i| request(&name, i, accounts))).await?;
        // A frozen process acks nothing: an ack now means one was not frozen (a `BENCH_WRAP`
        // that does not `exec` its program), and its figures would count work done off the clock.
        let info = consumer.info().await.map_err(|e| e.to_string())?;
        let waiting = info.num_pending + info.num_ack_pending as u64;
        if info.ack_floor.stream_sequence > 0 || waiting < n as u64 {
            return Err(format!(
                "a contender took messages while frozen (BENCH_WRAP must exec the program): {info:?}"
            ));
        }
        let nats_pid = nats.pid().ok_or("the private nats-server is not running")?;
        let all = |pids: &[u32]| -> Result<Usage, String> {
            let mut sum = Usage {
                cpu_s: 0.0,
                peak_rss_mib: 0.0,
            };
            for &pid in pids {
                let u = usage(pid, tick)?;
                sum.cpu_s += u.cpu_s;
                sum.peak_rss_mib = sum.peak_rss_mib.max(u.peak_rss_mib);
            }
            Ok(sum)
        };
        // The servers' CPU time so far: nats-server's, and the database's (none for SQLite).
        let servers = || -> Result<(f64, Option<f64>), String> {
            Ok((usage(nats_pid, tick)?.cpu_s, db_cpu(backend, tick)?))
        };
        // The drain starts when the contenders are let go, the whole backlog waiting for them
        // (the first batches already in their sockets), and ends when nothing is pending or
        // unacked, and every outbox row relayed.
        let (me0, (nats0, db0)) = (all(&pids)?, servers()?);
        let t0 = Instant::now();
        signal_all(&pids, "CONT")?;
        // When every message was acked, the relays perhaps not done.
        let mut acked: Option<Instant> = None;
        let (t1, me1, (nats1, db1), tail) = loop {
            let info = consumer.info().await.map_err(|e| e.to_string())?;
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                let acked = *acked.get_or_insert_with(Instant::now);
                if relayed.all().await? {
                    let now = Instant::now();
                    break (now, all(&pids)?, servers()?, now - acked);
                }
            }
            if t0.elapsed() > DEADLINE || exited(&mut children) {
                return Err(format!("not drained: {info:?}"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        relayed.close().await;
        let drained = n as f64;
        // Latency is measured with one process only.
        let (latencies, paced_n) = if shape.processes == 1 {
            let paced = paced(&client, &js, options, &name, &subject, n, accounts).await?;
            (Some(paced), options.latency_messages)
        } else {
            (None, 0)
        };
        let mut conflicts: Option<(u64, u64)> = None;
        for child in &mut children {
            let stopped = stop(child, contender).await?;
            if let Some((c, r)) = stopped {
                let sum = conflicts.get_or_insert((0, 0));
                sum.0 += c;
                sum.1 += r;
            }
        }
        if contender != Contender::Handwritten {
            conflicts.get_or_insert((0, 0));
        }
        check_applied(backend, &db.url, n + paced_n).await?;
        let (p50, p99) = match latencies {
            Some(l) => {
                let (p50, p99) = percentiles(l);
                (Some(p50), Some(p99))
            }
            None => (None, None),
        };
        Ok(Run {
            contender,
            workload: shape.workload,
            processes: shape.processes,
            round: shape.round,
            msgs_per_s: drained / (t1 - t0).as_secs_f64(),
            latency_p50_us: p50,
            latency_p99_us: p99,
            consumer_cpu_us: (me1.cpu_s - me0.cpu_s) * 1e6 / drained,
            nats_cpu_us: Some((nats1 - nats0) * 1e6 / drained),
            db_cpu_us: per_message(db0, db1, drained),
            peak_rss_mib: me1.peak_rss_mib,
            claim_p50_us: None,
            deadlocks: None,
            conflicts,
            relay_tail_ms: Some(tail.as_secs_f64() * 1000.0),
        })
    }
    .await;
    let result = match result {
        Ok(run) => deadlocks.after(&db).await.map(|d| Run {
            deadlocks: d,
            ..run
        }),
        Err(e) => Err(e),
    };
    let _ = js.delete_stream(&name).await;
    let _ = js
        .delete_stream(inbox_runtime::advisory_stream_name(&name))
        .await;
    let _ = js.delete_stream(format!("{name}_EVENTS")).await;
    db.remove().await?;
    result
}

/// Starts a consumer contender on `stream` and `db`, configured as `credit` reads it.
fn spawn_contender(
    options: &Options,
    backend: Backend,
    contender: Contender,
    binaries: &Binaries,
    nats: &PrivateNats,
    db: &Database,
    stream: &str,
) -> Result<Child, String> {
    // A profiler in front of the consumer (CONTRIBUTING.md, "Profiling a bench contender"): the
    // command's words, then the binary and its arguments.
    let wrap = |bin: &std::path::Path| {
        let wrapper = std::env::var("BENCH_WRAP").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        match words.next() {
            Some(first) => {
                let mut c = Command::new(first);
                c.args(words).arg(bin);
                c
            }
            None => Command::new(bin),
        }
    };
    let (binary, mut command) = match contender {
        Contender::Handwritten => {
            let mut c = wrap(&binaries.baseline);
            c.arg("consumer");
            (&binaries.baseline, c)
        }
        _ => (&binaries.credit, wrap(&binaries.credit)),
    };
    let url = match backend {
        // `credit` creates the file; the baseline's pool may too.
        Backend::Sqlite => format!("{}?mode=rwc", db.url),
        _ => through(&db.url, options.db_latency)?,
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
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    if contender == Contender::InboxBatched {
        command.env("CREDIT_BATCH", options.batch.to_string());
    }
    command
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))
}

/// The consumer's `max_ack_pending`, as `credit` would create it (`Config::max_ack_pending` in
/// the examples): JetStream's default, or, batched, room for four processes' full batches.
fn max_ack_pending(options: &Options, contender: Contender) -> i64 {
    match contender {
        Contender::InboxBatched if options.batch > 1 => {
            (4 * options.concurrency as i64 * options.batch as i64).max(1000)
        }
        _ => 0,
    }
}

/// Stops a contender: `credit` drains on SIGTERM, the baseline when its stdin closes. Returns
/// the conflicts and batch retries `credit` reported on its last line (none for the baseline).
async fn stop(child: &mut Child, contender: Contender) -> Result<Option<(u64, u64)>, String> {
    drop(child.stdin.take());
    if contender != Contender::Handwritten
        && let Some(pid) = child.id()
    {
        let _ = inbox_testkit::terminate(pid);
    }
    let mut out = String::new();
    let mut stdout = child.stdout.take();
    let read = async {
        if let Some(stdout) = stdout.as_mut() {
            let _ = tokio::io::AsyncReadExt::read_to_string(stdout, &mut out).await;
        }
        child.wait().await
    };
    match tokio::time::timeout(Duration::from_secs(60), read).await {
        Ok(Ok(status)) if status.success() => Ok(conflicts_of(&out)),
        Ok(Ok(status)) => Err(format!("the contender exited with {status}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the contender did not stop within 60 s".into()),
    }
}

/// `conflicts=N batch_retries=M` of `credit`'s stop line: `(0, 0)` when it has none.
fn conflicts_of(out: &str) -> Option<(u64, u64)> {
    let line = out.lines().find(|l| l.contains(" stopped: "))?;
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some((field("conflicts="), field("batch_retries=")))
}

/// The `i`-th credit request of `run`: 1 to one of `accounts` accounts, round-robin (so that
/// consecutive messages, and a batch's, credit different accounts).
fn request(run: &str, i: usize, accounts: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": format!("{run}-{i}"),
        "account": i % accounts,
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
    accounts: usize,
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
            .publish(
                subject.to_owned(),
                request(stream, first + i, accounts).into(),
            )
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
    // Every contender writes the same outbox row per credit.
    let events = scalar("SELECT count(*) FROM outbox").await?;
    if events as usize != n {
        return Err(format!("{events} outbox rows for {n} requests"));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_read_off_the_stop_line() {
        let line = "credit stopped: applied=5 skipped=0 nacked=0 terminated=0 conflicts=3 batch_retries=2\n";
        assert_eq!(conflicts_of(line), Some((3, 2)));
        let quiet = "credit stopped: applied=5 skipped=0 nacked=0 terminated=0\n";
        assert_eq!(conflicts_of(quiet), Some((0, 0)));
        assert_eq!(conflicts_of(""), None);
    }
}
