//! Shutdown while a handler is in flight: the worker stops pulling, the in-flight handler commits
//! and acks, and what was not started goes back to JetStream at once, for the next instance,
//! rather than waiting out `ack_wait`.

use super::setup;
use crate::backends::{TestBackend, TestDb};
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_runtime::{Inbox, Worker};
use inbox_testkit::wait_until;
use std::time::{Duration, Instant};

/// Long enough that nothing in these tests can come back by waiting it out: whatever comes back
/// within [`BACK_WITHIN`] was given back by the worker.
const ACK_WAIT: Duration = Duration::from_secs(60);

/// How soon, after the shutdown began, what was not started must be done by the next instance:
/// a third of [`ACK_WAIT`], generous for a loaded machine and still far from a redelivery by
/// timeout.
const BACK_WITHIN: Duration = Duration::from_secs(20);

/// The next instance, started on consumer `c` (on a connection of its own) once the first has
/// stopped, running once it has applied `what`: the ledger holds `rows`, within [`BACK_WITHIN`].
pub(super) async fn next_instance_applies<B: TestBackend>(
    nats: &NatsStream,
    inbox: Inbox<B::Db>,
    db: &TestDb<B::Db>,
    rows: i64,
    what: &str,
) -> Running {
    let next = nats
        .worker(inbox, nats.consumer_on_new_connection("c").await)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&next);
    wait_until(
        &format!("the next instance to apply {what}"),
        BACK_WITHIN,
        async || B::count(db, "SELECT count(*) FROM ledger").await == rows,
    )
    .await
    .unwrap();
    run
}

/// Concurrency 1: the shutdown comes while the only permit is in a handler, so nothing else was
/// fetched; the next instance finds the rest waiting for it.
async fn shutdown_finishes_in_flight_and_leaves_the_rest<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    nats.consumer("c", ACK_WAIT).await;
    let entries: Vec<Vec<u8>> = (0..5)
        .map(|i| Entry::new(format!("m-{i}"), 1, 1).json())
        .collect();
    nats.publish_all(entries).await;

    // First instance: its handler holds the first message until the shutdown has begun.
    let first = nats
        .worker(inbox.clone(), nats.consumer_on_new_connection("c").await)
        .concurrency(1)
        // What is counted here is one message per permit, as without batching.
        .batch(1, Duration::ZERO)
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
    let cancelled = Instant::now();
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
    let run = next_instance_applies::<B>(&nats, inbox, &db, 5, "the rest").await;
    assert!(cancelled.elapsed() < ACK_WAIT / 2, "too slow to tell");
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 4, "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 5);
    assert_eq!(
        nats.info("c").await.delivered.consumer_sequence,
        5,
        "a message was delivered twice"
    );
}

/// A first instance with `concurrency` permits whose handler holds `m-0` (published here) at the
/// gate, the other permits being one pull request seen waiting at the server; started, not yet
/// cancelled.
async fn held_with_an_open_pull<B: TestBackend>(
    nats: &NatsStream,
    inbox: &Inbox<B::Db>,
    concurrency: usize,
    fetch_expiry: Duration,
) -> (Worker<B::Ledger>, Running) {
    nats.consumer("c", ACK_WAIT).await;
    nats.publish_all([Entry::new("m-0", 1, 1).json()]).await;
    let first = nats
        .worker(inbox.clone(), nats.consumer_on_new_connection("c").await)
        .concurrency(concurrency)
        // What is counted here is one message per permit, as without batching.
        .batch(1, Duration::ZERO)
        .fetch_expiry(fetch_expiry)
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    assert_eq!(first.concurrency(), concurrency);
    let run = Running::start(&first);
    tokio::time::timeout(Duration::from_secs(30), first.state().entered())
        .await
        .expect("the handler did not start within 30 s");
    // m-0 holds one permit in its handler; the others are one pull request waiting at the server.
    wait_until(
        "the free permits' pull request to wait at the server",
        Duration::from_secs(30),
        async || {
            let info = nats.info("c").await;
            (info.num_waiting, info.num_ack_pending) == (1, 1)
        },
    )
    .await
    .unwrap();
    (first, run)
}

/// Concurrency 2, one handler held: the free permit keeps a pull request for one message open at
/// the server. The pull loop never asks for more than its free permits, so a message is fetched
/// but not started only when such a pull is open as the shutdown begins and brings a message
/// afterwards. The test makes that happen in that order: the pull is seen waiting at the server,
/// then the shutdown begins, then more messages than permits are published, of which the open
/// pull brings exactly one. That one must be nak'd at once: the next instance processes it, and
/// the rest, long before `ack_wait` could have brought it back.
async fn shutdown_gives_back_what_a_pull_brings<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    // The pull stays open through the test (it ends when it has brought its message): the
    // message it brings after the shutdown began cannot slip past it into a later pull.
    let (first, run) = held_with_an_open_pull::<B>(&nats, &inbox, 2, ACK_WAIT / 2).await;

    run.cancel();
    let cancelled = Instant::now();
    // Three more messages than the worker can take: the open pull brings the first of them (m-1),
    // fetched after the shutdown began and so never started.
    let rest: Vec<Vec<u8>> = (1..4)
        .map(|i| Entry::new(format!("m-{i}"), 1, 1).json())
        .collect();
    nats.publish_all(rest).await;
    wait_until(
        "the open pull to bring one message",
        Duration::from_secs(30),
        async || nats.info("c").await.delivered.consumer_sequence == 2,
    )
    .await
    .unwrap();
    assert!(
        !run.is_finished(),
        "the worker stopped with a handler in flight"
    );
    assert_eq!(first.state().runs(), 1, "a message started after shutdown");

    // The first instance finishes m-0, and only m-0.
    first.state().release();
    let stats = run.join().await;
    assert_eq!(
        (stats.acked, stats.skipped, stats.nacked, stats.terminated),
        (1, 0, 0, 0),
        "the in-flight message was not finished alone: {stats:?}"
    );
    assert_eq!(first.state().runs(), 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);

    // The next instance gets m-1 back at once, not after ack_wait, and does m-1..m-3.
    let what =
        "m-1..m-3 (m-1, fetched but not started, must be nak'd on shutdown, not left to ack_wait)";
    let run = next_instance_applies::<B>(&nats, inbox, &db, 4, what).await;
    let since_cancel = cancelled.elapsed();
    assert!(
        since_cancel < ACK_WAIT / 2,
        "back only {since_cancel:?} after the shutdown: too slow to tell from ack_wait"
    );
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 3, "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 4);
    // m-0 once, m-1 twice (the nak'd fetch, then the next instance), m-2 and m-3 once.
    assert_eq!(nats.info("c").await.delivered.consumer_sequence, 5);
}

/// Concurrency 8, one handler held: the seven free permits are one pull request for seven
/// messages, open at the server as the shutdown begins. One message published then is brought by
/// that pull and nak'd without delay, so the server delivered it straight back to the same open
/// pull, again and again: five deliveries (max_deliver) within moments, and the message was gone,
/// neither applied nor dead-lettered. Now the nak's delay outlasts the pull.
async fn repro_shutdown_nak_spends_every_delivery<B: TestBackend>() {
    let (db, inbox) = setup::<B>(8).await;
    let nats = NatsStream::create().await;
    let (first, run) = held_with_an_open_pull::<B>(&nats, &inbox, 8, Duration::from_secs(5)).await;
    run.cancel();
    nats.publish_all([Entry::new("m-1", 1, 1).json()]).await;
    wait_until(
        "the open pull to bring m-1",
        Duration::from_secs(30),
        async || nats.info("c").await.delivered.consumer_sequence >= 2,
    )
    .await
    .unwrap();
    first.state().release();
    let stats = run.join().await;
    assert_eq!(stats.acked, 1, "{stats:?}");

    let run = next_instance_applies::<B>(&nats, inbox, &db, 2, "m-1").await;
    run.stop().await;
    // m-0 once; m-1 to the first instance (nak'd) and to the second.
    assert_eq!(nats.info("c").await.delivered.consumer_sequence, 3);
    assert!(nats.dead_letters().await.is_empty());
}

super::behaviours!(
    repro_shutdown_nak_spends_every_delivery,
    shutdown_finishes_in_flight_and_leaves_the_rest,
    shutdown_gives_back_what_a_pull_brings,
);
