//! A unique violation in the business write (the business table's own UNIQUE) is an error, never
//! mistaken for a duplicate: the claim aims at the inbox's key only.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use inbox_runtime::{ErrorClass, Outcome, ProcessError, classify};

/// The test.
async fn business_unique_violation_is_an_error_not_a_skip<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let first = Entry::new("k1", 42, 1);
    let same_reference = Entry {
        key: "k2".into(),
        ..first.clone()
    };
    let payment = B::Payment::default();
    assert_eq!(
        inbox
            .process(&payment, &(), first, &inbox_runtime::Delivery::default())
            .await
            .unwrap(),
        Outcome::Ack
    );
    let err = inbox
        .process(
            &payment,
            &(),
            same_reference,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap_err();
    let ProcessError::Handler(source) = &err else {
        panic!("expected a handler error, got {err:?}")
    };
    let sqlx_err = source.downcast_ref::<sqlx::Error>().expect("a sqlx error");
    assert!(
        sqlx_err
            .as_database_error()
            .is_some_and(|e| e.is_unique_violation()),
        "unexpected error: {sqlx_err}"
    );
    // An integrity violation in the business write is permanent: dead-lettered, not retried.
    assert_eq!(classify::<B::Db>(&err), ErrorClass::Permanent);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM payments").await, 1);
}

super::behaviours!(
    partitioned_too;
    business_unique_violation_is_an_error_not_a_skip);
