//! A key expression that panics inside a batch: the message is served alone, where the panic is
//! caught and the message dead-lettered; the rest of the batch commits. Before, the panic ended
//! the batch's task and every message of the batch was left without ack or nak (on its last
//! delivery, lost). With concurrency 1 the message served alone also waits for the batch's
//! connection rather than take a second one.

use inbox_runtime::{Tx, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{Postgres, TestBackend};
use inbox_tests::handlers::Entry;
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

fn key_or_panic(key: &str) -> &str {
    assert_ne!(key, "boom", "a key expression that panics");
    key
}

#[idempotent(consumer = "panicky", key = key_or_panic(&msg.key))]
async fn panicky(msg: Entry, tx: &mut Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_key_in_a_batch_is_dead_lettered_alone() {
    let db = Postgres::create(2).await;
    let inbox = inbox_runtime::Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let keys = ["a", "b", "boom", "c", "d"];
    nats.publish_all(keys.iter().map(|k| Entry::new(*k, 1, 1).json()))
        .await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .batch(16, Duration::from_millis(500))
        .build(panicky)
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the panicking message's dead letter",
        Duration::from_secs(60),
        async || !nats.dead_letters().await.is_empty(),
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.terminated), (4, 1), "{stats:?}");
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let error = letters[0]
        .1
        .get("Inbox-Error")
        .map(|v| v.as_str().to_owned());
    assert!(
        error.as_deref().is_some_and(|e| e.contains("panic")),
        "{error:?}"
    );
    assert_eq!(Postgres::count(&db, "SELECT count(*) FROM inbox").await, 4);
}
