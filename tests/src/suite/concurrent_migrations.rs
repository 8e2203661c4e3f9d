//! Regression: instances starting together on a fresh database all migrate successfully (sqlx
//! takes no migration lock on SQLite, and its lock did not hold on MariaDB; the loser failed with
//! a duplicate migration row and the process exited).

use crate::backends::TestBackend;
use inbox_runtime::Outcome;

/// The test.
async fn instances_migrating_together_all_succeed<B: TestBackend>() {
    let db = B::create(1).await;
    let mut starts = Vec::new();
    for _ in 0..4 {
        let inbox = B::inbox(B::connect(&db.url, 1).await);
        starts.push(tokio::spawn(async move { inbox.migrate().await }));
    }
    for start in starts {
        start.await.unwrap().expect("a racing migration failed");
    }
    let inbox = B::inbox(db.pool.clone());
    let entry = crate::handlers::Entry::new("k", 1, 1);
    let outcome = inbox
        .process(
            &B::Credit::default(),
            &(),
            entry,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Ack);
}

/// A migration interrupted half-way (the process killed during MySQL's non-transactional DDL)
/// stays recorded as dirty; `migrate()` gave up with `Dirty` after five tries and `credit` exited
/// at every start. The DDL is idempotent: the dirty step is run again.
async fn repro_interrupted_migration_blocks_every_restart<B: TestBackend>() {
    let db = B::create(1).await;
    let inbox = B::inbox(db.pool.clone());
    inbox.migrate().await.expect("first migration");
    // What sqlx leaves behind when the process dies inside a step: the row written as it
    // began, with success still false.
    B::exec(
        &db,
        "UPDATE _inbox_migrations SET success = FALSE WHERE version = \
         (SELECT v FROM (SELECT max(version) AS v FROM _inbox_migrations) AS last)",
    )
    .await;
    inbox
        .migrate()
        .await
        .expect("a restart after an interrupted migration");
    let dirty = "SELECT count(*) FROM _inbox_migrations WHERE success = FALSE";
    assert_eq!(B::count(&db, dirty).await, 0);
    let entry = crate::handlers::Entry::new("k", 1, 1);
    let outcome = inbox
        .process(
            &B::Credit::default(),
            &(),
            entry,
            &inbox_runtime::Delivery::default(),
        )
        .await;
    assert_eq!(outcome.unwrap(), Outcome::Ack);
}

super::behaviours!(
    partitioned_too;
    instances_migrating_together_all_succeed,
    repro_interrupted_migration_blocks_every_restart,
);
