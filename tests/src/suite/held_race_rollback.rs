//! As the commit race, but A's handler fails: A rolls back, B's waiting claim then wins, B runs
//! and acks. The effect is applied once.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::wait_until;
use inbox_runtime::{Outcome, ProcessError};
use std::sync::Arc;
use std::time::Duration;

/// The test.
pub async fn held_race_rollback_lets_the_twin_apply<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let entry = Entry {
        key: "k".into(),
        account: 1,
        amount: 10,
    };

    let probe_a = Arc::new(Probe::held(true));
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
    wait_until("B to wait behind A", Duration::from_secs(30), || async {
        B::waiting_writers(&db).await == 1
    })
    .await;
    assert_eq!(probe_b.runs(), 0, "B ran while A held the key");

    probe_a.release();
    let a = a.await.unwrap();
    assert!(matches!(a, Err(ProcessError::Handler(_))), "{a:?}");
    assert_eq!(b.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(probe_b.runs(), 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}
