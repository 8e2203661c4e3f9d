//! How an example starts: NATS and the database may be down when it does, and are waited out
//! ([`until_up`]); whatever else goes wrong stops it. [`start_database`] is the one database
//! start-up every example goes through, whichever backend `DATABASE_URL` names.

use crate::config::NatsAuth;
use crate::{Error, MAX_AGE, redact};
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::CreateStreamError;
use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::{Backoff, Inbox, InboxBackend, is_transient, sqlite_options};
use sqlx::pool::PoolOptions;
use sqlx::{MySql, Pool, Postgres, Sqlite};
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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

/// `e`, from a start-up step (`doing`: "open the database") on the database at `shown` (its
/// URL, redacted), as a start-up error: a transient one (the database down, a connection lost)
/// is waited out, anything else stops the example.
pub(crate) fn db_start_error<DB: InboxBackend>(
    shown: &str,
    doing: &str,
    e: sqlx::Error,
) -> StartError {
    if is_transient::<DB>(&e) {
        StartError::Down(format!("{shown}: {doing}: {e}"))
    } else {
        StartError::Fatal(format!("cannot {doing} at {shown}: {e}").into())
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
                // The crate's target, as before start-up had a module of its own: log searches
                // and filters that name it keep finding this line.
                tracing::warn!(
                    target: "inbox_examples",
                    "{what} is not reachable ({e}); retrying in {wait:?}"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
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

/// Opens NATS connections as the example's own (same servers, same credentials): each handler
/// of an example's `App` pulls on one of its own (`App::pull_connections`), so that a message
/// the client cannot read, which drops the connection it is delivered on, interrupts no one else.
#[derive(Debug, Clone)]
pub(crate) struct NatsConnector {
    url: String,
    auth: NatsAuth,
}

/// A connection being opened by a [`NatsConnector`].
type Opening =
    std::pin::Pin<Box<dyn Future<Output = Result<jetstream::Context, Error>> + Send + 'static>>;

impl NatsConnector {
    /// Connections to `url` with `auth`.
    pub(crate) fn new(url: &str, auth: &NatsAuth) -> Self {
        NatsConnector {
            url: url.to_owned(),
            auth: auth.clone(),
        }
    }

    /// What `App::pull_connections` takes.
    pub(crate) fn pulls(&self) -> impl Fn() -> Opening + Send + Sync + 'static {
        let this = self.clone();
        move || {
            let this = this.clone();
            Box::pin(async move {
                match connect_nats(&this.url, &this.auth).await {
                    Ok(client) => Ok(jetstream::new(client)),
                    Err(StartError::Down(why)) => Err(why.into()),
                    Err(StartError::Fatal(e)) => Err(e),
                }
            })
        }
    }
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
    /// 0: JetStream's default (1,000).
    pub max_ack_pending: i64,
}

/// `e`, from getting or creating stream `name`, as a start-up error.
pub(crate) fn stream_start_error(name: &str, e: CreateStreamError) -> StartError {
    use async_nats::jetstream::context::CreateStreamErrorKind as Kind;
    let what = format!("cannot get or create stream {name}: {e}");
    match e.kind() {
        // A cluster electing a leader, JetStream not ready yet: wait it out.
        Kind::TimedOut | Kind::JetStreamUnavailable => StartError::Down(what),
        Kind::JetStream(e) if e.code() == 503 => StartError::Down(what),
        _ => StartError::Fatal(what.into()),
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
            // Messages are kept three days, their markers RETENTION longer. An existing stream
            // is taken as it is, whatever its limits: markers follow its messages.
            max_age: MAX_AGE,
            subjects: vec![config.subject.to_owned()],
            ..Default::default()
        })
        .await
        .map_err(|e| stream_start_error(config.stream, e))?;
    let consumer = stream
        .get_or_create_consumer(
            config.durable,
            pull::Config {
                durable_name: Some(config.durable.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                // Finite, so that a message that keeps failing ends up dead-lettered.
                max_deliver: config.max_deliver,
                max_ack_pending: config.max_ack_pending,
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

/// Where an example's database is, and how many connections its pool gets.
pub(crate) struct DatabaseSpec<'a> {
    /// `DATABASE_URL`: its scheme picks the backend.
    pub url: &'a str,
    /// The pool's size on PostgreSQL, MySQL or MariaDB (see [`server_pool`]).
    pub server_pool: u32,
    /// The pool's size on SQLite. It has one writer at a time: connections beyond those the
    /// example really uses side by side would only queue for its lock.
    pub sqlite_pool: u32,
}

/// An example's part for each backend (its tables' DDL, its handlers), of which
/// [`start_database`] runs the one `DATABASE_URL` names: all three are given because their types
/// differ, and which one is wanted is known only at run time.
pub(crate) struct Backends<P, M, S> {
    pub postgres: P,
    pub mysql: M,
    pub sqlite: S,
}

/// An example from the moment its database answers: written once, generic over the backend, and
/// given the `Part` (see [`Backends`]) of the backend it runs on.
pub(crate) trait Example<Part> {
    /// The backend `Part` is written for.
    type Db: InboxBackend;
    /// What the example returns when it stops.
    type Output;

    /// Creates the example's own tables when missing (before the inbox's, as ever).
    async fn create_tables(part: &Part, pool: &Pool<Self::Db>) -> Result<(), sqlx::Error>;

    /// Runs on `inbox` (migrated) until the example stops; [`start_database`] closes the pool
    /// after.
    async fn run(self, part: Part, inbox: Inbox<Self::Db>) -> Result<Self::Output, Error>;
}

/// The examples' database start-up: picks the backend by `DATABASE_URL`'s scheme, connects
/// (waiting out a database that is down, until `shutdown`), creates the example's tables,
/// migrates the inbox, then runs `example` with that backend's part of `parts`. `None` when
/// `shutdown` came before the database answered.
pub(crate) async fn start_database<E, P, M, S, O>(
    database: &DatabaseSpec<'_>,
    shutdown: &CancellationToken,
    example: E,
    parts: Backends<P, M, S>,
) -> Result<Option<O>, Error>
where
    E: Example<P, Db = Postgres, Output = O>
        + Example<M, Db = MySql, Output = O>
        + Example<S, Db = Sqlite, Output = O>,
{
    let url = database.url;
    let shown = redact::url(url);
    let bad_url = |e: sqlx::Error| format!("DATABASE_URL {shown}: {e}");
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    match scheme {
        "postgres" | "postgresql" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool(database.server_pool);
            open(&shown, pool, options, shutdown, example, parts.postgres).await
        }
        "mysql" | "mariadb" => {
            let options = url.parse().map_err(bad_url)?;
            let pool = server_pool(database.server_pool);
            open(&shown, pool, options, shutdown, example, parts.mysql).await
        }
        "sqlite" => {
            let options = sqlite_options(url).map_err(bad_url)?;
            // No ping before every acquire, as on a server: a dead connection fails BEGIN.
            let pool = PoolOptions::new()
                .max_connections(database.sqlite_pool)
                .test_before_acquire(false);
            open(&shown, pool, options, shutdown, example, parts.sqlite).await
        }
        _ => Err(format!(
            "DATABASE_URL {shown} is not supported: use postgres://, mysql:// (or mariadb://) or sqlite://"
        )
        .into()),
    }
}

/// [`start_database`] once the backend is known: `shown` is `DATABASE_URL`, redacted.
async fn open<E, Part>(
    shown: &str,
    pool: PoolOptions<E::Db>,
    options: <<E::Db as sqlx::Database>::Connection as sqlx::Connection>::Options,
    shutdown: &CancellationToken,
    example: E,
    part: Part,
) -> Result<Option<E::Output>, Error>
where
    E: Example<Part>,
{
    let connect = || {
        let pool = pool.clone().connect_with(options.clone());
        async move {
            let opened = pool.await;
            opened.map_err(|e| db_start_error::<E::Db>(shown, "open the database", e))
        }
    };
    let Some(pool) = until_up("the database", shutdown, connect).await? else {
        return Ok(None);
    };
    // A connection of the pool lost meanwhile (the database restarting, its sessions ended by
    // a failover or an operator) fails the statement: waited out like a database that is down.
    let create = || async {
        let created = E::create_tables(&part, &pool).await;
        created.map_err(|e| db_start_error::<E::Db>(shown, "create the example's tables", e))
    };
    if until_up("the database", shutdown, create).await?.is_none() {
        pool.close().await;
        return Ok(None);
    }
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    let output = example.run(part, inbox).await?;
    pool.close().await;
    Ok(Some(output))
}
