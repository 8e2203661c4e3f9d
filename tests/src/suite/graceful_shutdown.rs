//! Shutdown while a handler is in flight: the worker stops pulling, the in-flight handler commits
//! and acks, and what was not started stays with JetStream for the next instance.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use std::time::Duration;

/// The test.
async fn shutdown_finishes_in_flight_and_leaves_the_rest<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;
    let entries: Vec<Vec<u8>> = (0..5)
        .map(|i| Entry::new(format!("m-{i}"), 1, 1).json())
        .collect();
    nats.publish_all(entries).await;

    // First instance: its handler holds the first message until the shutdown has begun.
    let first = nats
        .worker(inbox.clone(), nats.consumer_on_new_connection("c").await)
        .concurrency(1)
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&first);
    // In flight means the handler runs, not merely that the server delivered the message: a
    // message the pull loop has not handed to a task when the shutdown comes is nak'd instead.
    tokio::time::timeout(Duration::from_secs(30), first.state().entered())
        .await
        .expect("the handler did not start within 30 s");
    assert_eq!(nats.info("c").await.num_ack_pending, 1);
    run.cancel();
    assert!(
        !run.is_finished(),
        "the worker stopped with a handler in flight"
    );
    first.state().release();
    let stats = run.join().await;
    assert_eq!(
        stats.acked, 1,
        "the in-flight message was not finished: {stats:?}"
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);

    // Second instance: picks up the rest at once (nothing waits out ack_wait).
    let second = nats
        .worker(inbox, nats.consumer_on_new_connection("c").await)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&second);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 4, "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 5);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 5);
}

super::behaviours!(shutdown_finishes_in_flight_and_leaves_the_rest);
