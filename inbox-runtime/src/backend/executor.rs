//! The statements every dialect runs alike, written once over the bounds sqlx's generic
//! executors need, each binding what its statements take and reading rows into named structs
//! (`rows.rs`).

use super::rows::{
    Backlog, ClaimState, DeleteBatch, FailedRow, IdSize, KeyId, NewOutboxRow, OpenClaimRow,
    OutboxRow, ParkedRow,
};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::{Pool, SqlStr};
use std::future::Future;

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

    /// The outbox: runs `sql` binding, for each row, (msg id, subject, order key, headers,
    /// payload) and then the marker's (id, consumer, key) when given.
    fn outbox_insert<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        rows: &'a [NewOutboxRow<'a>],
        marker: Option<(i64, &'a str, &'a str)>,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// Runs `sql`, which answers one text (the server's version).
    fn fetch_text<'a>(
        pool: &'a Pool<Self>,
        sql: &'static str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + 'a;

    /// The outbox: runs `sql` binding each of `subjects`, then `n`, and returns the ids and
    /// sizes it locked.
    fn outbox_sizes<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        subjects: &'a [String],
        n: i64,
    ) -> impl Future<Output = Result<Vec<IdSize>, sqlx::Error>> + Send + 'a;

    /// The outbox: runs `sql` (no binds) and returns its rows.
    fn outbox_rows<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send + 'a;

    /// The outbox: records row `id` (of order key `key`) as refused for good, with `error`.
    fn outbox_fail<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        id: i64,
        key: &'a str,
        error: &'a str,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

    /// The outbox: runs `sql` binding `n` and returns the failed rows it selects.
    fn outbox_failed<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        n: i64,
    ) -> impl Future<Output = Result<Vec<FailedRow>, sqlx::Error>> + Send + 'a;

    /// The outbox: each order key's smallest pending id, among the rows up to id `up_to`.
    fn outbox_heads<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        up_to: i64,
    ) -> impl Future<Output = Result<Vec<KeyId>, sqlx::Error>> + Send + 'a;

    /// The outbox: how many rows are pending, and how old the oldest is.
    fn outbox_backlog<'a>(
        pool: &'a Pool<Self>,
        sql: SqlStr,
    ) -> impl Future<Output = Result<Backlog, sqlx::Error>> + Send + 'a;

    /// The outbox (SQLite): takes or renews the relays' lease for `owner`, for `lease_secs`;
    /// affects no row while another owner's lease runs.
    fn take_relay_lease<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        owner: &'a str,
        lease_secs: f64,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

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
    for<'r> OutboxRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> FailedRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> IdSize: sqlx::FromRow<'r, DB::Row>,
    for<'r> KeyId: sqlx::FromRow<'r, DB::Row>,
    for<'r> Backlog: sqlx::FromRow<'r, DB::Row>,
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

    async fn outbox_insert<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        rows: &'a [NewOutboxRow<'a>],
        marker: Option<(i64, &'a str, &'a str)>,
    ) -> Result<DB::QueryResult, sqlx::Error> {
        let mut query = sqlx::query::<DB>(sql);
        for row in rows {
            query = query.bind(row.msg_id).bind(row.subject).bind(row.order_key);
            query = query.bind(row.headers).bind(row.payload);
            if let Some((id, consumer, key)) = marker {
                query = query.bind(id).bind(consumer).bind(key);
            }
        }
        query.execute(conn).await
    }

    async fn fetch_text(pool: &Pool<DB>, sql: &'static str) -> Result<String, sqlx::Error> {
        let (text,): (String,) = sqlx::query_as(sql).fetch_one(pool).await?;
        Ok(text)
    }

    async fn outbox_sizes<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        subjects: &'a [String],
        n: i64,
    ) -> Result<Vec<IdSize>, sqlx::Error> {
        let mut query = sqlx::query_as::<DB, IdSize>(sql);
        for subject in subjects {
            query = query.bind(subject.as_str());
        }
        query.bind(n).fetch_all(conn).await
    }

    async fn outbox_rows(
        conn: &mut DB::Connection,
        sql: SqlStr,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        sqlx::query_as::<DB, OutboxRow>(sql).fetch_all(conn).await
    }

    async fn outbox_fail<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        id: i64,
        key: &'a str,
        error: &'a str,
    ) -> Result<DB::QueryResult, sqlx::Error> {
        sqlx::query::<DB>(sql)
            .bind(id)
            .bind(key)
            .bind(error)
            .execute(conn)
            .await
    }

    async fn outbox_failed(
        conn: &mut DB::Connection,
        sql: SqlStr,
        n: i64,
    ) -> Result<Vec<FailedRow>, sqlx::Error> {
        sqlx::query_as::<DB, FailedRow>(sql)
            .bind(n)
            .fetch_all(conn)
            .await
    }

    async fn outbox_heads(
        conn: &mut DB::Connection,
        sql: SqlStr,
        up_to: i64,
    ) -> Result<Vec<KeyId>, sqlx::Error> {
        sqlx::query_as::<DB, KeyId>(sql)
            .bind(up_to)
            .fetch_all(conn)
            .await
    }

    async fn outbox_backlog(pool: &Pool<DB>, sql: SqlStr) -> Result<Backlog, sqlx::Error> {
        sqlx::query_as::<DB, Backlog>(sql).fetch_one(pool).await
    }

    async fn take_relay_lease<'a>(
        conn: &'a mut DB::Connection,
        sql: SqlStr,
        owner: &'a str,
        lease_secs: f64,
    ) -> Result<DB::QueryResult, sqlx::Error> {
        sqlx::query::<DB>(sql)
            .bind(owner)
            .bind(lease_secs)
            .execute(conn)
            .await
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
