//! The contenders' runs: building them, running each on a fresh database (the loop alone, the
//! consumers on a backlog and then paced messages), and checking every credit applied once.

use super::measure::{Run, percentiles, usage};
use super::options::{Contender, Options};
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

/// Contender 1, also run at several inbox sizes (`rows` markers loaded first).
pub async fn loop_run(
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
pub async fn consumer_run(
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

/// The `i`-th credit request of `run`: 1 to one of [`ACCOUNTS`].
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
