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
    CreditConfig, CreditProcess, EmailConfig, Flaky, Poll, PrivateNats, Sink, TcpProxy, backlog,
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
        result = chain_demo(&config, &run, &js, &pool, &logs).await;
    }
    let _ = js.delete_stream(config.events_stream()).await;
    if result.is_ok() {
        result = email_demo(&config, &run, &js, &pool, &logs).await;
    }
    if result.is_ok() {
        result = orders_demo(&config, &run, &js, &pool, &logs).await;
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

/// The chain part: what `credit` announced through its outbox, consumed by `statements` with an
/// inbox of its own; a third of the events published again (as a producer retrying after the
/// duplicate window would), which `statements` must skip.
async fn chain_demo(
    credit: &CreditConfig,
    run: &str,
    js: &jetstream::Context,
    pool: &AnyPool,
    logs: &Path,
) -> Result<(), String> {
    let (events, subject) = (credit.events_stream(), credit.events_subject());
    println!(
        "\n--- a chain: credit's outbox -> {subject} -> the statements example (an inbox of its own) ---"
    );
    let binary = crate::build_example("statements", true)?;
    let what = |e: &dyn std::fmt::Display| format!("events stream {events}: {e}");
    let mut stream = js.get_stream(&events).await.map_err(|e| what(&e))?;
    let announced = stream.info().await.map_err(|e| what(&e))?.state.messages;
    let mut copies = Vec::new();
    for seq in (1..=announced).step_by(DUPLICATE_EVERY) {
        let m = stream.get_raw_message(seq).await.map_err(|e| what(&e))?;
        copies.push(m.payload.to_vec());
    }
    println!(
        "credit announced {announced} credits in {events} (one event per applied request, published by its relay with the outbox row's id as Nats-Msg-Id)"
    );
    println!(
        "publishing {} of them again without a Nats-Msg-Id, as a retry after the duplicate window would...",
        copies.len()
    );
    let republished = copies.len();
    publish_and_wait(js, &subject, copies).await?;
    let durable = format!("statements_demo_{run}");
    let env = [
        ("NATS_URL", credit.nats_url.clone()),
        ("DATABASE_URL", credit.database_url.clone()),
        ("STATEMENTS_STREAM", events.clone()),
        ("STATEMENTS_SUBJECT", subject.clone()),
        ("STATEMENTS_CONSUMER", durable.clone()),
        ("RUST_LOG", "info".to_owned()),
    ];
    println!("starting 2 statements processes on durable consumer {durable}...");
    let mut children = Vec::new();
    for n in 1..=2 {
        let log = logs.join(format!("statements-{n}.log"));
        let _ = std::fs::remove_file(&log);
        children.push(CreditProcess::spawn_with(
            "statements",
            &binary,
            &env,
            Some(&log),
        )?);
    }
    let lines_sql =
        format!("SELECT count(*) FROM statement_lines WHERE request_id LIKE 'demo-{run}-%'");
    let finished = until_done("the statement lines", &mut children, async || {
        count(pool, &lines_sql).await == UNIQUE as i64
            && backlog(js, &events, &durable)
                .await
                .is_ok_and(|b| b.drained())
    })
    .await;
    let (applied, skipped) = stop_all(children).await?;
    if !finished {
        return Err(format!(
            "the statement lines were not all written within {DEADLINE:?} (or a process exited); see {}",
            logs.display()
        ));
    }
    let lines = count(pool, &lines_sql).await;
    // Each account's statement adds up to its balance.
    let differ_sql = format!(
        "SELECT count(*) FROM (SELECT account, SUM(amount) AS total FROM statement_lines \
         WHERE request_id LIKE 'demo-{run}-%' GROUP BY account) s \
         JOIN accounts a ON a.id = s.account WHERE a.balance <> s.total"
    );
    let differ = count(pool, &differ_sql).await;
    summary(&[
        (
            "announced",
            announced.to_string(),
            "events credit's relay published",
        ),
        (
            "re-published",
            republished.to_string(),
            "copies without a Nats-Msg-Id",
        ),
        ("statement lines", lines.to_string(), ""),
        (
            "duplicates skipped",
            skipped.to_string(),
            "by the statements inbox",
        ),
        (
            "statements match balances",
            if differ == 0 { "yes" } else { "NO" }.to_owned(),
            "each account's lines add up to its balance",
        ),
    ]);
    if announced != UNIQUE as u64 || lines != UNIQUE as i64 || applied != UNIQUE as u64 {
        return Err(format!(
            "announced {announced}, statement lines {lines}, applied {applied}: each should be {UNIQUE}"
        ));
    }
    if skipped != republished as u64 || differ != 0 {
        return Err(format!(
            "skipped {skipped} of {republished} copies; {differ} accounts' statements differ from their balances"
        ));
    }
    println!(
        "\nexactly once along the chain: every applied credit announced once, and written once downstream."
    );
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
    stream_created(js, &config.stream, &mut children, logs).await?;
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
    let finished = until_done("the e-mails to be sent", &mut children, async || {
        count(pool, &done_sql).await == EMAILS as i64
            && backlog(js, &config.stream, &config.consumer)
                .await
                .is_ok_and(|b| b.drained())
    })
    .await;
    let (applied, skipped) = stop_all(children).await?;
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
    let whys: Vec<String> = again.iter().map(|(why, n)| format!("{n} {why}")).collect();
    summary(&[
        ("messages published", published.to_string(), ""),
        ("unique requests", EMAILS.to_string(), ""),
        ("sent (claims done)", applied.to_string(), ""),
        ("duplicates skipped", skipped.to_string(), ""),
        ("calls to the API", calls.to_string(), ""),
        ("distinct idempotency keys", by_key.len().to_string(), ""),
        ("keys answered 200", succeeded.to_string(), ""),
        (
            "keys called more than once",
            again.values().sum::<usize>().to_string(),
            &whys.join("; "),
        ),
        (
            "overlapping calls for a key",
            overlapping.len().to_string(),
            "",
        ),
    ]);
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

/// Orders in the orders part, and stock adjustments.
const ORDERS: usize = 600;
const ADJUSTMENTS: usize = 200;

/// The orders part: two handlers on one `App` per process (orders keyed on an integer in the
/// payload, stock adjustments on an `Idempotency-Key` header sent as other producers send it),
/// two processes, duplicates of both; `/metrics` sampled while they work; then SIGTERM drains.
async fn orders_demo(
    credit: &CreditConfig,
    run: &str,
    js: &jetstream::Context,
    pool: &AnyPool,
    logs: &Path,
) -> Result<(), String> {
    println!("\n--- two handlers in one process: the orders example ---");
    let binary = crate::build_example("orders", true)?;
    let stream = format!("ORDERS_DEMO_{run}");
    let prefix = format!("demo.{run}.orders");
    let metrics_port = TcpProxy::reserve()?.port;
    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    let base: i64 = i64::from_str_radix(&run[..6], 16).map_err(|e| e.to_string())? * 10_000;
    let mut children = Vec::new();
    for n in 1..=2 {
        let mut env = vec![
            ("NATS_URL", credit.nats_url.clone()),
            ("DATABASE_URL", credit.database_url.clone()),
            ("ORDERS_STREAM", stream.clone()),
            ("ORDERS_SUBJECT_PREFIX", prefix.clone()),
            ("RUST_LOG", "info".to_owned()),
        ];
        if n == 1 {
            env.push(("METRICS_ADDR", format!("127.0.0.1:{metrics_port}")));
        }
        let log = logs.join(format!("orders-{n}.log"));
        let _ = std::fs::remove_file(&log);
        children.push(CreditProcess::spawn_with(
            "orders",
            &binary,
            &env,
            Some(&log),
        )?);
    }
    println!(
        "starting 2 orders processes (handlers `orders` and `inventory` on one App each); metrics of the first at {metrics}"
    );
    stream_created(js, &stream, &mut children, logs).await?;
    let sku = |i: usize| format!("sku-{run}-{}", i % 10);
    let mut orders = Vec::new();
    for i in 0..ORDERS {
        let body = serde_json::json!({ "order_id": base + i as i64, "sku": sku(i), "quantity": 1 });
        let json = serde_json::to_vec(&body).expect("json");
        if i % DUPLICATE_EVERY == 0 {
            orders.push(json.clone());
        }
        orders.push(json);
    }
    let published_orders = orders.len();
    println!(
        "publishing {published_orders} orders ({ORDERS} unique) and {} stock adjustments ({ADJUSTMENTS} unique, keyed on an Idempotency-Key header, half as nats-py spells it)...",
        ADJUSTMENTS + ADJUSTMENTS.div_ceil(DUPLICATE_EVERY)
    );
    publish_and_wait(js, &format!("{prefix}.placed"), orders).await?;
    let stock_subject = format!("{prefix}.stock");
    for i in 0..ADJUSTMENTS {
        let key = format!("adj-{run}-{i}");
        let header = if i % 2 == 0 {
            "idempotency-key"
        } else {
            "Idempotency-Key"
        };
        let body = serde_json::json!({ "sku": sku(i), "delta": 2 });
        let json = serde_json::to_vec(&body).expect("json");
        let copies = if i % DUPLICATE_EVERY == 0 { 2 } else { 1 };
        for _ in 0..copies {
            inbox_testkit::publish_raw(&credit.nats_url, &stock_subject, &[(header, &key)], &json)
                .await?;
        }
    }
    let sample = sample_metrics(&metrics).await;
    println!("  /metrics while they work:");
    for line in &sample {
        println!("    {line}");
    }
    let done_sql = format!(
        "SELECT (SELECT count(*) FROM orders WHERE id >= {base} AND id < {}) \
         + (SELECT count(*) FROM inbox WHERE consumer = 'inventory' AND message_key LIKE 'adj-{run}-%')",
        base + ORDERS as i64
    );
    let finished = until_done("the orders to be applied", &mut children, async || {
        count(pool, &done_sql).await == (ORDERS + ADJUSTMENTS) as i64
    })
    .await;
    let after = sample_metrics(&metrics).await;
    let (applied, skipped) = stop_all(children).await?;
    let _ = js.delete_stream(&stream).await;
    if !finished {
        return Err(format!(
            "the orders were not all applied within {DEADLINE:?} (or a process exited); see {}",
            logs.display()
        ));
    }
    let stock_sql = format!(
        "SELECT count(*), sum(on_hand), sum(reserved) FROM stock WHERE sku LIKE 'sku-{run}-%'"
    );
    let (skus, on_hand, reserved): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(stock_sql))
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
    println!("  /metrics once done:");
    for line in &after {
        println!("    {line}");
    }
    println!();
    println!("  messages applied           {applied:>6}");
    println!("  duplicates skipped         {skipped:>6}");
    println!("  stock reserved             {reserved:>6}   (expected {ORDERS}, one per order)");
    println!(
        "  stock on hand              {on_hand:>6}   (expected {}, 2 per adjustment) over {skus} skus",
        2 * ADJUSTMENTS
    );
    if applied != (ORDERS + ADJUSTMENTS) as u64
        || reserved != ORDERS as i64
        || on_hand != 2 * ADJUSTMENTS as i64
    {
        return Err("orders, adjustments and stock do not add up".into());
    }
    if after == sample || !after.iter().any(|l| l.contains("outcome=\"ack\"")) {
        return Err(format!(
            "the metrics did not move: {sample:?} then {after:?}"
        ));
    }
    println!("\nonce per order and per header key, across two handlers and two processes.");
    Ok(())
}

/// The `inbox_messages_total` lines of the Prometheus text at `url` (empty if it does not
/// answer), by a plain HTTP/1.0 request.
async fn sample_metrics(url: &str) -> Vec<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(rest) = url.strip_prefix("http://") else {
        return Vec::new();
    };
    let (addr, path) = rest.split_once('/').unwrap_or((rest, ""));
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return Vec::new();
    };
    let request = format!("GET /{path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut body = String::new();
    if stream.write_all(request.as_bytes()).await.is_err()
        || stream.read_to_string(&mut body).await.is_err()
    {
        return Vec::new();
    }
    let mut lines: Vec<String> = body
        .lines()
        .filter(|l| l.starts_with("inbox_messages_total"))
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// Waits until stream `name` exists (the processes create it), failing if one of `children`
/// exits first.
async fn stream_created(
    js: &jetstream::Context,
    name: &str,
    children: &mut [CreditProcess],
    logs: &Path,
) -> Result<(), String> {
    let mut poll = Poll::new(&format!("stream {name}"), DEADLINE);
    while js.get_stream(name).await.is_err() {
        if children.iter_mut().any(CreditProcess::has_exited) {
            return Err(format!("a process exited; see {}", logs.display()));
        }
        poll.tick().await?;
    }
    Ok(())
}

/// Polls `done` until it holds (`true`), a child exits or the deadline passes (`false`).
async fn until_done(
    what: &str,
    children: &mut [CreditProcess],
    mut done: impl AsyncFnMut() -> bool,
) -> bool {
    let mut poll = Poll::new(what, DEADLINE);
    loop {
        if done().await {
            return true;
        }
        if children.iter_mut().any(CreditProcess::has_exited) || poll.tick().await.is_err() {
            return false;
        }
    }
}

/// Stops every child with SIGTERM; what they applied and skipped, added up.
async fn stop_all(children: Vec<CreditProcess>) -> Result<(u64, u64), String> {
    let (mut applied, mut skipped) = (0, 0);
    for child in children {
        let summary = child.stop(Duration::from_secs(30)).await?;
        applied += summary.applied;
        skipped += summary.skipped;
    }
    Ok((applied, skipped))
}

/// The number `sql` counts (0 when it fails).
async fn count(pool: &AnyPool, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// A progress bar of `total` `what` (drawn only on a terminal).
fn progress(total: usize, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "  {{bar:40}} {{pos:>5}}/{{len}} {what}, {{msg}}"
    ))
    .expect("a valid template");
    bar.set_style(style);
    bar
}

/// Prints `rows` (label, value, note) as a table.
fn summary(rows: &[(&str, String, &str)]) {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    for (label, value, note) in rows {
        table.add_row([label.to_string(), value.clone(), note.to_string()]);
    }
    if let Some(c) = table.column_mut(1) {
        c.set_cell_alignment(comfy_table::CellAlignment::Right);
    }
    println!("\n{table}");
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
