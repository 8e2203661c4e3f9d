//! A delivery cannot hold its worker slot forever: lock waits are bounded and every try has a
//! deadline, after which its transaction is rolled back and the message nak'd.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::time::Duration;

/// A peer froze (SIGSTOP, a partition) inside the transaction that claimed key `k`. Its twin's
/// claim waited on that row lock with no bound (PostgreSQL has no lock timeout by default),
/// sending progress acks all the while: the twin's slot, and shutdown, were held for as long as
/// TCP keepalive let the frozen session live. Now the wait is bounded and the twin is nak'd.
async fn repro_twin_of_a_frozen_peer_waits_forever<B: TestBackend>() {
    let (db, _) = setup::<B>(4).await;
    // A deadline must be longer than the pool's acquire timeout.
    let inbox = B::inbox(B::connect_acquiring(&db.url, 4, Duration::from_millis(500)).await);
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    // The frozen peer: a transaction that inserted the marker of `k` and never finishes.
    let frozen = B::hold_in_transaction(
        &db,
        "INSERT INTO inbox (consumer, message_key) VALUES ('ledger', 'k')",
    )
    .await;
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    let worker = nats
        .worker(inbox.lock_timeout(Duration::from_secs(1)), consumer)
        .deadline(Duration::from_secs(3))
        .nak_delay(Duration::from_millis(200), Duration::from_millis(200))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the twin to be nak'd",
        Duration::from_secs(20),
        async || worker.stats().nacked >= 1,
    )
    .await
    .unwrap();
    assert_eq!(worker.stats().acked, 0);
    // The peer wakes up and rolls back: the message is applied once, on redelivery.
    frozen.rollback().await.expect("ROLLBACK");
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.terminated), (1, 0), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

/// A handler that never returns kept its message alive with progress acks forever. Past the
/// deadline its transaction is rolled back and the message nak'd.
async fn repro_hung_handler_holds_its_message_forever<B: TestBackend>() {
    let (db, _) = setup::<B>(4).await;
    // A deadline must be longer than the pool's acquire timeout.
    let inbox = B::inbox(B::connect_acquiring(&db.url, 4, Duration::from_millis(500)).await);
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    let worker = nats
        .worker(inbox, consumer)
        .deadline(Duration::from_secs(2))
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the hung delivery to be nak'd",
        Duration::from_secs(20),
        async || worker.stats().nacked >= 1,
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(stats.acked, 0, "{stats:?}");
    // Rolled back: the handler's write and the marker are gone.
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

super::behaviours!(
    repro_twin_of_a_frozen_peer_waits_forever,
    repro_hung_handler_holds_its_message_forever,
);

/// On MariaDB a worker's BEGIN claims the key in its round trip; a claim that waited out its
/// lock timeout behind a frozen peer (1205) fails that BEGIN after it began a transaction the
/// driver does not count, which is rolled back before the connection goes back to the pool:
/// every connection of the worker's pool is out of any transaction while the message waits for
/// its redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_timed_out_leaves_no_transaction_on_its_connection_on_mysql() {
    type B = crate::backends::MySql;
    let (db, _) = setup::<B>(2).await;
    let pool = B::connect_acquiring(&db.url, 2, Duration::from_millis(500)).await;
    let inbox = B::inbox(pool.clone());
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let frozen = B::hold_in_transaction(
        &db,
        "INSERT INTO inbox (consumer, message_key) VALUES ('ledger', 'k')",
    )
    .await;
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    // No redelivery while the pool is looked at.
    let worker = nats
        .worker(inbox.lock_timeout(Duration::from_secs(1)), consumer)
        .deadline(Duration::from_secs(3))
        .nak_delay(Duration::from_secs(60), Duration::from_secs(60))
        .build_with_state(<B as TestBackend>::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the twin to be nak'd",
        Duration::from_secs(20),
        async || worker.stats().nacked >= 1,
    )
    .await
    .unwrap();
    super::assert_no_transaction_left_on_mysql(&pool, 2).await;
    frozen.rollback().await.expect("ROLLBACK");
    let stats = run.stop().await;
    assert_eq!(stats.acked, 0, "{stats:?}");
}
