//! Each backend classifies its own transient errors: a real deadlock (PostgreSQL 40P01, MariaDB
//! 1213) and a real SQLITE_BUSY are transient; a unique violation is not.

use inbox_runtime::is_transient;
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use sqlx::{Database, Pool};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::Barrier;

/// Two transactions each lock one account, meet at a barrier, then each wants the other's: the
/// server must abort one of them with a deadlock error, which is returned.
async fn deadlock<DB, F, Fut>(pool: Pool<DB>, update: F) -> sqlx::Error
where
    DB: Database,
    F: Fn(Pool<DB>, Arc<Barrier>, i64, i64) -> Fut,
    Fut: Future<Output = Result<(), sqlx::Error>> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(2));
    let a = tokio::spawn(update(pool.clone(), barrier.clone(), 1, 2));
    let b = tokio::spawn(update(pool, barrier, 2, 1));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    match (a, b) {
        (Err(e), Ok(())) | (Ok(()), Err(e)) => e,
        other => panic!("expected exactly one deadlock victim, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_deadlock_is_transient_and_unique_violation_is_not() {
    let db = Postgres::create(4).await;
    sqlx::query("INSERT INTO accounts VALUES (1, 0), (2, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = deadlock(db.pool.clone(), |pool, barrier, first, second| async move {
        let mut tx = pool.begin().await?;
        let sql = "UPDATE accounts SET balance = balance + 1 WHERE id = $1";
        sqlx::query(sql).bind(first).execute(&mut *tx).await?;
        barrier.wait().await;
        sqlx::query(sql).bind(second).execute(&mut *tx).await?;
        tx.commit().await
    })
    .await;
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("40P01")
    );
    assert!(is_transient::<sqlx::Postgres>(&err), "{err}");

    let dup = sqlx::query("INSERT INTO accounts VALUES (1, 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(!is_transient::<sqlx::Postgres>(&dup), "{dup}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_deadlock_is_transient_and_unique_violation_is_not() {
    let db = MySql::create(4).await;
    sqlx::query("INSERT INTO accounts VALUES (1, 0), (2, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = deadlock(db.pool.clone(), |pool, barrier, first, second| async move {
        let mut tx = pool.begin().await?;
        let sql = "UPDATE accounts SET balance = balance + 1 WHERE id = ?";
        sqlx::query(sql).bind(first).execute(&mut *tx).await?;
        barrier.wait().await;
        sqlx::query(sql).bind(second).execute(&mut *tx).await?;
        tx.commit().await
    })
    .await;
    let number = err
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(|e| e.number());
    assert_eq!(number, Some(1213), "{err}");
    assert!(is_transient::<sqlx::MySql>(&err), "{err}");

    let dup = sqlx::query("INSERT INTO accounts VALUES (1, 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(!is_transient::<sqlx::MySql>(&dup), "{dup}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_busy_is_transient_and_unique_violation_is_not() {
    let db = Sqlite::create(1).await;
    // A second connection that does not wait for the write lock.
    let impatient = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            inbox_runtime::sqlite_options(&db.url)
                .unwrap()
                .busy_timeout(std::time::Duration::ZERO),
        )
        .await
        .unwrap();
    let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let err = impatient.begin_with("BEGIN IMMEDIATE").await.unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("5"),
        "{err}"
    );
    assert!(is_transient::<sqlx::Sqlite>(&err), "{err}");
    drop(holder);

    sqlx::query("INSERT INTO accounts VALUES (1, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let dup = sqlx::query("INSERT INTO accounts VALUES (1, 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(!is_transient::<sqlx::Sqlite>(&dup), "{dup}");
}
