//! The held race both race tests share: transaction A claims key k and holds at a gate, and B's
//! claim of k is seen waiting behind A.

use super::setup;
use crate::backends::{TestBackend, TestDb};
use crate::handlers::{Entry, Probe};
use crate::wait_until;
use inbox_runtime::{Outcome, ProcessError};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// A race in progress: A holds k, B waits for it.
pub struct HeldRace<B: TestBackend> {
    /// The database.
    pub db: TestDb<B::Db>,
    /// A's probe: [`Probe::release`] lets A commit (or fail).
    pub probe_a: Arc<Probe>,
    /// B's probe: how often B's body ran.
    pub probe_b: Arc<Probe>,
    /// A's processing.
    pub a: JoinHandle<Result<Outcome, ProcessError>>,
    /// B's processing.
    pub b: JoinHandle<Result<Outcome, ProcessError>>,
}

/// Starts A (which fails after the gate when `a_fails`), then B, and returns once B is seen
/// blocked behind A's uncommitted claim (not merely not yet started).
pub(super) async fn start<B: TestBackend>(a_fails: bool) -> HeldRace<B> {
    let (db, inbox) = setup::<B>(4).await;
    let entry = Entry::new("k", 1, 10);
    let process = |probe: Arc<Probe>| {
        let (inbox, entry) = (inbox.clone(), entry.clone());
        tokio::spawn(async move {
            inbox
                .process(
                    &B::Ledger::default(),
                    &probe,
                    entry,
                    &inbox_runtime::Delivery::default(),
                )
                .await
        })
    };

    let probe_a = Arc::new(Probe::held(a_fails));
    let mut a = process(probe_a.clone());
    tokio::select! {
        _ = probe_a.entered() => {}
        early = &mut a => panic!("A finished before holding the key: {early:?}"),
    }
    let probe_b = Arc::new(Probe::open());
    let b = process(probe_b.clone());
    wait_until("B to wait behind A", Duration::from_secs(30), || async {
        B::waiting_writers(&db).await == 1
    })
    .await
    .unwrap();
    assert!(!b.is_finished(), "B finished while A still held the key");
    assert_eq!(probe_b.runs(), 0, "B ran while A held the key");
    HeldRace {
        db,
        probe_a,
        probe_b,
        a,
        b,
    }
}
