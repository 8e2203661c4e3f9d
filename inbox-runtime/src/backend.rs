//! What differs per database, behind one sealed trait; the generic code never asks which database
//! it is. A backend writes its dialect's SQL and overrides only what behaves differently; the
//! statements every dialect runs alike have default bodies over sqlx's generic executor bounds.

use crate::partition::{Layout, Partitions};
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr, Transaction};
use std::fmt;
use std::future::Future;
use std::time::Duration;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlite")]
pub use sqlite::sqlite_options;

/// A database the inbox runs on: `sqlx::Postgres` (feature `postgres`), `sqlx::MySql` (feature
/// `mysql`, for MySQL and MariaDB) and `sqlx::Sqlite` (feature `sqlite`).
///
/// Sealed: its SQL is an implementation detail of this crate, and a new backend is added here,
/// where the conformance suite runs it (see CONTRIBUTING.md).
pub trait InboxBackend: sqlx::Database + sealed::Backend {}

impl<DB: sealed::Backend> InboxBackend for DB {}

/// A validated SQL identifier naming the inbox table: ASCII letters, digits and `_`, not starting
/// with a digit, at most 48 bytes (so that derived index names stay within identifier limits).
///
/// ```
/// use inbox_runtime::TableName;
/// assert!(TableName::new("inbox").is_ok());
/// assert!(TableName::new("inbox; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

/// The longest accepted table name.
const MAX_TABLE_LEN: usize = 48;

/// A table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid inbox table name {name:?}: use 1 to {MAX_TABLE_LEN} ASCII letters, digits or `_`, not starting with a digit"
)]
pub struct InvalidTableName {
    /// The rejected name.
    pub name: String,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, InvalidTableName> {
        let ok = !name.is_empty()
            && name.len() <= MAX_TABLE_LEN
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if ok {
            Ok(TableName(name.to_owned()))
        } else {
            Err(InvalidTableName {
                name: name.to_owned(),
            })
        }
    }

    /// The name as written in SQL.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName("inbox".to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The SQL statements of one inbox table, written once per [`Inbox`](crate::Inbox).
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// Binds consumer and key; see [`sealed::Backend::claim`].
    pub claim: SqlStr,
    /// Binds the marker's id: sets `processed_at` as the effect commits.
    pub finish: SqlStr,
    /// See [`sealed::Backend::cleanup_sql`].
    pub cleanup: SqlStr,
    /// See [`sealed::Backend::done_sql`].
    pub done: SqlStr,
    /// See [`sealed::Backend::begin_sql`].
    pub begin: SqlStr,
    /// Binds consumer, headers (JSON), payload: parks a dead letter in `<table>_dead_letters`.
    pub park: SqlStr,
    /// Binds consumer: the oldest parked letters (id, headers, payload).
    pub parked: SqlStr,
    /// Binds id: forgets a parked letter once the dead-letter stream has it.
    pub unpark: SqlStr,
    /// The statements of two-phase claims: see `claim.rs`.
    pub claims: ClaimStatements,
}

/// The statements of two-phase claims (`claim.rs`). A claim is open while `processed_at` is NULL
/// and `lease_until` is set; its owner holds it while `lease_until` is in the future and `fence`
/// is the one it took it with.
#[derive(Debug, Clone)]
pub(crate) struct ClaimStatements {
    /// Binds consumer, key: (id, done 0/1, ms until lease_until or -1, fence, attempts) of the
    /// marker, locked for update.
    pub state: SqlStr,
    /// Binds lease seconds, id, fence: takes the claim over (fence + 1, attempts + 1, a new lease)
    /// if its lease has run out (or it has none yet).
    pub take: SqlStr,
    /// Binds lease seconds, id, fence: extends the lease of the claim still held with `fence`.
    pub renew: SqlStr,
    /// Binds id, fence: marks the claim done, if `fence` still holds it; `received_at` becomes
    /// the completion time, from which retention counts.
    pub complete: SqlStr,
    /// Binds id, fence: ends the lease now, if `fence` still holds it.
    pub release: SqlStr,
    /// Binds consumer, -age ms: (key, fence, attempts, age ms, ms until lease_until) of open
    /// claims received at least that long ago, oldest first.
    pub open: SqlStr,
    /// Binds consumer, key: ends the lease of an open claim now.
    pub release_key: SqlStr,
    /// Binds consumer, key: deletes an open claim.
    pub forget_key: SqlStr,
}

impl ClaimStatements {
    fn new<DB: InboxBackend>(table: &TableName) -> Self {
        let p = DB::param;
        let int = |expr: &str| format!("CAST({expr} AS {})", DB::INT64);
        let until = |col: &str| format!("COALESCE({}, -1)", DB::ms_until_sql(col));
        let open = "processed_at IS NULL AND lease_until IS NOT NULL";
        ClaimStatements {
            state: sql(format!(
                "SELECT id, {}, {}, fence, {} FROM {table} WHERE consumer = {} AND message_key = {}{}",
                int("CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END"),
                until("lease_until"),
                int("attempts"),
                p(1),
                p(2),
                DB::FOR_UPDATE
            )),
            take: sql(format!(
                "UPDATE {table} SET fence = fence + 1, attempts = attempts + 1, lease_until = {} \
                 WHERE id = {} AND fence = {} AND processed_at IS NULL \
                 AND (lease_until IS NULL OR lease_until <= {})",
                DB::secs_from_now_sql(&p(1)),
                p(2),
                p(3),
                DB::NOW_SQL
            )),
            renew: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE id = {} AND fence = {} AND {open}",
                DB::secs_from_now_sql(&p(1)),
                p(2),
                p(3)
            )),
            // received_at moves to the completion too: retention and the cleanup cutoff, which
            // read received_at, then count from when the effect was done, as for a marker (a
            // claim can stay open for days before a replay completes it).
            complete: sql(format!(
                "UPDATE {table} SET processed_at = {now}, received_at = {now}, lease_until = NULL \
                 WHERE id = {} AND fence = {} AND {open}",
                p(1),
                p(2),
                now = DB::NOW_SQL,
            )),
            release: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE id = {} AND fence = {} AND {open}",
                DB::NOW_SQL,
                p(1),
                p(2)
            )),
            open: sql(format!(
                "SELECT {}, fence, {}, -{}, {} FROM {table} \
                 WHERE consumer = {} AND {open} AND {} <= {} ORDER BY id LIMIT 1000",
                DB::KEY_TEXT,
                int("attempts"),
                DB::ms_until_sql("received_at"),
                until("lease_until"),
                p(1),
                DB::ms_until_sql("received_at"),
                p(2)
            )),
            release_key: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE consumer = {} AND message_key = {} AND {open}",
                DB::NOW_SQL,
                p(1),
                p(2)
            )),
            forget_key: sql(format!(
                "DELETE FROM {table} WHERE consumer = {} AND message_key = {} AND {open}",
                p(1),
                p(2)
            )),
        }
    }
}

impl Statements {
    pub(crate) fn new<DB: InboxBackend>(
        table: &TableName,
        layout: &Layout,
        lock_timeout: Duration,
    ) -> Self {
        Statements {
            begin: DB::begin_sql(lock_timeout),
            park: sql(format!(
                "INSERT INTO {table}_dead_letters (consumer, headers, payload) VALUES ({}, {}, {})",
                DB::param(1),
                DB::param(2),
                DB::param(3)
            )),
            parked: sql(format!(
                "SELECT id, headers, payload FROM {table}_dead_letters WHERE consumer = {} \
                 ORDER BY id LIMIT 100",
                DB::param(1)
            )),
            unpark: sql(format!(
                "DELETE FROM {table}_dead_letters WHERE id = {}",
                DB::param(1)
            )),
            claim: DB::claim_sql(table, layout),
            finish: DB::finish_sql(table),
            cleanup: DB::cleanup_sql(table),
            done: DB::done_sql(table),
            claims: ClaimStatements::new::<DB>(table),
        }
    }
}

fn sql(text: String) -> SqlStr {
    AssertSqlSafe(text).into_sql_str()
}

pub(crate) mod sealed {
    use super::*;

    /// The result of the claim statement.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Claim {
        /// This transaction inserted the marker (row `id`): it owns the key until it commits or rolls
        /// back.
        New(i64),
        /// A committed marker for the key exists: the message is a duplicate.
        Duplicate,
    }

    /// One database's inbox SQL. Not public API: reachable only inside this crate.
    pub trait Backend: sqlx::Database + Generic {
        /// The backend's name, for logs and errors.
        const NAME: &'static str;

        /// The current time as this dialect writes it into `processed_at`.
        const NOW_SQL: &'static str;

        /// The type an integer expression is CAST to so that it decodes as `i64`.
        const INT64: &'static str;

        /// What locks the rows a SELECT reads until the transaction ends (empty where the
        /// transaction holds the database's write lock already).
        const FOR_UPDATE: &'static str = " FOR UPDATE";

        /// The time `param` seconds (a float) from now, as the dialect stores timestamps.
        fn secs_from_now_sql(param: &str) -> String;

        /// The whole milliseconds from now until `column` (negative once it is past; NULL when
        /// it is NULL), as an integer expression.
        fn ms_until_sql(column: &str) -> String;

        /// `message_key` as text (MySQL stores it as bytes, compared exactly).
        const KEY_TEXT: &'static str = "message_key";

        /// The claim statement for `table` in `layout`. Binds: consumer, key. PostgreSQL and
        /// SQLite return the new row's id, or no row (or NULL) for a duplicate (the default
        /// [`Backend::claim`]). Only PostgreSQL is ever given [`Layout::Partitioned`].
        fn claim_sql(table: &TableName, layout: &Layout) -> SqlStr;

        /// Sets `processed_at` on the marker whose id is bound, in the message's transaction.
        fn finish_sql(table: &TableName) -> SqlStr;

        /// Returns the id of the finished marker of (consumer, key), if one is committed: after
        /// a COMMIT whose reply was lost, whether the effect is done.
        fn done_sql(table: &TableName) -> SqlStr;

        /// The `n`th bind placeholder (from 1) in this dialect: `$1`, `?` or `?1`.
        fn param(n: usize) -> String;

        /// The migrations that create and evolve `table` in `layout`, in order.
        fn migration_sql(table: &TableName, layout: &Layout) -> Vec<String>;

        /// Deletes at most `?3` finished markers of consumer `?1` received more than `?2` seconds
        /// (a float) ago, oldest first. Never an open claim (`processed_at IS NULL`).
        fn cleanup_sql(table: &TableName) -> SqlStr;

        /// The rows a statement affected (sqlx has no generic accessor).
        fn rows_affected(done: &Self::QueryResult) -> u64;

        /// Whether a database error says the data itself is wrong (a value out of range, too
        /// long, not valid in its encoding): the same message fails the same way every time.
        fn is_data_error(err: &dyn sqlx::error::DatabaseError) -> bool {
            let _ = err;
            false
        }

        /// Whether a database error says the connection or the server is gone (the server
        /// shutting down, the session killed, a connection failure): see
        /// [`is_outage`](crate::classify::is_outage).
        fn is_connection_error(err: &dyn sqlx::error::DatabaseError) -> bool;

        /// Whether a database error is transient (serialization failure, deadlock, lock timeout,
        /// busy, connection killed): the same message may succeed in a fresh transaction.
        fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool;

        /// The statement that begins a message's transaction, waiting at most `lock_timeout`
        /// for any lock (a twin blocked behind a frozen peer's transaction must not wait for as
        /// long as TCP keepalive allows).
        fn begin_sql(lock_timeout: Duration) -> SqlStr;

        /// Begins the transaction a message is processed in with `sql` ([`Backend::begin_sql`]).
        fn begin(
            pool: &Pool<Self>,
            sql: SqlStr,
        ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_
        {
            pool.begin_with(sql)
        }

        /// Inserts the marker for (`consumer`, `key`) in `tx`, answering whether it was new. A
        /// concurrent transaction holding the same key makes this wait until that one finishes.
        fn claim<'a, 'c>(
            tx: &'a mut Transaction<'c, Self>,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> impl Future<Output = Result<Claim, sqlx::Error>> + Send + 'a {
            let row = Self::fetch_id(&mut **tx, sql, consumer, key);
            async move { Ok(row.await?.map_or(Claim::Duplicate, Claim::New)) }
        }

        /// Claims every key of a batch (in the order given) in `tx`: per key, what
        /// [`Backend::claim`] would answer, a later copy of a key the batch claimed being a
        /// duplicate. By default a claim statement per key; a dialect that can tell new rows from
        /// duplicates in one statement overrides it.
        fn claim_many<'a, 'c>(
            tx: &'a mut Transaction<'c, Self>,
            (table, layout): (&'a TableName, &'a Layout),
            claim: SqlStr,
            consumer: &'a str,
            keys: &'a [&'a str],
        ) -> impl Future<Output = Result<Vec<Claim>, sqlx::Error>> + Send + 'a {
            let _ = (table, layout);
            async move {
                let mut claims = Vec::with_capacity(keys.len());
                for key in keys {
                    claims.push(Self::claim(tx, claim.clone(), consumer, key).await?);
                }
                Ok(claims)
            }
        }

        /// Takes the fleet-wide cleanup lock `name` on `conn` without waiting; `false` when
        /// another instance holds it. The default suits a database with a single writer, whose
        /// cleanups serialise on its write lock anyway.
        fn try_cleanup_lock<'a>(
            conn: &'a mut Self::Connection,
            name: &'a str,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
            let _ = (conn, name);
            std::future::ready(Ok(true))
        }

        /// Releases the lock taken by [`Backend::try_cleanup_lock`].
        fn cleanup_unlock<'a>(
            conn: &'a mut Self::Connection,
            name: &'a str,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
            let _ = (conn, name);
            std::future::ready(Ok(()))
        }

        /// Partitioned layout: creates the partitions of `table` from the current one to
        /// `partitions.ahead` beyond it that do not exist yet, one instance at a time; returns
        /// how many it created. Only a dialect that has the layout overrides it.
        fn add_partitions<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
            partitions: &'a Partitions,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
            let _ = (conn, table, partitions);
            std::future::ready(Ok(0))
        }

        /// Partitioned layout, on a connection holding the cleanup lock: removes `consumer`'s
        /// finished markers in the partitions whose whole range is more than `older_than_secs`
        /// old, by dropping the partition when nothing else is in it (no open claim, no other
        /// consumer's marker), else by deleting them in batches of `batch`. Returns how many
        /// markers went.
        fn drop_partitions<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
            consumer: &'a str,
            older_than_secs: f64,
            batch: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
            let _ = (conn, table, consumer, older_than_secs, batch);
            std::future::ready(Ok(0))
        }

        /// `err` as this backend's database error, when it is one: a handler's error that wraps
        /// a `sqlx::Error` transparently (`#[error(transparent)]`) shows, as its source, the
        /// database error inside it rather than the `sqlx::Error`.
        fn downcast_database_error<'e>(
            err: &'e (dyn std::error::Error + 'static),
        ) -> Option<&'e dyn sqlx::error::DatabaseError>;

        /// The outbox (`outbox.rs`): the migrations that create `table` and its indexes.
        fn outbox_migration_sql(table: &TableName) -> Vec<String>;

        /// The outbox: what a relay's SELECT of pending rows ends with, to lock them for its
        /// transaction and pass over those another relay holds. Empty where the transaction holds
        /// the database's write lock (SQLite, whose relays take turns by a lease instead).
        const SKIP_LOCKED: &'static str = " FOR UPDATE SKIP LOCKED";

        /// The outbox: deletes at most `?2` rows of `table` sent more than `?1` seconds (a float)
        /// ago, oldest first.
        fn outbox_cleanup_sql(table: &TableName) -> SqlStr;
    }

    /// The statements every dialect runs alike, written once over the bounds sqlx's generic
    /// executors need; implemented for every database that meets them.
    pub trait Generic: sqlx::Database {
        /// Runs `sql` with (consumer, key) and returns the id of the row it returns, if any.
        fn fetch_id<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

        /// Runs `sql` with (consumer, key) and returns the five integers of the row it returns.
        fn fetch_claim_state<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> impl Future<Output = Result<Option<ClaimRow>, sqlx::Error>> + Send + 'a;

        /// Runs `sql` with (consumer, a number) and returns its (text, four integers) rows.
        fn fetch_open_claims<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            consumer: &'a str,
            n: i64,
        ) -> impl Future<Output = Result<Vec<OpenClaimRow>, sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding (`secs`, `id`, `fence`), or (`id`, `fence`) without `secs`.
        fn execute_fenced<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            secs: Option<f64>,
            id: i64,
            fence: i64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding (consumer, key).
        fn execute_key<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding `id`.
        fn execute_id<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            id: i64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs one cleanup batch ([`Backend::cleanup_sql`]).
        fn cleanup_batch<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            consumer: &'a str,
            older_than_secs: f64,
            limit: i64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql` ([`Statements::park`]) on `pool`.
        fn park<'a>(
            pool: &'a Pool<Self>,
            sql: SqlStr,
            consumer: &'a str,
            headers: &'a str,
            payload: &'a [u8],
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql` ([`Statements::parked`]) on `pool`.
        fn parked<'a>(
            pool: &'a Pool<Self>,
            sql: SqlStr,
            consumer: &'a str,
        ) -> impl Future<Output = Result<Vec<(i64, String, Vec<u8>)>, sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding `id` on `pool`.
        fn execute_id_on<'a>(
            pool: &'a Pool<Self>,
            sql: SqlStr,
            id: i64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql`, without binds and unprepared, on `conn`.
        fn execute_raw<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql`, without binds, on `pool`.
        fn execute<'a>(
            pool: &'a Pool<Self>,
            sql: SqlStr,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// The outbox: runs `sql` binding (msg id, subject, order key, headers, payload).
        fn outbox_insert<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            row: (&'a str, &'a str, &'a str, &'a str, &'a [u8]),
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// The outbox: runs `sql` binding `n` and returns its rows.
        fn outbox_rows<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            n: i64,
        ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send + 'a;

        /// The outbox: runs `sql` binding `n` and returns its (text, integer) rows.
        fn keyed_ints<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            n: i64,
        ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'a;

        /// Runs `sql`, without binds, on `pool` and returns the two integers of its row.
        fn two_ints<'a>(
            pool: &'a Pool<Self>,
            sql: SqlStr,
        ) -> impl Future<Output = Result<(i64, i64), sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding (`text`, `secs`) on `conn`.
        fn execute_text_secs<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            text: &'a str,
            secs: f64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `sql` binding (`secs`, `n`) on `conn`.
        fn execute_secs_n<'a>(
            conn: &'a mut Self::Connection,
            sql: SqlStr,
            secs: f64,
            n: i64,
        ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

        /// Runs `migrator` on `pool`.
        fn run_migrator<'a>(
            pool: &'a Pool<Self>,
            migrator: &'a Migrator,
        ) -> impl Future<Output = Result<(), MigrateError>> + Send + 'a;
    }

    impl<DB> Generic for DB
    where
        DB: sqlx::Database,
        DB::Arguments: sqlx::IntoArguments<DB>,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        DB::Connection: sqlx::migrate::Migrate,
        for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
        for<'q> f64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        for<'r> (i64, String, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
        for<'r> (i64, i64, i64, i64, i64): sqlx::FromRow<'r, DB::Row>,
        for<'r> (String, i64, i64, i64, i64): sqlx::FromRow<'r, DB::Row>,
        for<'r> OutboxRow: sqlx::FromRow<'r, DB::Row>,
        for<'r> (String, i64): sqlx::FromRow<'r, DB::Row>,
        for<'r> (i64, i64): sqlx::FromRow<'r, DB::Row>,
        usize: sqlx::ColumnIndex<DB::Row>,
    {
        async fn fetch_claim_state<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> Result<Option<ClaimRow>, sqlx::Error> {
            sqlx::query_as::<DB, ClaimRow>(sql)
                .bind(consumer)
                .bind(key)
                .fetch_optional(conn)
                .await
        }

        async fn fetch_open_claims<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            consumer: &'a str,
            n: i64,
        ) -> Result<Vec<OpenClaimRow>, sqlx::Error> {
            sqlx::query_as::<DB, OpenClaimRow>(sql)
                .bind(consumer)
                .bind(n)
                .fetch_all(conn)
                .await
        }

        async fn execute_fenced(
            conn: &mut DB::Connection,
            sql: SqlStr,
            secs: Option<f64>,
            id: i64,
            fence: i64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            let mut query = sqlx::query::<DB>(sql);
            if let Some(secs) = secs {
                query = query.bind(secs);
            }
            query.bind(id).bind(fence).execute(conn).await
        }

        async fn execute_key<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql)
                .bind(consumer)
                .bind(key)
                .execute(conn)
                .await
        }

        async fn fetch_id<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            consumer: &'a str,
            key: &'a str,
        ) -> Result<Option<i64>, sqlx::Error> {
            sqlx::query_scalar::<DB, i64>(sql)
                .bind(consumer)
                .bind(key)
                .fetch_optional(conn)
                .await
        }

        async fn execute_id(
            conn: &mut DB::Connection,
            sql: SqlStr,
            id: i64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql).bind(id).execute(conn).await
        }

        async fn cleanup_batch<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            consumer: &'a str,
            older_than_secs: f64,
            limit: i64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql)
                .bind(consumer)
                .bind(older_than_secs)
                .bind(limit)
                .execute(conn)
                .await
        }

        async fn park<'a>(
            pool: &'a Pool<DB>,
            sql: SqlStr,
            consumer: &'a str,
            headers: &'a str,
            payload: &'a [u8],
        ) -> Result<DB::QueryResult, sqlx::Error> {
            let query = sqlx::query::<DB>(sql).bind(consumer).bind(headers);
            query.bind(payload).execute(pool).await
        }

        async fn parked<'a>(
            pool: &'a Pool<DB>,
            sql: SqlStr,
            consumer: &'a str,
        ) -> Result<Vec<(i64, String, Vec<u8>)>, sqlx::Error> {
            sqlx::query_as::<DB, (i64, String, Vec<u8>)>(sql)
                .bind(consumer)
                .fetch_all(pool)
                .await
        }

        async fn execute_id_on(
            pool: &Pool<DB>,
            sql: SqlStr,
            id: i64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql).bind(id).execute(pool).await
        }

        async fn execute_raw(
            conn: &mut DB::Connection,
            sql: SqlStr,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::raw_sql(sql).execute(conn).await
        }

        async fn outbox_insert<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            (msg_id, subject, order_key, headers, payload): (
                &'a str,
                &'a str,
                &'a str,
                &'a str,
                &'a [u8],
            ),
        ) -> Result<DB::QueryResult, sqlx::Error> {
            let query = sqlx::query::<DB>(sql).bind(msg_id).bind(subject);
            let query = query.bind(order_key).bind(headers).bind(payload);
            query.execute(conn).await
        }

        async fn outbox_rows(
            conn: &mut DB::Connection,
            sql: SqlStr,
            n: i64,
        ) -> Result<Vec<OutboxRow>, sqlx::Error> {
            sqlx::query_as::<DB, OutboxRow>(sql)
                .bind(n)
                .fetch_all(conn)
                .await
        }

        async fn keyed_ints(
            conn: &mut DB::Connection,
            sql: SqlStr,
            n: i64,
        ) -> Result<Vec<(String, i64)>, sqlx::Error> {
            sqlx::query_as::<DB, (String, i64)>(sql)
                .bind(n)
                .fetch_all(conn)
                .await
        }

        async fn two_ints(pool: &Pool<DB>, sql: SqlStr) -> Result<(i64, i64), sqlx::Error> {
            sqlx::query_as::<DB, (i64, i64)>(sql).fetch_one(pool).await
        }

        async fn execute_text_secs<'a>(
            conn: &'a mut DB::Connection,
            sql: SqlStr,
            text: &'a str,
            secs: f64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql)
                .bind(text)
                .bind(secs)
                .execute(conn)
                .await
        }

        async fn execute_secs_n(
            conn: &mut DB::Connection,
            sql: SqlStr,
            secs: f64,
            n: i64,
        ) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql)
                .bind(secs)
                .bind(n)
                .execute(conn)
                .await
        }

        async fn execute(pool: &Pool<DB>, sql: SqlStr) -> Result<DB::QueryResult, sqlx::Error> {
            sqlx::query::<DB>(sql).execute(pool).await
        }

        fn run_migrator<'a>(
            pool: &'a Pool<DB>,
            migrator: &'a Migrator,
        ) -> impl Future<Output = Result<(), MigrateError>> + Send + 'a {
            migrator.run(pool)
        }
    }
}

/// A claim's state row: (id, done 0/1, ms until `lease_until` or -1, fence, attempts).
pub(crate) type ClaimRow = (i64, i64, i64, i64, i64);

/// A pending outbox row: (id, msg id, subject, order key, headers as JSON, payload).
pub(crate) type OutboxRow = (i64, String, String, String, String, Vec<u8>);

/// An open claim's row: (key, fence, attempts, age ms, ms until `lease_until` or -1).
pub(crate) type OpenClaimRow = (String, i64, i64, i64, i64);

/// The claims of `keys`, in order, from the (key, id) rows one statement inserted: a key's first
/// copy with a row is new, every other copy a duplicate.
pub(crate) fn claims_of(keys: &[&str], rows: Vec<(String, i64)>) -> Vec<sealed::Claim> {
    let mut new: std::collections::HashMap<String, i64> = rows.into_iter().collect();
    keys.iter()
        .map(|key| match new.remove(*key) {
            Some(id) => sealed::Claim::New(id),
            None => sealed::Claim::Duplicate,
        })
        .collect()
}

/// Sets `processed_at` on the markers `ids` of `table`: a batch's markers, in its transaction.
/// The ids are the database's own integers, written into the statement (it runs unprepared,
/// since its text changes with every batch).
pub(crate) fn finish_many_sql<DB: InboxBackend>(table: &TableName, ids: &[i64]) -> SqlStr {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    sql(format!(
        "UPDATE {table} SET processed_at = {} WHERE id IN ({})",
        DB::NOW_SQL,
        ids.join(", ")
    ))
}

/// The migrator for `table`: the backend's migrations, tracked in a migrations table of our own
/// (`_<table>_migrations`) so that they never mix with the application's `_sqlx_migrations`.
pub(crate) fn migrator<DB: InboxBackend>(table: &TableName, layout: &Layout) -> Migrator {
    let migrations = DB::migration_sql(table, layout)
        .into_iter()
        .enumerate()
        .map(|(i, sql)| {
            Migration::new(
                i as i64 + 1,
                format!("inbox table {table}, step {}", i + 1).into(),
                MigrationType::Simple,
                AssertSqlSafe(sql).into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(migrations_table(table));
    migrator
}

/// The migrator of outbox `table`, tracked in `_<table>_migrations` like an inbox's.
pub(crate) fn outbox_migrator<DB: InboxBackend>(table: &TableName) -> Migrator {
    let migrations = DB::outbox_migration_sql(table)
        .into_iter()
        .enumerate()
        .map(|(i, sql)| {
            Migration::new(
                i as i64 + 1,
                format!("outbox table {table}, step {}", i + 1).into(),
                MigrationType::Simple,
                AssertSqlSafe(sql).into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(migrations_table(table));
    migrator
}

/// The table that records which migrations of `table` ran.
fn migrations_table(table: &TableName) -> String {
    format!("_{table}_migrations")
}

/// Forgets the interrupted run of migration `version` (recorded with `success = FALSE`), so that
/// the migrator runs it again. Only for idempotent DDL, which every migration here is.
pub(crate) fn forget_dirty_sql(table: &TableName, version: i64) -> SqlStr {
    let migrations = migrations_table(table);
    AssertSqlSafe(format!(
        "DELETE FROM {migrations} WHERE version = {version} AND success = FALSE"
    ))
    .into_sql_str()
}

/// Whether `err` is worth retrying with a fresh transaction: a transient database error of the
/// backend, a lost connection, or a pool timeout. Constraint violations and the like are not.
pub fn is_transient<DB: InboxBackend>(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(e) => DB::is_transient_error(e.as_ref()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

#[cfg(test)]
mod claims_tests {
    use super::claims_of;
    use super::sealed::Claim;

    #[test]
    fn the_first_copy_with_a_row_is_new_and_every_other_a_duplicate() {
        let keys = ["a", "a", "b", "c", "c"];
        let rows = vec![("a".to_owned(), 7), ("c".to_owned(), 9)];
        assert_eq!(
            claims_of(&keys, rows),
            [
                Claim::New(7),
                Claim::Duplicate,
                Claim::Duplicate,
                Claim::New(9),
                Claim::Duplicate
            ]
        );
    }
}
