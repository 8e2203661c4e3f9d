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
//!
//! Its parts, one a module, run one after the other on the same NATS and database: `credit`,
//! then `chain` (credit's outbox into `statements`), `email`, `orders` and `operate` (debits
//! dead-lettered, the cause fixed, the letters replayed with the `inbox` command); `harness`
//! holds what they share.

mod chain;
mod credit;
mod email;
mod harness;
mod operate;
mod orders;

use async_nats::jetstream;
use harness::Part;
use inbox_testkit::{CreditConfig, PrivateNats, remove_sqlite_files, unique};
use sqlx::any::AnyPoolOptions;

/// One part of the demo, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Only {
    /// Credits, duplicated, two processes, balances exact.
    Credit,
    /// Credit's outbox into `statements` (runs `credit` first).
    Chain,
    /// Two-phase claims against a flaky HTTP sink.
    Email,
    /// Two handlers on one App.
    Orders,
    /// Dead letters fixed and replayed with the `inbox` command.
    Operate,
}

/// Runs the demo: every part, or `only` one; `timings` passes `--timings` to its build.
pub async fn run(only: Option<Only>, timings: bool) -> Result<(), String> {
    let runs = |part: Only| match only {
        None => true,
        // Chain reads what credit's outbox published.
        Some(Only::Chain) => matches!(part, Only::Credit | Only::Chain),
        Some(o) => o == part,
    };
    // Everything the parts run, built at once, before any part starts.
    println!(
        "building the demo's binaries (credit, statements, email, orders, inbox): \
         a few minutes from a fresh clone, seconds after..."
    );
    crate::workspace::build_demo(timings)?;
    let credit = crate::workspace::demo_binary("credit");
    let logs = crate::workspace::root().join("target/demo");
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
    harness::create_credit_stream(&js, &config).await?;

    let part = Part {
        credit: &config,
        run: &run,
        js: &js,
        pool: &pool,
        logs: &logs,
    };
    let mut result = Ok(());
    if runs(Only::Credit) {
        result = credit::run(part).await;
    }
    harness::delete_stream(&js, &config.stream).await;
    if result.is_ok() && runs(Only::Chain) {
        result = chain::run(part).await;
    }
    harness::delete_stream(&js, &config.events_stream()).await;
    if result.is_ok() && runs(Only::Email) {
        result = email::run(part).await;
    }
    if result.is_ok() && runs(Only::Orders) {
        result = orders::run(part).await;
    }
    if result.is_ok() && runs(Only::Operate) {
        result = operate::run(part).await;
    }
    pool.close().await;
    drop(private);
    result
}
