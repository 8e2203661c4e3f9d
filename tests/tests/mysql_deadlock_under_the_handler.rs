//! MySQL/MariaDB: a real deadlock under a worker's handler, which swallows its error (1213),
//! writes an effect (committed on its own: the deadlock rolled the whole transaction back and
//! the session is out of any transaction) and one outbox row. Through a worker, whose deadline
//! tells it its server, so that on MariaDB the row is written with the server's check of the
//! transaction (`@@in_transaction`) rather than the marker's lookup: the check must see the
//! transaction gone, the row must not commit, and the message ends `TransactionEnded`
//! (terminated, never acked). The other tests of an ended transaction roll back with SQL of
//! their own (`ROLLBACK`); this one has the server end it, as it does in production.
//!
//! The deadlock is provoked, not hoped for: the test's own transaction first updates many rows
//! (so that InnoDB, which rolls back the lighter of the two, picks the handler's), then row 1;
//! the handler updates row 2, then row 1, and waits; once the processlist shows that wait, the
//! test updates row 2.

use inbox_runtime::{Inbox, Outbox, OutboxMessage, Tx, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{MySql, TestBackend};
use inbox_tests::handlers::Entry;
use inbox_tests::{NatsStream, Running};
use sqlx::Connection;
use std::time::Duration;

/// Rows the test's transaction updates before row 1, to weigh more than the handler's.
const HEAVY: i64 = 200;

/// Updates row 2 then row 1 of `locks`; swallows the error of the second (the deadlock), and
/// records it in `effects`, outside any transaction; then writes one outbox row.
#[idempotent(consumer = "deadlocked", key = msg.key)]
async fn swallows(
    msg: Entry,
    tx: &mut Tx<sqlx::MySql>,
    outbox: &Outbox<sqlx::MySql>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE locks SET v = v + 1 WHERE id = 2")
        .execute(&mut **tx)
        .await?;
    let second = sqlx::query("UPDATE locks SET v = v + 1 WHERE id = 1")
        .execute(&mut **tx)
        .await;
    let swallowed = match second {
        Ok(_) => "none".to_owned(),
        Err(e) => e
            .as_database_error()
            .and_then(|d| d.code())
            .map_or_else(|| e.to_string(), |c| c.into_owned()),
    };
    sqlx::query("INSERT INTO effects (msg_key, swallowed) VALUES (?, ?)")
        .bind(&msg.key)
        .bind(&swallowed)
        .execute(&mut **tx)
        .await?;
    let row = OutboxMessage::new("events.deadlocked", msg.key.clone()).order_key("k");
    outbox.enqueue(tx, row).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_deadlock_commits_no_outbox_row() {
    let db = MySql::create(4).await;
    for sql in [
        "CREATE TABLE locks (id BIGINT PRIMARY KEY, v BIGINT NOT NULL) ENGINE = InnoDB",
        "CREATE TABLE effects (msg_key VARCHAR(64) NOT NULL, swallowed TEXT NOT NULL) \
         ENGINE = InnoDB",
        "INSERT INTO locks (id, v) WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL \
         SELECT i + 1 FROM n WHERE i < 1000) SELECT i, 0 FROM n",
    ] {
        sqlx::raw_sql(sql)
            .execute(&db.pool)
            .await
            .expect("set up the tables");
    }
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.expect("migrate the inbox");
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate the outbox");

    // The test's transaction: heavy, then row 1.
    let mut holder = db.pool.acquire().await.expect("a connection for the test");
    let mut held = holder.begin().await.expect("BEGIN");
    let heavy = format!(
        "UPDATE locks SET v = v + 1 WHERE id > 2 AND id <= {}",
        HEAVY + 2
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(heavy))
        .execute(&mut *held)
        .await
        .unwrap();
    sqlx::query("UPDATE locks SET v = v + 1 WHERE id = 1")
        .execute(&mut *held)
        .await
        .unwrap();

    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry::new("d", 0, 1).json()]).await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .build_with_state(swallows, outbox.clone())
        .unwrap();
    let run = Running::start(&worker);
    // The handler waits for row 1 (its statement in the processlist, waiting on the lock).
    let pool = db.pool.clone();
    wait_until(
        "the handler to wait for row 1",
        Duration::from_secs(60),
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.PROCESSLIST \
                 WHERE INFO LIKE 'UPDATE locks SET v = v + 1 WHERE id = 1%' \
                 AND ID <> CONNECTION_ID()",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(0);
            waiting > 0
        },
    )
    .await
    .unwrap();
    // Row 2, which the handler holds: a deadlock, the handler's transaction the lighter one.
    sqlx::query("UPDATE locks SET v = v + 1 WHERE id = 2")
        .execute(&mut *held)
        .await
        .expect("the test's transaction outweighs the handler's and goes on");
    held.commit().await.unwrap();

    wait_until("the message to end", Duration::from_secs(60), async || {
        let s = worker.stats();
        s.acked + s.terminated > 0
    })
    .await
    .unwrap();
    let stats = run.stop().await;
    let swallowed: Vec<(String,)> = sqlx::query_as("SELECT swallowed FROM effects")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(swallowed, [("40001".to_owned(),)], "{stats:?}");
    let rows = MySql::count(&db, "SELECT count(*) FROM outbox").await;
    assert_eq!(
        rows, 0,
        "an outbox row committed without its marker: {stats:?}"
    );
    assert_eq!((stats.acked, stats.terminated), (0, 1), "{stats:?}");
    let markers = MySql::count(&db, "SELECT count(*) FROM inbox").await;
    assert_eq!(markers, 0, "{stats:?}");
}
