//! `cargo xtask demo`: exactly-once consumption, shown end to end.
//!
//! Publishes a few thousand credit requests, a good share of them published again as a producer
//! retrying after a lost ack would (no `Nats-Msg-Id`, so the broker does not dedup), runs two
//! `credit` processes on one durable consumer, and checks that every balance is exact.

use async_nats::jetstream::{self, stream};
use sqlx::PgPool;
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
    let root = workspace_root();
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
    tokio::runtime::Runtime::new()
        .map_err(|e| e.to_string())?
        .block_on(demo(credit, root.join("target/demo")))
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
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
    let d = Demo {
        stream: format!("CREDITS_DEMO_{run}"),
        subject: format!("demo.{run}.credits"),
        durable: format!("credit_demo_{run}"),
        nats_url: std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        database_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        run,
    };
    let client = async_nats::connect(&d.nats_url)
        .await
        .map_err(|e| format!("NATS does not answer at {}: {e}", d.nats_url))?;
    let js = jetstream::new(client);
    let pool = PgPool::connect(&d.database_url)
        .await
        .map_err(|e| format!("the database does not answer at {}: {e}", d.database_url))?;
    js.get_or_create_stream(stream::Config {
        name: d.stream.clone(),
        subjects: vec![d.subject.clone()],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot create stream {}: {e}", d.stream))?;

    let result = demo_on(&d, &js, &pool, &credit, &logs).await;
    let _ = js.delete_stream(&d.stream).await;
    result
}

async fn demo_on(
    d: &Demo,
    js: &jetstream::Context,
    pool: &PgPool,
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

    std::fs::create_dir_all(logs).map_err(|e| e.to_string())?;
    println!(
        "starting {INSTANCES} credit processes on durable consumer {} (logs in {})...",
        d.durable,
        logs.display()
    );
    let mut children = Vec::new();
    for n in 1..=INSTANCES {
        children.push(spawn(d, credit, &logs.join(format!("credit-{n}.log")))?);
    }

    let like = format!("demo-{}-%", d.run);
    let started = Instant::now();
    let mut last = String::new();
    let done = loop {
        let applied = applied(pool, &like).await;
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

    let accounts: Vec<i64> = expected.keys().copied().collect();
    let balances: BTreeMap<i64, i64> =
        sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts WHERE id = ANY($1)")
            .bind(&accounts)
            .fetch_all(pool)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .collect();
    let wrong: Vec<_> = expected
        .iter()
        .filter(|(a, sum)| balances.get(a) != Some(sum))
        .collect();
    let applied = applied(pool, &like).await;

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

async fn applied(pool: &PgPool, like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM inbox WHERE consumer = 'credit' AND message_key LIKE $1",
    )
    .bind(like)
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
