//! PostgreSQL's partitioned layout (opt in): its migrations (the claim function, the partition
//! functions), the batch claim through the function, and cleanup by dropping partitions. See
//! ARCHITECTURE.md ("The partitioned inbox") for why a twin still waits.

use super::{dead_letters_migration, open_claims_migration};
use crate::backend::{Claimed, KeyId, TableName, claims_of};
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr, SqlStr, Transaction};

/// How far back `add_partitions` starts, and how recent a partition cleanup never drops (it
/// would be created again): two hours, far beyond any transaction a claim runs in.
const BEHIND: &str = "2 hours";

/// The partitioned layout's migrations. PostgreSQL requires every unique key of a partitioned
/// table to include the partition column, so UNIQUE (consumer, message_key, received_at) no
/// longer stops a twin: the claim function does. It takes a transaction-scoped advisory lock on
/// a 64-bit hash of (table, consumer, key), so that a twin waits there until the first
/// transaction ends, and only then, in a statement of its own (a VOLATILE function's statements
/// each take a fresh snapshot under READ COMMITTED), looks for the key in every partition: it
/// sees the marker once that transaction committed, and inserts its own if it rolled back. Two
/// keys whose hashes collide only wait for each other; the lookup compares the keys themselves.
pub(super) fn partitioned_migrations(table: &TableName) -> Vec<String> {
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
        super::payload_hash_migration(table),
    ]
}

/// The partitioned claim of a batch: the claim function per distinct key, in the order given
/// (sorted by the caller, so that twins' batches take the keys' locks in one order), in one
/// statement. Each call's statements see what committed before they started, like a claim of
/// its own; a later copy of a key is a duplicate of the first (`claims_of`).
pub(super) async fn claim_many_partitioned(
    tx: &mut Transaction<'_, Postgres>,
    table: &TableName,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claimed>, sqlx::Error> {
    let mut seen = std::collections::HashSet::new();
    let distinct: Vec<&str> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
    let sql = AssertSqlSafe(format!(
        "SELECT k, id FROM (SELECT k, n, {table}_claim($1, k) AS id \
         FROM unnest($2::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n) c \
         WHERE id IS NOT NULL"
    ));
    let rows: Vec<KeyId> = sqlx::query_as(sql)
        .bind(consumer)
        .bind(&distinct)
        .fetch_all(&mut **tx)
        .await?;
    Ok(claims_of(keys, rows))
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
pub(super) async fn partitioned_cleanup(
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
