//! The outbox's SQL, written once per [`Outbox`](super::Outbox).

use crate::backend::{InboxBackend, TableName, stamp_ids_sql};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// The outbox's SQL, written once per [`Outbox`].
pub(crate) struct OutboxStatements {
    /// Binds msg id, subject, order key, headers (JSON), payload.
    pub(crate) insert: SqlStr,
    /// Binds a limit: the oldest pending rows, locked (passing over those another relay holds).
    pub(crate) fetch: SqlStr,
    /// Binds an id: (order key, smallest id) of pending rows up to that id.
    pub(crate) heads: SqlStr,
    /// (pending rows, age in ms of the oldest).
    pub(crate) pending: SqlStr,
    /// Binds seconds, limit: deletes rows sent longer ago than that.
    pub(crate) cleanup: SqlStr,
    /// SQLite: binds owner, lease seconds: takes or renews the relays' lease.
    pub(crate) lease: SqlStr,
    /// The table, for statements written per batch.
    pub(crate) table: TableName,
}

impl OutboxStatements {
    pub(crate) fn new<DB: InboxBackend>(table: &TableName) -> Self {
        let p = DB::param;
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        OutboxStatements {
            insert: sql(format!(
                "INSERT INTO {table} (msg_id, subject, order_key, headers, payload) \
                 VALUES ({}, {}, {}, {}, {})",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5)
            )),
            fetch: sql(format!(
                "SELECT id, msg_id, subject, order_key, headers, payload FROM {table} \
                 WHERE sent_at IS NULL ORDER BY id LIMIT {}{}",
                p(1),
                DB::RELAY_TURNS.fetch_suffix()
            )),
            heads: sql(format!(
                "SELECT order_key, MIN(id) FROM {table} WHERE sent_at IS NULL AND id <= {} \
                 GROUP BY order_key",
                p(1)
            )),
            pending: sql(format!(
                "SELECT CAST(COUNT(*) AS {int}), CAST(COALESCE(MAX(-({})), 0) AS {int}) \
                 FROM {table} WHERE sent_at IS NULL",
                DB::ms_until_sql("created_at"),
                int = DB::INT64
            )),
            cleanup: DB::outbox_cleanup_sql(table),
            lease: sql(format!(
                "INSERT INTO {table}_relay (id, owner, lease_until) VALUES (1, {}, {}) \
                 ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, \
                 lease_until = excluded.lease_until \
                 WHERE {table}_relay.owner = excluded.owner OR {table}_relay.lease_until <= {}",
                p(1),
                DB::secs_from_now_sql(&p(2)),
                DB::NOW_SQL
            )),
            table: table.clone(),
        }
    }

    /// Marks rows `ids` sent. The ids are the database's own integers, written into the
    /// statement (it runs unprepared, since its text changes with every batch).
    pub(crate) fn mark_sent<DB: InboxBackend>(&self, ids: &[i64]) -> SqlStr {
        stamp_ids_sql::<DB>(&self.table, "sent_at", ids)
    }
}
