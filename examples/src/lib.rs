//! The `credit` example: a consumer that credits accounts exactly once per message.
//!
//! The binary in `src/bin/credit.rs` is a thin `main` over [`run`], configured from the
//! environment (see [`Config::from_env`]).

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::{
    Backoff, Handler, Inbox, InboxBackend, Stats, Tx, WorkerBuilder, idempotent, is_transient,
    sqlite_options,
};
use serde::{Deserialize, Serialize};
use sqlx::pool::PoolOptions;
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

/// How long markers are kept: above the floor of the consumer and stream credit creates
/// (ack_wait 30 s × max_deliver 10 + the stream's max_age of three days + its duplicate window +
/// a 1 h margin).
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The `max_age` of the stream `credit` creates: the retention floor counts it, since a replay
/// of any stored message must still find its marker.
pub const MAX_AGE: Duration = Duration::from_secs(3 * 24 * 3600);

/// Why the example could not start.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Sets up the stream, the durable consumer, the inbox and the accounts table, then consumes until
/// `shutdown` is cancelled. The database is chosen by `DATABASE_URL`'s scheme. NATS or the
/// database being down at start is waited out (capped backoff, one log line per attempt).
pub async fn run(config: &Config, shutdown: CancellationToken) -> Result<Stats, Error> {
    let Some((consumer, stream)) =
        until_up("NATS", &shutdown, || jetstream_consumer(config)).await?
    else {
        return Ok(Stats::default());
    };
    let url = config.database_url.as_str();
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    let bad_url = |e: sqlx::Error| format!("DATABASE_URL {url:?}: {e}");
    let on = Serve {
        consumer,
        stream: &stream,
        shutdown,
    };
    match scheme {
        "postgres" | "postgresql" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool::<Postgres>();
            on.serve(pool, options, create_accounts_postgres, credit_postgres)
                .await
        }
        "mysql" | "mariadb" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool::<MySql>();
            on.serve(pool, options, create_accounts_mysql, credit_mysql)
                .await
        }
        "sqlite" => {
            let options = sqlite_options(url).map_err(bad_url)?;
            // SQLite has one writer at a time: more connections would only queue for the lock.
            // Processes opening a new file together race to switch it to WAL, and the loser gets
            // SQLITE_BUSY at once, without waiting out the busy timeout: waited out like an outage.
            let pool = PoolOptions::<Sqlite>::new()
                .max_connections(1)
                .test_before_acquire(false);
            on.serve(pool, options, create_accounts_sqlite, credit_sqlite)
                .await
        }
        _ => Err(format!(
            "DATABASE_URL {url:?} is not supported: use postgres://, mysql:// (or mariadb://) or sqlite://"
        )
        .into()),
    }
}

/// Why a start-up step failed: a service that is down (wait and retry) or anything else (stop).
enum StartError {
    Down(String),
    Fatal(Error),
}

impl<E: Into<Error>> From<E> for StartError {
    fn from(e: E) -> Self {
        StartError::Fatal(e.into())
    }
}

fn db_start_error<DB: InboxBackend>(e: sqlx::Error) -> StartError {
    if is_transient::<DB>(&e) {
        StartError::Down(e.to_string())
    } else {
        StartError::Fatal(format!("cannot open the database: {e}").into())
    }
}

/// Runs `step` until it succeeds, waiting out `Down` errors with capped exponential backoff and
/// one log line per attempt. `None` when `shutdown` came first.
async fn until_up<T, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    mut step: F,
) -> Result<Option<T>, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StartError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    loop {
        match step().await {
            Ok(value) => return Ok(Some(value)),
            Err(StartError::Fatal(e)) => return Err(e),
            Err(StartError::Down(e)) => {
                let wait = backoff.next();
                tracing::warn!("{what} is not reachable ({e}); retrying in {wait:?}");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Gets or creates the stream and the durable pull consumer.
async fn jetstream_consumer(config: &Config) -> Result<(PullConsumer, stream::Stream), StartError> {
    use async_nats::ConnectErrorKind;
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(&config.nats_url)
        .await
        .map_err(|e| match e.kind() {
            ConnectErrorKind::Io | ConnectErrorKind::TimedOut | ConnectErrorKind::Dns => {
                StartError::Down(format!("{}: {e}", config.nats_url))
            }
            _ => StartError::Fatal(
                format!("cannot connect to NATS at {}: {e}", config.nats_url).into(),
            ),
        })?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            // Messages are kept three days, markers seven (RETENTION), above the floor.
            max_age: MAX_AGE,
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
    Ok((consumer, stream))
}

/// The pool of a database server: eight connections, and no ping before every acquire (the hot
/// path is BEGIN, claim, handler, COMMIT, and a dead connection fails BEGIN, which is retried like
/// any transient error).
fn server_pool<DB: sqlx::Database>() -> PoolOptions<DB> {
    PoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
}

/// Where the worker runs, once NATS is up.
struct Serve<'a> {
    consumer: PullConsumer,
    stream: &'a stream::Stream,
    shutdown: CancellationToken,
}

impl Serve<'_> {
    /// Opens the pool (waiting out a database that is down), creates `accounts`, migrates the
    /// inbox and runs the worker until `shutdown`.
    async fn serve<H>(
        self,
        pool: PoolOptions<H::Db>,
        options: <<H::Db as sqlx::Database>::Connection as sqlx::Connection>::Options,
        create_accounts: impl AsyncFnOnce(&Pool<H::Db>) -> Result<(), sqlx::Error>,
        handler: H,
    ) -> Result<Stats, Error>
    where
        H: Handler<State = ()>,
        H::Message: serde::de::DeserializeOwned,
    {
        let connect = || {
            let pool = pool.clone().connect_with(options.clone());
            async { pool.await.map_err(db_start_error::<H::Db>) }
        };
        let Some(pool) = until_up("the database", &self.shutdown, connect).await? else {
            return Ok(Stats::default());
        };
        create_accounts(&pool).await?;
        let inbox = Inbox::new(pool.clone());
        inbox.migrate().await?;
        let worker = WorkerBuilder::new(inbox, self.consumer)
            .cleanup(RETENTION, self.stream)
            .build(handler)?;
        let stats = worker.run_until(self.shutdown).await;
        pool.close().await;
        Ok(stats)
    }
}
