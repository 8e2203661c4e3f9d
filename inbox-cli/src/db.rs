//! The database side: markers, open claims, parked letters and the outbox, read with the
//! runtime's API where it has one and with plain SQL over its tables where it has not (counts
//! and ages for `status`, listings).

use crate::{Config, Error};
use inbox_runtime::{Inbox, InboxBackend, Outbox, TableName};
use serde::Serialize;
use sqlx::{MySql, Pool, Postgres, Sqlite};
use std::time::Duration;

/// A pool of the database `DATABASE_URL` names, with the inbox's and the outbox's tables.
pub enum Db {
    Postgres(Pool<Postgres>, Tables),
    MySql(Pool<MySql>, Tables),
    Sqlite(Pool<Sqlite>, Tables),
}

/// The tables' names.
pub struct Tables {
    inbox: TableName,
    outbox: TableName,
}

/// Runs `$body` with `$pool` the concrete pool, `$tables` the tables and `$d` the dialect.
macro_rules! on_db {
    ($db:expr, |$pool:ident, $tables:ident, $d:ident| $body:expr) => {
        match $db {
            Db::Postgres($pool, $tables) => {
                let $d = Dialect::Postgres;
                $body
            }
            Db::MySql($pool, $tables) => {
                let $d = Dialect::MySql;
                $body
            }
            Db::Sqlite($pool, $tables) => {
                let $d = Dialect::Sqlite;
                $body
            }
        }
    };
}

/// How the three databases spell what the queries below need.
#[derive(Debug, Clone, Copy)]
enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

impl Dialect {
    /// The `n`th bind placeholder.
    fn param(self, n: usize) -> String {
        match self {
            Dialect::Postgres => format!("${n}"),
            Dialect::MySql => "?".into(),
            Dialect::Sqlite => format!("?{n}"),
        }
    }

    /// The whole milliseconds since `column`, as a 64-bit integer.
    fn age_ms(self, column: &str) -> String {
        match self {
            Dialect::Postgres => {
                format!("CAST(EXTRACT(EPOCH FROM (clock_timestamp() - {column})) * 1000 AS BIGINT)")
            }
            Dialect::MySql => format!(
                "CAST(TIMESTAMPDIFF(MICROSECOND, {column}, CURRENT_TIMESTAMP(6)) DIV 1000 AS SIGNED)"
            ),
            Dialect::Sqlite => {
                format!("CAST((julianday('now') - julianday({column})) * 86400000 AS INTEGER)")
            }
        }
    }
}

fn db_error(what: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
    move |e| format!("{what}: {e}")
}

/// A consumer, its markers and the oldest's age, its open claims and the oldest's age.
type MarkerCounts = (String, i64, Option<i64>, i64, Option<i64>);

/// The markers, open claims and parked letters of one consumer.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ConsumerRows {
    pub consumer: String,
    pub markers: i64,
    pub oldest_marker_age_ms: Option<i64>,
    pub open_claims: i64,
    pub oldest_open_claim_age_ms: Option<i64>,
    pub parked_letters: i64,
    pub oldest_parked_age_ms: Option<i64>,
}

/// The outbox's backlog.
#[derive(Debug, Default, Clone, Serialize)]
pub struct OutboxSummary {
    pub pending: u64,
    pub oldest_pending_age_ms: u64,
    pub failed: u64,
}

/// An open claim.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimLine {
    pub consumer: String,
    pub key: String,
    pub fence: i64,
    pub attempts: i64,
    pub age_ms: u128,
    pub lease_left_ms: Option<u128>,
}

/// An outbox row: pending, or failed with its error.
#[derive(Debug, Clone, Serialize)]
pub struct OutboxLine {
    pub id: i64,
    pub subject: String,
    pub order_key: String,
    pub age_ms: i64,
    pub error: Option<String>,
}

/// A parked letter.
#[derive(Debug, Clone, Serialize)]
pub struct ParkedLine {
    pub id: i64,
    pub consumer: String,
    pub stream: Option<String>,
    pub stream_seq: Option<String>,
    pub error: Option<String>,
    pub age_ms: i64,
}

impl Db {
    /// Connects to `DATABASE_URL` (one connection is enough for a command).
    pub async fn connect(config: &Config) -> Result<Db, Error> {
        let url = &config.database_url;
        let tables = || -> Result<Tables, Error> {
            Ok(Tables {
                inbox: TableName::new(&config.table).map_err(|e| format!("--table: {e}"))?,
                outbox: TableName::new(&config.outbox_table)
                    .map_err(|e| format!("--outbox-table: {e}"))?,
            })
        };
        let scheme = url.split(':').next().unwrap_or_default();
        // The URL is never printed: it may carry a password.
        let failed = |e: sqlx::Error| format!("cannot connect to the {scheme} database: {e}");
        Ok(match scheme {
            "postgres" | "postgresql" => {
                Db::Postgres(options(2).connect(url).await.map_err(failed)?, tables()?)
            }
            "mysql" | "mariadb" => {
                Db::MySql(options(2).connect(url).await.map_err(failed)?, tables()?)
            }
            "sqlite" => Db::Sqlite(options(1).connect(url).await.map_err(failed)?, tables()?),
            _ => {
                return Err(
                    "DATABASE_URL must start with postgres://, mysql:// or sqlite:".to_owned(),
                );
            }
        })
    }

    /// Per consumer: markers, open claims and parked letters, with the age of the oldest.
    pub async fn consumers(&self) -> Result<Vec<ConsumerRows>, Error> {
        on_db!(self, |pool, tables, d| {
            let table = &tables.inbox;
            let age = d.age_ms("received_at");
            let open = "processed_at IS NULL AND lease_until IS NOT NULL";
            let markers = format!(
                "SELECT consumer, COUNT(*), MAX({age}), \
                 COUNT(CASE WHEN {open} THEN 1 END), MAX(CASE WHEN {open} THEN {age} END) \
                 FROM {table} GROUP BY consumer ORDER BY consumer"
            );
            let rows: Vec<MarkerCounts> = sqlx::query_as(sqlx::AssertSqlSafe(markers))
                .fetch_all(pool)
                .await
                .map_err(db_error(&format!("reading the markers of table {table}")))?;
            let parked_sql = format!(
                "SELECT consumer, COUNT(*), MAX({}) FROM {table}_dead_letters GROUP BY consumer",
                d.age_ms("stored_at")
            );
            let parked: Vec<(String, i64, Option<i64>)> =
                sqlx::query_as(sqlx::AssertSqlSafe(parked_sql))
                    .fetch_all(pool)
                    .await
                    .map_err(db_error(&format!("reading {table}_dead_letters")))?;
            let mut all: Vec<ConsumerRows> = rows
                .into_iter()
                .map(
                    |(consumer, markers, oldest, open, oldest_open)| ConsumerRows {
                        consumer,
                        markers,
                        oldest_marker_age_ms: oldest,
                        open_claims: open,
                        oldest_open_claim_age_ms: oldest_open,
                        ..ConsumerRows::default()
                    },
                )
                .collect();
            for (consumer, n, oldest) in parked {
                let at = match all.iter().position(|c| c.consumer == consumer) {
                    Some(at) => at,
                    None => {
                        all.push(ConsumerRows {
                            consumer,
                            ..ConsumerRows::default()
                        });
                        all.len() - 1
                    }
                };
                all[at].parked_letters = n;
                all[at].oldest_parked_age_ms = oldest;
            }
            Ok(all)
        })
    }

    /// The outbox's pending and failed rows; `None` when the database has no outbox table.
    pub async fn outbox_summary(&self) -> Result<Option<OutboxSummary>, Error> {
        on_db!(self, |pool, tables, _d| {
            let outbox = Outbox::with_table(pool.clone(), tables.outbox.clone());
            let (pending, oldest) = match outbox.pending().await {
                Ok(pending) => pending,
                Err(e) if is_missing_table(&e) => return Ok(None),
                Err(e) => return Err(format!("reading outbox {}: {e}", tables.outbox)),
            };
            let failed = outbox
                .failed(i64::MAX)
                .await
                .map_err(db_error("reading the outbox's failed rows"))?;
            Ok(Some(OutboxSummary {
                pending,
                oldest_pending_age_ms: u64::try_from(oldest.as_millis()).unwrap_or(u64::MAX),
                failed: failed.len() as u64,
            }))
        })
    }

    /// Open claims of `consumer` (of every consumer with one, without), oldest first.
    pub async fn open_claims(&self, consumer: Option<&str>) -> Result<Vec<ClaimLine>, Error> {
        let consumers: Vec<String> = match consumer {
            Some(c) => vec![c.to_owned()],
            None => self
                .consumers()
                .await?
                .into_iter()
                .filter(|c| c.open_claims > 0)
                .map(|c| c.consumer)
                .collect(),
        };
        let mut lines = Vec::new();
        for consumer in consumers {
            let claims = on_db!(self, |pool, tables, _d| {
                Inbox::with_table(pool.clone(), tables.inbox.clone())
                    .open_claims(&consumer, Duration::ZERO)
                    .await
            })
            .map_err(db_error("reading open claims"))?;
            lines.extend(claims.into_iter().map(|c| ClaimLine {
                consumer: consumer.clone(),
                key: c.key,
                fence: c.fence,
                attempts: c.attempts,
                age_ms: c.age.as_millis(),
                lease_left_ms: c.lease_left.map(|d| d.as_millis()),
            }));
        }
        Ok(lines)
    }

    /// Ends the lease of an open claim.
    pub async fn release_claim(&self, consumer: &str, key: &str) -> Result<bool, Error> {
        on_db!(self, |pool, tables, _d| {
            Inbox::with_table(pool.clone(), tables.inbox.clone())
                .release_claim(consumer, key)
                .await
        })
        .map_err(db_error("releasing the claim"))
    }

    /// Deletes an open claim.
    pub async fn forget_claim(&self, consumer: &str, key: &str) -> Result<bool, Error> {
        on_db!(self, |pool, tables, _d| {
            Inbox::with_table(pool.clone(), tables.inbox.clone())
                .forget_claim(consumer, key)
                .await
        })
        .map_err(db_error("forgetting the claim"))
    }

    /// Deletes the marker of `consumer` with `key`, done or not.
    pub async fn forget_marker(&self, consumer: &str, key: &str) -> Result<bool, Error> {
        on_db!(self, |pool, tables, d| {
            let sql = format!(
                "DELETE FROM {} WHERE consumer = {} AND message_key = {}",
                tables.inbox,
                d.param(1),
                d.param(2)
            );
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(consumer)
                .bind(key)
                .execute(pool)
                .await
                .map_err(db_error("deleting the marker"))?;
            Ok(done.rows_affected() > 0)
        })
    }

    /// The outbox's pending rows (at most 1,000, oldest first), or its failed ones.
    pub async fn outbox_rows(&self, failed: bool) -> Result<Vec<OutboxLine>, Error> {
        on_db!(self, |pool, tables, d| {
            let table = &tables.outbox;
            if failed {
                let outbox = Outbox::with_table(pool.clone(), table.clone());
                let rows = outbox
                    .failed(1000)
                    .await
                    .map_err(db_error("reading the outbox's failed rows"))?;
                return Ok(rows
                    .into_iter()
                    .map(|r| OutboxLine {
                        id: r.id,
                        subject: r.subject,
                        order_key: r.order_key,
                        age_ms: r.failed_ms_ago,
                        error: Some(r.error),
                    })
                    .collect());
            }
            let sql = format!(
                "SELECT id, subject, order_key, {} FROM {table} WHERE sent_at IS NULL \
                 AND id NOT IN (SELECT id FROM {table}_failed) ORDER BY id LIMIT 1000",
                d.age_ms("created_at")
            );
            let rows: Vec<(i64, String, String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .map_err(db_error(&format!("reading outbox {table}")))?;
            Ok(rows
                .into_iter()
                .map(|(id, subject, order_key, age_ms)| OutboxLine {
                    id,
                    subject,
                    order_key,
                    age_ms,
                    error: None,
                })
                .collect())
        })
    }

    /// Lets a failed outbox row be sent again.
    pub async fn outbox_retry(&self, id: i64) -> Result<bool, Error> {
        on_db!(self, |pool, tables, _d| {
            Outbox::with_table(pool.clone(), tables.outbox.clone())
                .retry_failed(id)
                .await
        })
        .map_err(db_error("retrying the outbox row"))
    }

    /// Gives up a failed outbox row.
    pub async fn outbox_discard(&self, id: i64) -> Result<bool, Error> {
        on_db!(self, |pool, tables, _d| {
            Outbox::with_table(pool.clone(), tables.outbox.clone())
                .discard_failed(id)
                .await
        })
        .map_err(db_error("discarding the outbox row"))
    }

    /// The parked letters, oldest first.
    pub async fn parked(&self) -> Result<Vec<ParkedLine>, Error> {
        on_db!(self, |pool, tables, d| {
            let sql = format!(
                "SELECT id, consumer, headers, {} FROM {}_dead_letters ORDER BY id",
                d.age_ms("stored_at"),
                tables.inbox
            );
            let rows: Vec<(i64, String, String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .map_err(db_error("reading the parked letters"))?;
            Ok(rows
                .into_iter()
                .map(|(id, consumer, headers, age_ms)| {
                    let headers: Vec<(String, String)> =
                        serde_json::from_str(&headers).unwrap_or_default();
                    let header = |name: &str| {
                        headers
                            .iter()
                            .find(|(n, _)| n.eq_ignore_ascii_case(name))
                            .map(|(_, v)| v.clone())
                    };
                    ParkedLine {
                        id,
                        stream: header("Inbox-Stream"),
                        stream_seq: header("Inbox-Stream-Seq"),
                        error: header("Inbox-Error"),
                        consumer,
                        age_ms,
                    }
                })
                .collect())
        })
    }

    /// Publishes every parked letter to the dead-letter stream; how many went.
    pub async fn relay_parked(
        &self,
        config: &Config,
        js: &async_nats::jetstream::Context,
    ) -> Result<usize, Error> {
        let parked = self.parked().await?;
        let mut consumers: Vec<(String, String)> = Vec::new();
        for letter in &parked {
            if !consumers.iter().any(|(c, _)| *c == letter.consumer) {
                let source = letter.stream.clone().unwrap_or_default();
                consumers.push((letter.consumer.clone(), source));
            }
        }
        let mut sent = 0;
        for (consumer, source) in consumers {
            let dlq = (config.dlq_stream.as_str(), config.dlq_prefix.as_str());
            sent += on_db!(self, |pool, tables, _d| {
                relay(
                    Inbox::with_table(pool.clone(), tables.inbox.clone()),
                    js,
                    dlq,
                    &consumer,
                    &source,
                )
                .await
            })?;
        }
        Ok(sent)
    }
}

async fn relay<DB: InboxBackend>(
    inbox: Inbox<DB>,
    js: &async_nats::jetstream::Context,
    dlq: (&str, &str),
    consumer: &str,
    source: &str,
) -> Result<usize, Error> {
    inbox
        .relay_parked_letters(js, dlq, consumer, source)
        .await
        .map_err(|e| format!("publishing {consumer:?}'s parked letters: {e}"))
}

/// A small pool: a command needs a connection or two.
fn options<DB: sqlx::Database>(max: u32) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new().max_connections(max)
}

/// Whether `e` says a table does not exist.
fn is_missing_table(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| {
        // PostgreSQL 42P01, MySQL 1146; SQLite says so in words.
        matches!(d.code().as_deref(), Some("42P01" | "42S02"))
            || d.message().contains("no such table")
            || d.message().contains("doesn't exist")
    })
}

/// `ms` as a short age: `42 s`, `3 min`, `5 h`, `2 d`.
pub fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// `claims list` as text.
pub fn claims_text(lines: &[ClaimLine]) -> String {
    if lines.is_empty() {
        return "no open claims\n".into();
    }
    let mut out = String::from("CONSUMER\tKEY\tFENCE\tATTEMPTS\tAGE\tLEASE LEFT\n");
    for c in lines {
        let lease = c
            .lease_left_ms
            .map_or("over".to_owned(), |ms| age(ms as i64));
        out += &format!(
            "{}\t{}\t{}\t{}\t{}\t{lease}\n",
            c.consumer,
            c.key,
            c.fence,
            c.attempts,
            age(c.age_ms as i64)
        );
    }
    out
}

/// `outbox list` as text.
pub fn outbox_text(lines: &[OutboxLine]) -> String {
    if lines.is_empty() {
        return "no rows\n".into();
    }
    let mut out = String::from("ID\tSUBJECT\tORDER KEY\tAGE\tERROR\n");
    for r in lines {
        out += &format!(
            "{}\t{}\t{}\t{}\t{}\n",
            r.id,
            r.subject,
            r.order_key,
            age(r.age_ms),
            r.error.as_deref().unwrap_or("-")
        );
    }
    out
}

/// `parked list` as text.
pub fn parked_text(lines: &[ParkedLine]) -> String {
    if lines.is_empty() {
        return "no parked letters\n".into();
    }
    let mut out = String::from("ID\tCONSUMER\tSTREAM\tSEQ\tAGE\tERROR\n");
    for p in lines {
        out += &format!(
            "{}\t{}\t{}\t{}\t{}\t{}\n",
            p.id,
            p.consumer,
            p.stream.as_deref().unwrap_or("-"),
            p.stream_seq.as_deref().unwrap_or("-"),
            age(p.age_ms),
            p.error.as_deref().unwrap_or("-")
        );
    }
    out
}
