//! A stored message whose header block carries a status line (`NATS/1.0 503`, written so by a
//! raw producer, or a server's own status message that a stream's subjects happened to cover)
//! is a delivery like any other: the worker handles and acks it on its first delivery, and the
//! pull session goes on. The client reports a status on it, as on the server's own status
//! messages; only those come without a reply subject.

use super::setup;
use crate::NatsStream;
use crate::Running;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use inbox_testkit::wait_until;
use std::time::Duration;

/// The test.
async fn stored_status_lines_are_handled_as_deliveries<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    // No redelivery within the test: a message the worker skipped would wait 60 s.
    let consumer = nats.consumer("c", Duration::from_secs(60)).await;
    let statuses = [
        "503",
        "100 Idle Heartbeat",
        "404 No Messages",
        "408 Request Timeout",
        "409 Leadership Change",
        "409 Consumer Deleted",
    ];
    for (i, status) in statuses.iter().enumerate() {
        let payload = Entry::new(format!("status-{i}"), 1, 1).json();
        let lines = [b"X-From: raw".to_vec()];
        inbox_testkit::publish_raw_status(nats.url(), &nats.subject, status, &lines, &payload)
            .await
            .expect("a raw publish");
    }
    nats.publish_all((0..3).map(|i| Entry::new(format!("plain-{i}"), 1, 1).json()))
        .await;
    let worker = nats
        .worker(inbox, consumer)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    let n = statuses.len() as u64 + 3;
    wait_until("every message handled", Duration::from_secs(30), || async {
        worker.stats().acked == n
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.nacked, stats.terminated), (0, 0), "{stats:?}");
    crate::backends::assert_applied_once::<B>(&db, n as i64).await;
    let info = nats.info("c").await;
    assert_eq!(
        info.num_redelivered, 0,
        "every message on its first delivery"
    );
}

super::behaviours!(stored_status_lines_are_handled_as_deliveries);
