//! Migrations of the tables this crate owns (an inbox, its dead letters, an outbox): each
//! tracked in a migrations table of its own, run by every instance at start and safe when they
//! race.

use super::{InboxBackend, TableName};
use crate::backoff::Backoff;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr};
use std::time::Duration;

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
    migrator
}

/// The table that records which migrations of `table` ran.
fn migrations_table(table: &TableName) -> String {
    format!("_{table}_migrations")
}

/// Forgets the interrupted run of migration `version` (recorded with `success = FALSE`), so that
/// the migrator runs it again. Only for idempotent DDL, which every migration here is.
fn forget_dirty_sql(table: &TableName, version: i64) -> SqlStr {
    let migrations = migrations_table(table);
    AssertSqlSafe(format!(
        "DELETE FROM {migrations} WHERE version = {version} AND success = FALSE"
    ))
    .into_sql_str()
}

/// Runs `migrator` (of `table`) on `pool`, where instances starting together race: sqlx takes no
/// lock on SQLite, and its MySQL lock did not hold on MariaDB here, so the loser fails to record
/// a migration the winner is applying or has applied. The DDL is idempotent; a later attempt
/// sees it recorded.
pub(crate) async fn migrate_racing<DB: InboxBackend>(
    pool: &Pool<DB>,
    table: &TableName,
    migrator: &Migrator,
) -> Result<(), sqlx::migrate::MigrateError> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut attempt = 1;
    loop {
        match DB::run_migrator(pool, migrator).await {
            Ok(()) => return Ok(()),
            // A step that was interrupted (MySQL's DDL is not transactional, so a process
            // killed inside it leaves the step recorded as dirty) would block every restart.
            // Every step is idempotent: forget the dirty record and run the step again.
            Err(sqlx::migrate::MigrateError::Dirty(version)) if attempt < 5 => {
                tracing::warn!(
                    %table,
                    version,
                    "an earlier migration of the table was interrupted; running it again"
                );
                let forget = forget_dirty_sql(table, version);
                DB::execute(pool, forget).await?;
                attempt += 1;
            }
            Err(e) if attempt < 5 => {
                tracing::debug!(error = %e, attempt, %table, "migration raced another instance; retrying");
                tokio::time::sleep(backoff.next()).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}
