//! Empty keys, keys over 255 bytes and missing keys are rejected before any transaction begins.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use inbox_runtime::{ErrorClass, KeyError, Outcome, ProcessError, classify};

/// The test.
async fn empty_long_and_missing_keys_are_rejected<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let probe = Probe::open();
    let ledger = B::Ledger::default();
    let entry = |key: String| Entry::new(key, 1, 1);

    let err = inbox
        .process(
            &ledger,
            &probe,
            entry(String::new()),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ProcessError::Key(KeyError::Empty)), "{err:?}");
    assert_eq!(classify::<B::Db>(&err), ErrorClass::Permanent);
    let err = inbox
        .process(
            &ledger,
            &probe,
            entry("é".repeat(128)),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::Key(KeyError::TooLong(256))),
        "{err:?}"
    );
    // 255 bytes fit, multi-byte characters included.
    let longest = format!("{}x", "é".repeat(127));
    assert_eq!(longest.len(), 255);
    assert_eq!(
        inbox
            .process(
                &ledger,
                &probe,
                entry(longest),
                &inbox_runtime::Delivery::default()
            )
            .await
            .unwrap(),
        Outcome::Ack
    );
    // Without a `key`, the transport id is the key; with neither there is nothing to dedup on.
    let err = inbox
        .process(
            &B::LedgerByTransportId::default(),
            &(),
            entry("a".into()),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::Key(KeyError::Missing)),
        "{err:?}"
    );
    assert_eq!(probe.runs(), 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}

/// A NUL byte in a key: PostgreSQL could not store it (22021, retried until max_deliver as an
/// unknown inbox error) while MySQL and SQLite did, so a key did not mean the same everywhere.
/// Now key validation rejects it on every backend, before any transaction.
async fn repro_nul_in_key_differs_by_backend<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let probe = Probe::open();
    let err = inbox
        .process(
            &B::Ledger::default(),
            &probe,
            Entry::new("a\0b", 1, 1),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ProcessError::Key(KeyError::Nul)), "{err:?}");
    assert_eq!(classify::<B::Db>(&err), ErrorClass::Permanent);
    assert_eq!(probe.runs(), 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

super::behaviours!(
    partitioned_too;
    empty_long_and_missing_keys_are_rejected,
    repro_nul_in_key_differs_by_backend,
);
