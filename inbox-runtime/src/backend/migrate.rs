//! Migrations of the tables this crate owns (an inbox, its dead letters, an outbox): each
//! tracked in a migrations table of its own, run by every instance at start, one instance at a
//! time per table.

use super::fleet::FleetLock;
use super::{InboxBackend, TableName};
use crate::backoff::Backoff;
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr};
use std::time::Duration;

/// How long an instance waits by default for another one migrating the same table before it
/// gives up with an error naming the lock.
pub(crate) const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(300);

/// How many times a migration is run before its error is returned.
const ATTEMPTS: u32 = 5;

/// The migrator of `table` (`what` names its kind in each step's description: "inbox",
/// "outbox"): `steps`, in order, tracked in a migrations table of our own
/// (`_<table>_migrations`) so that they never mix with the application's `_sqlx_migrations`.
pub(crate) fn migrator(table: &TableName, what: &str, steps: Vec<String>) -> Migrator {
    let migrations = steps
        .into_iter()
        .enumerate()
        .map(|(i, sql)| {
            Migration::new(
                i as i64 + 1,
                format!("{what} table {table}, step {}", i + 1).into(),
                MigrationType::Simple,
                AssertSqlSafe(sql).into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(migrations_table(table));
    // sqlx's own lock is one per database, taken without a bound (and on MariaDB not at all:
    // `GET_LOCK(.., -1)` returns at once there). Ours, per table and bounded, replaces it.
    migrator.set_locking(false);
    // A step this version does not know was recorded by a later one (a rolling upgrade, a
    // rollback): every step only adds to the schema, so the table serves this version as it
    // is, rather than keeping it from starting.
    migrator.set_ignore_missing(true);
    migrator
}

/// The table that records which migrations of `table` ran.
fn migrations_table(table: &TableName) -> String {
    format!("_{table}_migrations")
}

/// The fleet lock that migrations of `table` take.
pub(crate) fn lock_name(table: &TableName) -> String {
    format!("migrate:{table}")
}

/// Forgets the interrupted run of migration `version` (recorded with `success = FALSE`), so that
/// the migrator runs it again. Only for idempotent DDL, which every migration here is, and only
/// under the migration lock: without it, the row may be another instance's step in progress.
fn forget_dirty_sql(table: &TableName, version: i64) -> SqlStr {
    let migrations = migrations_table(table);
    AssertSqlSafe(format!(
        "DELETE FROM {migrations} WHERE version = {version} AND success = FALSE"
    ))
    .into_sql_str()
}

/// The error of an instance that waited `waited` for lock `lock` in vain.
fn lock_wait_error(table: &TableName, lock: &str, waited: Duration) -> MigrateError {
    let text = format!(
        "waited {waited:?} for the migration lock {lock:?} of table {table}: another instance \
         is migrating it, or a database session holds the lock (a connection pooler in \
         transaction mode can pin it)"
    );
    MigrateError::Execute(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        text,
    )))
}

/// Runs `migrator` (of `table`) on `pool` while holding the table's migration lock, one instance
/// at a time, waiting at most `wait` for another instance to finish: instances starting
/// together each run the migrator in turn, and all but the first find every step recorded.
///
/// The migrator runs on the lock's connection (a pool of one connection is enough). Under the
/// lock, a step recorded as dirty (`success = FALSE`: MySQL's DDL is not transactional, so a
/// process killed inside a step leaves it so) was interrupted, not in progress elsewhere, and is
/// run again: every step is idempotent. SQLite takes no lock (its single writer serialises the
/// steps, each one transaction with its record, so it never shows a step in progress); an
/// instance that loses a race there fails to record a step the winner recorded, and its next
/// attempt finds it recorded.
///
/// `then`: idempotent statements run after the migrator, in the same attempt (an attempt cut by
/// a lost connection is made again, as for a step).
pub(crate) async fn migrate_racing<DB: InboxBackend>(
    pool: &Pool<DB>,
    table: &TableName,
    migrator: &Migrator,
    wait: Duration,
    then: &[String],
) -> Result<(), MigrateError> {
    let name = lock_name(table);
    let Some(mut lock) = FleetLock::take(pool, name.clone(), wait).await? else {
        return Err(lock_wait_error(table, &name, wait));
    };
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut attempt = 1;
    let result = loop {
        let attempt_result = async {
            DB::run_migrator(lock.conn(), migrator).await?;
            for sql in then {
                let sql = AssertSqlSafe(sql.clone()).into_sql_str();
                DB::execute_raw(lock.conn(), sql).await?;
            }
            Ok::<_, MigrateError>(())
        };
        match attempt_result.await {
            Ok(()) => break Ok(()),
            // An interrupted step would block every restart: forget it and run it again.
            Err(MigrateError::Dirty(version)) if attempt < ATTEMPTS => {
                tracing::warn!(
                    %table,
                    version,
                    "an earlier migration of the table was interrupted; running it again"
                );
                let forget = forget_dirty_sql(table, version);
                if let Err(e) = DB::execute_raw(lock.conn(), forget).await {
                    break Err(e.into());
                }
                attempt += 1;
            }
            Err(e) if attempt < ATTEMPTS => {
                tracing::debug!(error = %e, attempt, %table, "migration failed; retrying");
                tokio::time::sleep(backoff.next()).await;
                attempt += 1;
                // A connection lost (cut by a failover or an operator, a process starting while
                // it happens) fails every later statement on it, and its session lock is gone:
                // the next attempt takes the lock again, on a connection of its own. Dropped,
                // the old lock closes its connection.
                if matches!(&e, MigrateError::Execute(err) if super::is_transient::<DB>(err)) {
                    match FleetLock::take(pool, name.clone(), wait).await {
                        Ok(Some(again)) => lock = again,
                        Ok(None) => break Err(lock_wait_error(table, &name, wait)),
                        // A pooled connection lost too (a pool that tests none on acquire):
                        // closed, not pooled; the next attempt fails on the old one and takes
                        // the lock again.
                        Err(e) if super::is_transient::<DB>(&e) => {}
                        Err(e) => break Err(e.into()),
                    }
                }
            }
            Err(e) => break Err(e),
        }
    };
    lock.release().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_wait_in_vain_names_the_lock_and_the_table() {
        let table = TableName::default();
        let err = lock_wait_error(&table, &lock_name(&table), Duration::from_secs(300));
        let text = err.to_string();
        for part in [
            "\"migrate:inbox\"",
            "table inbox",
            "300s",
            "another instance",
        ] {
            assert!(text.contains(part), "{part:?} missing from: {text}");
        }
    }
}
