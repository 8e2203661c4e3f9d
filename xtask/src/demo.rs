//! `cargo xtask demo`: exactly-once consumption, shown end to end.
//!
//! Publishes a few thousand credit requests, a good share of them published again as a producer
//! retrying after a lost ack would (no `Nats-Msg-Id`, so the broker does not dedup), runs two
//! `credit` processes on one durable consumer, and checks that every balance is exact.
//!
//! The database is `DATABASE_URL`, else a SQLite file under `target/demo/`. NATS is `NATS_URL`
//! (default `nats://127.0.0.1:4222`); when nothing answers there, the demo runs a private
//! `nats-server` with JetStream in a temporary directory and stops it at the end.

use async_nats::jetstream::{self, stream};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const UNIQUE: usize = 3_000;
const ACCOUNTS: i64 = 50;
/// One message in this many is published a second time.
const DUPLICATE_EVERY: usize = 3;
const INSTANCES: usize = 2;
const DEADLINE: Duration = Duration::from_secs(300);

/// Runs the demo.
pub fn run() -> Result<(), String> {
    let root = crate::workspace_root();
    println!("building the credit example (release)...");
    let status = std::process::Command::new(crate::cargo())
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "inbox-examples",
            "--bin",
            "credit",
        ])
        .current_dir(&root)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building `credit` failed".into());
    }
    let credit = root.join("target/release/credit");
    let logs = root.join("target/demo");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    tokio::runtime::Runtime::new()
        .map_err(|e| e.to_string())?
        .block_on(demo(credit, logs))
}

struct Demo {
    run: String,
    stream: String,
    subject: String,
    durable: String,
    nats_url: String,
    database_url: String,
}

async fn demo(credit: PathBuf, logs: PathBuf) -> Result<(), String> {
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let database_url = match std::env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => {
            // A fresh file each run, so that the numbers below are this run's alone.
            let file = logs.join("credit.db");
            for suffix in ["", "-wal", "-shm"] {
                let mut f = file.clone().into_os_string();
                f.push(suffix);
                let _ = std::fs::remove_file(f);
            }
            format!("sqlite://{}", file.display())
        }
    };
    let requested_nats =
        std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let private = if nats_answers(&requested_nats) {
        None
    } else {
        Some(crate::nats::PrivateNats::start(&run)?)
    };
    let d = Demo {
        stream: format!("CREDITS_DEMO_{run}"),
        subject: format!("demo.{run}.credits"),
        durable: format!("credit_demo_{run}"),
        nats_url: private.as_ref().map_or(requested_nats, |p| p.url.clone()),
        database_url,
        run,
    };
    println!("NATS:     {}", d.nats_url);
    println!("database: {}", d.database_url);
    let client = async_nats::connect(&d.nats_url)
        .await
        .map_err(|e| format!("NATS does not answer at {}: {e}", d.nats_url))?;
    let js = jetstream::new(client);
    sqlx::any::install_default_drivers();
    // Lazy: for SQLite the file appears when the first `credit` starts.
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&d.database_url)
        .map_err(|e| format!("DATABASE_URL {}: {e}", d.database_url))?;
    js.get_or_create_stream(stream::Config {
        name: d.stream.clone(),
        subjects: vec![d.subject.clone()],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot create stream {}: {e}", d.stream))?;

    let result = demo_on(&d, &js, &pool, &credit, &logs).await;
    let _ = js.delete_stream(&d.stream).await;
    pool.close().await;
    drop(private);
    result
}

pub(crate) fn nats_answers(url: &str) -> bool {
    let host_port = url.split("://").last().unwrap_or(url).trim_end_matches('/');
    use std::net::ToSocketAddrs;
    host_port
        .to_socket_addrs()
        .map(|mut addrs| {
            addrs.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
        })
        .unwrap_or(false)
}

async fn demo_on(
    d: &Demo,
    js: &jetstream::Context,
    pool: &AnyPool,
    credit: &std::path::Path,
    logs: &std::path::Path,
) -> Result<(), String> {
    // Accounts of this run only, so that earlier runs and other data do not matter.
    let base: i64 = i64::from_str_radix(&d.run[..6], 16).map_err(|e| e.to_string())? * 1_000;
    let mut rng = XorShift(base as u64 | 1);
    let mut messages = Vec::new();
    let mut expected: BTreeMap<i64, i64> = BTreeMap::new();
    for i in 0..UNIQUE {
        let account = base + (rng.next() % ACCOUNTS as u64) as i64;
        let amount = (rng.next() % 100 + 1) as i64;
        *expected.entry(account).or_default() += amount;
        let body = serde_json::json!({ "id": format!("demo-{}-{i}", d.run), "account": account, "amount": amount });
        messages.push(serde_json::to_vec(&body).expect("json"));
    }
    // The copies go out right behind their original or later, as retries do.
    let mut publishes: Vec<&Vec<u8>> = messages.iter().collect();
    for (i, m) in messages.iter().enumerate() {
        if i % DUPLICATE_EVERY == 0 {
            let at = (i + (rng.next() % 50) as usize).min(publishes.len());
            publishes.insert(at, m);
        }
    }
    let published = publishes.len();
    println!(
        "publishing {published} messages to {} ({UNIQUE} unique, {} re-published copies)...",
        d.subject,
        published - UNIQUE
    );
    let mut acks = Vec::with_capacity(published);
    for m in &publishes {
        let ack = js
            .publish(d.subject.clone(), (*m).clone().into())
            .await
            .map_err(|e| format!("publish: {e}"))?;
        acks.push(ack);
    }
    for ack in acks {
        ack.await.map_err(|e| format!("publish ack: {e}"))?;
    }

    println!(
        "starting {INSTANCES} credit processes on durable consumer {} (logs in {})...",
        d.durable,
        logs.display()
    );
    let mut children = Vec::new();
    for n in 1..=INSTANCES {
        children.push(spawn(d, credit, &logs.join(format!("credit-{n}.log")))?);
    }

    let run = d.run.as_str();
    let started = Instant::now();
    let mut last = String::new();
    let done = loop {
        let applied = applied(pool, run).await;
        let pending = pending(js, d).await;
        let line = match pending {
            Some(p) => format!(
                "  applied {applied:>5} / {UNIQUE} unique, {p:>5} messages still with JetStream"
            ),
            None => format!("  applied {applied:>5} / {UNIQUE} unique, waiting for the consumer"),
        };
        if line != last {
            println!("{line}");
            last = line;
        }
        if applied == UNIQUE as i64 && pending == Some(0) {
            break true;
        }
        if started.elapsed() > DEADLINE || children_exited(&mut children) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    let mut skipped = 0u64;
    for child in children {
        skipped += stop(child).await?.1;
    }
    if !done {
        return Err(format!(
            "the consumers did not finish within {DEADLINE:?} (or one exited); see {}",
            logs.display()
        ));
    }

    // Literals rather than binds: the Any driver does not translate placeholders, and these are
    // numbers the demo made.
    let sql = format!(
        "SELECT id, balance FROM accounts WHERE id BETWEEN {base} AND {}",
        base + ACCOUNTS
    );
    let balances: BTreeMap<i64, i64> = sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect();
    let wrong: Vec<_> = expected
        .iter()
        .filter(|(a, sum)| balances.get(a) != Some(sum))
        .collect();
    let applied = applied(pool, run).await;

    println!();
    println!("  published            {published:>6}");
    println!("  unique               {UNIQUE:>6}");
    println!("  applied              {applied:>6}");
    println!("  duplicates skipped   {skipped:>6}");
    println!(
        "  balances exact       {:>6}   ({} accounts, each equal to the sum of its unique credits)",
        if wrong.is_empty() { "yes" } else { "NO" },
        expected.len()
    );
    if !wrong.is_empty() {
        return Err(format!(
            "{} balances differ from the expected sums: {wrong:?}",
            wrong.len()
        ));
    }
    if applied != UNIQUE as i64 || skipped != (published - UNIQUE) as u64 {
        return Err("applied or skipped counts do not add up".into());
    }
    println!("\nexactly once: every message applied once, every duplicate skipped.");
    Ok(())
}

fn spawn(d: &Demo, credit: &std::path::Path, log: &std::path::Path) -> Result<Child, String> {
    let log = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    Command::new(credit)
        .env("NATS_URL", &d.nats_url)
        .env("DATABASE_URL", &d.database_url)
        .env("CREDIT_STREAM", &d.stream)
        .env("CREDIT_SUBJECT", &d.subject)
        .env("CREDIT_CONSUMER", &d.durable)
        .stdout(Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", credit.display()))
}

fn children_exited(children: &mut [Child]) -> bool {
    children
        .iter_mut()
        .any(|c| matches!(c.try_wait(), Ok(Some(_))))
}

/// SIGTERMs `child`, waits for it, and reads its `applied=` and `skipped=` counts.
async fn stop(mut child: Child) -> Result<(u64, u64), String> {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .map_err(|_| "credit did not stop within 30 s of SIGTERM".to_string())?
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out).await;
    }
    if !status.success() {
        return Err(format!("credit exited with {status}"));
    }
    let count = |name: &str| {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Ok((count("applied="), count("skipped=")))
}

/// Markers of this run's messages.
async fn applied(pool: &AnyPool, run: &str) -> i64 {
    // `run` is hex the demo made; a literal keeps the SQL the same on every backend.
    let sql = format!(
        "SELECT count(*) FROM inbox WHERE consumer = 'credit' AND message_key LIKE 'demo-{run}-%'"
    );
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql).into_sql_str())
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// Messages not yet acked on the demo's consumer; `None` until `credit` has created it.
async fn pending(js: &jetstream::Context, d: &Demo) -> Option<u64> {
    let stream = js.get_stream(&d.stream).await.ok()?;
    let mut consumer: jetstream::consumer::PullConsumer =
        stream.get_consumer(&d.durable).await.ok()?;
    let info = consumer.info().await.ok()?;
    Some(info.num_pending + info.num_ack_pending as u64)
}

/// A tiny deterministic generator; the demo needs variety, not quality.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
