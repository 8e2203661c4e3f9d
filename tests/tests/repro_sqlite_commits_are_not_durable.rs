//! Regression: `sqlite_options` opened databases with `synchronous = NORMAL`, under which WAL may
//! lose the last commits on power loss, after their messages were acked. It is `FULL` now.

use inbox_tests::backends::{Sqlite, TestBackend};

#[tokio::test]
async fn sqlite_commits_are_durable_by_default() {
    let db = Sqlite::create(1).await;
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&db.pool)
        .await
        .expect("PRAGMA synchronous");
    assert_eq!(synchronous, 2, "synchronous is not FULL (2)");
}
