//! PostgreSQL: `INSERT ... ON CONFLICT DO NOTHING RETURNING id` claims (the default claim); a
//! unique violation would abort the whole transaction (25P02), so duplicates must be an answer,
//! never an error. Transactions are READ COMMITTED (the default) with a `lock_timeout`.

use super::TableName;
mod arrays;
mod partitioned;

use super::{Backend, Claimed, GenericOutbox, KeyId, NewOutboxRow, OutboxRow, Server};
use crate::layout::{Layout, Partitions};
use futures::future::Either;
use partitioned::{claim_many_partitioned, partitioned_cleanup, partitioned_migrations};
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr, SqlStr, Transaction};
use std::future::Future;
use std::time::Duration;

impl Backend for Postgres {
    const NAME: &'static str = "PostgreSQL";
    // The statement's own time, not now(): that is when the transaction began.
    const NOW_SQL: &'static str = "clock_timestamp()";
    const INT64: &'static str = "BIGINT";

    fn secs_from_now_sql(param: &str) -> String {
        format!("clock_timestamp() + make_interval(secs => {param})")
    }

    fn ms_until_sql(column: &str) -> String {
        format!("CAST(EXTRACT(EPOCH FROM ({column} - clock_timestamp())) * 1000 AS BIGINT)")
    }

    fn claim_sql(table: &TableName, layout: &Layout) -> SqlStr {
        if let Layout::Partitioned(_) = layout {
            // The claim function (see `partitioned_migrations`) answers NULL for a duplicate.
            return AssertSqlSafe(format!(
                "SELECT id FROM (SELECT {table}_claim($1, $2) AS id) c WHERE id IS NOT NULL"
            ))
            .into_sql_str();
        }
        AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_key) VALUES ($1, $2) \
             ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id"
        ))
        .into_sql_str()
    }

    fn claim_finished_sql(table: &TableName, layout: &Layout) -> Option<SqlStr> {
        if let Layout::Partitioned(_) = layout {
            return None;
        }
        Some(
            AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_key, processed_at, payload_hash) \
                 VALUES ($1, $2, {}, $3) \
                 ON CONFLICT (consumer, message_key) DO NOTHING RETURNING id",
                Self::NOW_SQL
            ))
            .into_sql_str(),
        )
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn migration_sql(table: &TableName, layout: &Layout) -> Vec<String> {
        if let Layout::Partitioned(_) = layout {
            return partitioned_migrations(table);
        }
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                consumer VARCHAR(200) NOT NULL,
                message_key VARCHAR(255) NOT NULL,
                received_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                processed_at TIMESTAMPTZ,
                lease_until TIMESTAMPTZ,
                fence BIGINT NOT NULL DEFAULT 0,
                attempts INTEGER NOT NULL DEFAULT 0,
                CONSTRAINT {table}_consumer_key_uq UNIQUE (consumer, message_key)
            );
            CREATE INDEX IF NOT EXISTS {table}_received_at_idx ON {table} (received_at);"
            ),
            dead_letters_migration(table),
            open_claims_migration(table),
            payload_hash_migration(table),
        ]
    }

    fn outbox_migration_sql(table: &TableName) -> Vec<String> {
        vec![
            format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                msg_id VARCHAR(255) NOT NULL,
                subject TEXT NOT NULL,
                order_key TEXT NOT NULL,
                headers TEXT NOT NULL,
                payload BYTEA NOT NULL,
                created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
                sent_at TIMESTAMPTZ NULL
            );
            CREATE INDEX IF NOT EXISTS {table}_pending_idx ON {table} (id) WHERE sent_at IS NULL;
            CREATE INDEX IF NOT EXISTS {table}_sent_idx ON {table} (sent_at) WHERE sent_at IS NOT NULL;"
            ),
            // The rows NATS refused for good; each holds back its key's later rows.
            format!(
                "CREATE TABLE IF NOT EXISTS {table}_failed (
                id BIGINT PRIMARY KEY,
                order_key TEXT NOT NULL,
                error TEXT NOT NULL,
                failed_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
            )"
            ),
        ]
    }

    /// A transaction-scoped advisory lock: let go at COMMIT or ROLLBACK, or when the session
    /// ends, so no path can leave it held; it writes nothing (a row lock would write the row).
    /// Its key is a pair of integers, the crate's and the outbox's: the pair form never meets a
    /// lock on one bigint (an application's by entity id, the fleet lock's), and the turn is
    /// held nearly all the time. A relay frozen or cut off mid-pass would hold the turn until
    /// TCP keepalive ended its session (hours), every other relay letting its passes go
    /// meanwhile: a pass idle in its transaction for a minute (a healthy one is idle while it
    /// publishes: 10 s, then the PubAcks it awaits) has its session ended by the server, and its
    /// rows are published again by the next pass, into the duplicate window.
    fn relay_turn_sql(table: &TableName) -> Option<String> {
        Some(format!(
            "SET LOCAL idle_in_transaction_session_timeout = 60000; \
             SELECT pg_advisory_xact_lock(hashtext('inbox-runtime'), \
             hashtext('outbox-relay-turn:{table}'))"
        ))
    }

    fn outbox_cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
             WHERE sent_at < now() - make_interval(secs => $1) ORDER BY sent_at LIMIT $2)"
        ))
        .into_sql_str()
    }

    fn param(n: usize) -> String {
        format!("${n}")
    }

    fn is_data_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // SQLSTATE class 22, data exception: invalid byte sequence or NUL in text (22021),
        // numeric value out of range (22003), string too long (22001), division by zero (22012).
        err.code().is_some_and(|c| c.starts_with("22"))
    }

    // sqlx rolls back a transaction whose BEGIN was cut.
    const CUT_BEGIN_LEAVES_TRANSACTION: bool = false;

    fn begin_sql(lock_timeout: Duration, statement_timeout: Option<Duration>) -> SqlStr {
        // In the BEGIN's own round trip; LOCAL ends with the transaction. At most i32::MAX ms;
        // 0 would mean no limit.
        let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX as u128);
        let mut sql = format!("BEGIN; SET LOCAL lock_timeout = {}", ms(lock_timeout));
        if let Some(timeout) = statement_timeout {
            sql.push_str(&format!("; SET LOCAL statement_timeout = {}", ms(timeout)));
        }
        AssertSqlSafe(sql).into_sql_str()
    }

    fn downcast_database_error<'e>(
        err: &'e (dyn std::error::Error + 'static),
    ) -> Option<&'e dyn sqlx::error::DatabaseError> {
        let err = err.downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
        Some(err)
    }

    fn is_connection_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 57P01-03: the server is shutting down, crashed or not yet accepting connections (the
        // session was terminated); class 08: connection exceptions.
        err.code()
            .is_some_and(|c| matches!(&*c, "57P01" | "57P02" | "57P03") || c.starts_with("08"))
    }

    fn writable_probe_sql(_table: &TableName) -> String {
        // No table, so no lock: a DELETE of no row of the inbox takes a ROW EXCLUSIVE lock and
        // waits behind an ACCESS EXCLUSIVE one (partition DDL, VACUUM FULL), and a 5 s probe
        // would then report an outage. This asks what makes PostgreSQL refuse writes, a hot
        // standby or a read-only session, and refuses as it would (25006).
        "DO $probe$ BEGIN \
         IF pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean THEN \
         RAISE EXCEPTION USING ERRCODE = 'read_only_sql_transaction', \
         MESSAGE = 'the database takes no writes (a standby, or a read-only session)'; \
         END IF; END $probe$"
            .to_owned()
    }

    fn inbox_probe_sql(table: &TableName) -> String {
        // The DELETE of no row the health check's probe avoids: it takes the table's ROW
        // EXCLUSIVE lock, so it waits behind an ACCESS EXCLUSIVE one, for 1 s at most (the
        // setting is the DO statement's own transaction's), then fails with 55P03; a standby
        // or a read-only session refuses it with 25006.
        format!(
            "DO $probe$ BEGIN PERFORM set_config('lock_timeout', '1000', true); \
             DELETE FROM {table} WHERE false; END $probe$"
        )
    }

    fn is_timeout_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 55P03 lock_not_available (`lock_timeout` ran out), 57014 query_canceled
        // (`statement_timeout` ran out, or a cancel request).
        err.code().is_some_and(|c| matches!(&*c, "55P03" | "57014"))
    }

    fn is_read_only_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 25006 read_only_sql_transaction: a hot standby, or default_transaction_read_only.
        err.code().is_some_and(|c| c == "25006")
    }

    fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 40001 serialization failure, 40P01 deadlock, 55P03 lock not available, 57P01-03 the
        // server is shutting down or the backend was terminated, 53300 too many connections, and
        // class 08 (connection exceptions).
        err.code().is_some_and(|c| {
            matches!(
                &*c,
                "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | "53300"
            ) || c.starts_with("08")
        })
    }

    fn is_conflict_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 40001 serialization failure, 40P01 deadlock, 55P03 lock not available.
        err.code()
            .is_some_and(|c| matches!(&*c, "40001" | "40P01" | "55P03"))
    }

    fn cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
             WHERE consumer = $1 AND processed_at IS NOT NULL \
             AND received_at < now() - make_interval(secs => $2) ORDER BY id LIMIT $3)"
        ))
        .into_sql_str()
    }

    async fn claim_many<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        (table, layout, _): (&'a TableName, &'a Layout, Server),
        _claim: SqlStr,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        if let Layout::Partitioned(_) = layout {
            return claim_many_partitioned(tx, table, consumer, keys).await;
        }
        // One statement for the batch, inserting in the order given (sorted: twins' batches
        // take the markers' locks in one order).
        let sql = AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_key) \
             SELECT $1, k FROM unnest($2::varchar[]) WITH ORDINALITY AS t(k, n) ORDER BY n \
             ON CONFLICT (consumer, message_key) DO NOTHING RETURNING message_key, id"
        ));
        let rows: Vec<KeyId> = sqlx::query_as(sql)
            .bind(consumer)
            .bind(keys)
            .fetch_all(&mut **tx)
            .await?;
        Ok(super::claims_of(keys, rows))
    }

    /// Several rows go as arrays, `unnest`ed in their order: one statement text for every
    /// batch (an arm per row would be a new text, parsed and planned again, for each count
    /// of rows), and one lookup of the marker.
    fn insert_held<'a>(
        conn: &'a mut sqlx::PgConnection,
        (outbox, inbox): (&TableName, &TableName),
        rows: &'a [NewOutboxRow<'a>],
        marker: (i64, &'a str, &'a str),
    ) -> impl Future<Output = Result<sqlx::postgres::PgQueryResult, sqlx::Error>> + Send + 'a {
        // One row: the default's statement, as a message's.
        if rows.len() < 2 {
            let one = Self::insert_if_marked_sql(outbox, inbox, rows.len());
            return Either::Left(Self::outbox_insert(conn, one, rows, Some(marker)));
        }
        let column = |f: fn(&NewOutboxRow<'a>) -> &'a str| rows.iter().map(f).collect::<Vec<_>>();
        let many = sqlx::query(arrays::insert_held(outbox, inbox))
            .bind(column(|r| r.msg_id))
            .bind(column(|r| r.subject))
            .bind(column(|r| r.order_key))
            .bind(column(|r| r.headers))
            .bind(rows.iter().map(|r| r.payload).collect::<Vec<&[u8]>>())
            .bind(marker.0)
            .bind(marker.1)
            .bind(marker.2);
        Either::Right(many.execute(conn))
    }

    fn finish_many<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &TableName,
        ids: &'a [i64],
        hashes: &'a [Option<&'a str>],
    ) -> impl Future<Output = Result<sqlx::postgres::PgQueryResult, sqlx::Error>> + Send + 'a {
        let sql = arrays::finish_many(table);
        // As the default writes them.
        let hashes: Vec<Option<&str>> = hashes
            .iter()
            .map(|&h| super::statements::hex_only(h))
            .collect();
        async move { sqlx::query(sql).bind(ids).bind(hashes).execute(conn).await }
    }

    fn mark_sent<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &TableName,
        ids: &'a [i64],
    ) -> impl Future<Output = Result<sqlx::postgres::PgQueryResult, sqlx::Error>> + Send + 'a {
        sqlx::query(arrays::mark_sent(table))
            .bind(ids)
            .execute(conn)
    }

    fn outbox_rows_of<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &TableName,
        ids: &'a [i64],
    ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send + 'a {
        sqlx::query_as(arrays::rows_of(table))
            .bind(ids)
            .fetch_all(conn)
    }

    async fn add_partitions<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &'a TableName,
        partitions: &'a Partitions,
    ) -> Result<u64, sqlx::Error> {
        let sql = AssertSqlSafe(format!("SELECT {table}_add_partitions($1, $2)"));
        let made: i32 = sqlx::query_scalar(sql)
            .bind(i64::try_from(partitions.span_duration().as_secs()).unwrap_or(i64::MAX))
            .bind(i32::try_from(partitions.ahead_count()).unwrap_or(i32::MAX))
            .fetch_one(conn)
            .await?;
        Ok(u64::try_from(made).unwrap_or(0))
    }

    async fn drop_partitions<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &'a TableName,
        consumer: &'a str,
        older_than_secs: f64,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        partitioned_cleanup(conn, table, consumer, older_than_secs, batch).await
    }

    async fn fleet_lock<'a>(
        conn: &'a mut sqlx::PgConnection,
        name: &'a str,
        wait: Duration,
    ) -> Result<bool, sqlx::Error> {
        use sqlx::Connection;
        if wait.is_zero() {
            return sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
                .bind(name)
                .fetch_one(conn)
                .await;
        }
        // An advisory lock waits as long as `lock_timeout` allows, set for this transaction only
        // (the session's own setting is back after it). A session lock outlives the transaction.
        let ms = wait.as_millis().clamp(1, i32::MAX as u128).to_string();
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(ms)
            .execute(&mut *tx)
            .await?;
        let locked = sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
            .bind(name)
            .execute(&mut *tx)
            .await;
        match locked {
            Ok(_) => {
                tx.commit().await?;
                Ok(true)
            }
            // 55P03 lock_not_available: the wait ran out (the transaction rolls back on drop).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn fleet_unlock<'a>(
        conn: &'a mut sqlx::PgConnection,
        name: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(name)
            .execute(conn)
            .await
            .map(|_| ())
    }
}

/// A hash of each key's first payload (`delivery::payload_hash`), to tell key reuse.
pub(super) fn payload_hash_migration(table: &TableName) -> String {
    format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS payload_hash VARCHAR(32)")
}

pub(super) fn dead_letters_migration(table: &TableName) -> String {
    // Dead letters that no stream would take on a message's last delivery, kept until the worker
    // can publish them.
    format!(
        "CREATE TABLE IF NOT EXISTS {table}_dead_letters (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            consumer VARCHAR(200) NOT NULL,
            headers TEXT NOT NULL,
            payload BYTEA NOT NULL,
            stored_at TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE INDEX IF NOT EXISTS {table}_dl_idx ON {table}_dead_letters (consumer, id);"
    )
}

pub(super) fn open_claims_migration(table: &TableName) -> String {
    // Open two-phase claims, for the sweeper. Partial: one-transaction markers never set
    // lease_until, so they never enter it (and a batch's processed_at update stays HOT).
    format!(
        "CREATE INDEX IF NOT EXISTS {table}_open_claims_idx ON {table} (consumer, id) \
         WHERE lease_until IS NOT NULL"
    )
}
