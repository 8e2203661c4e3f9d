//! `cargo xtask demo`: exactly-once consumption, shown end to end.
//!
//! Publishes a few thousand credit requests, a good share of them published again as a producer
//! retrying after a lost ack would (no `Nats-Msg-Id`, so the broker does not dedup), runs two
//! `credit` processes on one durable consumer, and checks that every balance is exact.
//!
//! Then the `email` example (two-phase claims): a few hundred e-mail requests, a third of them
//! published twice, two `email` processes on one durable consumer calling a local HTTP sink that
//! answers one call in eight with a 503 and is slow on another; the sink counts calls per
//! `Idempotency-Key` and the demo prints messages, calls, distinct keys, and the keys called
//! more than once with why.
//!
//! The database is `DATABASE_URL`, else a SQLite file under `target/demo/`. NATS is `NATS_URL`
//! (default `nats://127.0.0.1:4222`); when nothing answers there, the demo runs a private
//! `nats-server` with JetStream in a temporary directory and stops it at the end.

use async_nats::jetstream::{self, stream};
use inbox_testkit::{
    CreditConfig, CreditProcess, EmailConfig, Flaky, Poll, PrivateNats, Sink, backlog,
    publish_and_wait, remove_sqlite_files, unique, why_again,
};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const UNIQUE: usize = 3_000;
const ACCOUNTS: i64 = 50;
/// One message in this many is published a second time.
const DUPLICATE_EVERY: usize = 3;
const INSTANCES: usize = 2;
const DEADLINE: Duration = Duration::from_secs(300);

/// Runs the demo.
pub async fn run() -> Result<(), String> {
    println!("building the credit example (release)...");
    let credit = crate::build_credit(true)?;
    let logs = crate::workspace_root().join("target/demo");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;

    let run = unique("")[..8].to_owned();
    let database_url = match std::env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => {
            // A fresh file each run, so that the numbers below are this run's alone.
            let file = logs.join("credit.db");
            remove_sqlite_files(&file);
            format!("sqlite://{}", file.display())
        }
    };
    let requested_nats =
        std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let host_port = requested_nats
        .split("://")
        .last()
        .unwrap_or(&requested_nats);
    let private = if crate::services::answers(host_port.trim_end_matches('/')).await {
        None
    } else {
        let nats = PrivateNats::start().await.map_err(|e| {
            format!("no NATS answers at NATS_URL ({requested_nats}) and none could be started: {e}")
        })?;
        println!("started a private nats-server on port {}", nats.port);
        Some(nats)
    };
    let config = CreditConfig {
        binary: credit,
        nats_url: private.as_ref().map_or(requested_nats, |p| p.url.clone()),
        database_url,
        stream: format!("CREDITS_DEMO_{run}"),
        subject: format!("demo.{run}.credits"),
        consumer: format!("credit_demo_{run}"),
        rust_log: "info".into(),
    };
    println!("NATS:     {}", config.nats_url);
    println!("database: {}", config.database_url);
    let js = jetstream::new(inbox_testkit::connect(&config.nats_url).await?);
    sqlx::any::install_default_drivers();
    // Lazy: for SQLite the file appears when the first `credit` starts.
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&config.database_url)
        .map_err(|e| format!("DATABASE_URL {}: {e}", config.database_url))?;
    js.get_or_create_stream(stream::Config {
        name: config.stream.clone(),
        subjects: vec![config.subject.clone()],
        // Finite, as `credit`'s cleanup requires.
        max_age: std::time::Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot create stream {}: {e}", config.stream))?;

    let mut result = demo_on(&config, &run, &js, &pool, &logs).await;
    let _ = js.delete_stream(&config.stream).await;
    if result.is_ok() {
        result = email_demo(&config, &run, &js, &pool, &logs).await;
    }
    pool.close().await;
    drop(private);
    result
}

async fn demo_on(
    config: &CreditConfig,
    run: &str,
    js: &jetstream::Context,
    pool: &AnyPool,
    logs: &Path,
) -> Result<(), String> {
    // Accounts of this run only, so that earlier runs and other data do not matter.
    let base: i64 = i64::from_str_radix(&run[..6], 16).map_err(|e| e.to_string())? * 1_000;
    let mut rng = XorShift(base as u64 | 1);
    let mut messages = Vec::new();
    let mut expected: BTreeMap<i64, i64> = BTreeMap::new();
    for i in 0..UNIQUE {
        let account = base + (rng.next() % ACCOUNTS as u64) as i64;
        let amount = (rng.next() % 100 + 1) as i64;
        *expected.entry(account).or_default() += amount;
        let body = serde_json::json!({ "id": format!("demo-{run}-{i}"), "account": account, "amount": amount });
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
        config.subject,
        published - UNIQUE
    );
    publish_and_wait(js, &config.subject, publishes.into_iter().cloned()).await?;

    println!(
        "starting {INSTANCES} credit processes on durable consumer {} (logs in {})...",
        config.consumer,
        logs.display()
    );
    let mut children = Vec::new();
    for n in 1..=INSTANCES {
        let log = logs.join(format!("credit-{n}.log"));
        let _ = std::fs::remove_file(&log);
        children.push(CreditProcess::spawn(config, Some(&log))?);
    }

    let mut poll = Poll::new("the consumers to finish", DEADLINE);
    let mut last = String::new();
    let done = loop {
        let applied = applied(pool, run).await;
        let pending = backlog(js, &config.stream, &config.consumer).await.ok();
        let line = match pending {
            Some(p) => format!(
                "  applied {applied:>5} / {UNIQUE} unique, {:>5} messages still with JetStream",
                p.pending + p.ack_pending as u64
            ),
            None => format!("  applied {applied:>5} / {UNIQUE} unique, waiting for the consumer"),
        };
        if line != last {
            println!("{line}");
            last = line;
        }
        if applied == UNIQUE as i64 && pending.is_some_and(|p| p.drained()) {
            break true;
        }
        if children.iter_mut().any(CreditProcess::has_exited) || poll.tick().await.is_err() {
            break false;
        }
    };

    let mut skipped = 0u64;
    let mut stop_failed = None;
    for child in children {
        match child.stop(Duration::from_secs(30)).await {
            Ok(summary) => skipped += summary.skipped,
            Err(e) => stop_failed = stop_failed.or(Some(e)),
        }
    }
    if !done {
        return Err(format!(
            "the consumers did not finish within {DEADLINE:?} (or one exited); see {}",
            logs.display()
        ));
    }
    if let Some(e) = stop_failed {
        return Err(e);
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

/// E-mail requests in the email part.
const EMAILS: usize = 300;

/// The email part: two `email` processes, a flaky sink, duplicates; every request called under
/// one idempotency key, done once.
async fn email_demo(
    credit: &CreditConfig,
    run: &str,
    js: &jetstream::Context,
    pool: &AnyPool,
    logs: &Path,
) -> Result<(), String> {
    println!("\n--- two-phase claims: the email example ---");
    let binary = crate::build_example("email", true)?;
    let sink = Sink::start().await?;
    sink.flaky(Some(Flaky {
        every: 8,
        fail: 3,
        slow: 5,
        slow_for: Duration::from_millis(300),
    }));
    let config = EmailConfig {
        binary,
        nats_url: credit.nats_url.clone(),
        database_url: credit.database_url.clone(),
        stream: format!("EMAILS_DEMO_{run}"),
        subject: format!("demo.{run}.emails"),
        consumer: format!("email_demo_{run}"),
        api_url: sink.url.clone(),
        lease: Duration::from_secs(2),
        hold_before_call: Duration::ZERO,
        concurrency: None,
        rust_log: "info".into(),
    };
    let mut requests = Vec::new();
    for i in 0..EMAILS {
        let body = serde_json::json!({
            "id": format!("email-{run}-{i}"),
            "to": format!("user{i}@example.com"),
            "body": "your receipt",
        });
        let json = serde_json::to_vec(&body).expect("json");
        if i % DUPLICATE_EVERY == 0 {
            requests.push(json.clone());
        }
        requests.push(json);
    }
    println!(
        "starting 2 email processes (lease {:?}) calling a local HTTP sink at {} that answers one call in 8 with a 503 ...",
        config.lease, sink.url
    );
    let mut children = Vec::new();
    for n in 1..=2 {
        let log = logs.join(format!("email-{n}.log"));
        let _ = std::fs::remove_file(&log);
        children.push(config.spawn(Some(&log))?);
    }
    // The processes create the stream; publish once it exists.
    let mut poll = Poll::new("the email stream", DEADLINE);
    while js.get_stream(&config.stream).await.is_err() {
        if children.iter_mut().any(CreditProcess::has_exited) {
            return Err(format!("an email process exited; see {}", logs.display()));
        }
        poll.tick().await?;
    }
    let published = requests.len();
    println!(
        "publishing {published} e-mail requests to {} ({EMAILS} unique, {} re-published copies)...",
        config.subject,
        published - EMAILS
    );
    publish_and_wait(js, &config.subject, requests).await?;
    let done_sql = format!(
        "SELECT count(*) FROM inbox WHERE consumer = 'email' AND processed_at IS NOT NULL \
         AND message_key LIKE 'email-{run}-%'"
    );
    let mut poll = Poll::new("the e-mails to be sent", DEADLINE);
    let finished = loop {
        let done: i64 = sqlx::query_scalar(AssertSqlSafe(done_sql.clone()))
            .fetch_one(pool)
            .await
            .unwrap_or(0);
        let drained = backlog(js, &config.stream, &config.consumer)
            .await
            .is_ok_and(|b| b.drained());
        if done == EMAILS as i64 && drained {
            break true;
        }
        if children.iter_mut().any(CreditProcess::has_exited) || poll.tick().await.is_err() {
            break false;
        }
    };
    let mut applied = 0;
    let mut skipped = 0;
    for child in children {
        let summary = child.stop(Duration::from_secs(30)).await?;
        applied += summary.applied;
        skipped += summary.skipped;
    }
    let _ = js.delete_stream(&config.stream).await;
    if !finished {
        return Err(format!(
            "the e-mails were not all sent within {DEADLINE:?} (or a process exited); see {}",
            logs.display()
        ));
    }
    let by_key = sink.by_key();
    let calls: usize = by_key.values().map(Vec::len).sum();
    let mut again: BTreeMap<&'static str, usize> = BTreeMap::new();
    for calls in by_key.values().filter(|c| c.len() > 1) {
        *again.entry(why_again(calls)).or_default() += 1;
    }
    let overlapping = inbox_testkit::overlaps(&by_key);
    let succeeded = by_key
        .values()
        .filter(|c| c.iter().any(|c| c.status == Some(200)))
        .count();
    println!();
    println!("  messages published          {published:>6}");
    println!("  unique requests             {EMAILS:>6}");
    println!("  sent (claims done)          {applied:>6}");
    println!("  duplicates skipped          {skipped:>6}");
    println!("  calls to the API            {calls:>6}");
    println!("  distinct idempotency keys   {:>6}", by_key.len());
    println!("  keys answered 200           {succeeded:>6}");
    println!(
        "  keys called more than once  {:>6}",
        again.values().sum::<usize>()
    );
    for (why, n) in &again {
        println!("      {n:>4}  {why}");
    }
    println!("  overlapping calls for a key {:>6}", overlapping.len());
    if by_key.len() != EMAILS || succeeded != EMAILS || applied != EMAILS as u64 {
        return Err("calls, keys and sent e-mails do not add up".into());
    }
    if !overlapping.is_empty() || again.contains_key("called again after a success") {
        return Err(format!(
            "a key was called twice at once or after a success: {overlapping:?}"
        ));
    }
    println!(
        "\nonce per key: every request sent under one idempotency key, retried only after a 503, never twice at once."
    );
    Ok(())
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
