//! What a failing handler's message comes to: a transient failure is retried in-process (same
//! delivery, fresh transaction); a permanent one is dead-lettered at once; an unrecognised one is
//! redelivered until `max_deliver`, then dead-lettered; and a dead letter that cannot be stored
//! leaves the message with JetStream.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Failure, Probe};
use crate::{MAX_DELIVER, NatsStream, Running};
use inbox_runtime::{Stats, WorkerBuilder};
use inbox_testkit::wait_until;
use std::time::Duration;

/// Runs `builder`'s worker with `probe` on one published message until `done` holds.
async fn run_one<B: TestBackend>(
    nats: &NatsStream,
    builder: WorkerBuilder<B::Db>,
    probe: Probe,
    done: impl Fn(Stats) -> bool,
) -> Stats {
    nats.publish_all([Entry {
        key: "k".into(),
        account: 1,
        amount: 1,
    }
    .json()])
        .await;
    let worker = builder
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .build_with_state(B::Ledger::default(), probe)
        .unwrap();
    let run = Running::start(&worker);
    wait_until("the expected outcome", Duration::from_secs(60), || async {
        done(worker.stats())
    })
    .await
    .unwrap();
    run.stop().await
}

/// Transient: retried at once, in the same delivery.
async fn transient_failure_is_retried_in_process<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let builder = nats.worker(inbox, consumer).attempts(3);
    let stats = run_one::<B>(&nats, builder, Probe::failing(2, Failure::Transient), |s| {
        s.acked == 1
    })
    .await;
    nats.wait_drained("c").await;
    assert_eq!(stats.nacked, 0, "{stats:?}");
    assert_eq!(
        nats.info("c").await.delivered.consumer_sequence,
        1,
        "redelivered"
    );
    // The two failed attempts rolled back their writes and their claims.
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}

/// Permanent: dead-lettered at once.
async fn permanent_failure_is_dead_lettered_at_once<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let builder = nats.worker(inbox, consumer);
    let stats = run_one::<B>(
        &nats,
        builder,
        Probe::failing(usize::MAX, Failure::Permanent),
        |s| s.terminated == 1,
    )
    .await;
    nats.wait_drained("c").await;
    assert_eq!(stats.nacked, 0, "{stats:?}");
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let reason = letters[0].1.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(reason.contains("handler failed"), "{reason}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// Unrecognised: redelivered until max_deliver, then dead-lettered.
async fn failure_is_dead_lettered_at_max_deliver<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let builder = nats.worker(inbox, consumer);
    let stats = run_one::<B>(
        &nats,
        builder,
        Probe::failing(usize::MAX, Failure::Plain),
        |s| s.terminated == 1,
    )
    .await;
    nats.wait_drained("c").await;
    assert_eq!(stats.nacked, MAX_DELIVER as u64 - 1, "{stats:?}");
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let headers = &letters[0].1;
    assert_eq!(
        headers.get("Inbox-Delivered").unwrap().as_str(),
        MAX_DELIVER.to_string()
    );
    let reason = headers.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(reason.contains("max_deliver"), "{reason}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 0);
}

/// A dead letter that cannot be stored: the original is nak'd, never termed.
async fn unstorable_dead_letter_leaves_the_message<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    // The "dead-letter stream" is the main stream, which does not hold the dead-letter subject:
    // the publish finds no stream and fails.
    let builder = WorkerBuilder::new(inbox, consumer).dead_letters(
        nats.stream.clone(),
        format!("nowhere.{}", nats.stream.to_lowercase()),
    );
    let stats = run_one::<B>(
        &nats,
        builder,
        Probe::failing(usize::MAX, Failure::Permanent),
        |s| s.nacked >= 2,
    )
    .await;
    assert_eq!(stats.terminated, 0, "{stats:?}");
    let info = nats.info("c").await;
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "the message was acked or termed"
    );
    assert_eq!(info.num_pending + info.num_ack_pending as u64, 1);
}

super::behaviours!(
    transient_failure_is_retried_in_process,
    permanent_failure_is_dead_lettered_at_once,
    failure_is_dead_lettered_at_max_deliver,
    unstorable_dead_letter_leaves_the_message
);
