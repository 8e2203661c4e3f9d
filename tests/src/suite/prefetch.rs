//! Prefetch (`WorkerBuilder::prefetch`): messages fetched ahead of the concurrency wait in the
//! worker for a permit, kept from redelivery by progress acks, and run once each, in delivery
//! order; on shutdown, those still waiting go back to JetStream at once, for the next instance.

use super::graceful_shutdown::next_instance_applies;
use super::setup;
use crate::backends::{TestBackend, assert_applied_once};
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_runtime::Worker;
use inbox_testkit::{Poll, wait_until};
use std::time::{Duration, Instant};

/// Messages in each test: one runs, [`PREFETCH`] wait, the rest stay at the server.
const MESSAGES: usize = 4;

/// Fetched ahead of the one permit.
const PREFETCH: usize = 2;

/// A worker of concurrency 1 and [`PREFETCH`] on consumer `c` (made with `ack_wait`), of
/// [`MESSAGES`] published messages, whose handler holds `m-0` while the prefetched ones are
/// seen fetched at the server: started, the first message in its handler.
async fn prefetched<B: TestBackend>(
    nats: &NatsStream,
    inbox: inbox_runtime::Inbox<B::Db>,
    ack_wait: Duration,
    probe: Probe,
) -> (Worker<B::Ledger>, Running) {
    let consumer = nats.consumer("c", ack_wait).await;
    let entries: Vec<Vec<u8>> = (0..MESSAGES)
        .map(|i| Entry::new(format!("m-{i}"), 1, 1).json())
        .collect();
    nats.publish_all(entries).await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        // Prefetch is for workers without batching (the suite's batched run batches the rest).
        .batch(1, Duration::ZERO)
        .prefetch(PREFETCH)
        .build_with_state(B::Ledger::default(), probe)
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the first message in its handler and two more fetched",
        Duration::from_secs(30),
        async || {
            let info = nats.info("c").await;
            worker.state().runs() == 1 && info.num_ack_pending as usize == 1 + PREFETCH
        },
    )
    .await
    .unwrap();
    (worker, run)
}

/// The handler holds `m-0` for two `ack_wait`s while `m-1` and `m-2` wait, fetched: neither is
/// redelivered (progress acks) nor started (one permit), and `m-3` is not fetched (concurrency
/// plus prefetch). Once resumed, all four run once, in delivery order, with nothing delivered
/// twice.
async fn prefetched_messages_wait_their_turn_without_redelivery<B: TestBackend>() {
    const ACK_WAIT: Duration = Duration::from_secs(3);
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    let probe = Probe::open();
    probe.pause();
    let (worker, run) = prefetched::<B>(&nats, inbox, ACK_WAIT, probe).await;

    let held_since = Instant::now();
    let mut poll = Poll::new("two ack_waits of watching", ACK_WAIT * 6);
    while held_since.elapsed() < ACK_WAIT * 2 {
        let info = nats.info("c").await;
        assert_eq!(
            (
                info.delivered.consumer_sequence,
                info.num_redelivered,
                info.num_ack_pending as usize
            ),
            (1 + PREFETCH as u64, 0, 1 + PREFETCH),
            "{:?} after the first message started (ack_wait {ACK_WAIT:?})",
            held_since.elapsed()
        );
        assert_eq!(worker.state().runs(), 1, "a prefetched message started");
        poll.tick().await.unwrap();
    }

    worker.state().resume();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(
        (stats.acked, stats.nacked, stats.terminated),
        (MESSAGES as u64, 0, 0),
        "{stats:?}"
    );
    assert_applied_once::<B>(&db, MESSAGES as i64).await;
    let out_of_order = B::count(
        &db,
        "SELECT count(*) FROM ledger a JOIN ledger b ON a.id < b.id AND a.msg_key > b.msg_key",
    )
    .await;
    assert_eq!(out_of_order, 0, "messages ran out of delivery order");
    assert_eq!(
        nats.info("c").await.delivered.consumer_sequence,
        MESSAGES as u64,
        "a message was delivered twice"
    );
}

/// Shutdown while `m-0` runs and `m-1`, `m-2` wait: `m-0` commits and is acked, the two waiting
/// are given back with a nak (not started, not left to wait out `ack_wait`), and the next
/// instance applies them and `m-3` long before `ack_wait` could have brought them back.
async fn shutdown_gives_back_prefetched_messages<B: TestBackend>() {
    const ACK_WAIT: Duration = Duration::from_secs(60);
    let (db, inbox) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    let (first, run) = prefetched::<B>(&nats, inbox.clone(), ACK_WAIT, Probe::held(false)).await;

    run.cancel();
    let cancelled = Instant::now();
    first.state().release();
    let stats = run.join().await;
    assert_eq!(
        (stats.acked, first.state().runs()),
        (1, 1),
        "only the message in flight runs on shutdown: {stats:?}"
    );

    let run = next_instance_applies::<B>(&nats, inbox, &db, MESSAGES as i64, "the rest").await;
    assert!(cancelled.elapsed() < ACK_WAIT / 2, "too slow to tell");
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, (MESSAGES - 1) as u64, "{stats:?}");
    assert_applied_once::<B>(&db, MESSAGES as i64).await;
    // m-0 once; m-1 and m-2 to the first instance (nak'd) and to the second; m-3 once.
    assert_eq!(
        nats.info("c").await.delivered.consumer_sequence,
        (MESSAGES + PREFETCH) as u64
    );
    assert!(nats.dead_letters().await.is_empty());
}

super::behaviours!(
    prefetched_messages_wait_their_turn_without_redelivery,
    shutdown_gives_back_prefetched_messages,
);
