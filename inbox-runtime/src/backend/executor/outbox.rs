//! The outbox's statements, run alike on every dialect: written once over the bounds sqlx's
//! generic executors need, as `executor.rs` writes the inbox's.

use crate::backend::Generic;
use crate::backend::rows::{Backlog, FailedRow, IdSize, KeyId, NewOutboxRow, OutboxRow};
use sqlx::{Pool, SqlStr};
use std::future::Future;

/// The outbox's statements every dialect runs alike; implemented for every database that meets
/// the bounds of sqlx's generic executors.
pub trait GenericOutbox: Generic {
    /// The outbox: runs `sql` binding, for each row, (msg id, subject, order key, headers,
    /// payload) and then the marker's (id, consumer, key) when given.
    fn outbox_insert<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        rows: &'a [NewOutboxRow<'a>],
        marker: Option<(i64, &'a str, &'a str)>,
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a;

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

    /// The outbox: how many rows are pending up to id `up_to`.
    fn outbox_pending_up_to<'a>(
        conn: &'a mut Self::Connection,
        sql: SqlStr,
        up_to: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

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
}

impl<DB> GenericOutbox for DB
where
    DB: Generic,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> f64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> OutboxRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> FailedRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> IdSize: sqlx::FromRow<'r, DB::Row>,
    for<'r> KeyId: sqlx::FromRow<'r, DB::Row>,
    for<'r> Backlog: sqlx::FromRow<'r, DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
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

    async fn outbox_pending_up_to(
        conn: &mut DB::Connection,
        sql: SqlStr,
        up_to: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar::<DB, i64>(sql)
            .bind(up_to)
            .fetch_one(conn)
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
}
