//! What differs per database, behind one trait; the generic code never asks which database it is.

use crate::store::TableName;
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr, Transaction};
use std::future::Future;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlite")]
pub use sqlite::sqlite_options;

/// The result of the claim statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This transaction inserted the marker: it owns the key until it commits or rolls back.
    New,
    /// A committed marker for the key exists: the message is a duplicate.
    Duplicate,
}

/// One database's inbox SQL: how to begin, claim, and create the table.
///
/// Implemented for `sqlx::Postgres` (feature `postgres`), `sqlx::MySql` (feature `mysql`, for MySQL
/// and MariaDB) and `sqlx::Sqlite` (feature `sqlite`).
pub trait InboxBackend: sqlx::Database {
    /// The backend's name, for logs and errors.
    const NAME: &'static str;

    /// The claim statement for `table`, prepared once per [`Inbox`](crate::Inbox). Its binds are
    /// the consumer and the key.
    fn claim_sql(table: &TableName) -> SqlStr;

    /// The migrations that create and evolve `table`, in order.
    fn migration_sql(table: &TableName) -> Vec<String>;

    /// Begins the transaction a message is processed in.
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_;

    /// Inserts the marker for (`consumer`, `key`) in `tx`, answering whether it was new. A
    /// concurrent transaction holding the same key makes this wait until that one finishes.
    fn claim<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<Claim, sqlx::Error>> + Send + 'a;

    /// Whether a database error is transient (serialization failure, deadlock, lock timeout, busy,
    /// connection killed): the same message may succeed in a fresh transaction.
    fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool;

    /// Deletes at most `?3` finished markers of consumer `?1` received more than `?2` seconds
    /// (a float) ago, oldest first. Never an open claim (`processed_at IS NULL`).
    fn cleanup_sql(table: &TableName) -> SqlStr;

    /// Runs one [`InboxBackend::cleanup_sql`] batch on `conn`; returns the rows deleted.
    fn cleanup_batch<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        consumer: &'a str,
        older_than_secs: f64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Takes the fleet-wide cleanup lock `name` on `conn` without waiting; `false` when another
    /// instance holds it. A backend with a single writer may always answer `true`.
    fn try_cleanup_lock<'a>(
        conn: &'a mut Self::Connection,
        name: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Releases the lock taken by [`InboxBackend::try_cleanup_lock`].
    fn cleanup_unlock<'a>(
        conn: &'a mut Self::Connection,
        name: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs `migrator` on `pool`.
    fn run_migrator<'a>(
        pool: &'a Pool<Self>,
        migrator: &'a Migrator,
    ) -> impl Future<Output = Result<(), MigrateError>> + Send + 'a;
}

/// The migrator for `table`: the backend's migrations, tracked in a migrations table of our own
/// (`_<table>_migrations`) so that they never mix with the application's `_sqlx_migrations`.
pub(crate) fn migrator<DB: InboxBackend>(table: &TableName) -> Migrator {
    let migrations = DB::migration_sql(table)
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
    migrator.dangerous_set_table_name(format!("_{table}_migrations"));
    migrator
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
