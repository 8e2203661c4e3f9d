//! A consumer's `max_deliver` changed while a worker runs (a rolling deploy that lowers it) is
//! seen: the worker reads it again and acts on the lower of its last two reads. Acting on the
//! limit read at start, it nak'd the delivery the server made last, and a nak on the last
//! delivery is never redelivered: the message was neither applied nor dead-lettered. (The rule
//! itself, a raise confirmed by a second read, a consumer updated to no limit: the unit tests
//! of `inbox-runtime`'s `worker/max_deliver.rs`.)

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Failure, Probe};
use crate::{MAX_DELIVER, NatsStream, Running};
use async_nats::jetstream::consumer::pull;
use inbox_runtime::Worker;
use inbox_testkit::wait_until;
use std::time::Duration;

/// The consumer's `ack_wait`: long, so that only naks bring the message back.
const ACK_WAIT: Duration = Duration::from_secs(30);

/// How long each wait may take.
const DEADLINE: Duration = Duration::from_secs(60);

/// A stream with one message, consumed by a worker whose handler always fails (naks of 10 ms, the
/// limit read every 50 ms), paused at the gate on its first run; returns them with the run.
async fn failing_worker<B: TestBackend>(
    inbox: inbox_runtime::Inbox<B::Db>,
) -> (NatsStream, Worker<B::Ledger>, Running) {
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", ACK_WAIT).await;
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    let probe = Probe::failing(usize::MAX, Failure::Plain);
    probe.pause();
    let worker = nats
        .worker(inbox, consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .max_deliver_every(Duration::from_millis(50))
        .build_with_state(B::Ledger::default(), probe)
        .unwrap();
    assert_eq!(worker.max_deliver(), MAX_DELIVER);
    let run = Running::start(&worker);
    wait_until("delivery 1 to run", DEADLINE, async || {
        worker.state().runs() >= 1
    })
    .await
    .unwrap();
    (nats, worker, run)
}

/// Updates consumer `c` of `nats` to `max_deliver`, as an operator would.
async fn set_max_deliver(nats: &NatsStream, max_deliver: i64) {
    let stream = nats.js.get_stream(&nats.stream).await.expect("get stream");
    stream
        .create_consumer(pull::Config {
            durable_name: Some("c".into()),
            ack_wait: ACK_WAIT,
            max_deliver,
            ..Default::default()
        })
        .await
        .expect("update the consumer");
    assert_eq!(nats.info("c").await.config.max_deliver, max_deliver);
}

/// Waits for the worker's one dead letter, stops it, and returns the delivery the letter names.
async fn lettered_at<B: TestBackend>(nats: &NatsStream, worker: &Worker<B::Ledger>) -> String {
    wait_until("the message to be dead-lettered", DEADLINE, async || {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1, "one dead letter");
    let delivered = letters[0]
        .1
        .get("Inbox-Delivered")
        .expect("Inbox-Delivered");
    delivered.as_str().to_owned()
}

/// Lowered from 5 to 2 while delivery 1 runs: delivery 2, the server's last, is dead-lettered.
async fn a_lowered_max_deliver_is_acted_on<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let (nats, worker, run) = failing_worker::<B>(inbox).await;
    set_max_deliver(&nats, 2).await;
    wait_until("the worker to act on max_deliver 2", DEADLINE, async || {
        worker.max_deliver() == 2
    })
    .await
    .unwrap();
    worker.state().resume();
    assert_eq!(lettered_at::<B>(&nats, &worker).await, "2");
    let stats = run.stop().await;
    assert_eq!((stats.nacked, stats.terminated), (1, 1), "{stats:?}");
}

super::behaviours!(a_lowered_max_deliver_is_acted_on);
