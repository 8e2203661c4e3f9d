//! A worker's tries keep their connections from one message to the next (no release check, a
//! round trip, per message), yet never starve the pool's other users: one connection at least
//! goes round through the pool, where whoever waits gets it in turn; and kept connections go back
//! to the pool once idle.

use super::setup;
use crate::backends::{TestBackend, assert_applied_once};
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::future::Future;
use std::task::Poll;
use std::time::Duration;

const MESSAGES: usize = 4;

/// Both connections of a pool of two held by the worker's two tries (held in the handler, or,
/// with a single writer, waiting for the write lock behind it), another user of the pool waits
/// for one; a try finishes: its connection goes to that user, not to the worker's next try,
/// while the other try is still held. Once drained, every connection is idle in the pool again.
async fn a_busy_worker_leaves_the_pool_a_connection_going_round<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(60)).await;
    nats.publish_all(
        (0..MESSAGES)
            .map(|i| Entry::new(format!("m-{i}"), 1, 1).json())
            .collect::<Vec<Vec<u8>>>(),
    )
    .await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(2)
        .batch(1, Duration::ZERO)
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&worker);
    let in_handler = if B::SINGLE_WRITER { 1 } else { 2 };
    wait_until(
        "both tries on a connection, the first in its handler",
        Duration::from_secs(30),
        async || {
            worker.state().runs() == in_handler && db.pool.size() == 2 && db.pool.num_idle() == 0
        },
    )
    .await
    .unwrap();

    // In the pool's queue before a try finishes.
    let acquire = db.pool.acquire();
    tokio::pin!(acquire);
    assert!(
        matches!(
            std::future::poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await,
            Poll::Pending
        ),
        "a connection was free while both tries held one"
    );
    worker.state().release();
    let other = tokio::time::timeout(Duration::from_secs(30), &mut acquire)
        .await
        .expect("the pool's other user starved while the worker kept its connections")
        .expect("a connection");
    assert!(
        worker.state().runs() < MESSAGES,
        "the worker ran everything before the other user got a connection"
    );
    drop(other);

    let mut poll = inbox_testkit::Poll::new("the backlog drained", Duration::from_secs(60));
    while let info = nats.info("c").await
        && (info.num_ack_pending > 0 || info.num_pending > 0)
    {
        worker.state().release();
        poll.tick().await.unwrap();
    }
    assert_applied_once::<B>(&db, MESSAGES as i64).await;
    wait_until(
        "the kept connections back in the pool once idle",
        Duration::from_secs(30),
        async || db.pool.num_idle() == db.pool.size() as usize,
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(
        (stats.acked, stats.nacked, stats.terminated),
        (MESSAGES as u64, 0, 0),
        "{stats:?}"
    );
}

super::behaviours!(a_busy_worker_leaves_the_pool_a_connection_going_round);
