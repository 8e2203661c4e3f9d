//! Two instances (each its own pool and NATS connection) on one durable consumer, 1,000 unique
//! messages each published twice without broker dedup: exactly 1,000 effects and 1,000 markers,
//! and afterwards nothing pending.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::time::Duration;

const UNIQUE: usize = 1_000;

/// The test.
async fn two_instances_apply_each_message_once<B: TestBackend>() {
    let (db, _) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;

    // Each message twice, the copy right behind the original, as a producer retry would send it:
    // the twins often land on different instances at the same time.
    let entries: Vec<Entry> = (0..UNIQUE)
        .map(|i| Entry::new(format!("m-{i}"), (i % 10) as i64, 1))
        .collect();
    nats.publish_all(entries.iter().flat_map(|e| [e.json(), e.json()]))
        .await;

    let mut workers = Vec::new();
    for _ in 0..2 {
        let inbox = B::inbox(B::connect(&db.url, 8).await);
        let consumer = nats.consumer_on_new_connection("c").await;
        let worker = nats
            .worker(inbox, consumer)
            .build_with_state(B::Ledger::default(), Probe::open())
            .unwrap();
        let run = Running::start(&worker);
        workers.push((worker, run));
    }
    wait_until(
        "every delivery to be handled",
        Duration::from_secs(180),
        || async {
            let done: u64 = workers
                .iter()
                .map(|(w, _)| w.stats().acked + w.stats().skipped)
                .sum();
            done >= 2 * UNIQUE as u64
        },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let mut acked = 0;
    let mut skipped = 0;
    for (_, run) in workers {
        let stats = run.stop().await;
        assert!(stats.acked > 0, "an instance did no work: {stats:?}");
        acked += stats.acked;
        skipped += stats.skipped;
    }
    assert_eq!(acked, UNIQUE as u64);
    assert_eq!(skipped, UNIQUE as u64);
    let rows = B::count(&db, "SELECT count(*) FROM ledger").await;
    assert_eq!(rows, UNIQUE as i64);
    let keys = B::count(&db, "SELECT count(DISTINCT msg_key) FROM ledger").await;
    assert_eq!(keys, UNIQUE as i64);
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM inbox").await,
        UNIQUE as i64
    );
    let info = nats.info("c").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
}

super::behaviours!(
    partitioned_too;
    two_instances_apply_each_message_once);
