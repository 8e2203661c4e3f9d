//! Regression: instances starting together on a fresh database all migrate successfully (sqlx
//! takes no migration lock on SQLite, and its lock did not hold on MariaDB; the loser failed with
//! a duplicate migration row and the process exited).

use crate::backends::TestBackend;
use inbox_runtime::{Inbox, Outcome};

/// The test.
async fn instances_migrating_together_all_succeed<B: TestBackend>() {
    let db = B::create(1).await;
    let mut starts = Vec::new();
    for _ in 0..4 {
        let inbox = Inbox::new(B::connect(&db.url, 1).await);
        starts.push(tokio::spawn(async move { inbox.migrate().await }));
    }
    for start in starts {
        start.await.unwrap().expect("a racing migration failed");
    }
    let inbox = Inbox::new(db.pool.clone());
    let entry = crate::handlers::Entry::new("k", 1, 1);
    let outcome = inbox
        .process(&B::Credit::default(), &(), entry, None)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Ack);
}

super::behaviours!(instances_migrating_together_all_succeed);
