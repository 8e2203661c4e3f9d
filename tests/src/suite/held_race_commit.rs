//! Transaction A claims key k and holds; B's claim of k waits behind A; A commits; B is a Skip and
//! B's handler body never ran.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::wait_until;
use inbox_runtime::Outcome;
use std::sync::Arc;
use std::time::Duration;

/// The test.
pub async fn held_race_commit_makes_the_twin_skip<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let entry = Entry {
        key: "k".into(),
        account: 1,
        amount: 10,
    };

    let probe_a = Arc::new(Probe::held(false));
    let mut a = tokio::spawn({
        let (inbox, probe, entry) = (inbox.clone(), probe_a.clone(), entry.clone());
        async move {
            inbox
                .process(&B::Ledger::default(), &probe, entry, None)
                .await
        }
    });
    tokio::select! {
        _ = probe_a.entered() => {}
        early = &mut a => panic!("A finished before holding the key: {early:?}"),
    }

    let probe_b = Arc::new(Probe::open());
    let b = tokio::spawn({
        let (inbox, probe, entry) = (inbox.clone(), probe_b.clone(), entry.clone());
        async move {
            inbox
                .process(&B::Ledger::default(), &probe, entry, None)
                .await
        }
    });
    // B must be blocked behind A's uncommitted claim, not merely not yet started.
    wait_until("B to wait behind A", Duration::from_secs(30), || async {
        B::waiting_writers(&db).await == 1
    })
    .await;
    assert!(!b.is_finished(), "B finished while A still held the key");

    probe_a.release();
    assert_eq!(a.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(b.await.unwrap().unwrap(), Outcome::Skip);
    assert_eq!(probe_b.runs(), 0, "B's handler body ran for a duplicate");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}
