//! A handler whose transaction ends under it: on MySQL/MariaDB a deadlock (1213) rolls the whole
//! transaction back, and on SQLite some errors do the same; a handler that swallows that error
//! and goes on runs its later statements outside any transaction, each committed on its own
//! (here the handler rolls back itself, which leaves the same state). The marker went with the
//! rollback, so the inbox's lookup of it after the handler finds no row. That used to be a retryable
//! failure: every redelivery claimed the key again and committed the later statements again,
//! so the effect was applied once per delivery. It is now permanent, naming the cause, and its
//! letter is kept as on the last delivery (never a nak, even when the dead-letter stream
//! refuses it): the effect is committed at most once.
//!
//! In a batch, where the messages share one transaction, the handlers that ran after the end
//! committed on their own too: a batch whose markers are gone at its end dead-letters every
//! message whose handler ran (which one ended it is not known); before, they went alone and
//! were applied again.

use inbox_runtime::{ErrorClass, Inbox, ProcessError, Tx, classify, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use inbox_tests::handlers::Entry;
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

/// The handler's key that ends its transaction.
const ENDS: &str = "end";

/// Defines, in module `$name`, the handler (writing its effect to the ledger; for key
/// [`ENDS`], after rolling its transaction back) and the tests, on `$backend`.
macro_rules! ended_under_the_handler {
    ($name:ident, $backend:ty, $db:ty, $insert:literal) => {
        mod $name {
            use super::*;

            #[idempotent(consumer = "ended", key = msg.key)]
            async fn ends(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
                if msg.key == ENDS {
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

            /// Delivered up to three times as the worker would (until its failure is
            /// permanent): applied once, and the error names the cause.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_message() {
                let db = <$backend>::create(2).await;
                let inbox = Inbox::new(db.pool.clone());
                inbox.migrate().await.expect("migrate the inbox");
                let mut last = None;
                for _ in 0..3 {
                    let entry = Entry::new(ENDS, 1, 5);
                    let delivery = inbox_runtime::Delivery::default();
                    let err = inbox
                        .process(&ends, &(), entry, &delivery)
                        .await
                        .expect_err("a transaction that ended under the handler must not commit");
                    let permanent = classify::<$db>(&err) == ErrorClass::Permanent;
                    last = Some(err);
                    if permanent {
                        break;
                    }
                }
                let err = last.expect("one delivery at least");
                assert!(
                    matches!(err, ProcessError::TransactionEnded { .. }),
                    "{err}"
                );
                assert_eq!(
                    <$backend>::count(&db, "SELECT count(*) FROM ledger").await,
                    1,
                    "the effect, committed outside the transaction, was applied again"
                );
                assert_eq!(
                    <$backend>::count(&db, "SELECT count(*) FROM inbox").await,
                    0
                );
            }

            /// Through a worker (batched too, under `cargo xtask test --batched`), with a
            /// dead-letter stream that takes no letter: a nak would run the message again, so
            /// the letter is kept in the database at once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn letter_refused() {
                let db = <$backend>::create(4).await;
                let inbox = Inbox::new(db.pool.clone());
                inbox.migrate().await.expect("migrate the inbox");
                let nats = NatsStream::create().await;
                let consumer = nats.consumer("c", Duration::from_secs(30)).await;
                // The dead-letter stream exists, but listens elsewhere.
                nats.js
                    .create_stream(async_nats::jetstream::stream::Config {
                        name: nats.dlq_stream.clone(),
                        subjects: vec![format!("elsewhere.{}", nats.stream.to_lowercase())],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                nats.publish_all([Entry::new(ENDS, 1, 1).json()]).await;
                let worker = nats
                    .worker(inbox, consumer)
                    .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
                    .build(ends)
                    .unwrap();
                let run = Running::start(&worker);
                wait_until(
                    "the message to be terminated",
                    Duration::from_secs(60),
                    async || worker.stats().terminated == 1,
                )
                .await
                .unwrap();
                nats.wait_drained("c").await;
                let stats = run.stop().await;
                assert_eq!(
                    <$backend>::count(&db, "SELECT count(*) FROM ledger").await,
                    1,
                    "the message ran again: {stats:?}"
                );
                assert_eq!(stats.nacked, 0, "{stats:?}");
                let kept = "SELECT count(*) FROM inbox_dead_letters";
                assert_eq!(<$backend>::count(&db, kept).await, 1, "{stats:?}");
            }

            /// A batch of four (one worker, one batch) whose third handler ends the
            /// transaction: no message applied twice, and a letter names the cause.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batched() {
                let db = <$backend>::create(4).await;
                let inbox = Inbox::new(db.pool.clone());
                inbox.migrate().await.expect("migrate the inbox");
                let nats = NatsStream::create().await;
                let consumer = nats.consumer("c", Duration::from_secs(30)).await;
                let keys = ["a", "b", ENDS, "f"];
                nats.publish_all(keys.iter().map(|k| Entry::new(*k, 1, 1).json()))
                    .await;
                let worker = nats
                    .worker(inbox, consumer)
                    .concurrency(1)
                    .batch(16, Duration::from_millis(500))
                    .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
                    .build(ends)
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
