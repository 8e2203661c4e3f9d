//! The credit runs' database side below the run itself: the pool that watches and audits a
//! database, counting markers, running a statement. Shared by every chaos run (the email run
//! too), so it imports none of them.

use super::streams::CONSUMER;
use inbox_testkit::{Backend, Database};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};

/// A pool of one connection on `db`, to watch and audit it, connected when first used; on
/// SQLite it creates the file if the processes have not yet.
pub fn audit_pool(backend: Backend, db: &Database) -> Result<AnyPool, String> {
    let url = match backend {
        Backend::Sqlite => format!("{}?mode=rwc", db.url),
        _ => db.url.clone(),
    };
    AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .map_err(|e| e.to_string())
}

/// Markers of `credit`'s requests, for following the run's progress.
pub async fn applied(pool: &AnyPool) -> Result<i64, String> {
    let sql = format!("SELECT count(*) FROM inbox WHERE consumer = '{CONSUMER}'");
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.clone()).into_sql_str())
        .fetch_one(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))
}

/// Runs one statement.
pub async fn execute(pool: &AnyPool, sql: String) -> Result<(), String> {
    sqlx::query(AssertSqlSafe(sql.clone()).into_sql_str())
        .execute(pool)
        .await
        .map(drop)
        .map_err(|e| format!("{sql}: {e}"))
}
