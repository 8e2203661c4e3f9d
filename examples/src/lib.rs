//! The `credit` example: a consumer that credits accounts exactly once per message and announces
//! each credit through its transactional outbox; the `statements` example ([`statements`]),
//! which consumes those announcements with an inbox of its own; the `email` example
//! ([`email`]): a two-phase consumer that calls an HTTP API once per message; and `orders`.
//!
//! The binaries in `src/bin/` are thin `main`s over [`run`] and [`email::run`], configured from
//! the environment (see [`Config::from_env`], [`email::EmailConfig::from_env`]).

pub mod email;
mod observe;
pub mod orders;
pub mod statements;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::{
    AckMode, App, Backoff, Durable, Handler, Inbox, InboxBackend, Outbox, OutboxMessage, Relay,
    Stats, Tx, WorkerBuilder, idempotent, is_transient, sqlite_options,
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

/// What `credit` announces for each credit it applies, on `CREDIT_EVENTS_SUBJECT`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditApplied {
    /// The request's id.
    pub id: String,
    /// The account credited.
    pub account: i64,
    /// The amount.
    pub amount: i64,
}

/// Where `credit` announces what it applied: its outbox, and the subject.
pub struct Announce<DB: InboxBackend> {
    /// The outbox, in the accounts' database.
    pub outbox: Outbox<DB>,
    /// `CREDIT_EVENTS_SUBJECT`.
    pub subject: String,
}

impl<DB: InboxBackend> Announce<DB> {
    /// Writes the [`CreditApplied`] of `msg` to the outbox in `tx`: published if and only if the
    /// credit commits. Per account, events leave in the order they were applied.
    pub async fn applied(
        &self,
        tx: &mut Tx<'_, DB>,
        msg: &CreditRequested,
    ) -> Result<(), sqlx::Error> {
        let event = CreditApplied {
            id: msg.id.clone(),
            account: msg.account,
            amount: msg.amount,
        };
        let message = OutboxMessage::json(&*self.subject, &event)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?
            .order_key(msg.account.to_string());
        self.outbox.enqueue(tx, message).await.map(drop)
    }
}

/// Adds `msg.amount` to the account's balance in PostgreSQL, creating the account when new,
/// and announces it ([`CreditApplied`]) through the outbox.
///
/// A credit that would take a balance below zero violates the `accounts` CHECK constraint: a
/// genuine error that rolls back the marker (and the announcement) too, never a duplicate.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_postgres(
    msg: CreditRequested,
    tx: &mut Tx<Postgres>,
    events: &Announce<Postgres>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    events.applied(tx, &msg).await
}

/// [`credit_postgres`] for MySQL and MariaDB.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_mysql(
    msg: CreditRequested,
    tx: &mut Tx<MySql>,
    events: &Announce<MySql>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?, ?) \
         ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    events.applied(tx, &msg).await
}

/// [`credit_postgres`] for SQLite.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit_sqlite(
    msg: CreditRequested,
    tx: &mut Tx<Sqlite>,
    events: &Announce<Sqlite>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
         ON CONFLICT (id) DO UPDATE SET balance = balance + excluded.balance",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    events.applied(tx, &msg).await
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

/// Environment variables as the examples read them, through a lookup (the environment, or a
/// test's map): empty is unset, and a number that does not parse is an error naming it.
pub(crate) struct Vars<F>(pub F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    /// `name`'s value, else `default`.
    pub fn var(&self, name: &str, default: &str) -> String {
        (self.0)(name)
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| default.into())
    }

    /// `name`'s value as a whole number of at least `min` (at most `u32::MAX`), else `default`.
    pub fn number(&self, name: &str, default: &str, min: u64) -> Result<u64, String> {
        let value = self.var(name, default);
        value
            .parse::<u64>()
            .ok()
            .filter(|n| *n >= min && *n <= u64::from(u32::MAX))
            .ok_or_else(|| format!("{name}={value:?} is not a whole number of at least {min}"))
    }
}

/// The example's configuration. Its `Debug` shows the URLs with their credentials masked.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `NATS_CREDS` or `NATS_NKEY`.
    pub nats_auth: NatsAuth,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`; `postgres://`,
    /// `mysql://` (or `mariadb://`) or `sqlite://`.
    pub database_url: String,
    /// `CREDIT_STREAM`, default `CREDITS`.
    pub stream: String,
    /// `CREDIT_SUBJECT`, default `credits.requested`.
    pub subject: String,
    /// `CREDIT_CONSUMER`: the durable consumer's name, default `credit`.
    pub durable: String,
    /// `CREDIT_EVENTS_STREAM`: the stream of [`CreditApplied`] events, default `CREDIT_EVENTS`
    /// (created when missing, with a duplicate window of two minutes).
    pub events_stream: String,
    /// `CREDIT_EVENTS_SUBJECT`: their subject, default `credits.applied`.
    pub events_subject: String,
    /// `CREDIT_CONCURRENCY`: how many messages are processed at once, and the size of the
    /// database pool (one connection more, for the outbox relay), default 8 (SQLite: always 1,
    /// its one writer, and the relay's connection).
    pub concurrency: u32,
    /// `CREDIT_ACK`: `plain` or `double` (see `inbox_runtime::AckMode`), default the runtime's.
    pub ack_mode: Option<AckMode>,
    /// `METRICS_ADDR`: where `/metrics` and `/healthz` are served (unset: not served).
    pub metrics: Option<std::net::SocketAddr>,
    /// `CREDIT_BATCH`: commit up to this many messages per transaction (see
    /// `WorkerBuilder::batch`), waiting at most 10 ms for a batch to fill; default 1, no batching.
    pub batch: usize,
    /// `CREDIT_TEST_RELAY_HOLD_MS` (tests only): how long the outbox relay waits between its
    /// PubAcks and marking the rows sent, so that a test can kill the process there.
    pub relay_hold: Duration,
}

impl Config {
    /// Reads the configuration from the environment, with the documented defaults; a variable
    /// that does not parse is an error that names it.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Config::from_env`] over `get`, which looks a variable up.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let env = Vars(get);
        let var = |name: &str, default: &str| env.var(name, default);
        let count = |name: &str, default: &str| env.number(name, default, 1).map(|n| n as u32);
        Ok(Config {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            nats_auth: NatsAuth::from_vars(&env)?,
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("CREDIT_STREAM", "CREDITS"),
            subject: var("CREDIT_SUBJECT", "credits.requested"),
            durable: var("CREDIT_CONSUMER", "credit"),
            events_stream: var("CREDIT_EVENTS_STREAM", "CREDIT_EVENTS"),
            events_subject: var("CREDIT_EVENTS_SUBJECT", "credits.applied"),
            concurrency: count("CREDIT_CONCURRENCY", "8")?,
            ack_mode: match var("CREDIT_ACK", "").as_str() {
                "" => None,
                "plain" => Some(AckMode::Plain),
                "double" => Some(AckMode::Double),
                other => return Err(format!("CREDIT_ACK={other:?}: use plain or double")),
            },
            batch: count("CREDIT_BATCH", "1")? as usize,
            relay_hold: Duration::from_millis(env.number("CREDIT_TEST_RELAY_HOLD_MS", "0", 0)?),
            metrics: observe::metrics_addr(&env)?,
        })
    }

    /// The credentials of both URLs, to scrub from whatever is printed.
    pub fn secrets(&self) -> redact::Secrets {
        let mut secrets = redact::Secrets::default();
        secrets.add_url_list(&self.nats_url);
        secrets.add_url(&self.database_url);
        secrets
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("nats_url", &redact::url_list(&self.nats_url))
            .field("nats_auth", &self.nats_auth)
            .field("database_url", &redact::url(&self.database_url))
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("durable", &self.durable)
            .field("events_stream", &self.events_stream)
            .field("events_subject", &self.events_subject)
            .field("concurrency", &self.concurrency)
            .field("ack_mode", &self.ack_mode)
            .field("batch", &self.batch)
            .field("relay_hold", &self.relay_hold)
            .field("metrics", &self.metrics)
            .finish()
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
    let spec = config.consumer_spec();
    let Some((jetstream, _, stream)) =
        until_up("NATS", &shutdown, || jetstream_consumer(&spec)).await?
    else {
        return Ok(Stats::default());
    };
    let replicas = stream.cached_info().config.num_replicas;
    let events = || events_stream(&jetstream, config, replicas);
    if until_up("NATS", &shutdown, events).await?.is_none() {
        return Ok(Stats::default());
    }
    let url = config.database_url.as_str();
    let shown = redact::url(url);
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    let bad_url = |e: sqlx::Error| format!("DATABASE_URL {shown}: {e}");
    let on = Serve {
        batch: config.batch,
        ack_mode: config.ack_mode,
        jetstream,
        durable: &config.durable,
        events: (&config.events_stream, &config.events_subject),
        relay_hold: config.relay_hold,
        metrics: config.metrics,
        stream: &stream,
        database: &shown,
        shutdown,
    };
    match scheme {
        "postgres" | "postgresql" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool::<Postgres>(config.concurrency + 1);
            on.serve(pool, options, create_accounts_postgres, credit_postgres)
                .await
        }
        "mysql" | "mariadb" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool::<MySql>(config.concurrency + 1);
            on.serve(pool, options, create_accounts_mysql, credit_mysql)
                .await
        }
        "sqlite" => {
            let options = sqlite_options(url).map_err(bad_url)?;
            // SQLite has one writer at a time: more connections would only queue for the lock.
            // One for the worker, one for the outbox relay (which reads and marks, and holds
            // no lock while it publishes). Processes opening a new file together race to switch
            // it to WAL, and the loser gets SQLITE_BUSY at once, without waiting out the busy
            // timeout: waited out like an outage.
            let pool = PoolOptions::<Sqlite>::new()
                .max_connections(2)
                .test_before_acquire(false);
            on.serve(pool, options, create_accounts_sqlite, credit_sqlite)
                .await
        }
        _ => Err(format!(
            "DATABASE_URL {shown} is not supported: use postgres://, mysql:// (or mariadb://) or sqlite://"
        )
        .into()),
    }
}

/// Gets or creates `config.events_stream` on `config.events_subject`, with `replicas` (those of
/// the requests' stream) and a duplicate window of two minutes: the outbox relay's re-publishes
/// after a crash land in it.
async fn events_stream(
    js: &jetstream::Context,
    config: &Config,
    replicas: usize,
) -> Result<(), StartError> {
    js.get_or_create_stream(stream::Config {
        name: config.events_stream.clone(),
        subjects: vec![config.events_subject.clone()],
        duplicate_window: Duration::from_secs(120),
        max_age: MAX_AGE,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| {
        use async_nats::jetstream::context::CreateStreamErrorKind as Kind;
        let what = format!("cannot get or create stream {}: {e}", config.events_stream);
        match e.kind() {
            Kind::TimedOut | Kind::JetStreamUnavailable => StartError::Down(what),
            Kind::JetStream(e) if e.code() == 503 => StartError::Down(what),
            _ => StartError::Fatal(what.into()),
        }
    })?;
    Ok(())
}

/// Why a start-up step failed: a service that is down (wait and retry) or anything else (stop).
pub(crate) enum StartError {
    Down(String),
    Fatal(Error),
}

impl<E: Into<Error>> From<E> for StartError {
    fn from(e: E) -> Self {
        StartError::Fatal(e.into())
    }
}

/// `e`, from opening the database at `shown` (its URL, redacted), as a start-up error.
pub(crate) fn db_start_error<DB: InboxBackend>(shown: &str, e: sqlx::Error) -> StartError {
    if is_transient::<DB>(&e) {
        StartError::Down(format!("{shown}: {e}"))
    } else {
        StartError::Fatal(format!("cannot open the database at {shown}: {e}").into())
    }
}

/// Runs `step` until it succeeds, waiting out `Down` errors with capped exponential backoff and
/// one log line per attempt. `None` when `shutdown` came first.
pub(crate) async fn until_up<T, F, Fut>(
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

/// How an example authenticates to NATS, besides what its URL holds (a user and password, a
/// token): `NATS_CREDS`, a credentials file (a user JWT and its NKey seed, as `nsc` writes), or
/// `NATS_NKEY`, a file holding an NKey seed (`SU...`). At most one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAuth {
    /// `NATS_CREDS`.
    pub creds_file: Option<std::path::PathBuf>,
    /// `NATS_NKEY`.
    pub nkey_file: Option<std::path::PathBuf>,
}

impl NatsAuth {
    /// Reads `NATS_CREDS` and `NATS_NKEY`.
    pub(crate) fn from_vars<F: Fn(&str) -> Option<String>>(env: &Vars<F>) -> Result<Self, String> {
        let path = |name: &str| {
            Some(env.var(name, ""))
                .filter(|v| !v.is_empty())
                .map(Into::into)
        };
        let auth = NatsAuth {
            creds_file: path("NATS_CREDS"),
            nkey_file: path("NATS_NKEY"),
        };
        if auth.creds_file.is_some() && auth.nkey_file.is_some() {
            return Err("NATS_CREDS and NATS_NKEY are both set: use one".into());
        }
        Ok(auth)
    }

    /// `options` with these credentials.
    async fn apply(
        &self,
        options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, StartError> {
        if let Some(path) = &self.creds_file {
            return options.credentials_file(path).await.map_err(|e| {
                StartError::Fatal(format!("NATS_CREDS {}: {e}", path.display()).into())
            });
        }
        if let Some(path) = &self.nkey_file {
            let seed = std::fs::read_to_string(path).map_err(|e| {
                StartError::Fatal(format!("NATS_NKEY {}: {e}", path.display()).into())
            })?;
            return Ok(options.nkey(seed.trim().to_owned()));
        }
        Ok(options)
    }
}

/// Connects to the NATS servers of `url` (one URL, or several comma-separated: the NATS
/// convention for a cluster) with `auth`: a server that does not answer is `Down` (waited out),
/// refused credentials or a bad URL are fatal.
pub(crate) async fn connect_nats(
    url: &str,
    auth: &NatsAuth,
) -> Result<async_nats::Client, StartError> {
    use async_nats::ConnectErrorKind;
    let shown = redact::url_list(url);
    let servers: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let options = async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(5));
    auth.apply(options)
        .await?
        .connect(servers)
        .await
        .map_err(|e| match e.kind() {
            ConnectErrorKind::Io | ConnectErrorKind::TimedOut | ConnectErrorKind::Dns => {
                StartError::Down(format!("{shown}: {e}"))
            }
            _ => StartError::Fatal(format!("cannot connect to NATS at {shown}: {e}").into()),
        })
}

/// The stream and durable consumer an example consumes: created when missing.
pub(crate) struct ConsumerSpec<'a> {
    pub nats_url: &'a str,
    pub nats_auth: &'a NatsAuth,
    pub stream: &'a str,
    pub subject: &'a str,
    pub durable: &'a str,
    pub ack_wait: Duration,
    pub max_deliver: i64,
}

impl Config {
    fn consumer_spec(&self) -> ConsumerSpec<'_> {
        ConsumerSpec {
            nats_url: &self.nats_url,
            nats_auth: &self.nats_auth,
            stream: &self.stream,
            subject: &self.subject,
            durable: &self.durable,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
        }
    }
}

/// Gets or creates the stream and the durable pull consumer.
pub(crate) async fn jetstream_consumer(
    config: &ConsumerSpec<'_>,
) -> Result<(jetstream::Context, PullConsumer, stream::Stream), StartError> {
    let client = connect_nats(config.nats_url, config.nats_auth).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: config.stream.to_owned(),
            // Messages are kept three days, markers seven (RETENTION), above the floor.
            max_age: MAX_AGE,
            subjects: vec![config.subject.to_owned()],
            ..Default::default()
        })
        .await
        .map_err(|e| {
            use async_nats::jetstream::context::CreateStreamErrorKind as Kind;
            let what = format!("cannot get or create stream {}: {e}", config.stream);
            match e.kind() {
                // A cluster electing a leader, JetStream not ready yet: wait it out.
                Kind::TimedOut | Kind::JetStreamUnavailable => StartError::Down(what),
                Kind::JetStream(e) if e.code() == 503 => StartError::Down(what),
                _ => StartError::Fatal(what.into()),
            }
        })?;
    let consumer = stream
        .get_or_create_consumer(
            config.durable,
            pull::Config {
                durable_name: Some(config.durable.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                // Finite, so that a message that keeps failing ends up dead-lettered.
                max_deliver: config.max_deliver,
                filter_subject: config.subject.to_owned(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            use async_nats::jetstream::stream::ConsumerErrorKind as Kind;
            let what = format!("cannot get or create consumer {}: {e}", config.durable);
            match e.kind() {
                Kind::TimedOut | Kind::Request => StartError::Down(what),
                // 503: no leader for the stream or consumer yet (an election).
                Kind::JetStream(e) if e.code() == 503 => StartError::Down(what),
                _ => StartError::Fatal(what.into()),
            }
        })?;
    Ok((js, consumer, stream))
}

/// The pool of a database server: `size` connections (`CREDIT_CONCURRENCY`; the worker's
/// concurrency follows the pool), and no ping before every acquire (the hot path is BEGIN,
/// claim, handler, COMMIT, and a dead connection fails BEGIN, which is retried like any transient
/// error).
pub(crate) fn server_pool<DB: sqlx::Database>(size: u32) -> PoolOptions<DB> {
    PoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
}

/// Where the worker runs, once NATS is up.
struct Serve<'a> {
    batch: usize,
    ack_mode: Option<AckMode>,
    jetstream: jetstream::Context,
    /// The durable consumer's name.
    durable: &'a str,
    /// `CREDIT_EVENTS_STREAM`, `CREDIT_EVENTS_SUBJECT`.
    events: (&'a str, &'a str),
    /// `CREDIT_TEST_RELAY_HOLD_MS`.
    relay_hold: Duration,
    /// `METRICS_ADDR`.
    metrics: Option<std::net::SocketAddr>,
    stream: &'a stream::Stream,
    /// `DATABASE_URL`, redacted, for messages.
    database: &'a str,
    shutdown: CancellationToken,
}

impl Serve<'_> {
    /// Opens the pool (waiting out a database that is down), creates `accounts`, migrates the
    /// inbox and the outbox, and runs the worker and the outbox's relay until `shutdown`.
    async fn serve<H>(
        self,
        pool: PoolOptions<H::Db>,
        options: <<H::Db as sqlx::Database>::Connection as sqlx::Connection>::Options,
        create_accounts: impl AsyncFnOnce(&Pool<H::Db>) -> Result<(), sqlx::Error>,
        handler: H,
    ) -> Result<Stats, Error>
    where
        H: Handler<State = Announce<<H as Handler>::Db>>,
    {
        let shown = self.database;
        let connect = || {
            let pool = pool.clone().connect_with(options.clone());
            async move { pool.await.map_err(|e| db_start_error::<H::Db>(shown, e)) }
        };
        let Some(pool) = until_up("the database", &self.shutdown, connect).await? else {
            return Ok(Stats::default());
        };
        create_accounts(&pool).await?;
        let inbox = Inbox::new(pool.clone());
        inbox.migrate().await?;
        let outbox = Outbox::new(pool.clone());
        outbox.migrate().await?;
        let (events_stream, events_subject) = self.events;
        let announce = Announce {
            outbox: outbox.clone(),
            subject: events_subject.to_owned(),
        };
        let durable = Durable::existing(&self.stream.cached_info().config.name, self.durable);
        let (stream, batch, ack_mode) = (self.stream.clone(), self.batch, self.ack_mode);
        let configure = move |w: WorkerBuilder<H::Db>| {
            let w = w
                .cleanup(RETENTION, &stream)
                .batch(batch, Duration::from_millis(10));
            match ack_mode {
                Some(mode) => w.ack_mode(mode),
                None => w,
            }
        };
        let mut relay = Relay::new(outbox).stream(events_stream);
        let hold = self.relay_hold;
        if !hold.is_zero() {
            relay = relay.before_mark(std::sync::Arc::new(move || {
                Box::pin(async move {
                    tracing::info!(
                        ?hold,
                        "holding the relay before it marks rows sent (CREDIT_TEST_RELAY_HOLD_MS)"
                    );
                    tokio::time::sleep(hold).await;
                })
            }));
        }
        let app = App::new(inbox, &self.jetstream)
            .handler_configured(handler, announce, durable, configure)
            .relay(relay);
        if let Some(addr) = self.metrics {
            observe::serve(addr, app.health()).await?;
        }
        let stats = app.run_until(self.shutdown).await?;
        pool.close().await;
        Ok(orders::total(&stats))
    }
}

/// Logs (scrubbed of `secrets`) to stderr at `RUST_LOG` (default `info`), and a panic's message
/// scrubbed too, for the example binary `name`.
pub fn init_logs(name: &'static str, secrets: &redact::Secrets) {
    use tracing_subscriber::EnvFilter;
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(redact::ScrubbedStderr::new(secrets.clone()))
        .init();
    let on_panic = secrets.clone();
    std::panic::set_hook(Box::new(move |panic| {
        eprintln!("{name}: {}", on_panic.scrub(&panic.to_string()));
    }));
}

/// The `main` of an example binary named `name`: logs (scrubbed of `secrets`) to stderr at
/// `RUST_LOG` (default `info`), a panic's message scrubbed too, SIGINT and SIGTERM cancelling the
/// token `consume` runs until, and on success one machine-readable line on stdout for scripts
/// such as `cargo xtask demo`: `<name> stopped: applied=N skipped=N nacked=N terminated=N`.
pub async fn main_loop(
    name: &'static str,
    secrets: redact::Secrets,
    consume: impl AsyncFnOnce(CancellationToken) -> Result<Stats, Error>,
) -> std::process::ExitCode {
    use tokio::signal::unix::{SignalKind, signal};
    init_logs(name, &secrets);

    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            eprintln!("{name}: cannot install signal handlers");
            return std::process::ExitCode::FAILURE;
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received; stopping");
        on_signal.cancel();
    });

    match consume(shutdown).await {
        Ok(stats) => {
            println!(
                "{name} stopped: applied={} skipped={} nacked={} terminated={}",
                stats.acked, stats.skipped, stats.nacked, stats.terminated
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{name}: {}", secrets.scrub(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Credentials kept out of everything `credit` prints. [`url`](redact::url) masks the password or
/// token of a URL for the messages `credit` writes itself; [`Secrets`](redact::Secrets) scrubs any
/// text of the credentials the configured URLs hold, for what libraries write (async-nats logs a
/// server's address with its `Debug`, password included) and for errors that might echo a URL;
/// [`ScrubbedStderr`](redact::ScrubbedStderr) puts every log line through it.
pub mod redact {
    use std::io::Write;
    use std::sync::Arc;
    use url::Url;

    /// What stands in for a credential.
    pub const MASK: &str = "***";

    /// A secret at least this long is masked wherever it appears; a shorter one only where it
    /// stands delimited as a credential would (`:pw@`, `"pw"`, `=pw&`), lest every "a" of a log
    /// line be masked for a password "a".
    const MASKED_ANYWHERE: usize = 4;

    /// `raw` with its credentials masked: the password (`postgres://user:***@host/db`), a lone
    /// user name in a NATS URL, which is a token (`nats://***@host`), and the values of query
    /// parameters that name a secret (`?password=***`); the fragment is dropped. When `raw` does
    /// not parse as a URL with a path, or its path or query holds an `@`, where the credentials
    /// end cannot be told: everything up to the last `@` is masked, and the query with it
    /// (`postgres://***@host:port/db?***`).
    pub fn url(raw: &str) -> String {
        match Url::parse(raw) {
            Ok(parsed) if clear_authority(&parsed) => masked(parsed),
            _ => unparsed(raw),
        }
    }

    /// [`url()`] for each server of a comma-separated list (`NATS_URL` may name several).
    pub fn url_list(raw: &str) -> String {
        raw.split(',').map(url).collect::<Vec<_>>().join(",")
    }

    /// Whether `u` has an authority (or none at all, as `sqlite:///file`) and no `@` past it:
    /// its credentials are exactly its user info.
    fn clear_authority(u: &Url) -> bool {
        !u.cannot_be_a_base()
            && !u.path().contains('@')
            && !u.query().unwrap_or("").contains('@')
            && !u.fragment().unwrap_or("").contains('@')
    }

    fn masked(mut u: Url) -> String {
        u.set_fragment(None);
        // Cannot fail: a URL with a user name or password has a host.
        if u.password().is_some() {
            let _ = u.set_password(Some(MASK));
        } else if is_token(&u) {
            let _ = u.set_username(MASK);
        }
        if u.query_pairs().any(|(k, _)| secret_key(&k)) {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| {
                    let v = if secret_key(&k) {
                        MASK.into()
                    } else {
                        v.into()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
        }
        u.into()
    }

    /// `raw`, not a URL that can be taken apart: only what follows its last `@`, without query
    /// or fragment.
    fn unparsed(raw: &str) -> String {
        let (scheme, rest) = match raw.split_once("://") {
            Some((scheme, rest)) => (format!("{scheme}://"), rest),
            None => (String::new(), raw),
        };
        let (userinfo, place) = match rest.rfind('@') {
            Some(at) => (format!("{MASK}@"), &rest[at + 1..]),
            None => (String::new(), rest),
        };
        let (place, query) = match place.find(['?', '#']) {
            Some(end) => (&place[..end], format!("?{MASK}")),
            None => (place, String::new()),
        };
        format!("{scheme}{userinfo}{place}{query}")
    }

    /// A user name without a password, in a NATS URL: async-nats sends it as a token.
    fn is_token(u: &Url) -> bool {
        !u.username().is_empty()
            && u.password().is_none()
            && matches!(u.scheme(), "nats" | "tls" | "ws" | "wss")
    }

    /// Whether a query parameter named `key` holds a secret (`password`, `sslpassword`, `token`,
    /// `auth_token`, `secret`, `pwd`, `pass`...).
    fn secret_key(key: &str) -> bool {
        let key = key.to_ascii_lowercase();
        ["pass", "pwd", "token", "secret", "key", "credential"]
            .iter()
            .any(|word| key.contains(word))
    }

    /// The credentials of some URLs, as they might be printed, to mask in any text.
    #[derive(Clone, Default)]
    pub struct Secrets {
        /// Longest first, so that a secret containing another is masked whole.
        needles: Vec<String>,
    }

    impl std::fmt::Debug for Secrets {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Secrets({} masked)", self.needles.len())
        }
    }

    impl Secrets {
        /// Adds the credentials of `raw`: those [`url()`] masks, as written and percent-decoded.
        /// When `raw` cannot be taken apart, everything before its last `@` (whole, and after
        /// its first `:`) and the values of its secret query parameters.
        pub fn add_url(&mut self, raw: &str) {
            let mut found = Vec::new();
            match Url::parse(raw) {
                Ok(u) if clear_authority(&u) => {
                    if let Some(password) = u.password() {
                        found.push(password.to_owned());
                    } else if is_token(&u) {
                        found.push(u.username().to_owned());
                    }
                    if let Some(query) = u.query() {
                        found.extend(secret_values(query));
                    }
                }
                _ => {
                    let rest = raw.split_once("://").map_or(raw, |(_, rest)| rest);
                    if let Some(at) = rest.rfind('@') {
                        let userinfo = &rest[..at];
                        found.push(userinfo.to_owned());
                        if let Some((_, password)) = userinfo.split_once(':') {
                            found.push(password.to_owned());
                        }
                    }
                    if let Some((_, query)) = rest.split_once('?') {
                        found.extend(secret_values(query));
                    }
                }
            }
            for secret in found {
                let decoded = percent_decoded(&secret);
                self.add(decoded);
                self.add(secret);
            }
        }

        /// [`Secrets::add_url`] for the list as a whole and for each of its comma-separated
        /// servers.
        pub fn add_url_list(&mut self, raw: &str) {
            self.add_url(raw);
            for one in raw.split(',') {
                self.add_url(one);
            }
        }

        fn add(&mut self, secret: String) {
            if !secret.is_empty() && !self.needles.contains(&secret) {
                self.needles.push(secret);
                self.needles.sort_by_key(|s| std::cmp::Reverse(s.len()));
            }
        }

        /// `text` with every secret masked.
        pub fn scrub(&self, text: &str) -> String {
            let mut text = text.to_owned();
            for needle in &self.needles {
                if text.contains(needle.as_str()) {
                    text = if needle.len() >= MASKED_ANYWHERE {
                        text.replace(needle.as_str(), MASK)
                    } else {
                        mask_delimited(&text, needle)
                    };
                }
            }
            text
        }
    }

    /// The values, as written, of the parameters of `query` that [`secret_key`] names.
    fn secret_values(query: &str) -> Vec<String> {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .filter(|(key, _)| secret_key(&percent_decoded(key)))
            .map(|(_, value)| value.to_owned())
            .collect()
    }

    /// `s` with its `%XX` escapes decoded (as URL parsers read a user name or password).
    fn percent_decoded(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match (bytes[i], hex) {
                (b'%', Some(byte)) => {
                    out.push(byte);
                    i += 3;
                }
                (byte, _) => {
                    out.push(byte);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `text` with `needle` masked where it stands delimited as a credential: after one of
    /// `: / " ' =` and before one of `@ " ' & , ) ;`, whitespace or the end.
    fn mask_delimited(text: &str, needle: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut copied = 0;
        for (at, _) in text.match_indices(needle) {
            let end = at + needle.len();
            let before = text[..at].chars().next_back();
            let after = text[end..].chars().next();
            let opens = matches!(before, Some(':' | '/' | '"' | '\'' | '='));
            let closes = match after {
                None => true,
                Some(c) => {
                    c.is_whitespace() || matches!(c, '@' | '"' | '\'' | '&' | ',' | ')' | ';')
                }
            };
            if at >= copied && opens && closes {
                out.push_str(&text[copied..at]);
                out.push_str(MASK);
                copied = end;
            }
        }
        out.push_str(&text[copied..]);
        out
    }

    /// A `tracing_subscriber` writer to stderr that scrubs each log line of the [`Secrets`]
    /// before writing it: `fmt().with_writer(ScrubbedStderr::new(secrets))`.
    #[derive(Debug, Clone)]
    pub struct ScrubbedStderr(Arc<Secrets>);

    impl ScrubbedStderr {
        /// Writes to stderr with `secrets` masked.
        pub fn new(secrets: Secrets) -> Self {
            ScrubbedStderr(Arc::new(secrets))
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ScrubbedStderr {
        type Writer = ScrubbedLine;

        fn make_writer(&'a self) -> ScrubbedLine {
            ScrubbedLine {
                secrets: self.0.clone(),
                buffer: Vec::new(),
            }
        }
    }

    /// One log event on its way to stderr: kept whole until dropped, so that a secret split
    /// across two writes is still found, then scrubbed and written.
    #[derive(Debug)]
    pub struct ScrubbedLine {
        secrets: Arc<Secrets>,
        buffer: Vec<u8>,
    }

    impl Write for ScrubbedLine {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.buffer.extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Drop for ScrubbedLine {
        fn drop(&mut self) {
            if !self.buffer.is_empty() {
                let line = self.secrets.scrub(&String::from_utf8_lossy(&self.buffer));
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn passwords_and_tokens_are_masked() {
            let cases = [
                (
                    "postgres://user:secret@127.0.0.1:1/db",
                    "postgres://user:***@127.0.0.1:1/db",
                ),
                (
                    "mysql://root:p%40ss@db:3306/x",
                    "mysql://root:***@db:3306/x",
                ),
                (
                    "nats://user:secret@127.0.0.1:1",
                    "nats://user:***@127.0.0.1:1",
                ),
                ("nats://token@host", "nats://***@host"),
                ("tls://token@host:4443", "tls://***@host:4443"),
                // A lone user of a database is a user, not a token.
                ("postgres://postgres@h/test", "postgres://postgres@h/test"),
                (
                    "postgres://u@h/db?sslmode=require&password=secret",
                    "postgres://u@h/db?sslmode=require&password=***",
                ),
                ("postgres://u:secret@h/db#frag", "postgres://u:***@h/db"),
                ("sqlite:///tmp/x.db?mode=rwc", "sqlite:///tmp/x.db?mode=rwc"),
            ];
            for (raw, shown) in cases {
                assert_eq!(url(raw), shown, "{raw}");
            }
        }

        #[test]
        fn what_does_not_parse_keeps_only_what_follows_the_last_at() {
            let cases = [
                (
                    "postgres://user:secret@127.0.0.1:notaport/db",
                    "postgres://***@127.0.0.1:notaport/db",
                ),
                // The path would swallow part of the password: `@` past the host.
                ("postgres://u:123/se@cret@h/db", "postgres://***@h/db"),
                ("postgres://u:se?cret@h/db?x=1", "postgres://***@h/db?***"),
                ("user:secret@127.0.0.1:4222", "***@127.0.0.1:4222"),
                ("nats://a b@h", "nats://***@h"),
            ];
            for (raw, shown) in cases {
                assert_eq!(url(raw), shown, "{raw}");
            }
        }

        #[test]
        fn every_server_of_a_list_is_masked() {
            assert_eq!(
                url_list("nats://a:pw@h1:4222,nats://tok@h2"),
                "nats://a:***@h1:4222,nats://***@h2"
            );
        }

        #[test]
        fn text_is_scrubbed_of_the_secrets() {
            let mut secrets = Secrets::default();
            secrets.add_url("postgres://user:p%40ssword@h/db");
            secrets.add_url_list("nats://tok3n@h1,nats://u:x@h2");
            secrets.add_url("postgres://u:bad/secret@h:port/db");
            let text = r#"ServerAddr(Url { username: "tok3n", password: None }) p@ssword p%40ssword
                url nats://u:x@h2 password: Some("x") box x y bad/secret"#;
            let scrubbed = secrets.scrub(text);
            for secret in [
                "tok3n",
                "p@ssword",
                "p%40ssword",
                "bad/secret",
                "\"x\"",
                ":x@",
            ] {
                assert!(!scrubbed.contains(secret), "{secret} in {scrubbed}");
            }
            // A short secret is masked only where it stands as one.
            assert!(scrubbed.contains("box x y"), "{scrubbed}");
            assert!(!format!("{secrets:?}").contains("tok3n"));
        }

        #[test]
        fn percent_escapes_are_decoded() {
            assert_eq!(percent_decoded("p%40ss%2"), "p@ss%2");
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config, String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults_and_bad_values_named() {
        let c = config(&[]).unwrap();
        assert_eq!((c.concurrency, c.batch, c.ack_mode), (8, 1, None));
        let c = config(&[("CREDIT_BATCH", "64"), ("CREDIT_ACK", "double")]).unwrap();
        assert_eq!((c.batch, c.ack_mode), (64, Some(AckMode::Double)));
        for (name, value) in [
            ("CREDIT_CONCURRENCY", "eight"),
            ("CREDIT_CONCURRENCY", "0"),
            ("CREDIT_BATCH", "-1"),
            ("CREDIT_ACK", "twice"),
        ] {
            let e = config(&[(name, value)]).unwrap_err();
            assert!(e.contains(name) && e.contains(value), "{e}");
        }
    }
}
