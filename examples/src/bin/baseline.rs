//! `baseline`: what `cargo xtask bench` measures the framework against, written without it.
//!
//! - `baseline loop`: the database's limit. `BENCH_CONCURRENCY` tasks run `BENCH_MESSAGES`
//!   transactions in all, each the same as a credit's: BEGIN, the claim (an insert into the inbox
//!   table), the balance upsert, COMMIT. No NATS. Prints `ready` once connected, then one line
//!   `done {json}` (elapsed seconds, transaction and claim latencies), then waits for its stdin
//!   to close, so that the bench can read its CPU time and peak memory before it exits.
//! - `baseline consumer`: what a user writes instead of the framework, as well as we can: one
//!   long-lived pull (async-nats's message stream, with heartbeats), `BENCH_CONCURRENCY`
//!   messages at once, each BEGIN, claim, upsert (unless a duplicate), COMMIT, ack. Prints
//!   `ready`, then runs until its stdin closes.
//!
//! Environment: `DATABASE_URL` (as for `credit`), and for the consumer `NATS_URL`,
//! `CREDIT_STREAM`, `CREDIT_CONSUMER` (an existing durable pull consumer).
//!
//! Both use the inbox table `Inbox::migrate` creates and the `accounts` table of `credit`, so
//! that every contender writes the same rows into the same indexes.

use futures::StreamExt;
use inbox_examples::CreditRequested;
use sqlx::pool::PoolOptions;
use sqlx::{Database, MySql, Pool, Postgres, Sqlite};
use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One backend's SQL for the credit transaction.
struct Sql {
    /// Inserts finished markers of another run numbered from the first bind, as many as the
    /// second (at most 1,000,000): an old backlog, for timing the claim against a large inbox.
    preload: &'static str,
    begin: &'static str,
    claim: &'static str,
    upsert: &'static str,
    /// MySQL answers the claim with rows affected (1 new, 2 duplicate), the others with a row.
    returns_row: bool,
}

const POSTGRES: Sql = Sql {
    preload: "INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
              SELECT 'credit', 'old-' || ($1 + a.n * 1000 + b.n), now(), now() \
              FROM generate_series(0, 999) a(n), generate_series(0, 999) b(n) \
              WHERE a.n * 1000 + b.n < $2",
    begin: "BEGIN",
    claim: "INSERT INTO inbox (consumer, message_key, processed_at) VALUES ($1, $2, now()) \
            ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id",
    upsert: "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    returns_row: true,
};

const MYSQL: Sql = Sql {
    preload: "INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
              WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999) \
              SELECT 'credit', CONCAT('old-', ? + a.n * 1000 + b.n), NOW(6), NOW(6) \
              FROM d a, d b WHERE a.n * 1000 + b.n < ?",
    begin: "BEGIN",
    claim: "INSERT INTO inbox (consumer, message_key, processed_at) VALUES (?, ?, NOW(6)) \
            ON DUPLICATE KEY UPDATE dup_count = dup_count + 1",
    upsert: "INSERT INTO accounts (id, balance) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
    returns_row: false,
};

const SQLITE: Sql = Sql {
    preload: "WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999) \
              INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
              SELECT 'credit', 'old-' || (?1 + a.n * 1000 + b.n), \
                     strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
              FROM d a, d b WHERE a.n * 1000 + b.n < ?2",
    begin: "BEGIN IMMEDIATE",
    claim: "INSERT INTO inbox (consumer, message_key, processed_at) \
            VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
            ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id",
    upsert: "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
             ON CONFLICT (id) DO UPDATE SET balance = balance + excluded.balance",
    returns_row: true,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> std::process::ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(&mode)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("baseline {mode}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn var(name: &str) -> Result<String, Error> {
    std::env::var(name).map_err(|_| format!("{name} is not set").into())
}

async fn run(mode: &str) -> Result<(), Error> {
    if mode != "loop" && mode != "consumer" {
        return Err("usage: baseline loop|consumer".into());
    }
    let url = var("DATABASE_URL")?;
    let concurrency: usize = var("BENCH_CONCURRENCY")?.parse()?;
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    match scheme {
        "postgres" | "postgresql" => {
            let pool = server_pool::<Postgres>(concurrency).connect(&url).await?;
            inbox_examples::create_accounts_postgres(&pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            contend(mode, pool, &POSTGRES, concurrency).await
        }
        "mysql" | "mariadb" => {
            let pool = server_pool::<MySql>(concurrency).connect(&url).await?;
            inbox_examples::create_accounts_mysql(&pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            contend(mode, pool, &MYSQL, concurrency).await
        }
        "sqlite" => {
            let options = inbox_runtime::sqlite_options(&url)?;
            let pool = PoolOptions::<Sqlite>::new()
                .max_connections(1)
                .test_before_acquire(false)
                .connect_with(options)
                .await?;
            inbox_examples::create_accounts_sqlite(&pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            contend(mode, pool, &SQLITE, 1).await
        }
        _ => Err(format!("DATABASE_URL scheme {scheme:?} is not supported").into()),
    }
}

fn server_pool<DB: Database>(size: usize) -> PoolOptions<DB> {
    PoolOptions::new()
        .max_connections(size as u32)
        .min_connections(size as u32)
        .test_before_acquire(false)
}

async fn contend<DB: Credit>(
    mode: &str,
    pool: Pool<DB>,
    sql: &'static Sql,
    c: usize,
) -> Result<(), Error> {
    if mode == "loop" {
        db_loop(pool, sql, c).await
    } else {
        consume(pool, sql, c).await
    }
}

/// `rows_affected`, which sqlx has on each backend's result but not generically.
trait RowsAffected {
    fn rows(&self) -> u64;
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// The credit transaction, for every database sqlx's generic executors can run it on.
trait Credit: Database {
    /// Runs it; returns how long the claim took, or `None` for a duplicate.
    fn credit<'a>(
        pool: &'a Pool<Self>,
        sql: &'static Sql,
        key: &'a str,
        account: i64,
        amount: i64,
    ) -> impl Future<Output = Result<Option<Duration>, sqlx::Error>> + Send + 'a;

    /// Inserts `rows` old markers, a million per statement.
    fn preload(
        pool: &Pool<Self>,
        sql: &'static Sql,
        rows: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl<DB> Credit for DB
where
    DB: Database<QueryResult: RowsAffected>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    async fn credit<'a>(
        pool: &'a Pool<DB>,
        sql: &'static Sql,
        key: &'a str,
        account: i64,
        amount: i64,
    ) -> Result<Option<Duration>, sqlx::Error> {
        let mut tx = pool.begin_with(sql.begin).await?;
        let started = Instant::now();
        let claim = sqlx::query::<DB>(sql.claim).bind("credit").bind(key);
        let new = if sql.returns_row {
            claim.fetch_optional(&mut *tx).await?.is_some()
        } else {
            // MySQL: 1 row affected for a new marker, 2 for a duplicate.
            claim.execute(&mut *tx).await?.rows() == 1
        };
        let claimed = started.elapsed();
        if !new {
            tx.rollback().await?;
            return Ok(None);
        }
        sqlx::query::<DB>(sql.upsert)
            .bind(account)
            .bind(amount)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(claimed))
    }

    async fn preload(pool: &Pool<DB>, sql: &'static Sql, rows: i64) -> Result<(), sqlx::Error> {
        let mut done = 0;
        while done < rows {
            let chunk = (rows - done).min(1_000_000);
            sqlx::query::<DB>(sql.preload)
                .bind(done)
                .bind(chunk)
                .execute(pool)
                .await?;
            done += chunk;
        }
        Ok(())
    }
}

/// Percentiles 50 and 99 of `samples`, in microseconds.
fn percentiles(samples: &mut [u32]) -> (u32, u32) {
    if samples.is_empty() {
        return (0, 0);
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

/// How many accounts the credits spread over (the bench publishes the same spread).
fn accounts() -> i64 {
    std::env::var("BENCH_ACCOUNTS")
        .ok()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000)
}

/// Contender 1: `BENCH_MESSAGES` credit transactions over `c` tasks, no NATS.
async fn db_loop<DB: Credit>(pool: Pool<DB>, sql: &'static Sql, c: usize) -> Result<(), Error> {
    let total: usize = var("BENCH_MESSAGES")?.parse()?;
    let accounts = accounts();
    let preload: i64 = std::env::var("BENCH_INBOX_ROWS").map_or(Ok(0), |r| r.parse())?;
    DB::preload(&pool, sql, preload).await?;
    let next = Arc::new(AtomicUsize::new(0));
    println!("ready");
    let started = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let (pool, next) = (pool.clone(), next.clone());
            tokio::spawn(async move {
                let (mut latency, mut claims) = (Vec::new(), Vec::new());
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok::<_, sqlx::Error>((latency, claims));
                    }
                    let key = format!("loop-{i}");
                    let t = Instant::now();
                    let claimed = DB::credit(&pool, sql, &key, i as i64 % accounts, 1).await?;
                    latency.push(t.elapsed().as_micros() as u32);
                    claims.extend(claimed.map(|d| d.as_micros() as u32));
                }
            })
        })
        .collect();
    let (mut latency, mut claims) = (Vec::new(), Vec::new());
    for task in tasks {
        let (l, c) = task.await??;
        latency.extend(l);
        claims.extend(c);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (p50, p99) = percentiles(&mut latency);
    let (claim50, claim99) = percentiles(&mut claims);
    println!(
        "done {}",
        serde_json::json!({
            "elapsed_s": elapsed,
            "latency_p50_us": p50,
            "latency_p99_us": p99,
            "claim_p50_us": claim50,
            "claim_p99_us": claim99,
        })
    );
    wait_for_stdin_to_close().await;
    Ok(())
}

async fn wait_for_stdin_to_close() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        std::io::stdin().read_to_end(&mut sink)
    })
    .await;
}

/// Contender 2: a hand-written JetStream consumer.
async fn consume<DB: Credit>(pool: Pool<DB>, sql: &'static Sql, c: usize) -> Result<(), Error> {
    let client = async_nats::connect(var("NATS_URL")?).await?;
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(var("CREDIT_STREAM")?).await?;
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(&var("CREDIT_CONSUMER")?).await?;
    let messages = consumer
        .stream()
        .max_messages_per_batch(c)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await?;
    println!("ready");
    let work = messages.for_each_concurrent(c, |message| {
        let pool = pool.clone();
        async move {
            let message = match message {
                Ok(message) => message,
                Err(e) => {
                    eprintln!("baseline consumer: pull: {e}");
                    return;
                }
            };
            let Ok(request) = serde_json::from_slice::<CreditRequested>(&message.payload) else {
                let _ = message.ack_with(async_nats::jetstream::AckKind::Term).await;
                return;
            };
            let credited =
                DB::credit(&pool, sql, &request.id, request.account, request.amount).await;
            match credited {
                Ok(_) => {
                    let _ = message.ack().await;
                }
                Err(e) => {
                    eprintln!("baseline consumer: {e}");
                    let nak = async_nats::jetstream::AckKind::Nak(Some(Duration::from_secs(1)));
                    let _ = message.ack_with(nak).await;
                }
            }
        }
    });
    tokio::select! {
        _ = work => Err("the message stream ended".into()),
        _ = wait_for_stdin_to_close() => Ok(()),
    }
}
