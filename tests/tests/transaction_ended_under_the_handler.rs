//! A handler whose transaction ends under it: on MySQL/MariaDB a deadlock (1213) rolls the whole
//! transaction back, and on SQLite some errors do the same; a handler that swallows that error
//! and goes on runs its later statements outside any transaction, each committed on its own
//! (here the handler rolls back itself, which leaves the same state). The marker went with the
//! rollback, so the inbox's `processed_at` update finds no row. That used to be a retryable
//! failure: every redelivery claimed the key again and committed the later statements again,
//! so the effect was applied once per delivery. It is now permanent (dead-lettered at once),
//! naming the cause: the effect is committed at most once.
//!
//! In a batch, where the messages share one transaction: the handlers that ran after the end
//! committed on their own too. A batch whose markers are gone at its end dead-letters every
//! message whose handler ran (which one ended it is not known); before, they went alone and
//! were applied again.

use inbox_runtime::{ErrorClass, Inbox, ProcessError, Tx, classify, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use inbox_tests::handlers::Entry;
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

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

macro_rules! ended_under_a_batched_handler {
    ($test:ident, $backend:ty, $db:ty, $insert:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            /// Writes its effect; for key `b`, after rolling its transaction back.
            #[idempotent(consumer = "ended", key = msg.key)]
            async fn ends_the_batch(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
                if msg.key == "b" {
                    sqlx::raw_sql("ROLLBACK").execute(&mut **tx).await?;
                }
                sqlx::query($insert)
                    .bind(&msg.key)
                    .bind(msg.account)
                    .bind(msg.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            let db = <$backend>::create(4).await;
            let inbox = Inbox::new(db.pool.clone());
            inbox.migrate().await.expect("migrate the inbox");
            let nats = NatsStream::create().await;
            let consumer = nats.consumer("c", Duration::from_secs(30)).await;
            let keys = ["a", "b", "c", "d"];
            nats.publish_all(keys.iter().map(|k| Entry::new(*k, 1, 1).json()))
                .await;
            let worker = nats
                .worker(inbox, consumer)
                .concurrency(1)
                .batch(16, Duration::from_millis(500))
                .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
                .build(ends_the_batch)
                .unwrap();
            let run = Running::start(&worker);
            wait_until(
                "every message to end",
                Duration::from_secs(60),
                async || {
                    let s = worker.stats();
                    s.acked + s.skipped + s.terminated == keys.len() as u64
                },
            )
            .await
            .unwrap();
            nats.wait_drained("c").await;
            let stats = run.stop().await;
            let applied = <$backend>::count(&db, "SELECT count(*) FROM ledger").await;
            let distinct =
                <$backend>::count(&db, "SELECT count(DISTINCT msg_key) FROM ledger").await;
            assert_eq!(applied, distinct, "a message was applied twice: {stats:?}");
            let letters = nats.dead_letters().await;
            assert!(
                letters.iter().any(|(_, headers)| headers
                    .get("Inbox-Error")
                    .is_some_and(|e| e.as_str().contains("ended while its handler ran"))),
                "no letter names the ended transaction: {stats:?}"
            );
        }
    };
}

ended_under_a_batched_handler!(
    postgres_batched,
    Postgres,
    sqlx::Postgres,
    "INSERT INTO ledger (msg_key, account, amount) VALUES ($1, $2, $3)"
);
ended_under_a_batched_handler!(
    mysql_batched,
    MySql,
    sqlx::MySql,
    "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)"
);
ended_under_a_batched_handler!(
    sqlite_batched,
    Sqlite,
    sqlx::Sqlite,
    "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)"
);
