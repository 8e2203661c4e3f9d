//! PostgreSQL: `INSERT ... ON CONFLICT DO NOTHING RETURNING id` claims (the default claim); a
//! unique violation would abort the whole transaction (25P02), so duplicates must be an answer,
//! never an error. Transactions are READ COMMITTED (the default) with a `lock_timeout`.

use super::TableName;
use super::sealed::{Backend, Claim};
use crate::partition::{Layout, Partitions};
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr, SqlStr, Transaction};
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

    fn finish_sql(table: &TableName) -> SqlStr {
        // The statement's own time, not now(): that is when the transaction began.
        AssertSqlSafe(format!(
            "UPDATE {table} SET processed_at = clock_timestamp() WHERE id = $1"
        ))
        .into_sql_str()
    }

    fn done_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "SELECT id FROM {table} WHERE consumer = $1 AND message_key = $2 \
             AND processed_at IS NOT NULL"
        ))
        .into_sql_str()
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
        ]
    }

    fn outbox_migration_sql(table: &TableName) -> Vec<String> {
        vec![format!(
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
        )]
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

    fn begin_sql(lock_timeout: Duration) -> SqlStr {
        // In the BEGIN's own round trip; LOCAL ends with the transaction.
        let ms = lock_timeout.as_millis().max(1);
        AssertSqlSafe(format!("BEGIN; SET LOCAL lock_timeout = {ms}")).into_sql_str()
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
        (table, layout): (&'a TableName, &'a Layout),
        _claim: SqlStr,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> Result<Vec<Claim>, sqlx::Error> {
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
        let rows: Vec<(String, i64)> = sqlx::query_as(sql)
            .bind(consumer)
            .bind(keys)
            .fetch_all(&mut **tx)
            .await?;
        Ok(super::claims_of(keys, rows))
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

    async fn try_cleanup_lock<'a>(
        conn: &'a mut sqlx::PgConnection,
        name: &'a str,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
            .bind(name)
            .fetch_one(conn)
            .await
    }

    async fn cleanup_unlock<'a>(
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

/// How far back `add_partitions` starts, and how recent a partition cleanup never drops (it
/// would be created again): two hours, far beyond any transaction a claim runs in.
const BEHIND: &str = "2 hours";

fn dead_letters_migration(table: &TableName) -> String {
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

fn open_claims_migration(table: &TableName) -> String {
    // Open two-phase claims, for the sweeper. Partial: one-transaction markers never set
    // lease_until, so they never enter it, and their processed_at update stays HOT.
    format!(
        "CREATE INDEX IF NOT EXISTS {table}_open_claims_idx ON {table} (consumer, id) \
         WHERE lease_until IS NOT NULL"
    )
}

/// The partitioned layout's migrations. PostgreSQL requires every unique key of a partitioned
/// table to include the partition column, so UNIQUE (consumer, message_key, received_at) no
/// longer stops a twin: the claim function does. It takes a transaction-scoped advisory lock on
/// a 64-bit hash of (table, consumer, key), so that a twin waits there until the first
/// transaction ends, and only then, in a statement of its own (a VOLATILE function's statements
/// each take a fresh snapshot under READ COMMITTED), looks for the key in every partition: it
/// sees the marker once that transaction committed, and inserts its own if it rolled back. Two
/// keys whose hashes collide only wait for each other; the lookup compares the keys themselves.
fn partitioned_migrations(table: &TableName) -> Vec<String> {
    vec![
        // ids stay unique across partitions: one sequence for the parent. No received_at index:
        // cleanup drops partitions instead of finding rows by age.
        format!(
            "CREATE SEQUENCE IF NOT EXISTS {table}_id_seq AS BIGINT;
            CREATE TABLE IF NOT EXISTS {table} (
                id BIGINT NOT NULL DEFAULT nextval('{table}_id_seq'),
                consumer VARCHAR(200) NOT NULL,
                message_key VARCHAR(255) NOT NULL,
                received_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                processed_at TIMESTAMPTZ,
                lease_until TIMESTAMPTZ,
                fence BIGINT NOT NULL DEFAULT 0,
                attempts INTEGER NOT NULL DEFAULT 0,
                CONSTRAINT {table}_pk PRIMARY KEY (id, received_at),
                CONSTRAINT {table}_consumer_key_uq UNIQUE (consumer, message_key, received_at)
            ) PARTITION BY RANGE (received_at);
            ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id;"
        ),
        dead_letters_migration(table),
        open_claims_migration(table),
        format!(
            "CREATE OR REPLACE FUNCTION {table}_claim(p_consumer TEXT, p_key TEXT) RETURNS BIGINT
            LANGUAGE plpgsql VOLATILE AS $fn$
            DECLARE
                new_id BIGINT;
            BEGIN
                -- A twin waits here until the transaction holding the key ends (lock_timeout
                -- applies). Its own statement: the lookup below must start after the wait.
                PERFORM pg_advisory_xact_lock(hashtextextended(
                    '{table}/' || length(p_consumer) || '/' || p_consumer || '/' || p_key, 0));
                IF EXISTS (SELECT 1 FROM {table} WHERE consumer = p_consumer AND message_key = p_key)
                THEN
                    RETURN NULL;
                END IF;
                INSERT INTO {table} (consumer, message_key) VALUES (p_consumer, p_key)
                    RETURNING id INTO new_id;
                RETURN new_id;
            END
            $fn$;"
        ),
        // The attached partitions and their ranges, read back from the catalog.
        format!(
            "CREATE OR REPLACE FUNCTION {table}_partitions()
            RETURNS TABLE (name TEXT, lo TIMESTAMPTZ, hi TIMESTAMPTZ, pending BOOLEAN)
            LANGUAGE sql STABLE AS $fn$
                SELECT c.relname::text, b[1]::timestamptz, b[2]::timestamptz, i.inhdetachpending
                FROM pg_inherits i
                JOIN pg_class c ON c.oid = i.inhrelid,
                LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                    'FROM \\(''([^'']*)''\\) TO \\(''([^'']*)''\\)') AS b
                WHERE i.inhparent = '{table}'::regclass
            $fn$;"
        ),
        // Creates the partitions from the one holding BEHIND ago (a transaction begun before
        // midnight inserts with its start time) to `ahead` beyond the current one, one instance at a
        // time (two CREATE TABLE IF NOT EXISTS of one name can still collide in the catalog).
        // CREATE then ATTACH: ATTACH PARTITION takes only SHARE UPDATE EXCLUSIVE on the parent,
        // where CREATE TABLE .. PARTITION OF would take ACCESS EXCLUSIVE and queue claims
        // behind any long transaction. No DEFAULT partition: a marker outside every partition
        // fails its claim (and is redelivered later) instead of landing where no drop reaches.
        format!(
            "CREATE OR REPLACE FUNCTION {table}_add_partitions(span_secs BIGINT, ahead INT)
            RETURNS INT LANGUAGE plpgsql VOLATILE AS $fn$
            DECLARE
                first BIGINT := floor(extract(epoch FROM clock_timestamp() - interval '{BEHIND}')
                    / span_secs)::BIGINT;
                last BIGINT := floor(extract(epoch FROM clock_timestamp()) / span_secs)::BIGINT
                    + ahead;
                v_lo TIMESTAMPTZ;
                v_hi TIMESTAMPTZ;
                part TEXT;
                made INT := 0;
            BEGIN
                PERFORM pg_advisory_xact_lock(hashtextextended('{table}/partitions', 0));
                FOR k IN first..last LOOP
                    v_lo := to_timestamp(k * span_secs);
                    v_hi := to_timestamp((k + 1) * span_secs);
                    part := '{table}_p' || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24');
                    IF NOT EXISTS (SELECT 1 FROM {table}_partitions() p
                                   WHERE p.lo < v_hi AND p.hi > v_lo)
                       AND to_regclass(part) IS NULL THEN
                        EXECUTE format('CREATE TABLE %I (LIKE {table} INCLUDING DEFAULTS)', part);
                        EXECUTE format(
                            'ALTER TABLE {table} ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                            part, v_lo, v_hi);
                        made := made + 1;
                    END IF;
                END LOOP;
                RETURN made;
            END
            $fn$;"
        ),
    ]
}

/// The partitioned claim of a batch: the claim function per distinct key, in the order given
/// (sorted by the caller, so that twins' batches take the keys' locks in one order), in one
/// statement. Each call's statements see what committed before they started, like a claim of
/// its own; a later copy of a key is a duplicate of the first (`claims_of`).
async fn claim_many_partitioned(
    tx: &mut Transaction<'_, Postgres>,
    table: &TableName,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claim>, sqlx::Error> {
    let mut seen = std::collections::HashSet::new();
    let distinct: Vec<&str> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
    let sql = AssertSqlSafe(format!(
        "SELECT k, id FROM (SELECT k, n, {table}_claim($1, k) AS id \
         FROM unnest($2::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n) c \
         WHERE id IS NOT NULL"
    ));
    let rows: Vec<(String, i64)> = sqlx::query_as(sql)
        .bind(consumer)
        .bind(&distinct)
        .fetch_all(&mut **tx)
        .await?;
    Ok(super::claims_of(keys, rows))
}

/// A partition's name as the catalog gives it, checked before it is written into a statement:
/// ours are `<table>_p<digits>t<digits>`.
fn partition_name<'a>(table: &TableName, name: &'a str) -> Option<&'a str> {
    let rest = name.strip_prefix(table.as_str())?.strip_prefix("_p")?;
    let ok = !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit() || b == b't');
    ok.then_some(name)
}

/// What is in a partition besides `consumer`'s finished markers.
struct Contents {
    open_claims: bool,
    others: bool,
}

async fn contents(
    conn: &mut sqlx::PgConnection,
    part: &str,
    consumer: &str,
) -> Result<Contents, sqlx::Error> {
    // Index probes only: the open-claims partial index, and the (consumer, key) index on either
    // side of `consumer`.
    let sql = AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM {part} WHERE lease_until IS NOT NULL AND processed_at IS NULL), \
         EXISTS (SELECT 1 FROM {part} WHERE consumer < $1) OR EXISTS (SELECT 1 FROM {part} WHERE consumer > $1)"
    ));
    let (open_claims, others): (bool, bool) =
        sqlx::query_as(sql).bind(consumer).fetch_one(conn).await?;
    Ok(Contents {
        open_claims,
        others,
    })
}

fn raw(sql: String) -> SqlStr {
    AssertSqlSafe(sql).into_sql_str()
}

/// The partitioned cleanup: see [`Backend::drop_partitions`]. A partition is detached
/// CONCURRENTLY (SHARE UPDATE EXCLUSIVE on the parent: claims go on meanwhile) and looked at
/// again once detached, since a transaction begun before the cutoff may have put a marker in it
/// on the way; if that left an open claim or another consumer's marker in it, it is attached
/// again, else dropped.
async fn partitioned_cleanup(
    conn: &mut sqlx::PgConnection,
    table: &TableName,
    consumer: &str,
    older_than_secs: f64,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    use sqlx::Executor;
    // Detaches left half-way (a cleanup interrupted between the two transactions of DETACH
    // CONCURRENTLY) are finished first; no later attach or detach is possible until they are.
    let expired: Vec<(String, String, String, bool)> = sqlx::query_as(raw(format!(
        "SELECT name, lo::text, hi::text, pending FROM {table}_partitions() \
         WHERE pending OR hi <= least(now() - make_interval(secs => $1), now() - interval '{BEHIND}') \
         ORDER BY lo"
    )))
    .bind(older_than_secs)
    .fetch_all(&mut *conn)
    .await?;
    let mut removed = 0u64;
    for (name, lo, hi, pending) in expired {
        let Some(part) = partition_name(table, &name) else {
            tracing::warn!(table = %table, partition = %name, "not an inbox partition name; left alone");
            continue;
        };
        if pending {
            conn.execute(raw(format!(
                "ALTER TABLE {table} DETACH PARTITION {part} FINALIZE"
            )))
            .await?;
        } else {
            let seen = contents(conn, part, consumer).await?;
            if seen.open_claims || seen.others {
                // Not only ours to drop: an open claim outlives retention until it completes
                // or is forgotten (the sweeper reports it), and other consumers' cutoffs may be
                // later. Only this consumer's finished markers go, row by row, as on the
                // unpartitioned table; the partition goes once the last row is gone.
                if seen.open_claims {
                    tracing::warn!(table = %table, partition = part, "a partition past the cutoff holds open claims; kept until they are done");
                }
                removed += delete_rows(conn, part, consumer, batch).await?;
                let empty: bool =
                    sqlx::query_scalar(raw(format!("SELECT NOT EXISTS (SELECT 1 FROM {part})")))
                        .fetch_one(&mut *conn)
                        .await?;
                if !empty {
                    continue;
                }
            }
            conn.execute(raw(format!(
                "ALTER TABLE {table} DETACH PARTITION {part} CONCURRENTLY"
            )))
            .await?;
        }
        let seen = contents(conn, part, consumer).await?;
        if seen.open_claims || seen.others {
            tracing::info!(table = %table, partition = part, "a marker arrived in the partition while it was detached; attached again");
            conn.execute(raw(format!(
                "ALTER TABLE {table} ATTACH PARTITION {part} FOR VALUES FROM ('{lo}') TO ('{hi}')"
            )))
            .await?;
            continue;
        }
        let rows: i64 = sqlx::query_scalar(raw(format!("SELECT count(*) FROM {part}")))
            .fetch_one(&mut *conn)
            .await?;
        conn.execute(raw(format!("DROP TABLE {part}"))).await?;
        removed += u64::try_from(rows).unwrap_or(0);
    }
    Ok(removed)
}

/// Deletes `consumer`'s finished markers from partition `part`, `batch` at a time.
async fn delete_rows(
    conn: &mut sqlx::PgConnection,
    part: &str,
    consumer: &str,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let sql = raw(format!(
        "DELETE FROM {part} WHERE ctid = ANY (ARRAY (SELECT ctid FROM {part} \
         WHERE consumer = $1 AND processed_at IS NOT NULL LIMIT $2))"
    ));
    let mut deleted = 0;
    loop {
        let done = sqlx::query(sql.clone())
            .bind(consumer)
            .bind(batch)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(deleted);
        }
        deleted += done.rows_affected();
    }
}
