//! The demo's first part: a few thousand credit requests, a good share of them published again,
//! two `credit` processes on one durable consumer, and every balance checked exact.

use super::harness::{DEADLINE, DUPLICATE_EVERY, Part, progress, spawn_logged, summary};
use inbox_testkit::{CreditProcess, Poll, backlog, publish_and_wait};
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};
use std::collections::BTreeMap;
use std::time::Duration;

/// Unique credit requests; the chain part expects as many statement lines.
pub const UNIQUE: usize = 3_000;
/// Accounts the credits spread over.
const ACCOUNTS: i64 = 50;
/// `credit` processes on the consumer.
const INSTANCES: usize = 2;

/// Publishes the credits with copies, runs the processes until every credit is applied, and
/// checks every balance.
pub async fn run(part: Part<'_>) -> Result<(), String> {
    let Part {
        credit: config,
        run,
        js,
        pool,
        logs,
    } = part;
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
    let mut children = spawn_logged(logs, "credit", INSTANCES, |_, log| {
        CreditProcess::spawn(config, Some(log))
    })?;

    let mut poll = Poll::new("the consumers to finish", DEADLINE);
    let bar = progress(UNIQUE, "applied");
    let done = loop {
        let applied = applied(pool, run).await;
        let pending = backlog(js, &config.stream, &config.consumer).await.ok();
        bar.set_position(applied.max(0) as u64);
        bar.set_message(match pending {
            Some(p) => format!(
                "{} messages still with JetStream",
                p.pending + p.ack_pending as u64
            ),
            None => "waiting for the consumer".to_owned(),
        });
        if applied == UNIQUE as i64 && pending.is_some_and(|p| p.drained()) {
            break true;
        }
        if children.iter_mut().any(CreditProcess::has_exited) || poll.tick().await.is_err() {
            break false;
        }
    };
    bar.finish();

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

    summary(&[
        ("published", published.to_string(), ""),
        ("unique", UNIQUE.to_string(), ""),
        ("applied", applied.to_string(), ""),
        ("duplicates skipped", skipped.to_string(), ""),
        (
            "balances exact",
            if wrong.is_empty() { "yes" } else { "NO" }.to_owned(),
            &format!(
                "{} accounts, each equal to the sum of its unique credits",
                expected.len()
            ),
        ),
    ]);
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
    /// The next number.
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
