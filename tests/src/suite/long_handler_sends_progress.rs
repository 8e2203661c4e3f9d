//! A handler that runs longer than `ack_wait` keeps its message: the worker sends progress acks,
//! so the server does not redeliver it (to this or another instance) while it works.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use futures::StreamExt;
use inbox_testkit::{Poll, wait_until};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The consumer's `ack_wait`. The worker sends a progress ack every third of it, so a progress
/// ack may come up to two thirds of it late before the server redelivers: seconds of slack on
/// a loaded machine, where the polls below look every 200 ms at most.
const ACK_WAIT: Duration = Duration::from_secs(5);

/// How long the handler holds: two `ack_wait`s, so that without progress acks the message would
/// certainly have been redelivered once.
const HOLD: Duration = Duration::from_secs(10);

/// Counts the acks of `durable`'s messages on `stream` whose body is `kind` (`+WPI`: progress),
/// as the worker sends them: a plain subscription to the consumer's ack subjects.
async fn count_acks(nats: &NatsStream, durable: &str, kind: &'static [u8]) -> Arc<AtomicUsize> {
    let subject = format!("$JS.ACK.{}.{durable}.>", nats.stream);
    let mut acks = nats
        .client
        .subscribe(subject.clone())
        .await
        .unwrap_or_else(|e| panic!("NATS: cannot subscribe to {subject}: {e}"));
    // The server has the subscription before the worker starts.
    nats.client.flush().await.expect("NATS: flush");
    let count = Arc::new(AtomicUsize::new(0));
    tokio::spawn({
        let count = count.clone();
        async move {
            while let Some(ack) = acks.next().await {
                if ack.payload.as_ref() == kind {
                    count.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    });
    count
}

/// The test.
async fn long_handler_is_not_redelivered<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", ACK_WAIT).await;
    let progress = count_acks(&nats, "c", b"+WPI").await;
    nats.publish_all([Entry::new("slow", 1, 1).json()]).await;
    // Room for a redelivery to start, were one sent.
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(2)
        .build_with_state(B::Ledger::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&worker);
    tokio::time::timeout(Duration::from_secs(30), worker.state().entered())
        .await
        .expect("the handler did not start within 30 s");
    // The scenario itself: the handler holds at the gate for two ack_waits, its transaction open.
    // At every look the message has been delivered once and is still awaiting its ack.
    let held_since = Instant::now();
    let mut poll = Poll::new("the handler to have held for two ack_waits", HOLD * 3);
    while held_since.elapsed() < HOLD {
        let info = nats.info("c").await;
        assert_eq!(
            (info.delivered.consumer_sequence, info.num_redelivered),
            (1, 0),
            "the message was redelivered {:?} after its handler started, ack_wait {ACK_WAIT:?}",
            held_since.elapsed(),
        );
        // The handler's transaction is still open: nothing may have been acked yet.
        assert_eq!(
            (info.ack_floor.stream_sequence, info.num_ack_pending),
            (0, 1),
            "acked before its effect was committed"
        );
        poll.tick().await.unwrap();
    }
    assert_eq!(worker.state().runs(), 1, "the handler ran twice");
    // What kept it: at least one progress ack in each ack_wait the handler held.
    let sent = progress.load(Ordering::SeqCst);
    assert!(
        sent >= 2,
        "{sent} progress acks in {HOLD:?} with ack_wait {ACK_WAIT:?}"
    );

    worker.state().release();
    wait_until("the ack", Duration::from_secs(30), async || {
        worker.stats().acked == 1
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(
        (stats.acked, stats.skipped, stats.nacked, stats.terminated),
        (1, 0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(worker.state().runs(), 1);
    let info = nats.info("c").await;
    assert_eq!(
        (info.delivered.consumer_sequence, info.num_redelivered),
        (1, 0),
        "redelivered after all"
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

super::behaviours!(long_handler_is_not_redelivered);
