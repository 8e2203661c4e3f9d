//! A payload that does not decode, or whose key is empty or too long, is terminated, and the
//! messages behind it are processed.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, wait_until};
use inbox_runtime::WorkerBuilder;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The test.
pub async fn poison_is_terminated_and_does_not_block<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let entry = |key: String| {
        Entry {
            key,
            account: 1,
            amount: 1,
        }
        .json()
    };
    let mut payloads = vec![
        b"{not json".to_vec(),
        br#"{"key": "wrong shape"}"#.to_vec(),
        entry(String::new()),
        entry("x".repeat(256)),
    ];
    payloads.extend((0..5).map(|i| entry(format!("good-{i}"))));
    nats.publish_all(payloads).await;

    // One at a time: the poison at the head must not block what follows.
    let worker = WorkerBuilder::new(inbox, consumer)
        .concurrency(1)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (worker, shutdown) = (worker.clone(), shutdown.clone());
        async move { worker.run_until(shutdown).await }
    });
    wait_until(
        "every message to be handled",
        Duration::from_secs(60),
        || async {
            let s = worker.stats();
            s.acked == 5 && s.terminated == 4
        },
    )
    .await;
    nats.wait_drained("c").await;
    shutdown.cancel();
    let stats = run.await.unwrap();
    assert_eq!(stats.nacked, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 5);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 5);
}
