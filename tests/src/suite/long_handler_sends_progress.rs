//! A handler that runs longer than `ack_wait` keeps its message: the worker sends progress acks,
//! so the server does not redeliver it (to this or another instance) while it works.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::time::{Duration, Instant};

/// The test.
async fn long_handler_is_not_redelivered<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let ack_wait = Duration::from_secs(1);
    let consumer = nats.consumer("c", ack_wait).await;
    nats.publish_all([Entry::new("slow", 1, 1).json()]).await;
    // Room for a redelivery to start, were one sent.
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(2)
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&worker);
    worker.state().entered().await;
    // The scenario itself: the handler holds for four times ack_wait.
    let held_since = Instant::now();
    wait_until(
        "four ack_waits to pass",
        Duration::from_secs(30),
        || async { held_since.elapsed() > ack_wait * 4 },
    )
    .await
    .unwrap();
    let info = nats.info("c").await;
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "the message was redelivered while its handler ran"
    );
    // The handler's transaction is still open: nothing may have been acked yet.
    assert_eq!(
        (info.ack_floor.stream_sequence, info.num_ack_pending),
        (0, 1),
        "acked before its effect was committed"
    );
    worker.state().release();
    wait_until("the ack", Duration::from_secs(30), || async {
        worker.stats().acked == 1
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    run.stop().await;
    assert_eq!(worker.state().runs(), 1);
    assert_eq!(nats.info("c").await.delivered.consumer_sequence, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

super::behaviours!(long_handler_is_not_redelivered);
