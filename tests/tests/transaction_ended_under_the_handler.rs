//! A handler whose transaction ends under it: on MySQL/MariaDB a deadlock (1213) rolls the whole
//! transaction back, and on SQLite some errors do the same; a handler that swallows that error
//! and goes on runs its later statements outside any transaction, each committed on its own
//! (here the handler rolls back itself, which leaves the same state). The marker went with the
//! rollback, so the inbox's `processed_at` update finds no row. That used to be a retryable
//! failure: every redelivery claimed the key again and committed the later statements again,
//! so the effect was applied once per delivery. It is now permanent (dead-lettered at once),
//! naming the cause: the effect is committed at most once.

use inbox_runtime::{ErrorClass, Inbox, ProcessError, Tx, classify, idempotent};
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use inbox_tests::handlers::Entry;

/// What the worker would do with each delivery, up to `deliveries`: tries `entry` until its
/// failure is permanent. Returns the last error.
macro_rules! deliver {
    ($inbox:expr, $handler:expr, $db:ty, $deliveries:expr) => {{
        let mut last = None;
        for _ in 0..$deliveries {
            let entry = Entry::new("k", 1, 5);
            let tried = $inbox
                .process(&$handler, &(), entry, &inbox_runtime::Delivery::default())
                .await;
            let err =
                tried.expect_err("a transaction that ended under the handler must not commit");
            let permanent = classify::<$db>(&err) == ErrorClass::Permanent;
            last = Some(err);
            if permanent {
                break;
            }
        }
        last.expect("one delivery at least")
    }};
}

macro_rules! ended_under_the_handler {
    ($test:ident, $backend:ty, $db:ty, $insert:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            /// Rolls its transaction back, then writes its effect.
            #[idempotent(consumer = "ended", key = msg.key)]
            async fn ends_its_transaction(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
                sqlx::raw_sql("ROLLBACK").execute(&mut **tx).await?;
                sqlx::query($insert)
                    .bind(&msg.key)
                    .bind(msg.account)
                    .bind(msg.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            let db = <$backend>::create(2).await;
            let inbox = Inbox::new(db.pool.clone());
            inbox.migrate().await.expect("migrate the inbox");
            let err = deliver!(inbox, ends_its_transaction, $db, 3);
            assert!(
                matches!(err, ProcessError::TransactionEnded { .. }),
                "{err}"
            );
            assert_eq!(
                <$backend>::count(&db, "SELECT count(*) FROM ledger").await,
                1,
                "the effect, committed outside the transaction, was applied again on redelivery"
            );
            assert_eq!(
                <$backend>::count(&db, "SELECT count(*) FROM inbox").await,
                0
            );
        }
    };
}

ended_under_the_handler!(
    postgres,
    Postgres,
    sqlx::Postgres,
    "INSERT INTO ledger (msg_key, account, amount) VALUES ($1, $2, $3)"
);
ended_under_the_handler!(
    mysql,
    MySql,
    sqlx::MySql,
    "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)"
);
ended_under_the_handler!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)"
);
