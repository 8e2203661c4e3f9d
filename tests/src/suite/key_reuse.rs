//! A key processed again with another payload (a producer reusing an idempotency key for another
//! request) is counted (`Stats::key_reuses`, `inbox_key_reuse_total`) and logged with both
//! payload hashes; a handler that opts in (`on_key_reuse = reject`) gets it dead-lettered; the
//! same payload again is a plain skip. Also when the duplicate waited for the original's commit.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running, wait_until};
use inbox_runtime::{Delivery, Outcome, ProcessError};
use std::sync::Arc;
use std::time::Duration;

/// How the messages ended: (acked, skipped, terminated, key reuses).
fn ends(stats: &inbox_runtime::Stats) -> (u64, u64, u64, u64) {
    (
        stats.acked,
        stats.skipped,
        stats.terminated,
        stats.key_reuses,
    )
}

/// `k` first, `k` again with the same body, `k` with another amount.
fn three() -> [Vec<u8>; 3] {
    [
        Entry::new("k", 1, 1).json(),
        Entry::new("k", 1, 1).json(),
        Entry::new("k", 1, 2).json(),
    ]
}

/// Used to be a silent skip, like an honest duplicate: counted now, and still skipped.
async fn key_reused_with_another_payload_is_counted<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all(three()).await;
    let worker = nats
        .worker(inbox, consumer)
        // One at a time, so that the copies find the first committed.
        .concurrency(1)
        .batch(1, Duration::from_millis(1))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(ends(&stats), (1, 2, 0, 1), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

/// With `on_key_reuse = reject`, the copy with another payload is dead-lettered, saying why; the
/// copy with the same payload is skipped.
async fn key_reuse_rejected_is_dead_lettered<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all(three()).await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .batch(1, Duration::from_millis(1))
        .build_with_state(B::LedgerStrict::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(ends(&stats), (1, 1, 1, 1), "{stats:?}");
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let (payload, headers) = &letters[0];
    assert_eq!(payload, &Entry::new("k", 1, 2).json());
    let error = headers.get("Inbox-Error").unwrap().as_str();
    assert!(error.contains("key reused with another payload"), "{error}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

/// The copy arrives while the original's transaction is open: its claim waits for the original's
/// commit, then finds the key taken, and with another payload.
async fn key_reuse_found_after_waiting_for_the_original<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let process = |probe: Arc<Probe>, entry: Entry| {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let delivery = Delivery::default().with_payload(&entry.json());
            inbox
                .process(&B::LedgerStrict::default(), &probe, entry, &delivery)
                .await
        })
    };
    let holder = Arc::new(Probe::held(false));
    let mut first = process(holder.clone(), Entry::new("k", 1, 1));
    tokio::select! {
        _ = holder.entered() => {}
        early = &mut first => panic!("the original finished before holding the key: {early:?}"),
    }
    let copy = process(Arc::new(Probe::open()), Entry::new("k", 1, 2));
    wait_until(
        "the copy to wait behind the original",
        Duration::from_secs(30),
        || async { B::waiting_writers(&db).await == 1 },
    )
    .await
    .unwrap();
    holder.release();
    assert!(matches!(first.await.unwrap(), Ok(Outcome::Ack)));
    match copy.await.unwrap() {
        Err(ProcessError::KeyReused {
            key,
            original,
            this,
        }) => {
            assert_eq!(key, "k");
            assert_ne!(original, this);
        }
        other => panic!("the copy with another payload ended {other:?}"),
    }
    assert_eq!(inbox.key_reuses(), 1);
    // The same payload again is a plain skip.
    let again = process(Arc::new(Probe::open()), Entry::new("k", 1, 1));
    assert!(matches!(again.await.unwrap(), Ok(Outcome::Skip)));
    assert_eq!(inbox.key_reuses(), 1);
}

/// The marker commits finished, keeping its payload's hash: on the tables whose claim inserts
/// it so, and on the partitioned one, whose finish writes both after the handler.
async fn the_marker_commits_finished_with_its_hash<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let delivery = Delivery::new("credits").with_payload(b"the body");
    let outcome = inbox
        .process(&B::Credit::default(), &(), Entry::new("k", 1, 1), &delivery)
        .await
        .expect("a credit");
    assert!(matches!(outcome, Outcome::Ack), "{outcome:?}");
    let finished =
        "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL AND payload_hash IS NOT NULL";
    assert_eq!(B::count(&db, finished).await, 1);
}

/// Both copies in one batch: the second claims nothing (the first claimed the key in the same
/// transaction, its hash not yet written) and used to be skipped unseen, also with `reject`.
async fn key_reuse_within_one_batch<B: TestBackend>() {
    for strict in [false, true] {
        let (db, inbox) = setup::<B>(4).await;
        let nats = NatsStream::create().await;
        let consumer = nats.consumer("c", Duration::from_secs(30)).await;
        nats.publish_all([Entry::new("k", 1, 1).json(), Entry::new("k", 1, 2).json()])
            .await;
        let builder = nats
            .worker(inbox, consumer)
            .concurrency(1)
            .batch(8, Duration::from_millis(500));
        let stats = if strict {
            let worker = builder
                .build_with_state(B::LedgerStrict::default(), Probe::open())
                .unwrap();
            let run = Running::start(&worker);
            nats.wait_drained("c").await;
            run.stop().await
        } else {
            let worker = builder
                .build_with_state(B::Ledger::default(), Probe::open())
                .unwrap();
            let run = Running::start(&worker);
            nats.wait_drained("c").await;
            run.stop().await
        };
        let (skipped, terminated) = if strict { (0, 1) } else { (1, 0) };
        assert_eq!(
            ends(&stats),
            (1, skipped, terminated, 1),
            "strict {strict}: {stats:?}"
        );
        assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    }
}

/// A batch writes each marker's payload hash with its `processed_at` (one statement for the
/// batch): a copy with another payload, coming after the batch committed, is told from an
/// honest duplicate.
async fn key_reused_after_its_batch_committed_is_counted<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let first = ["a", "b", "c"].map(|k| Entry::new(k, 1, 1).json());
    nats.publish_all(first).await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .batch(8, Duration::from_millis(200))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until("the batch acked", Duration::from_secs(60), async || {
        worker.stats().acked == 3
    })
    .await
    .unwrap();
    let hashed = "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL \
                  AND payload_hash IS NOT NULL";
    assert_eq!(
        B::count(&db, hashed).await,
        3,
        "every marker's hash written"
    );
    // The markers' `received_at` is their claim's (the transaction's time on PostgreSQL, the
    // statement's on MySQL and SQLite): one, so the three were one batch, claimed together (in
    // one statement on MySQL: the suite's MariaDB is 10.5 or later; Oracle MySQL and older
    // MariaDB claim a key per statement, and would fail this check).
    let claims = "SELECT count(DISTINCT received_at) FROM inbox";
    assert_eq!(
        B::count(&db, claims).await,
        1,
        "the first three not one batch"
    );
    nats.publish_all([Entry::new("b", 1, 1).json(), Entry::new("c", 1, 2).json()])
        .await;
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(ends(&stats), (3, 2, 0, 1), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 3);
}

super::behaviours!(partitioned_too;
    the_marker_commits_finished_with_its_hash,
    key_reuse_within_one_batch,
    key_reused_after_its_batch_committed_is_counted,
    key_reused_with_another_payload_is_counted,
    key_reuse_rejected_is_dead_lettered,
    key_reuse_found_after_waiting_for_the_original,
);
