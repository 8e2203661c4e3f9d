//! The outbox's SQL, written once per [`Outbox`](super::Outbox).

use crate::backend::{Begin, InboxBackend, TableName};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};
use std::time::Duration;

/// How long a relay waits for its turn (PostgreSQL, MySQL): the budget of the pass it waits for
/// (which starts no lookup or publish after it). A relay that waited that long lets the pass go, and tries
/// again at its next wake-up or poll. Every lock a pass's transaction waits for is bound by it,
/// but no other lock waits: the rows are taken `SKIP LOCKED`, then marked by the one relay that
/// holds them.
pub(crate) const TURN_WAIT: Duration = super::pass::PASS_BUDGET;

/// The outbox's SQL, written once per [`Outbox`].
pub(crate) struct OutboxStatements {
    /// Binds msg id, subject, order key, headers (JSON), payload.
    pub(crate) insert: SqlStr,
    /// Binds a limit: the ids and sizes of the oldest pending rows, locked (passing over those
    /// another relay holds), but for the keys of failed rows
    /// ([`OutboxStatements::fetch_without`] also leaves out subjects).
    pub(crate) fetch: SqlStr,
    /// Binds id, order key, error: records a row as failed.
    pub(crate) fail: SqlStr,
    /// Binds a limit: the failed rows, oldest first.
    pub(crate) failed: SqlStr,
    /// Binds an id: forgets that the row failed.
    pub(crate) unfail: SqlStr,
    /// Binds an id: deletes the row.
    pub(crate) delete: SqlStr,
    /// Binds an id: (order key, smallest id) of pending rows up to that id.
    pub(crate) heads: SqlStr,
    /// Binds an id: how many rows are pending up to that id.
    pub(crate) pending_up_to: SqlStr,
    /// (pending rows, age in ms of the oldest).
    pub(crate) pending: SqlStr,
    /// Binds seconds, limit: deletes rows sent longer ago than that.
    pub(crate) cleanup: SqlStr,
    /// SQLite: binds owner, lease seconds: takes or renews the relays' lease.
    pub(crate) lease: SqlStr,
    /// SQLite: binds owner, seconds (0): ends the owner's lease now, for a relay that stops.
    pub(crate) release: SqlStr,
    /// PostgreSQL, MySQL: takes the relays' turn for the rest of the pass's transaction
    /// (`Backend::relay_turn_sql`).
    pub(crate) turn: Option<SqlStr>,
    /// A relay pass's BEGIN, its lock waits bound by [`TURN_WAIT`] (its connection is never a
    /// kept one: `Begin::sql` alone is sent).
    pub(crate) begin: Begin,
    /// The table, for statements written per batch.
    pub(crate) table: TableName,
}

impl OutboxStatements {
    pub(crate) fn new<DB: InboxBackend>(table: &TableName) -> Self {
        let p = DB::param;
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        OutboxStatements {
            begin: Begin::new::<DB>(TURN_WAIT, None),
            insert: sql(format!(
                "INSERT INTO {table} (msg_id, subject, order_key, headers, payload) \
                 VALUES ({}, {}, {}, {}, {})",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5)
            )),
            fetch: fetch_sql::<DB>(table, 0),
            fail: sql(format!(
                "INSERT INTO {table}_failed (id, order_key, error) VALUES ({}, {}, {}){}",
                p(1),
                p(2),
                p(3),
                DB::KEEP_FIRST_FAILURE
            )),
            failed: sql(format!(
                "SELECT o.id, o.msg_id, o.subject, o.order_key, f.error, \
                 CAST(-({}) AS {int}) FROM {table}_failed f JOIN {table} o ON o.id = f.id \
                 ORDER BY f.id LIMIT {}",
                DB::ms_until_sql("f.failed_at"),
                p(1),
                int = DB::INT64
            )),
            unfail: sql(format!("DELETE FROM {table}_failed WHERE id = {}", p(1))),
            delete: sql(format!("DELETE FROM {table} WHERE id = {}", p(1))),
            heads: sql(format!(
                "SELECT order_key, MIN(id) FROM {table} WHERE sent_at IS NULL AND id <= {} \
                 GROUP BY order_key",
                p(1)
            )),
            pending_up_to: sql(format!(
                "SELECT CAST(COUNT(*) AS {int}) FROM {table} WHERE sent_at IS NULL AND id <= {}",
                p(1),
                int = DB::INT64
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
            release: sql(format!(
                "UPDATE {table}_relay SET lease_until = {} WHERE owner = {}",
                DB::secs_from_now_sql(&p(2)),
                p(1)
            )),
            turn: DB::relay_turn_sql(table).map(sql),
            table: table.clone(),
        }
    }

    /// [`OutboxStatements::fetch`] leaving out rows to `subjects` too (bound first, the limit
    /// last): subjects whose stream is missing or refused, whose rows would fill every pass.
    pub(crate) fn fetch_without<DB: InboxBackend>(&self, subjects: usize) -> SqlStr {
        match subjects {
            0 => self.fetch.clone(),
            n => fetch_sql::<DB>(&self.table, n),
        }
    }
}

/// The pending rows of `table` (id and size in bytes), oldest first, locked where relays lock
/// them, but for the keys of failed rows and (bound first) `subjects` subjects; binds the limit
/// last.
fn fetch_sql<DB: InboxBackend>(table: &TableName, subjects: usize) -> SqlStr {
    let p = DB::param;
    let without = match subjects {
        0 => String::new(),
        n => {
            let list: Vec<String> = (1..=n).map(p).collect();
            format!(" AND subject NOT IN ({})", list.join(", "))
        }
    };
    AssertSqlSafe(format!(
        "SELECT id, CAST({len}(payload) + {len}(headers) AS {int}) FROM {table} \
         WHERE sent_at IS NULL AND order_key NOT IN (SELECT order_key FROM {table}_failed){without} \
         ORDER BY id LIMIT {}{}",
        p(subjects + 1),
        DB::RELAY_TURNS.fetch_suffix(),
        len = DB::BYTE_LENGTH,
        int = DB::INT64,
    ))
    .into_sql_str()
}
