//! As the commit race, but A's handler fails: A rolls back, B's waiting claim then wins, B runs
//! and acks. The effect is applied once.

use inbox_runtime::{Inbox, Outcome, ProcessError};
use inbox_tests::handlers::{Entry, Probe, create_tables, ledger};
use inbox_tests::{PgDb, wait_until};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_race_rollback_lets_the_twin_apply() {
    let db = PgDb::create(4).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;
    let entry = Entry {
        key: "k".into(),
        account: 1,
        amount: 10,
    };

    let probe_a = Arc::new(Probe::held(true));
    let a = tokio::spawn({
        let (inbox, probe, entry) = (inbox.clone(), probe_a.clone(), entry.clone());
        async move { inbox.process(&ledger, &probe, entry, None).await }
    });
    probe_a.entered().await;

    let probe_b = Arc::new(Probe::open());
    let b = tokio::spawn({
        let (inbox, probe, entry) = (inbox.clone(), probe_b.clone(), entry.clone());
        async move { inbox.process(&ledger, &probe, entry, None).await }
    });
    wait_until(
        "B's claim to wait on A's lock",
        Duration::from_secs(30),
        || async { db.lock_waiters().await == 1 },
    )
    .await;
    assert_eq!(probe_b.runs(), 0, "B ran while A held the key");

    probe_a.release();
    assert!(matches!(a.await.unwrap(), Err(ProcessError::Handler(_))));
    assert_eq!(b.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(probe_b.runs(), 1);
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 1);
}
