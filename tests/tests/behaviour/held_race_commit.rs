//! Transaction A claims key k and holds; B's claim of k waits on A's row; A commits; B is a Skip
//! and B's handler body never ran.

use inbox_runtime::{Inbox, Outcome};
use inbox_tests::handlers::{Entry, Probe, create_tables, ledger};
use inbox_tests::{PgDb, wait_until};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_race_commit_makes_the_twin_skip() {
    let db = PgDb::create(4).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;
    let entry = Entry {
        key: "k".into(),
        account: 1,
        amount: 10,
    };

    let probe_a = Arc::new(Probe::held(false));
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
    // B's claim must be blocked on A's uncommitted marker, not merely not yet started.
    wait_until(
        "B's claim to wait on A's lock",
        Duration::from_secs(30),
        || async { db.lock_waiters().await == 1 },
    )
    .await;
    assert!(!b.is_finished(), "B finished while A still held the key");

    probe_a.release();
    assert_eq!(a.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(b.await.unwrap().unwrap(), Outcome::Skip);
    assert_eq!(probe_b.runs(), 0, "B's handler body ran for a duplicate");
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 1);
}
