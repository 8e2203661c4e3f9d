//! What a failing handler's message comes to: a transient failure is retried in-process (same
//! delivery, fresh transaction); a permanent one is dead-lettered at once; an unrecognised one is
//! redelivered until `max_deliver`, then dead-lettered; and a dead letter that cannot be stored
//! leaves the message with JetStream.

use super::setup;
use crate::backends::{TestBackend, TestDb};
use crate::handlers::{Entry, Failure, Probe};
use crate::{MAX_DELIVER, NatsStream, Running};
use inbox_runtime::{Stats, WorkerBuilder};
use inbox_testkit::wait_until;
use std::time::Duration;

/// A fresh database and stream with one message, consumed by a worker (`configure`d) whose
/// handler fails as `probe` says, until `done` holds; returns what the worker did.
async fn run_one<B: TestBackend>(
    probe: Probe,
    configure: impl FnOnce(&NatsStream, WorkerBuilder<B::Db>) -> WorkerBuilder<B::Db>,
    done: impl Fn(Stats) -> bool,
) -> (TestDb<B::Db>, NatsStream, Stats) {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    let fast_naks = nats
        .worker(inbox, consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10));
    let worker = configure(&nats, fast_naks)
        .build_with_state(B::Ledger::default(), probe)
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the expected outcome",
        Duration::from_secs(60),
        async || done(worker.stats()),
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    (db, nats, stats)
}

/// A handler failing every time with `failure`: waits for its one dead letter and returns its
/// headers.
async fn dead_lettered<B: TestBackend>(
    failure: Failure,
) -> (TestDb<B::Db>, Stats, async_nats::HeaderMap) {
    let probe = Probe::failing(usize::MAX, failure);
    let (db, nats, stats) = run_one::<B>(probe, |_, b| b, |s| s.terminated == 1).await;
    nats.wait_drained("c").await;
    let mut letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    (db, stats, letters.remove(0).1)
}

/// Transient: retried at once, in the same delivery.
async fn transient_failure_is_retried_in_process<B: TestBackend>() {
    let probe = Probe::failing(2, Failure::Transient);
    let (db, nats, stats) = run_one::<B>(probe, |_, b| b.attempts(3), |s| s.acked == 1).await;
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
    let (db, stats, headers) = dead_lettered::<B>(Failure::Permanent).await;
    assert_eq!(stats.nacked, 0, "{stats:?}");
    let reason = headers.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(reason.contains("handler failed"), "{reason}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// A panicking handler used to kill its task with neither ack nor nak: redelivered until
/// `max_deliver`, then gone without a dead letter. Now a permanent failure: dead-lettered at once
/// with the panic's text, and the worker goes on.
async fn repro_panicking_handler_is_lost<B: TestBackend>() {
    let (db, stats, headers) = dead_lettered::<B>(Failure::Panic).await;
    assert_eq!(stats.nacked, 0, "{stats:?}");
    let reason = headers.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(reason.contains("panicked on purpose"), "{reason}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// Unrecognised: redelivered until max_deliver, then dead-lettered.
async fn failure_is_dead_lettered_at_max_deliver<B: TestBackend>() {
    let (db, stats, headers) = dead_lettered::<B>(Failure::Plain).await;
    assert_eq!(stats.nacked, MAX_DELIVER as u64 - 1, "{stats:?}");
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
    // The "dead-letter stream" is the main stream, which does not hold the dead-letter subject:
    // the publish finds no stream and fails.
    // One nak with a long delay: with short ones the message could reach max_deliver before the
    // worker stops, and what happens to an unstorable letter on the last delivery is not this
    // test's question.
    let nowhere = |nats: &NatsStream, builder: WorkerBuilder<B::Db>| {
        let subject = format!("nowhere.{}", nats.stream.to_lowercase());
        builder
            .dead_letters(nats.stream.clone(), subject)
            .nak_delay(Duration::from_secs(60), Duration::from_secs(60))
    };
    let probe = Probe::failing(usize::MAX, Failure::Permanent);
    let (_db, nats, stats) = run_one::<B>(probe, nowhere, |s| s.nacked >= 1).await;
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
    unstorable_dead_letter_leaves_the_message,
    repro_panicking_handler_is_lost,
);
