//! The `credit` example: a consumer that credits accounts exactly once per message.
//!
//! The binary in `src/bin/credit.rs` is a thin `main` over [`run`], configured from the
//! environment (see [`Config::from_env`]).

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::{
    Handler, Inbox, InboxBackend, Stats, Tx, WorkerBuilder, idempotent, is_transient,
    sqlite_options,
};
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{MySql, MySqlPool, PgPool, Pool, Postgres, Sqlite, SqlitePool};
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A request to add `amount` to `account`'s balance; `id` identifies the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditRequested {
    /// The request's id: the dedup key.
    pub id: String,
    /// The account to credit.
    pub account: i64,
    /// The amount, possibly negative; a balance never goes below zero.
    pub amount: i64,
}

/// Adds `msg.amount` to the account's balance in PostgreSQL, creating the account when new.
///
/// A credit that would take a balance below zero violates the `accounts` CHECK constraint: a
/// genuine error that rolls back the marker too, never a duplicate.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_postgres(
    msg: CreditRequested,
    tx: &mut Tx<Postgres>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// [`credit_postgres`] for MySQL and MariaDB.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_mysql(msg: CreditRequested, tx: &mut Tx<MySql>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?, ?) \
         ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// [`credit_postgres`] for SQLite.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_sqlite(msg: CreditRequested, tx: &mut Tx<Sqlite>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
         ON CONFLICT (id) DO UPDATE SET balance = balance + excluded.balance",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Creates `accounts` in PostgreSQL when missing. Serialised by an advisory lock, since
/// concurrent `CREATE TABLE IF NOT EXISTS` can still collide in PostgreSQL's catalog.
pub async fn create_accounts_postgres(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('inbox-examples accounts'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id BIGINT PRIMARY KEY, \
             balance BIGINT NOT NULL CHECK (balance >= 0))",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Creates `accounts` in MySQL or MariaDB when missing.
pub async fn create_accounts_mysql(pool: &MySqlPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id BIGINT PRIMARY KEY, \
             balance BIGINT NOT NULL, \
             CHECK (balance >= 0)) ENGINE = InnoDB",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates `accounts` in SQLite when missing.
pub async fn create_accounts_sqlite(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id INTEGER PRIMARY KEY, \
             balance INTEGER NOT NULL CHECK (balance >= 0))",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The example's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`; `postgres://`,
    /// `mysql://` (or `mariadb://`) or `sqlite://`.
    pub database_url: String,
    /// `CREDIT_STREAM`, default `CREDITS`.
    pub stream: String,
    /// `CREDIT_SUBJECT`, default `credits.requested`.
    pub subject: String,
    /// `CREDIT_CONSUMER`: the durable consumer's name, default `credit`.
    pub durable: String,
}

impl Config {
    /// Reads the configuration from the environment, with the documented defaults.
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Config {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("CREDIT_STREAM", "CREDITS"),
            subject: var("CREDIT_SUBJECT", "credits.requested"),
            durable: var("CREDIT_CONSUMER", "credit"),
        }
    }
}

/// Why the example could not start.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Sets up the stream, the durable consumer, the inbox and the accounts table, then consumes until
/// `shutdown` is cancelled. The database is chosen by `DATABASE_URL`'s scheme.
pub async fn run(config: &Config, shutdown: CancellationToken) -> Result<Stats, Error> {
    let consumer = jetstream_consumer(config).await?;
    let url = config.database_url.as_str();
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    let cannot = |e: sqlx::Error| format!("cannot open the database at {url}: {e}");
    match scheme {
        "postgres" | "postgresql" => {
            // No ping before every acquire: the hot path is BEGIN, claim, handler, COMMIT, and a
            // dead connection fails BEGIN, which is retried like any transient error.
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .connect(url)
                .await
                .map_err(cannot)?;
            create_accounts_postgres(&pool).await?;
            serve(pool, consumer, credit_postgres, shutdown).await
        }
        "mysql" | "mariadb" => {
            let pool = MySqlPoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .connect(url)
                .await
                .map_err(cannot)?;
            create_accounts_mysql(&pool).await?;
            serve(pool, consumer, credit_mysql, shutdown).await
        }
        "sqlite" => {
            // SQLite has one writer at a time: more connections would only queue for the lock.
            let options = sqlite_options(url).map_err(cannot)?;
            // Processes opening a new file together race to switch it to WAL, and the loser gets
            // SQLITE_BUSY at once, without waiting out the busy timeout: retry that.
            let pool = connect_retrying::<Sqlite, _, _>(|| {
                SqlitePoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect_with(options.clone())
            })
            .await
            .map_err(cannot)?;
            create_accounts_sqlite(&pool).await?;
            serve(pool, consumer, credit_sqlite, shutdown).await
        }
        _ => Err(format!(
            "DATABASE_URL {url:?} is not supported: use postgres://, mysql:// (or mariadb://) or sqlite://"
        )
        .into()),
    }
}

/// Calls `connect` until it succeeds or fails with an error that is not transient, waiting with
/// capped exponential backoff in between (at most 10 attempts).
async fn connect_retrying<DB, F, Fut>(mut connect: F) -> Result<Pool<DB>, sqlx::Error>
where
    DB: InboxBackend,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Pool<DB>, sqlx::Error>>,
{
    let mut wait = Duration::from_millis(50);
    let mut attempt = 1;
    loop {
        match connect().await {
            Ok(pool) => return Ok(pool),
            Err(e) if attempt < 10 && is_transient::<DB>(&e) => {
                tracing::warn!(attempt, error = %e, retry_in = ?wait, "database not ready");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Gets or creates the stream and the durable pull consumer.
async fn jetstream_consumer(config: &Config) -> Result<PullConsumer, Error> {
    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {}: {e}", config.nats_url))?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.subject.clone()],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot get or create stream {}: {e}", config.stream))?;
    let consumer = stream
        .get_or_create_consumer(
            &config.durable,
            pull::Config {
                durable_name: Some(config.durable.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                // Finite, so that a message that keeps failing ends up dead-lettered.
                max_deliver: 10,
                filter_subject: config.subject.clone(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("cannot get or create consumer {}: {e}", config.durable))?;
    Ok(consumer)
}

/// Migrates the inbox and runs the worker until `shutdown`.
async fn serve<H>(
    pool: Pool<H::Db>,
    consumer: PullConsumer,
    handler: H,
    shutdown: CancellationToken,
) -> Result<Stats, Error>
where
    H: Handler<State = ()>,
    H::Message: serde::de::DeserializeOwned,
{
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    let worker = WorkerBuilder::new(inbox, consumer).build(handler)?;
    let stats = worker.run_until(shutdown).await;
    pool.close().await;
    Ok(stats)
}
