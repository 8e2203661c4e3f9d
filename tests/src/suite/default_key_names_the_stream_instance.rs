//! Without a `key` and without `Nats-Msg-Id`, the key names the stream's instance (its creation
//! time) as well as the message's sequence.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use async_nats::jetstream::stream;
use inbox_testkit::wait_until;
use std::time::Duration;

/// The default key was `"{stream}:{seq}"`. A stream deleted and created again under its name
/// starts its sequences at 1 again, so its new messages took the keys of the old stream's: they
/// were skipped as duplicates (logged only at debug) and their effects lost.
async fn repro_recreated_stream_reuses_default_keys<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    for round in 0..2 {
        if round == 1 {
            nats.js.delete_stream(&nats.stream).await.expect("delete");
            nats.js
                .create_stream(stream::Config {
                    name: nats.stream.clone(),
                    subjects: vec![nats.subject.clone()],
                    ..Default::default()
                })
                .await
                .expect("create the stream again");
        }
        let consumer = nats.consumer("c", Duration::from_secs(30)).await;
        nats.publish_all((0..3).map(|i| Entry::new(format!("r{round}-{i}"), 1, 1).json()))
            .await;
        let worker = nats
            .worker(inbox.clone(), consumer)
            .build(B::LedgerByTransportId::default())
            .unwrap();
        let run = Running::start(&worker);
        nats.wait_drained("c").await;
        let stats = run.stop().await;
        assert_eq!(
            (stats.acked, stats.skipped),
            (3, 0),
            "round {round}: {stats:?}"
        );
    }
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 6);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 6);
}

/// The same worker across the recreation: while its one permit was held in a handler no pull
/// was open, so no pull failed and the stream's creation time it had looked up stayed cached;
/// the new stream's first messages then took the old stream's keys and were skipped. A delivery
/// sequence that goes back (a new consumer counts from 1) now makes it look the stream up again.
async fn repro_worker_keeps_a_recreated_streams_old_identity<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry::new("old", 1, 1).json()]).await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .build_with_state(B::ProbedByTransportId::default(), Probe::held(false))
        .unwrap();
    let run = Running::start(&worker);
    tokio::time::timeout(Duration::from_secs(30), worker.state().entered())
        .await
        .expect("the handler did not start within 30 s");
    // The stream is replaced while the worker's only permit is in the handler.
    nats.js.delete_stream(&nats.stream).await.expect("delete");
    nats.js
        .create_stream(stream::Config {
            name: nats.stream.clone(),
            subjects: vec![nats.subject.clone()],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("create the stream again");
    nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry::new("new", 1, 1).json()]).await;
    // Lets the held handler go, and (a stored permit) the next one through its gate at once.
    worker.state().release();
    worker.state().release();
    // The new stream's message 1 (its sequence the old one's) is applied, not skipped.
    wait_until(
        "the new stream's message",
        Duration::from_secs(60),
        async || {
            let applied = "SELECT count(*) FROM ledger WHERE msg_key = 'new'";
            B::count(&db, applied).await == 1
        },
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(stats.skipped, 0, "{stats:?}");
}

super::behaviours!(
    repro_recreated_stream_reuses_default_keys,
    repro_worker_keeps_a_recreated_streams_old_identity,
);
