//! Each backend classifies its own transient errors: a real deadlock (PostgreSQL 40P01, MariaDB
//! 1213) and a real SQLITE_BUSY are transient; a unique violation is not.

use inbox_runtime::is_transient;
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use std::sync::Arc;
use tokio::sync::Barrier;

/// Two transactions on `$db` each lock one account (`$update` adds 1 to the account it binds),
/// meet at a barrier, then each wants the other's: the server must abort one of them with a
/// deadlock error, which is the value.
macro_rules! deadlock {
    ($backend:ty, $update:literal) => {{
        let db = <$backend>::create(4).await;
        db.pool
            .execute("INSERT INTO accounts VALUES (1, 0), (2, 0)")
            .await
            .unwrap();
        let barrier = Arc::new(Barrier::new(2));
        let spawn = |first: i64, second: i64| {
            let (pool, barrier) = (db.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut tx = pool.begin().await?;
                sqlx::query($update).bind(first).execute(&mut *tx).await?;
                barrier.wait().await;
                sqlx::query($update).bind(second).execute(&mut *tx).await?;
                tx.commit().await
            })
        };
        let (a, b) = (spawn(1, 2), spawn(2, 1));
        match (a.await.unwrap(), b.await.unwrap()) {
            (Err(e), Ok(())) | (Ok(()), Err(e)) => (db, e),
            other => panic!("expected exactly one deadlock victim, got {other:?}"),
        }
    }};
}

/// `$err` is transient on `$backend`; inserting account 1 a second time on `$db` is a unique
/// violation, and not transient.
macro_rules! assert_transient_and_unique_violation_not {
    ($err:expr, $db:expr, $backend:ty) => {{
        let err = $err;
        assert!(is_transient::<<$backend as TestBackend>::Db>(&err), "{err}");
        let dup = $db.pool.execute("INSERT INTO accounts VALUES (1, 0)").await;
        let dup = dup.unwrap_err();
        assert!(
            !is_transient::<<$backend as TestBackend>::Db>(&dup),
            "{dup}"
        );
    }};
}

use sqlx::Executor;

mod postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlock_is_transient_and_unique_violation_is_not() {
        let (db, err) = deadlock!(
            Postgres,
            "UPDATE accounts SET balance = balance + 1 WHERE id = $1"
        );
        let code = err.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("40P01"));
        assert_transient_and_unique_violation_not!(err, db, Postgres);
    }
}

mod mysql {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlock_is_transient_and_unique_violation_is_not() {
        let (db, err) = deadlock!(
            MySql,
            "UPDATE accounts SET balance = balance + 1 WHERE id = ?"
        );
        let number = err
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(|e| e.number());
        assert_eq!(number, Some(1213), "{err}");
        assert_transient_and_unique_violation_not!(err, db, MySql);
    }
}

mod sqlite {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn busy_is_transient_and_unique_violation_is_not() {
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
        let code = err.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("5"), "{err}");
        drop(holder);

        db.pool
            .execute("INSERT INTO accounts VALUES (1, 0)")
            .await
            .unwrap();
        assert_transient_and_unique_violation_not!(err, db, Sqlite);
    }
}
