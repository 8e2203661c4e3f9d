//! Without a `key` and without `Nats-Msg-Id`, the key names the stream's instance (its creation
//! time) as well as the message's sequence.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use async_nats::jetstream::stream;
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

super::behaviours!(repro_recreated_stream_reuses_default_keys);
