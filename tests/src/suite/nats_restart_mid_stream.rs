//! NATS is killed and restarted mid-stream (a server of the test's own): the worker reconnects
//! and resumes, and every message is applied exactly once.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::{PrivateNats, wait_until};
use std::time::Duration;

const UNIQUE: usize = 400;

/// The test.
async fn nats_restart_mid_stream_keeps_exactly_once<B: TestBackend>() {
    let (db, _) = setup::<B>(4).await;
    let mut server = PrivateNats::start().await.unwrap();
    let nats = NatsStream::create_at(&server.url).await;
    // A short ack_wait: acks lost in the outage come back soon, and are skipped.
    nats.consumer("c", Duration::from_secs(2)).await;
    let entries: Vec<Vec<u8>> = (0..UNIQUE)
        .flat_map(|i| {
            let e = Entry::new(format!("m-{i}"), 1, 1);
            [e.json(), e.json()]
        })
        .collect();
    nats.publish_all(entries).await;

    let inbox = B::inbox(B::connect(&db.url, 4).await);
    let worker = nats
        .worker(inbox, nats.consumer_on_new_connection("c").await)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until("some progress", Duration::from_secs(60), || async {
        B::count(&db, "SELECT count(*) FROM inbox").await >= 50
    })
    .await
    .unwrap();
    server.kill();
    wait_until("the client to notice", Duration::from_secs(30), || async {
        nats.client.connection_state() != async_nats::connection::State::Connected
    })
    .await
    .unwrap();
    assert!(
        B::count(&db, "SELECT count(*) FROM inbox").await < UNIQUE as i64,
        "the stream was done before the outage"
    );
    server.restart().await.unwrap();

    wait_until(
        "every message to be applied",
        Duration::from_secs(120),
        || async { B::count(&db, "SELECT count(*) FROM inbox").await == UNIQUE as i64 },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    run.stop().await;
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM ledger").await,
        UNIQUE as i64
    );
    assert_eq!(
        B::count(&db, "SELECT count(DISTINCT msg_key) FROM ledger").await,
        UNIQUE as i64
    );
}

super::behaviours!(nats_restart_mid_stream_keeps_exactly_once);
