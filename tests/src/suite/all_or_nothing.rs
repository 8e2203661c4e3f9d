//! A business write that fails (CHECK violation) leaves no marker and no effect, and the message
//! is not acked: it stays with JetStream for redelivery.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use inbox_runtime::ProcessError;
use inbox_testkit::wait_until;
use sqlx::error::ErrorKind;
use std::time::Duration;

fn overdraw() -> Entry {
    Entry::new("k", 7, -5)
}

/// Without NATS: the error surfaces, nothing remains.
async fn check_violation_rolls_back_the_marker<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let err = inbox
        .process(
            &B::Credit::default(),
            &(),
            overdraw(),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    let ProcessError::Handler(source) = &err else {
        panic!("expected a handler error, got {err:?}")
    };
    let kind = source
        .downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .map(|e| e.kind());
    assert!(
        matches!(kind, Some(ErrorKind::CheckViolation)),
        "expected a CHECK violation, got {source}"
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM accounts").await, 0);
}

/// Through JetStream: never acked; an integrity violation is permanent, so the message is
/// dead-lettered (with the reason) and only then terminated.
async fn check_violation_is_dead_lettered_not_acked<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([overdraw().json()]).await;

    let worker = nats
        .worker(inbox, consumer)
        .build(B::Credit::default())
        .unwrap();
    let run = Running::start(&worker);
    wait_until("the dead letter", Duration::from_secs(30), || async {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(
        (stats.acked, stats.skipped, stats.nacked),
        (0, 0, 0),
        "{stats:?}"
    );
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let (payload, headers) = &letters[0];
    assert_eq!(payload, &overdraw().json());
    let reason = headers
        .get("Inbox-Error")
        .map(|v| v.as_str().to_lowercase());
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("check") || r.contains("constraint")),
        "{reason:?}"
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM accounts").await, 0);
}

super::behaviours!(
    partitioned_too;
    check_violation_rolls_back_the_marker,
    check_violation_is_dead_lettered_not_acked
);
