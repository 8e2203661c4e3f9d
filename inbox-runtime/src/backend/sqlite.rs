//! SQLite: one writer at a time. Every inbox transaction is `BEGIN IMMEDIATE`, taking the write
//! lock up front: a deferred transaction that reads and then writes after another writer committed
//! fails at once with BUSY_SNAPSHOT (517). The claim is `INSERT .. ON CONFLICT DO NOTHING
//! RETURNING id` (the default claim). Use WAL and a busy timeout (see [`sqlite_options`](crate::sqlite_options)).

use super::TableName;
use super::{Backend, Claimed, KeyId, RelayTurns, Server};
use crate::layout::Layout;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr, Sqlite, Transaction};
use std::time::Duration;

/// A timestamp with milliseconds, as ISO 8601 text that sorts as time does.
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

impl Backend for Sqlite {
    const NAME: &'static str = "SQLite";
    const NOW_SQL: &'static str = NOW;
    const INT64: &'static str = "INTEGER";
    // BEGIN IMMEDIATE holds the database's write lock already.
    const FOR_UPDATE: &'static str = "";

    fn secs_from_now_sql(param: &str) -> String {
        format!("strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || {param} || ' seconds')")
    }

    fn ms_until_sql(column: &str) -> String {
        format!("CAST((julianday({column}) - julianday('now')) * 86400000 AS INTEGER)")
    }

    async fn claim_many<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        (table, _layout, _): (&'a TableName, &'a Layout, Server),
        _claim: SqlStr,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        // One statement per 400 keys (well within SQLite's bind limit), rows in the order given.
        let mut claims = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(400) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| format!("(?1, ?{})", i + 2))
                .collect();
            let sql = AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_key) VALUES {} \
                 ON CONFLICT (consumer, message_key) DO NOTHING RETURNING message_key, id",
                rows.join(", ")
            ));
            let mut query = sqlx::query_as::<_, KeyId>(sql).bind(consumer);
            for key in chunk {
                query = query.bind(*key);
            }
            let inserted = query.fetch_all(&mut **tx).await?;
            claims.extend(super::claims_of(chunk, inserted));
        }
        Ok(claims)
    }

    fn claim_sql(table: &TableName, _layout: &Layout) -> SqlStr {
        AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_key) VALUES (?1, ?2) \
             ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id"
        ))
        .into_sql_str()
    }

    fn claim_finished_sql(table: &TableName, _layout: &Layout) -> Option<SqlStr> {
        Some(
            AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_key, processed_at, payload_hash) \
                 VALUES (?1, ?2, {NOW}, ?3) \
                 ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id"
            ))
            .into_sql_str(),
        )
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn migration_sql(table: &TableName, _layout: &Layout) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                consumer TEXT NOT NULL CHECK (length(consumer) BETWEEN 1 AND 200),
                message_key TEXT NOT NULL CHECK (length(CAST(message_key AS BLOB)) BETWEEN 1 AND 255),
                received_at TEXT NOT NULL DEFAULT ({NOW}),
                processed_at TEXT,
                lease_until TEXT,
                fence INTEGER NOT NULL DEFAULT 0,
                attempts INTEGER NOT NULL DEFAULT 0,
                CONSTRAINT {table}_consumer_key_uq UNIQUE (consumer, message_key)
            );
            CREATE INDEX IF NOT EXISTS {table}_received_at_idx ON {table} (received_at);"
        ), format!(
            // Dead letters that no stream would take on a message's last delivery, kept until
            // the worker can publish them.
            "CREATE TABLE IF NOT EXISTS {table}_dead_letters (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                consumer TEXT NOT NULL,
                headers TEXT NOT NULL,
                payload BLOB NOT NULL,
                stored_at TEXT NOT NULL DEFAULT ({NOW})
            );
            CREATE INDEX IF NOT EXISTS {table}_dl_idx ON {table}_dead_letters (consumer, id);"
        ), format!(
            // Open two-phase claims, for the sweeper; one-transaction markers never enter it.
            "CREATE INDEX IF NOT EXISTS {table}_open_claims_idx ON {table} (consumer, id) \
             WHERE lease_until IS NOT NULL"
        ), format!(
            // A hash of each key's first payload (`delivery::payload_hash`), to tell key reuse.
            "ALTER TABLE {table} ADD COLUMN payload_hash TEXT"
        )]
    }

    fn param(n: usize) -> String {
        format!("?{n}")
    }

    // BEGIN IMMEDIATE holds the write lock; relays take turns by the lease in `<table>_relay`.
    const RELAY_TURNS: RelayTurns = RelayTurns::Lease;
    // Of a BLOB, its bytes; of TEXT, its characters (close enough for a memory bound).
    const BYTE_LENGTH: &'static str = "length";

    fn outbox_migration_sql(table: &TableName) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    msg_id TEXT NOT NULL,
                    subject TEXT NOT NULL,
                    order_key TEXT NOT NULL,
                    headers TEXT NOT NULL,
                    payload BLOB NOT NULL,
                    created_at TEXT NOT NULL DEFAULT ({NOW}),
                    sent_at TEXT NULL
                )"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {table}_pending_idx ON {table} (id) WHERE sent_at IS NULL"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {table}_sent_idx ON {table} (sent_at) WHERE sent_at IS NOT NULL"
            ),
            // The relays' lease: one row, the owner and until when it holds it.
            format!(
                "CREATE TABLE IF NOT EXISTS {table}_relay (
                    id INTEGER PRIMARY KEY CHECK (id = 1),
                    owner TEXT NOT NULL,
                    lease_until TEXT NOT NULL
                )"
            ),
            // The rows NATS refused for good; each holds back its key's later rows.
            format!(
                "CREATE TABLE IF NOT EXISTS {table}_failed (
                    id INTEGER PRIMARY KEY,
                    order_key TEXT NOT NULL,
                    error TEXT NOT NULL,
                    failed_at TEXT NOT NULL DEFAULT ({NOW})
                )"
            ),
        ]
    }

    fn outbox_cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
             WHERE sent_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || ?1 || ' seconds') \
             ORDER BY sent_at LIMIT ?2)"
        ))
        .into_sql_str()
    }

    // sqlx rolls back a transaction whose BEGIN was cut.
    const CUT_BEGIN_LEAVES_TRANSACTION: bool = false;

    fn begin_sql(_lock_timeout: Duration, _statement_timeout: Option<Duration>) -> SqlStr {
        // The only lock is the database's write lock, and a connection waits for it as long as
        // its busy timeout (`sqlite_options`: 30 s), then fails with SQLITE_BUSY.
        SqlStr::from_static("BEGIN IMMEDIATE")
    }

    fn downcast_database_error<'e>(
        err: &'e (dyn std::error::Error + 'static),
    ) -> Option<&'e dyn sqlx::error::DatabaseError> {
        let err = err.downcast_ref::<sqlx::sqlite::SqliteError>()?;
        Some(err)
    }

    fn is_connection_error(_: &dyn sqlx::error::DatabaseError) -> bool {
        // In-process: no connection to lose.
        false
    }

    fn writable_probe_sql(table: &TableName) -> String {
        // Any write to the database needs its one write lock, which a frozen writer may hold
        // for as long as it is frozen; a temporary table is the connection's own, and a write
        // to it (every time: the DELETE, not the CREATE, which does nothing once the table is
        // there) is refused as well where the connection takes no writes (`PRAGMA
        // query_only`). A database file that is read-only is not seen here: its writes fail
        // as a message's failure.
        format!(
            "CREATE TEMP TABLE IF NOT EXISTS {table}_probe (x INTEGER); \
             DELETE FROM temp.{table}_probe WHERE 1 = 0"
        )
    }

    fn is_read_only_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // SQLITE_READONLY (8) and its extended codes: a file or directory not writable, a
        // connection with `PRAGMA query_only`.
        err.code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == 8)
    }

    fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // The extended result code; its low byte is the primary code: SQLITE_BUSY (5, with
        // BUSY_RECOVERY 261, BUSY_SNAPSHOT 517, BUSY_TIMEOUT 773) and SQLITE_LOCKED (6, with
        // LOCKED_SHAREDCACHE 262).
        err.code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|code| matches!(code & 0xff, 5 | 6))
    }

    fn is_conflict_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // Busy or locked: another connection holds the write lock.
        Self::is_transient_error(err)
    }

    fn cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
             WHERE consumer = ?1 AND processed_at IS NOT NULL \
             AND received_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || ?2 || ' seconds') \
             ORDER BY id LIMIT ?3)"
        ))
        .into_sql_str()
    }
}

/// Connect options for an inbox on SQLite: WAL (readers do not block the writer), a busy timeout
/// (writers queue for the lock instead of failing at once), `synchronous = FULL`, and the file
/// created when missing.
///
/// `FULL` makes every commit durable before the message is acked. With WAL, `NORMAL` is faster
/// but a power loss can undo the last commits after their messages were acked: their effects
/// are lost. Opt in only if that is acceptable:
/// `sqlite_options(url)?.synchronous(sqlx::sqlite::SqliteSynchronous::Normal)`.
///
/// ```
/// let options = inbox_runtime::sqlite_options("sqlite://target/inbox.db").unwrap();
/// ```
pub fn sqlite_options(url: &str) -> Result<sqlx::sqlite::SqliteConnectOptions, sqlx::Error> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    use std::str::FromStr;
    Ok(SqliteConnectOptions::from_str(url)?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(std::time::Duration::from_secs(30))
        .create_if_missing(true))
}
