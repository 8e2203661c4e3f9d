//! Transaction A claims key k and holds; B's claim of k waits behind A; A commits; B is a Skip and
//! B's handler body never ran.

use super::held_race;
use crate::backends::TestBackend;
use inbox_runtime::Outcome;

/// The test.
async fn held_race_commit_makes_the_twin_skip<B: TestBackend>() {
    let race = held_race::start::<B>(false).await;
    race.probe_a.release();
    assert_eq!(race.a.await.unwrap().unwrap(), Outcome::Ack);
    assert_eq!(race.b.await.unwrap().unwrap(), Outcome::Skip);
    assert_eq!(
        race.probe_b.runs(),
        0,
        "B's handler body ran for a duplicate"
    );
    assert_eq!(B::count(&race.db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&race.db, "SELECT count(*) FROM inbox").await, 1);
}

super::behaviours!(
    partitioned_too;
    held_race_commit_makes_the_twin_skip);
