//! `baseline`: what `cargo xtask bench` measures the framework against, written without it.
//!
//! The credit transaction, the same as `credit`'s: BEGIN (SQLite: BEGIN IMMEDIATE), the claim
//! (an insert into the inbox table; a duplicate rolls back here), the balance change (`credit`'s
//! statements, [`BalanceSql`]), the outbox
//! row (the insert `Outbox::enqueue` runs: msg id = the request's id, subject
//! `CREDIT_EVENTS_SUBJECT`, order key = the account, the headers `credit` writes, the JSON of
//! [`CreditApplied`] as payload), COMMIT.
//!
//! - `baseline loop`: the database's limit. `BENCH_CONCURRENCY` tasks run `BENCH_MESSAGES`
//!   credit transactions in all. No NATS and no relay: the outbox rows stay pending, as pgbench
//!   would leave them running the same transaction. Prints `ready` once connected, then one line
//!   `done {json}` (elapsed seconds, transaction and claim latencies), then waits for its stdin
//!   to close, so that the bench can read its CPU time and peak memory before it exits.
//! - `baseline consumer`: what a user writes instead of the framework, as well as we can: one
//!   long-lived pull (async-nats's message stream, with heartbeats, `BENCH_CONCURRENCY` and at
//!   least two messages per pull request), `BENCH_CONCURRENCY`
//!   messages at once, each a credit transaction (a duplicate claims nothing and writes nothing)
//!   then an ack; and beside it, in a task of its own, a hand-written outbox relay looping:
//!   BEGIN, the oldest 100 pending rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL and
//!   MySQL/MariaDB; on SQLite, BEGIN IMMEDIATE holds its one writer), each published with
//!   `Nats-Msg-Id` = its msg id and `credit`'s `Content-Type` (all published, then all PubAcks
//!   awaited), one UPDATE marking them sent, COMMIT; a 10 ms sleep when none was pending; a
//!   failed pass is printed to stderr and tried again 100 ms later. At start it gets or creates
//!   the events stream (`CREDIT_EVENTS_STREAM` on `CREDIT_EVENTS_SUBJECT`, a two-minute
//!   duplicate window). Its pool has a connection more than `BENCH_CONCURRENCY`, for the relay
//!   (SQLite: one in all, shared). Prints `ready`, then runs until its stdin closes.
//!
//! Environment: `DATABASE_URL` (as for `credit`), `BENCH_ACCOUNTS` (the accounts the loop
//! spreads its credits over, default 1000), `CREDIT_EVENTS_SUBJECT` (default
//! `credits.applied`), and for the consumer `NATS_URL`, `CREDIT_STREAM`, `CREDIT_CONSUMER` (an
//! existing durable pull consumer) and `CREDIT_EVENTS_STREAM` (default `CREDIT_EVENTS`).
//!
//! Both use the inbox table `Inbox::migrate` creates, the outbox table `Outbox::migrate`
//! creates and the `accounts` table of `credit`, so that every contender writes the same rows
//! into the same indexes.

use async_nats::jetstream::{self, message::PublishMessage, stream};
use futures::StreamExt;
use inbox_examples::{
    BalanceSql, CreditApplied, CreditRequested, MYSQL_BALANCES, POSTGRES_BALANCES, RowsAffected,
    SQLITE_BALANCES,
};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Database, MySql, Pool, Postgres, Sqlite};
use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The outbox row's headers: `serde_json::to_string` of the (name, value) pairs
/// `OutboxMessage::json` gives `credit`'s event, `[("Content-Type", "application/json")]`.
const HEADERS: &str = r#"[["Content-Type","application/json"]]"#;

/// One backend's SQL for the credit transaction and the relay.
struct Sql {
    /// Inserts finished markers of another run numbered from the first bind, as many as the
    /// second (at most 1,000,000): an old backlog, for timing the claim against a large inbox.
    preload: &'static str,
    begin: &'static str,
    claim: &'static str,
    /// The balance change, as `credit` writes it.
    balances: BalanceSql,
    /// `Outbox::enqueue`'s insert: binds msg id, subject, order key, headers (JSON), payload.
    outbox_insert: &'static str,
    /// The relay's read: the oldest pending rows, locked where the database can pass over
    /// those another transaction holds.
    outbox_fetch: &'static str,
    /// What the runtime sets `sent_at` to (its `NOW_SQL`).
    now: &'static str,
    /// Whether the relay holds its rows locked while it publishes them (`FOR UPDATE SKIP
    /// LOCKED`); SQLite's relay does not, since a transaction there would hold its one writer
    /// (and the pool's one connection) for the PubAcks' round trip: it reads, publishes and then
    /// marks, a row published twice by two processes being one message by its `Nats-Msg-Id`.
    relay_locks: bool,
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
    balances: POSTGRES_BALANCES,
    outbox_insert: "INSERT INTO outbox (msg_id, subject, order_key, headers, payload) \
                    VALUES ($1, $2, $3, $4, $5)",
    outbox_fetch: "SELECT id, msg_id, subject, payload FROM outbox WHERE sent_at IS NULL \
                   ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
    now: "clock_timestamp()",
    returns_row: true,
    relay_locks: true,
};

const MYSQL: Sql = Sql {
    preload: "INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
              WITH RECURSIVE d(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999) \
              SELECT 'credit', CONCAT('old-', ? + a.n * 1000 + b.n), NOW(6), NOW(6) \
              FROM d a, d b WHERE a.n * 1000 + b.n < ?",
    // READ COMMITTED, as `credit` runs (no gap locks between the relay and the credits).
    begin: "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION",
    claim: "INSERT INTO inbox (consumer, message_key, processed_at) VALUES (?, ?, NOW(6)) \
            ON DUPLICATE KEY UPDATE dup_count = dup_count + 1",
    balances: MYSQL_BALANCES,
    outbox_insert: "INSERT INTO outbox (msg_id, subject, order_key, headers, payload) \
                    VALUES (?, ?, ?, ?, ?)",
    outbox_fetch: "SELECT id, msg_id, subject, payload FROM outbox WHERE sent_at IS NULL \
                   ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
    now: "CURRENT_TIMESTAMP(6)",
    returns_row: false,
    relay_locks: true,
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
    balances: SQLITE_BALANCES,
    outbox_insert: "INSERT INTO outbox (msg_id, subject, order_key, headers, payload) \
                    VALUES (?1, ?2, ?3, ?4, ?5)",
    // BEGIN IMMEDIATE holds the database's one writer already.
    outbox_fetch: "SELECT id, msg_id, subject, payload FROM outbox WHERE sent_at IS NULL \
                   ORDER BY id LIMIT 100",
    now: "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
    returns_row: true,
    relay_locks: false,
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
    // The consumer's relay takes a connection of its own.
    let pool_size = concurrency + usize::from(mode == "consumer");
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    match scheme {
        "postgres" | "postgresql" => {
            let pool = server_pool::<Postgres>(pool_size).connect(&url).await?;
            inbox_examples::create_accounts_postgres(&pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            inbox_runtime::Outbox::new(pool.clone()).migrate().await?;
            contend(mode, pool, &POSTGRES, concurrency).await
        }
        "mysql" | "mariadb" => {
            let pool = server_pool::<MySql>(pool_size).connect(&url).await?;
            inbox_examples::create_accounts_mysql(&pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            inbox_runtime::Outbox::new(pool.clone()).migrate().await?;
            contend(mode, pool, &MYSQL, concurrency).await
        }
        "sqlite" => {
            let options = inbox_runtime::sqlite_options(&url)?;
            // Lazy: the first connection (its PRAGMAs, WAL among them, need the file's lock)
            // opens within `set_up_sqlite`'s tries, not before them.
            let pool = PoolOptions::<Sqlite>::new()
                .max_connections(1)
                .test_before_acquire(false)
                .connect_lazy_with(options);
            set_up_sqlite(&pool).await?;
            contend(mode, pool, &SQLITE, 1).await
        }
        _ => Err(format!("DATABASE_URL scheme {scheme:?} is not supported").into()),
    }
}

/// Creates `pool`'s tables, trying again for up to a minute while SQLite refuses a writer:
/// processes that set up one file at once may be told SQLITE_BUSY at once, without its busy
/// timeout, where waiting could deadlock (as `credit` does, waiting the database out).
async fn set_up_sqlite(pool: &Pool<Sqlite>) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let tried = async {
            inbox_examples::create_accounts_sqlite(pool).await?;
            inbox_runtime::Inbox::new(pool.clone()).migrate().await?;
            inbox_runtime::Outbox::new(pool.clone()).migrate().await?;
            Ok::<_, Error>(())
        }
        .await;
        let busy = |e: &Error| {
            let sqlx = match e.downcast_ref::<sqlx::migrate::MigrateError>() {
                Some(sqlx::migrate::MigrateError::Execute(e)) => Some(e),
                _ => e.downcast_ref::<sqlx::Error>(),
            };
            sqlx.is_some_and(inbox_runtime::is_transient::<Sqlite>)
        };
        match tried {
            Err(e) if busy(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
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
    let subject: Arc<str> = std::env::var("CREDIT_EVENTS_SUBJECT")
        .unwrap_or_else(|_| "credits.applied".to_owned())
        .into();
    if mode == "loop" {
        db_loop(pool, sql, c, subject).await
    } else {
        consume(pool, sql, c, subject).await
    }
}

/// The credit transaction and the relay's pass, for every database sqlx's generic executors can
/// run them on.
trait Credit: Database {
    /// Runs it, announcing the credit on `subject`; returns how long the claim took, or `None`
    /// for a duplicate.
    fn credit<'a>(
        pool: &'a Pool<Self>,
        sql: &'static Sql,
        key: &'a str,
        account: i64,
        amount: i64,
        subject: &'a str,
    ) -> impl Future<Output = Result<Option<Duration>, Error>> + Send + 'a;

    /// One pass of the relay: publishes the oldest pending outbox rows and marks them sent, in
    /// one transaction; returns how many.
    fn relay_pass<'a>(
        pool: &'a Pool<Self>,
        sql: &'static Sql,
        js: &'a jetstream::Context,
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a;

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
    for<'q> Vec<u8>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64, String, String, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
{
    async fn credit<'a>(
        pool: &'a Pool<DB>,
        sql: &'static Sql,
        key: &'a str,
        account: i64,
        amount: i64,
        subject: &'a str,
    ) -> Result<Option<Duration>, Error> {
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
        sql.balances.apply::<DB>(&mut tx, account, amount).await?;
        // What `credit` announces, written as `Outbox::enqueue` writes it.
        let event = CreditApplied {
            id: key.to_owned(),
            account,
            amount,
        };
        let payload = serde_json::to_vec(&event).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let order_key = account.to_string();
        sqlx::query::<DB>(sql.outbox_insert)
            .bind(key)
            .bind(subject)
            .bind(order_key.as_str())
            .bind(HEADERS)
            .bind(payload)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(claimed))
    }

    async fn relay_pass<'a>(
        pool: &'a Pool<DB>,
        sql: &'static Sql,
        js: &'a jetstream::Context,
    ) -> Result<usize, Error> {
        let mut tx = match sql.relay_locks {
            true => Some(pool.begin_with(sql.begin).await?),
            false => None,
        };
        let fetch = sqlx::query_as::<DB, (i64, String, String, Vec<u8>)>(sql.outbox_fetch);
        let rows = match tx.as_mut() {
            Some(tx) => fetch.fetch_all(&mut **tx).await?,
            None => fetch.fetch_all(pool).await?,
        };
        if rows.is_empty() {
            if let Some(tx) = tx {
                tx.commit().await?;
            }
            return Ok(0);
        }
        // Every row published first, then every PubAck awaited.
        let mut ids = Vec::with_capacity(rows.len());
        let mut acks = Vec::with_capacity(rows.len());
        for (id, msg_id, subject, payload) in rows {
            let message = PublishMessage::build()
                .payload(payload.into())
                .header("Content-Type", "application/json")
                .message_id(msg_id);
            acks.push(js.send_publish(subject, message).await?);
            ids.push(id.to_string());
        }
        for ack in acks {
            ack.await?;
        }
        // The ids are the database's own integers; the statement changes with every batch, so
        // it runs unprepared.
        let mark = format!(
            "UPDATE outbox SET sent_at = {} WHERE id IN ({})",
            sql.now,
            ids.join(", ")
        );
        let mark = sqlx::raw_sql(AssertSqlSafe(mark));
        match tx {
            Some(mut tx) => {
                mark.execute(&mut *tx).await?;
                tx.commit().await?;
            }
            None => {
                mark.execute(pool).await?;
            }
        }
        Ok(ids.len())
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
async fn db_loop<DB: Credit>(
    pool: Pool<DB>,
    sql: &'static Sql,
    c: usize,
    subject: Arc<str>,
) -> Result<(), Error> {
    let total: usize = var("BENCH_MESSAGES")?.parse()?;
    let accounts = accounts();
    let preload: i64 = std::env::var("BENCH_INBOX_ROWS").map_or(Ok(0), |r| r.parse())?;
    DB::preload(&pool, sql, preload).await?;
    let next = Arc::new(AtomicUsize::new(0));
    println!("ready");
    let started = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let (pool, next, subject) = (pool.clone(), next.clone(), subject.clone());
            tokio::spawn(async move {
                let (mut latency, mut claims) = (Vec::new(), Vec::new());
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok::<_, Error>((latency, claims));
                    }
                    let key = format!("loop-{i}");
                    let t = Instant::now();
                    let account = i as i64 % accounts;
                    let claimed = DB::credit(&pool, sql, &key, account, 1, &subject).await?;
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

/// Contender 2: a hand-written JetStream consumer, and its outbox relay.
async fn consume<DB: Credit>(
    pool: Pool<DB>,
    sql: &'static Sql,
    c: usize,
    subject: Arc<str>,
) -> Result<(), Error> {
    let client = async_nats::connect(var("NATS_URL")?).await?;
    let js = async_nats::jetstream::new(client);
    let events = std::env::var("CREDIT_EVENTS_STREAM").unwrap_or_else(|_| "CREDIT_EVENTS".into());
    js.get_or_create_stream(stream::Config {
        name: events,
        subjects: vec![subject.to_string()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await?;
    let stream = js.get_stream(var("CREDIT_STREAM")?).await?;
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(&var("CREDIT_CONSUMER")?).await?;
    // At least two per pull request: with one, async-nats 0.51's stream counts the next
    // request's message before the request itself when the reply outruns its own bookkeeping,
    // then believes a message is still coming and waits out the request's 30 s expiry (seen
    // as "missed idle heartbeat" stalls on SQLite, whose concurrency is 1).
    let messages = consumer
        .stream()
        .max_messages_per_batch(c.max(2))
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await?;
    println!("ready");
    let work = messages.for_each_concurrent(c, |message| {
        let (pool, subject) = (pool.clone(), subject.clone());
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
            let (id, account, amount) = (&request.id, request.account, request.amount);
            let credited = DB::credit(&pool, sql, id, account, amount, &subject).await;
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
    let relay = tokio::spawn(relay(pool.clone(), sql, js));
    let stopped = tokio::select! {
        _ = work => Err("the message stream ended".into()),
        _ = wait_for_stdin_to_close() => Ok(()),
    };
    relay.abort();
    stopped
}

/// The hand-written outbox relay: passes one after the other, a 10 ms sleep when nothing was
/// pending, 100 ms after a failure (printed to stderr). Runs until aborted.
async fn relay<DB: Credit>(pool: Pool<DB>, sql: &'static Sql, js: jetstream::Context) {
    loop {
        match DB::relay_pass(&pool, sql, &js).await {
            Ok(0) => tokio::time::sleep(Duration::from_millis(10)).await,
            Ok(_) => {}
            Err(e) => {
                eprintln!("baseline consumer: relay: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
