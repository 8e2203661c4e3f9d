//! Instances starting together on a fresh database all migrate successfully, one at a time per
//! table: each waits for the migration lock (PostgreSQL's advisory lock, MySQL's `GET_LOCK`;
//! SQLite's single writer needs none) and runs the migrator on the lock's connection.
//!
//! Regressions: sqlx's own migration lock is not taken on SQLite and did not hold on MariaDB
//! (`GET_LOCK(.., -1)` returns at once there), so racing instances failed with a duplicate
//! migration row; and with the rerun of dirty steps, an instance on MariaDB took another's step
//! in progress (recorded with `success = FALSE` until it ends) for an interrupted one, deleted
//! its row and ran it again: "Duplicate entry '3' for key 'PRIMARY'" once the collisions had
//! used up its attempts.

use crate::backends::TestBackend;
use inbox_runtime::Outcome;
use inbox_testkit::wait_until;
use std::sync::Arc;
use std::time::Duration;

/// Instances migrating at once, each on a pool of one connection.
const INSTANCES: usize = 8;

/// The test: the instances meet at a barrier, then all migrate at once.
async fn instances_migrating_together_all_succeed<B: TestBackend>() {
    let db = B::create(1).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(INSTANCES));
    let mut starts = Vec::new();
    for _ in 0..INSTANCES {
        let inbox = B::inbox(B::connect(&db.url, 1).await);
        let barrier = barrier.clone();
        starts.push(tokio::spawn(async move {
            barrier.wait().await;
            inbox.migrate().await
        }));
    }
    for start in starts {
        start.await.unwrap().expect("a racing migration failed");
    }
    let dirty = "SELECT count(*) FROM _inbox_migrations WHERE success = FALSE";
    assert_eq!(B::count(&db, dirty).await, 0);
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

/// While another instance holds the migration lock in the middle of a step (its row written
/// with `success = FALSE`, as MySQL records a step as it begins), a starting instance waits for
/// it, in the database, rather than take the step for an interrupted one and run it again; one
/// that may wait only briefly gives up with an error naming the lock. Once the step is done and
/// the lock released, the waiting instance finds every step recorded.
async fn an_instance_waits_for_the_one_migrating<B: TestBackend>() {
    let db = B::create(2).await;
    B::inbox(db.pool.clone()).migrate().await.expect("migrate");
    let lock = "migrate:inbox";
    let Some(holder) = B::hold_cleanup_lock(&db, lock).await else {
        // No lock: a single writer runs each step and its record in one transaction, so a step
        // in progress is never seen (`instances_migrating_together_all_succeed` races them).
        assert!(B::SINGLE_WRITER, "only a single-writer backend has no lock");
        return;
    };
    // The other instance's step in progress, marked so that a rerun would show.
    B::exec(
        &db,
        "UPDATE _inbox_migrations SET success = FALSE, execution_time = 424242 WHERE version = \
         (SELECT v FROM (SELECT max(version) AS v FROM _inbox_migrations) AS last)",
    )
    .await;
    let impatient = B::inbox(B::connect(&db.url, 1).await)
        .migration_lock_wait(Duration::from_millis(300))
        .migrate()
        .await
        .expect_err("an instance migrated while another held the lock");
    assert!(
        impatient.to_string().contains("\"migrate:inbox\""),
        "{impatient}"
    );

    let waiting = B::inbox(B::connect(&db.url, 1).await);
    let start = tokio::spawn(async move { waiting.migrate().await });
    wait_until(
        "the starting instance to wait for the migration lock",
        Duration::from_secs(30),
        async || B::waiting_for_fleet_lock(&db).await > 0,
    )
    .await
    .unwrap();
    let in_progress = "SELECT count(*) FROM _inbox_migrations \
                       WHERE success = FALSE AND execution_time = 424242";
    assert_eq!(
        B::count(&db, in_progress).await,
        1,
        "the step in progress was touched"
    );
    assert!(!start.is_finished());
    // The other instance finishes its step and lets go.
    B::exec(
        &db,
        "UPDATE _inbox_migrations SET success = TRUE WHERE success = FALSE",
    )
    .await;
    B::release_cleanup_lock(holder, lock).await;
    start
        .await
        .unwrap()
        .expect("the waiting instance's migration");
    let done = "SELECT count(*) FROM _inbox_migrations \
                WHERE success = TRUE AND execution_time = 424242";
    assert_eq!(
        B::count(&db, done).await,
        1,
        "the finished step was run again"
    );
}

/// A migration interrupted half-way (the process killed during MySQL's non-transactional DDL)
/// stays recorded as dirty; `migrate()` gave up with `Dirty` after five tries and `credit` exited
/// at every start. The DDL is idempotent: the dirty step is run again.
async fn repro_interrupted_migration_blocks_every_restart<B: TestBackend>() {
    let db = B::create(1).await;
    let inbox = B::inbox(db.pool.clone());
    inbox.migrate().await.expect("first migration");
    // What sqlx leaves behind when the process dies inside a step: the row written as it
    // began, with success still false. On SQLite a step commits with its row (transactional
    // DDL), so no step is ever left so; there its first step stands in (the last adds a column,
    // which SQLite cannot do conditionally).
    let dirty_step = match B::SINGLE_WRITER {
        false => {
            "UPDATE _inbox_migrations SET success = FALSE WHERE version = \
             (SELECT v FROM (SELECT max(version) AS v FROM _inbox_migrations) AS last)"
        }
        true => {
            "UPDATE _inbox_migrations SET success = FALSE WHERE version = \
             (SELECT v FROM (SELECT min(version) AS v FROM _inbox_migrations) AS first)"
        }
    };
    B::exec(&db, dirty_step).await;
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

/// The test: a database a later version has migrated (a step this version does not know,
/// recorded in the inbox's and the outbox's migration tables) keeps this version from starting
/// neither during a rolling upgrade nor after a rollback. sqlx's migrator refused it
/// (`VersionMissing`) unless told to let such steps be.
async fn a_step_of_a_later_version_is_let_be<B: TestBackend>() {
    let db = B::create(2).await;
    let inbox = B::inbox(db.pool.clone());
    inbox.migrate().await.expect("migrate the inbox");
    let outbox = inbox_runtime::Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate the outbox");
    let later = match B::BACKEND {
        inbox_testkit::Backend::Postgres => "decode('00', 'hex')",
        _ => "X'00'",
    };
    for table in ["_inbox_migrations", "_outbox_migrations"] {
        let sql = format!(
            "INSERT INTO {table} (version, description, success, checksum, execution_time) \
             VALUES (9999, 'a later version''s step', TRUE, {later}, 0)"
        );
        B::exec(&db, Box::leak(sql.into_boxed_str())).await;
    }
    inbox
        .migrate()
        .await
        .expect("the inbox, migrated by a later version");
    outbox
        .migrate()
        .await
        .expect("the outbox, migrated by a later version");
}

super::behaviours!(
    partitioned_too;
    instances_migrating_together_all_succeed,
    an_instance_waits_for_the_one_migrating,
    repro_interrupted_migration_blocks_every_restart,
    a_step_of_a_later_version_is_let_be,
);
