//! The `statements` example: the second link of a chain. `credit` applies credit requests and
//! announces each through its outbox ([`crate::CreditApplied`] on `credits.applied`); this
//! consumer reads those events with an inbox of its own and writes one statement line per
//! applied credit, exactly once however often an event is delivered.
//!
//! - Consumer `statements`, keyed on the event's `id` (the credit request's id).
//! - The stream (`STATEMENTS_STREAM`, default `CREDIT_EVENTS`) is created when missing, as
//!   `credit` creates it; the durable consumer with [`inbox_runtime::recommended_consumer`].

use crate::startup::{
    Backends, DatabaseSpec, Example, NatsConnector, connect_nats, start_database, until_up,
};
use crate::{CreditApplied, Error, Vars, redact};
use inbox_runtime::{App, AppStats, Durable, Handler, Inbox};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The handler and the table for one database: only the SQL dialect differs.
macro_rules! statement_handler {
    ($db:ty, insert = $insert:literal $(,)?) => {
        use crate::CreditApplied;
        use inbox_runtime::{Tx, idempotent};

        /// Writes the statement line of one applied credit.
        #[idempotent(consumer = "statements", key = msg.id)]
        pub async fn statement(msg: CreditApplied, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            sqlx::query($insert)
                .bind(&msg.id)
                .bind(msg.account)
                .bind(msg.amount)
                .execute(&mut **tx)
                .await
                .map(drop)
        }
    };
}

/// PostgreSQL.
pub mod postgres {
    statement_handler!(
        sqlx::Postgres,
        insert = "INSERT INTO statement_lines (request_id, account, amount) VALUES ($1, $2, $3)",
    );

    /// Creates `statement_lines` when missing (serialised by an advisory lock, as concurrent
    /// `CREATE TABLE IF NOT EXISTS` can collide in PostgreSQL's catalog).
    pub async fn create_table(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('inbox-examples statements'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS statement_lines (request_id TEXT NOT NULL, \
             account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }
}

/// MySQL and MariaDB.
pub mod mysql {
    statement_handler!(
        sqlx::MySql,
        insert = "INSERT INTO statement_lines (request_id, account, amount) VALUES (?, ?, ?)",
    );

    /// Creates `statement_lines` when missing.
    pub async fn create_table(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS statement_lines (request_id VARCHAR(255) NOT NULL, \
             account BIGINT NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB",
        )
        .execute(pool)
        .await
        .map(drop)
    }
}

/// SQLite.
pub mod sqlite {
    statement_handler!(
        sqlx::Sqlite,
        insert = "INSERT INTO statement_lines (request_id, account, amount) VALUES (?1, ?2, ?3)",
    );

    /// Creates `statement_lines` when missing.
    pub async fn create_table(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS statement_lines (request_id TEXT NOT NULL, \
             account INTEGER NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(pool)
        .await
        .map(drop)
    }
}

/// The example's configuration, from the environment.
#[derive(Clone, PartialEq, Eq)]
pub struct StatementsConfig {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `NATS_CREDS` or `NATS_NKEY` (see [`crate::NatsAuth`]).
    pub nats_auth: crate::NatsAuth,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
    pub database_url: String,
    /// `STATEMENTS_STREAM`: the events' stream, default `CREDIT_EVENTS` (`credit`'s
    /// `CREDIT_EVENTS_STREAM`).
    pub stream: String,
    /// `STATEMENTS_SUBJECT`: the events' subject, default `credits.applied`.
    pub subject: String,
    /// `STATEMENTS_CONSUMER`: the durable consumer's name, default `statements`.
    pub durable: String,
    /// `STATEMENTS_POOL`: the pool's size, default 4.
    pub pool: u32,
}

impl std::fmt::Debug for StatementsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatementsConfig")
            .field("nats_url", &redact::url_list(&self.nats_url))
            .field("nats_auth", &self.nats_auth)
            .field("database_url", &redact::url(&self.database_url))
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("durable", &self.durable)
            .field("pool", &self.pool)
            .finish()
    }
}

impl StatementsConfig {
    /// Reads the configuration; a variable that does not parse is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let env = Vars(|name: &str| std::env::var(name).ok());
        Ok(StatementsConfig {
            nats_url: env.var("NATS_URL", "nats://127.0.0.1:4222"),
            nats_auth: crate::NatsAuth::from_vars(&env)?,
            database_url: env.var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: env.var("STATEMENTS_STREAM", "CREDIT_EVENTS"),
            subject: env.var("STATEMENTS_SUBJECT", "credits.applied"),
            durable: env.var("STATEMENTS_CONSUMER", "statements"),
            pool: env.number("STATEMENTS_POOL", "4", 1)? as u32,
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

/// Connects (waiting out NATS and the database being down at start, until `startup` is
/// cancelled), creates the table, migrates the inbox, and runs the handler on an [`App`] until
/// SIGINT or SIGTERM.
pub async fn run(config: &StatementsConfig, startup: CancellationToken) -> Result<AppStats, Error> {
    let connect = || connect_nats(&config.nats_url, &config.nats_auth);
    let Some(client) = until_up("NATS", &startup, connect).await? else {
        return Ok(AppStats::new());
    };
    let js = async_nats::jetstream::new(client);
    let database = DatabaseSpec {
        url: &config.database_url,
        server_pool: config.pool,
        sqlite_pool: 1,
    };
    let parts = Backends {
        postgres: (postgres::create_table, postgres::statement),
        mysql: (mysql::create_table, mysql::statement),
        sqlite: (sqlite::create_table, sqlite::statement),
    };
    let on = Serve { config, js };
    let stats = start_database(&database, &startup, on, parts).await?;
    Ok(stats.unwrap_or_default())
}

/// Where the app runs, once NATS is up.
struct Serve<'a> {
    config: &'a StatementsConfig,
    js: async_nats::jetstream::Context,
}

/// `Part`: the backend's `create_table` and `statement`.
impl<C, H> Example<(C, H)> for Serve<'_>
where
    C: AsyncFn(&sqlx::Pool<H::Db>) -> Result<(), sqlx::Error>,
    H: Handler<Message = CreditApplied, State = ()>,
{
    type Db = H::Db;
    type Output = AppStats;

    async fn create_tables(
        (create_table, _): &(C, H),
        pool: &sqlx::Pool<H::Db>,
    ) -> Result<(), sqlx::Error> {
        create_table(pool).await
    }

    async fn run(self, (_, handler): (C, H), inbox: Inbox<H::Db>) -> Result<AppStats, Error> {
        let config = self.config;
        // As `credit` creates it, when it does not exist yet.
        let stream = async_nats::jetstream::stream::Config {
            subjects: vec![config.subject.clone()],
            duplicate_window: Duration::from_secs(120),
            max_age: crate::MAX_AGE,
            ..Default::default()
        };
        let durable = Durable::recommended(&config.stream, &config.durable, &config.subject)
            .with_stream(stream);
        Ok(App::new(inbox, &self.js)
            .pull_connections(NatsConnector::new(&config.nats_url, &config.nats_auth).pulls())
            .handler(handler, durable)
            .run()
            .await?)
    }
}
