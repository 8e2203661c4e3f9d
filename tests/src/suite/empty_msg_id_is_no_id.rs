//! Without a `key`, the key is the transport id: `Nats-Msg-Id`, else `<stream>:<sequence>`. Some
//! producers send `Nats-Msg-Id` empty; that is no id, not the id "".

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use std::time::Duration;

/// Two different messages with an empty `Nats-Msg-Id` used to get the key "", which is invalid:
/// both were dead-lettered instead of applied.
async fn repro_empty_msg_id_is_a_bad_key<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    for i in 0..2 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, "");
        let payload = Entry::new(format!("m-{i}"), 1, 1).json();
        nats.js
            .publish_with_headers(nats.subject.clone(), headers, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    let worker = nats
        .worker(inbox, consumer)
        .build(B::LedgerByTransportId::default())
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.terminated), (2, 0), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 2);
}

super::behaviours!(repro_empty_msg_id_is_a_bad_key);
