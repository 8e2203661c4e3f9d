//! The process commits and "dies" before the ack: the redelivery finds the marker, is a Skip and
//! is acked; the effect stays single. The key here is the transport id (`stream:sequence`), which
//! must be the same for the redelivery.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use inbox_runtime::{Outcome, process_delivery};
use inbox_testkit::wait_until;
use std::time::Duration;

/// The test.
async fn committed_but_not_acked_is_skipped_on_redelivery<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    // A short ack_wait, so that the unacked delivery comes back quickly.
    let consumer = nats.consumer("c", Duration::from_secs(1)).await;
    nats.publish_all([Entry::new("k", 1, 10).json()]).await;
    let handler = B::LedgerByTransportId::default();

    // The first instance commits and never acks.
    let first = crate::first_delivery(&consumer).await;
    assert_eq!(
        process_delivery(&inbox, &handler, &(), &first)
            .await
            .unwrap(),
        Outcome::Ack
    );
    drop(first);

    let worker = nats.worker(inbox, consumer).build(handler).unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the redelivery to be skipped",
        Duration::from_secs(60),
        || async { worker.stats().skipped == 1 },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 0);
    assert_eq!(stats.skipped, 1);
    // Two deliveries of the one stored message: the original and the redelivery.
    let info = nats.info("c").await;
    assert_eq!(info.delivered.stream_sequence, 1);
    assert_eq!(info.delivered.consumer_sequence, 2);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}

super::behaviours!(
    partitioned_too;
    committed_but_not_acked_is_skipped_on_redelivery);

/// On MariaDB a worker's BEGIN claims the key in its round trip, and a duplicate fails that
/// BEGIN after it began a transaction the driver does not count: the transaction is rolled back
/// before the connection goes on. Every connection of the pool, once the worker stopped, is out
/// of any transaction (a connection left inside one would run the pool's next user's statements
/// in it, uncommitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_leaves_no_transaction_on_its_connection_on_mysql() {
    type B = crate::backends::MySql;
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(1)).await;
    nats.publish_all([Entry::new("k", 1, 10).json()]).await;
    let handler = <B as TestBackend>::LedgerByTransportId::default();
    let first = crate::first_delivery(&consumer).await;
    let done = process_delivery(&inbox, &handler, &(), &first).await;
    assert_eq!(done.unwrap(), Outcome::Ack);
    drop(first);
    let worker = nats.worker(inbox, consumer).build(handler).unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the redelivery to be skipped",
        Duration::from_secs(60),
        || async { worker.stats().skipped == 1 },
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(stats.skipped, 1, "{stats:?}");
    super::assert_no_transaction_left_on_mysql(&db.pool, 2).await;
}
