//! The statements every dialect runs alike, written once over the bounds sqlx's generic
//! executors need, each binding what its statements take and reading rows into named structs
//! (`rows.rs`).

use super::rows::{ClaimState, DeleteBatch, OpenClaimRow, ParkedRow};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::{Pool, SqlStr};
use std::future::Future;

mod outbox;
pub use outbox::GenericOutbox;

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

    /// Runs `sql` with (consumer, key, hash) and returns the id of the row it returns, if any.
    fn fetch_id_hashed<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
        hash: Option<&'a str>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with (consumer, key) and returns the claim's state, if it has a row.
    fn fetch_claim_state<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<Option<ClaimState>, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with (consumer, a number) and returns the open claims it lists.
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

    /// Runs `sql` binding (`hash`, `id`): finishes a marker, keeping its payload's hash.
    fn execute_finish<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        id: i64,
        hash: Option<&'a str>,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with (consumer, key) and returns the payload hash the key's marker keeps:
    /// `None` without a marker, `Some(None)` for one that keeps none.
    fn fetch_hash<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<Option<Option<String>>, sqlx::Error>> + Send + 'a;

    /// Runs `sql` binding `id`.
    fn execute_id<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        id: i64,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// Deletes one batch of old rows: markers (`Backend::cleanup_sql`) or sent outbox rows
    /// (`Backend::outbox_cleanup_sql`), as `batch` binds them.
    fn delete_batch<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        batch: DeleteBatch<'a>,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// Runs `sql` (`InboxStatements::park`) on `conn`.
    fn park<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        consumer: &'a str,
        headers: &'a str,
        payload: &'a [u8],
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// Runs `sql` (`InboxStatements::parked`) on `pool`.
    fn parked<'a>(
        pool: &'a Pool<Self>,
        sql: SqlStr,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Vec<ParkedRow>, sqlx::Error>> + Send + 'a;

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

    /// Runs `sql`, which answers one text (the server's version).
    fn fetch_text<'a>(
        pool: &'a Pool<Self>,
        sql: &'static str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + 'a;

    /// Runs `migrator` on `conn` (the connection holding the migration lock).
    fn run_migrator<'a>(
        conn: &'a mut PoolConnection<Self>,
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
    for<'q> Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> Option<String>: sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> f64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> ParkedRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> ClaimState: sqlx::FromRow<'r, DB::Row>,
    for<'r> OpenClaimRow: sqlx::FromRow<'r, DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn fetch_claim_state<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> Result<Option<ClaimState>, sqlx::Error> {
        sqlx::query_as::<DB, ClaimState>(sql)
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

    async fn fetch_id_hashed<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
        hash: Option<&'a str>,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar::<DB, i64>(sql)
            .bind(consumer)
            .bind(key)
            .bind(hash)
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

    async fn execute_finish<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        id: i64,
        hash: Option<&'a str>,
    ) -> Result<DB::QueryResult, sqlx::Error> {
        sqlx::query::<DB>(sql)
            .bind(hash)
            .bind(id)
            .execute(conn)
            .await
    }

    async fn fetch_hash<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> Result<Option<Option<String>>, sqlx::Error> {
        sqlx::query_scalar::<DB, Option<String>>(sql)
            .bind(consumer)
            .bind(key)
            .fetch_optional(conn)
            .await
    }

    async fn delete_batch<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        batch: DeleteBatch<'a>,
    ) -> Result<DB::QueryResult, sqlx::Error> {
        let mut query = sqlx::query::<DB>(sql);
        if let Some(consumer) = batch.consumer {
            query = query.bind(consumer);
        }
        let query = query.bind(batch.older_than_secs).bind(batch.limit);
        query.execute(conn).await
    }

    async fn park<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        consumer: &'a str,
        headers: &'a str,
        payload: &'a [u8],
    ) -> Result<DB::QueryResult, sqlx::Error> {
        let query = sqlx::query::<DB>(sql).bind(consumer).bind(headers);
        query.bind(payload).execute(conn).await
    }

    async fn parked<'a>(
        pool: &'a Pool<DB>,
        sql: SqlStr,
        consumer: &'a str,
    ) -> Result<Vec<ParkedRow>, sqlx::Error> {
        sqlx::query_as::<DB, ParkedRow>(sql)
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

    async fn fetch_text(pool: &Pool<DB>, sql: &'static str) -> Result<String, sqlx::Error> {
        let (text,): (String,) = sqlx::query_as(sql).fetch_one(pool).await?;
        Ok(text)
    }

    fn run_migrator<'a>(
        conn: &'a mut PoolConnection<DB>,
        migrator: &'a Migrator,
    ) -> impl Future<Output = Result<(), MigrateError>> + Send + 'a {
        // What `Migrator::run` does once it has a connection. `run` itself takes an `Acquire`,
        // and its future, on a `&mut` connection, is not provably `Send` here ("implementation
        // of `Acquire` is not general enough"): sqlx keeps `run_direct` public for that case.
        migrator.run_direct(None, &mut **conn, false)
    }
}
