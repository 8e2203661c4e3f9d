//! The process commits and "dies" before the ack: the redelivery finds the marker, is a Skip and
//! is acked; the effect stays single. The key here is the transport id (`stream:sequence`), which
//! must be the same for the redelivery.

use futures::StreamExt;
use inbox_runtime::{Inbox, Outcome, WorkerBuilder, process_delivery};
use inbox_tests::handlers::{Entry, create_tables, ledger_by_transport_id};
use inbox_tests::{NatsStream, PgDb, wait_until};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn committed_but_not_acked_is_skipped_on_redelivery() {
    let db = PgDb::create(4).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;
    let nats = NatsStream::create().await;
    // A short ack_wait, so that the unacked delivery comes back quickly.
    let consumer = nats.consumer("c", Duration::from_secs(1)).await;
    nats.publish_all([Entry {
        key: "k".into(),
        account: 1,
        amount: 10,
    }
    .json()])
        .await;

    // The first instance commits and never acks.
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let first = batch.next().await.expect("a delivery").unwrap();
    assert_eq!(
        process_delivery(&inbox, &ledger_by_transport_id, &(), &first)
            .await
            .unwrap(),
        Outcome::Ack
    );
    drop(first);
    drop(batch);

    let worker = WorkerBuilder::new(inbox, consumer)
        .build(ledger_by_transport_id)
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (worker, shutdown) = (worker.clone(), shutdown.clone());
        async move { worker.run_until(shutdown).await }
    });
    wait_until(
        "the redelivery to be skipped",
        Duration::from_secs(60),
        || async { worker.stats().skipped == 1 },
    )
    .await;
    nats.wait_drained("c").await;
    shutdown.cancel();
    let stats = run.await.unwrap();
    assert_eq!(stats.acked, 0);
    assert_eq!(stats.skipped, 1);
    // Two deliveries of the one stored message: the original and the redelivery.
    let info = nats.info("c").await;
    assert_eq!(info.delivered.stream_sequence, 1);
    assert_eq!(info.delivered.consumer_sequence, 2);
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 1);
}
