//! As the commit race, but A's handler fails: A rolls back, B's waiting claim then wins, B runs
//! and acks. The effect is applied once.

use super::held_race;
use crate::backends::TestBackend;
use inbox_runtime::{Outcome, ProcessError};

/// The test.
async fn held_race_rollback_lets_the_twin_apply<B: TestBackend>() {
    let race = held_race::start::<B>(true).await;
    race.probe_a.release();
    let a = race.a.await.unwrap();
    assert!(matches!(a, Err(ProcessError::Handler(_))), "{a:?}");
    assert_eq!(race.b.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(race.probe_b.runs(), 1);
    assert_eq!(B::count(&race.db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&race.db, "SELECT count(*) FROM inbox").await, 1);
}

super::behaviours!(
    partitioned_too;
    held_race_rollback_lets_the_twin_apply);
