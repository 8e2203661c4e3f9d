//! Regression: a PostgreSQL handler that swallows a failed statement and returns `Ok` leaves its
//! transaction aborted (25P02). PostgreSQL answers the COMMIT of an aborted transaction with a
//! ROLLBACK tag, not an error, and sqlx does not check the tag: the inbox used to report `Ack`
//! with nothing committed, and the worker acked a message whose effect never happened (lost).
//! A statement on the marker now runs after the handler, in the same transaction (a lookup of the
//! marker inserted finished, or the partitioned inbox's `processed_at` update), so the aborted
//! transaction fails there and nothing is acked.

use inbox_runtime::{ErrorClass, Inbox, ProcessError, Stage, Tx, classify, idempotent};
use inbox_tests::backends::{Postgres, TestBackend};
use inbox_tests::handlers::Entry;

/// Credits the account, ignoring the error of a statement that fails.
#[idempotent(consumer = "swallow", key = msg.key)]
async fn swallows_an_error(msg: Entry, tx: &mut Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO accounts (id, balance) VALUES ($1, $2)")
        .bind(msg.account)
        .bind(msg.amount)
        .execute(&mut **tx)
        .await?;
    let ignored = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
    assert!(ignored.is_err(), "division by zero must fail");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_swallowed_error_is_not_acked() {
    let db = Postgres::create(2).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.expect("migrate the inbox");
    let entry = Entry {
        key: "k".into(),
        account: 1,
        amount: 5,
    };
    let err = inbox
        .process(
            &swallows_an_error,
            &(),
            entry,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .expect_err("an aborted transaction must not be reported as committed");
    assert!(
        matches!(
            err,
            ProcessError::Database {
                stage: Stage::Finish,
                ..
            }
        ),
        "{err}"
    );
    assert_ne!(
        classify::<sqlx::Postgres>(&err),
        ErrorClass::Transient,
        "retrying the same handler in process cannot help"
    );
    assert_eq!(Postgres::count(&db, "SELECT count(*) FROM inbox").await, 0);
    assert_eq!(
        Postgres::count(&db, "SELECT count(*) FROM accounts").await,
        0
    );
}
