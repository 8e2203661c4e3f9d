//! A worker's handler's outbox rows are held until it returns, then written in one statement that
//! is also the check of its marker (`INSERT .. SELECT .. FROM inbox WHERE id = <the marker's>`),
//! in place of the marker's own lookup:
//! - the rows commit, in the order they were written (ids ascending), one or many;
//! - a row written in a savepoint the handler opened (`tx.begin()`) is written at once: rolled
//!   back with it, committed when it is released;
//! - a handler whose transaction ends under it (here it rolls back itself, as a swallowed
//!   MySQL deadlock would) and that then writes a row: `TransactionEnded`, and the row is not
//!   committed, since the insert found no marker;
//! - a handler that swallows a failed statement's error and then writes a row: on PostgreSQL,
//!   whose transaction is aborted, the insert fails and nothing commits;
//! - the same end through a worker, whose deadline tells it its server: on MariaDB one row is
//!   written with the server's check of the transaction (`@@in_transaction AND @@autocommit`)
//!   instead of the marker's lookup, and so are a batch's rows (in one statement, strict for
//!   itself even when the session is not; the batch's finish checks the markers after them);
//!   with `autocommit` off the marker decides again;
//! - through a worker, batched, every message's rows commit, in each message's order;
//! - all of it on PostgreSQL's partitioned inbox too, whose markers are finished after the
//!   rows' insert.

use inbox_runtime::{Delivery, Inbox, Outbox, OutboxMessage, ProcessError, Tx, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{MySql, Postgres, Sqlite, TestBackend};
use inbox_tests::handlers::Entry;
use inbox_tests::{NatsStream, Running};
use sqlx::Connection;
use std::time::Duration;

/// The key whose handler ends its transaction before writing.
const ENDS: &str = "end";
/// The key whose handler swallows the error of a failed statement before writing (which
/// aborts the transaction on PostgreSQL).
const SWALLOWS: &str = "swallow";
/// MySQL: the key whose handler turns the session's `autocommit` off before writing.
const AUTOCOMMIT_OFF: &str = "autocommit-off";
/// MySQL: the key whose handler turns `autocommit` off, ends its transaction and reads a table,
/// which opens a transaction that is not the marker's, before writing.
const AUTOCOMMIT_OFF_ENDS: &str = "autocommit-off-end";
/// The key whose handler ends its transaction and begins one of its own before writing (raw
/// transaction control, which voids the guarantee for a single row on MariaDB; several rows
/// are still checked against the marker).
const RESTARTS: &str = "restart";
/// MySQL: the key whose handler takes its session out of strict mode (where a multi-row insert
/// stores a NULL into a NOT NULL column as `''`) and ends its transaction before writing.
const NOT_STRICT_ENDS: &str = "not-strict-end";

macro_rules! ride_with_the_marker {
    ($name:ident, $backend:ty, $db:ty, $aborts:literal, $inbox:expr) => {
        ride_with_the_marker!($name, $backend, $db, $aborts, $inbox, "held");
    };
    ($name:ident, $backend:ty, $db:ty, $aborts:literal, $inbox:expr, $consumer:literal) => {
        mod $name {
            use super::*;

            /// The payloads in the outbox, in id order.
            async fn payloads(pool: &sqlx::Pool<$db>) -> Vec<String> {
                let rows: Vec<(Vec<u8>,)> =
                    sqlx::query_as("SELECT payload FROM outbox ORDER BY id")
                        .fetch_all(pool)
                        .await
                        .expect("read the outbox");
                rows.into_iter()
                    .map(|(p,)| String::from_utf8(p).unwrap())
                    .collect()
            }

            /// Writes `amount` rows `<key>-<i>`; for account 1, then one in a savepoint rolled
            /// back (`-dropped`) and one in a savepoint released (`-kept`); for [`ENDS`], rolls
            /// its transaction back first.
            #[idempotent(consumer = $consumer, key = msg.key)]
            async fn announce(
                msg: Entry,
                tx: &mut Tx<$db>,
                outbox: &Outbox<$db>,
            ) -> Result<(), sqlx::Error> {
                if msg.key.starts_with(AUTOCOMMIT_OFF) {
                    sqlx::raw_sql("SET autocommit = 0")
                        .execute(&mut **tx)
                        .await?;
                }
                if msg.key == NOT_STRICT_ENDS {
                    sqlx::raw_sql("SET SESSION sql_mode = ''")
                        .execute(&mut **tx)
                        .await?;
                }
                if [ENDS, AUTOCOMMIT_OFF_ENDS, NOT_STRICT_ENDS, RESTARTS]
                    .contains(&msg.key.as_str())
                {
                    sqlx::raw_sql("ROLLBACK").execute(&mut **tx).await?;
                }
                if msg.key == RESTARTS {
                    sqlx::raw_sql("BEGIN").execute(&mut **tx).await?;
                }
                if msg.key == AUTOCOMMIT_OFF_ENDS {
                    sqlx::raw_sql("SELECT count(*) FROM outbox")
                        .execute(&mut **tx)
                        .await?;
                }
                if msg.key == SWALLOWS {
                    let failed = sqlx::raw_sql("SELECT * FROM no_such_table")
                        .execute(&mut **tx)
                        .await;
                    assert!(failed.is_err());
                }
                let row = |what: String| OutboxMessage::new("events.held", what).order_key("k");
                for i in 0..msg.amount {
                    outbox.enqueue(tx, row(format!("{}-{i}", msg.key))).await?;
                }
                if msg.account == 1 {
                    let mut dropped = tx.begin().await?;
                    outbox
                        .enqueue(&mut dropped, row(format!("{}-dropped", msg.key)))
                        .await?;
                    dropped.rollback().await?;
                    let mut kept = tx.begin().await?;
                    outbox
                        .enqueue(&mut kept, row(format!("{}-kept", msg.key)))
                        .await?;
                    kept.commit().await?;
                }
                Ok(())
            }

            async fn setup() -> (
                inbox_tests::backends::TestDb<<$backend as TestBackend>::Db>,
                Inbox<$db>,
                Outbox<$db>,
            ) {
                let db = <$backend>::create(4).await;
                let inbox: Inbox<$db> = $inbox(db.pool.clone());
                inbox.migrate().await.expect("migrate the inbox");
                let outbox = Outbox::new(db.pool.clone());
                outbox.migrate().await.expect("migrate the outbox");
                (db, inbox, outbox)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rows_commit_in_order_and_savepoints_keep_their_own() {
                let (db, inbox, outbox) = setup().await;
                for (key, account, amount) in [("one", 0, 1), ("many", 0, 3), ("sp", 1, 2)] {
                    let entry = Entry::new(key, account, amount);
                    let done = inbox
                        .process(&announce, &outbox, entry, &Delivery::default())
                        .await;
                    assert!(done.is_ok(), "{key}: {done:?}");
                }
                // The savepoint's row was written at once, the others when the handler returned.
                assert_eq!(
                    payloads(&db.pool).await,
                    [
                        "one-0", "many-0", "many-1", "many-2", "sp-kept", "sp-0", "sp-1"
                    ]
                );
                // Every marker is finished (on the partitioned inbox, by its update after the
                // rows' insert).
                let open = "SELECT count(*) FROM inbox WHERE processed_at IS NULL";
                assert_eq!(<$backend>::count(&db, open).await, 0, "unfinished markers");
                // A duplicate writes nothing.
                let again = inbox
                    .process(
                        &announce,
                        &outbox,
                        Entry::new("many", 0, 3),
                        &Delivery::default(),
                    )
                    .await;
                assert!(again.is_ok(), "{again:?}");
                assert_eq!(payloads(&db.pool).await.len(), 7);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_after_the_transaction_ended_is_not_committed() {
                let (db, inbox, outbox) = setup().await;
                // One row (MySQL writes it with `INSERT .. VALUES`) and two.
                for rows in [1, 2] {
                    let entry = Entry::new(ENDS, 0, rows);
                    let err = inbox
                        .process(&announce, &outbox, entry, &Delivery::default())
                        .await
                        .expect_err("a transaction that ended under the handler must not commit");
                    assert!(
                        matches!(err, ProcessError::TransactionEnded { .. }),
                        "{rows}: {err}"
                    );
                }
                assert!(payloads(&db.pool).await.is_empty());
                assert_eq!(
                    <$backend>::count(&db, "SELECT count(*) FROM inbox").await,
                    0
                );
            }

            /// Runs `entries` through a worker (whose deadline tells it the server: on
            /// MariaDB, one row is written with the server's check of the transaction) until
            /// each is acked or terminated; returns (acked, terminated) and the outbox's
            /// payloads.
            pub(super) async fn through_a_worker(entries: &[Entry]) -> ((u64, u64), Vec<String>) {
                through(entries, None).await
            }

            /// As [`through_a_worker`], in batches (on MariaDB, a batch's rows are written in
            /// one statement with the server's check, and its finish checks the markers
            /// after them).
            pub(super) async fn through_a_batch(entries: &[Entry]) -> ((u64, u64), Vec<String>) {
                through(entries, Some(8)).await
            }

            async fn through(entries: &[Entry], batch: Option<usize>) -> ((u64, u64), Vec<String>) {
                let (db, inbox, outbox) = setup().await;
                let nats = NatsStream::create().await;
                let consumer = nats.consumer("c", Duration::from_secs(30)).await;
                nats.publish_all(entries.iter().map(Entry::json)).await;
                let mut builder = nats.worker(inbox, consumer).concurrency(1);
                if let Some(n) = batch {
                    builder = builder.batch(n, Duration::from_millis(200));
                }
                let worker = builder.build_with_state(announce, outbox.clone()).unwrap();
                let run = Running::start(&worker);
                wait_until(
                    "every message to end",
                    Duration::from_secs(60),
                    async || {
                        let s = worker.stats();
                        s.acked + s.terminated == entries.len() as u64
                    },
                )
                .await
                .unwrap();
                let stats = run.stop().await;
                ((stats.acked, stats.terminated), payloads(&db.pool).await)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn through_a_worker_a_row_after_the_transaction_ended_is_not_committed() {
                // One message per run (a batch whose transaction ended dead-letters every
                // message in it, also under `cargo xtask test --batched`): one row and two,
                // alone and in a batch (there, on MariaDB, one multi-row statement with the
                // server's check).
                for rows in [1, 2] {
                    for batched in [false, true] {
                        let entries = [Entry::new(ENDS, 0, rows)];
                        let (ended, payloads) = match batched {
                            false => through_a_worker(&entries).await,
                            true => through_a_batch(&entries).await,
                        };
                        assert_eq!(ended, (0, 1), "{rows}, {batched}: {payloads:?}");
                        assert!(payloads.is_empty(), "{rows}, {batched}: {payloads:?}");
                    }
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn through_a_worker_rows_in_a_transaction_of_the_handlers_own_are_not_committed()
            {
                // Two rows: MariaDB's check of the session would take the handler's BEGIN for
                // the worker's, so a message's several rows go by the marker.
                let (ended, payloads) = through_a_worker(&[Entry::new(RESTARTS, 0, 2)]).await;
                assert_eq!(ended, (0, 1), "{payloads:?}");
                assert!(payloads.is_empty(), "{payloads:?}");
            }

            /// On PostgreSQL the insert fails in the aborted transaction (redelivered, nothing
            /// committed); elsewhere the transaction goes on, and the row commits.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_swallowed_error_before_the_row() {
                let (db, inbox, outbox) = setup().await;
                let entry = Entry::new(SWALLOWS, 0, 1);
                let done = inbox
                    .process(&announce, &outbox, entry, &Delivery::default())
                    .await;
                let inbox_rows = <$backend>::count(&db, "SELECT count(*) FROM inbox").await;
                if $aborts {
                    let err = done.expect_err("an aborted transaction must not be acked");
                    assert!(matches!(err, ProcessError::Database { .. }), "{err}");
                    assert!(payloads(&db.pool).await.is_empty());
                    assert_eq!(inbox_rows, 0);
                } else {
                    assert!(done.is_ok(), "{done:?}");
                    assert_eq!(payloads(&db.pool).await, ["swallow-0"]);
                    assert_eq!(inbox_rows, 1);
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_commits_every_messages_rows() {
                let (db, inbox, outbox) = setup().await;
                let nats = NatsStream::create().await;
                let consumer = nats.consumer("c", Duration::from_secs(30)).await;
                let entries: Vec<Entry> =
                    (0..6).map(|i| Entry::new(format!("b{i}"), 0, 2)).collect();
                nats.publish_all(entries.iter().map(Entry::json)).await;
                let worker = nats
                    .worker(inbox, consumer)
                    .concurrency(1)
                    .batch(16, Duration::from_millis(500))
                    .build_with_state(announce, outbox.clone())
                    .unwrap();
                let run = Running::start(&worker);
                wait_until("every message acked", Duration::from_secs(60), async || {
                    worker.stats().acked == entries.len() as u64
                })
                .await
                .unwrap();
                let stats = run.stop().await;
                let mut expected = Vec::new();
                for i in 0..6 {
                    expected.push(format!("b{i}-0"));
                    expected.push(format!("b{i}-1"));
                }
                assert_eq!(payloads(&db.pool).await, expected, "{stats:?}");
            }
        }
    };
}

ride_with_the_marker!(postgres, Postgres, sqlx::Postgres, true, Inbox::new);
// Its markers are claimed unfinished: the rows' insert, then the `processed_at` update.
ride_with_the_marker!(
    postgres_partitioned,
    Postgres,
    sqlx::Postgres,
    true,
    |pool| Inbox::new(pool).partitioned(inbox_runtime::Partitions::daily()),
    // A consumer of its own: one process's workers take a consumer name per inbox table.
    "held_partitioned"
);
ride_with_the_marker!(mysql, MySql, sqlx::MySql, false, Inbox::new);

/// MySQL with `autocommit` off in the handler's session: the server's check of the transaction
/// (MariaDB's, which requires `autocommit` on) fails, and the marker decides: there, the row
/// commits with it; gone with a rollback, under a transaction the next statement opened, the
/// row is not committed.
mod mysql_autocommit_off {
    use super::mysql::*;
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_marker_decides() {
        // Each alone (a batch whose transaction ended dead-letters every message in it).
        let (ended, payloads) = through_a_worker(&[Entry::new(AUTOCOMMIT_OFF, 0, 1)]).await;
        assert_eq!(ended, (1, 0), "{payloads:?}");
        assert_eq!(payloads, ["autocommit-off-0"]);
        let (ended, payloads) = through_a_batch(&[Entry::new(AUTOCOMMIT_OFF, 0, 2)]).await;
        assert_eq!(ended, (1, 0), "{payloads:?}");
        assert_eq!(payloads, ["autocommit-off-0", "autocommit-off-1"]);
        let (ended, payloads) = through_a_worker(&[Entry::new(AUTOCOMMIT_OFF_ENDS, 0, 1)]).await;
        assert_eq!(ended, (0, 1), "{payloads:?}");
        assert!(payloads.is_empty(), "{payloads:?}");
    }
}

/// MySQL with the session out of strict mode: MariaDB's multi-row insert with the server's
/// check is strict for itself, so that a failed check fails it rather than storing `''`.
mod mysql_not_strict {
    use super::mysql::*;
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_check_stores_nothing() {
        let entries = [Entry::new(NOT_STRICT_ENDS, 0, 2)];
        for (ended, payloads) in [
            through_a_worker(&entries).await,
            through_a_batch(&entries).await,
        ] {
            assert_eq!(ended, (0, 1), "{payloads:?}");
            assert!(payloads.is_empty(), "{payloads:?}");
        }
    }
}
ride_with_the_marker!(sqlite, Sqlite, sqlx::Sqlite, false, Inbox::new);
