//! Empty keys and keys over 255 bytes are rejected before any transaction begins.

use inbox_runtime::{Inbox, KeyError, Outcome, ProcessError};
use inbox_tests::PgDb;
use inbox_tests::handlers::{Entry, Probe, create_tables, ledger, ledger_by_transport_id};

#[tokio::test]
async fn empty_and_long_keys_are_rejected() {
    let db = PgDb::create(2).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;
    let probe = Probe::open();
    let entry = |key: String| Entry {
        key,
        account: 1,
        amount: 1,
    };

    let err = inbox
        .process(&ledger, &probe, entry(String::new()), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ProcessError::Key(KeyError::Empty)), "{err:?}");
    assert!(err.is_permanent());
    let err = inbox
        .process(&ledger, &probe, entry("x".repeat(256)), None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::Key(KeyError::TooLong(256))),
        "{err:?}"
    );
    assert_eq!(
        inbox
            .process(&ledger, &probe, entry("x".repeat(255)), None)
            .await
            .unwrap(),
        Outcome::Ack
    );
    // Without a `key`, the transport id is the key; with neither there is nothing to dedup on.
    let err = inbox
        .process(&ledger_by_transport_id, &(), entry("a".into()), None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::Key(KeyError::Missing)),
        "{err:?}"
    );
    assert_eq!(probe.runs(), 1);
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 1);
}
