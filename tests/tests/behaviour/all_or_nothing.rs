//! A business write that fails (CHECK violation) leaves no marker and no effect, and the message
//! is not acked: it stays with JetStream for redelivery.

use inbox_runtime::{Inbox, ProcessError, WorkerBuilder};
use inbox_tests::handlers::{Entry, create_tables, credit};
use inbox_tests::{NatsStream, PgDb, wait_until};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn check_violation_rolls_back_the_marker() {
    let db = PgDb::create(4).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;

    let overdraw = Entry {
        key: "k".into(),
        account: 7,
        amount: -5,
    };
    let err = inbox
        .process(&credit, &(), overdraw, None)
        .await
        .unwrap_err();
    let ProcessError::Handler(source) = &err else {
        panic!("expected a handler error, got {err:?}")
    };
    assert!(
        source.to_string().contains("check constraint"),
        "unexpected error: {source}"
    );
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM accounts").await, 0);
}

#[tokio::test]
async fn check_violation_is_not_acked() {
    let db = PgDb::create(4).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    create_tables(&db.pool).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    nats.publish_all([Entry {
        key: "k".into(),
        account: 7,
        amount: -5,
    }
    .json()])
        .await;

    let worker = WorkerBuilder::new(inbox, consumer)
        .nak_delay(Duration::from_secs(60), Duration::from_secs(60))
        .build(credit)
        .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (worker, shutdown) = (worker.clone(), shutdown.clone());
        async move { worker.run_until(shutdown).await }
    });
    wait_until("the nak", Duration::from_secs(30), || async {
        worker.stats().nacked == 1
    })
    .await;
    shutdown.cancel();
    let stats = run.await.unwrap();
    assert_eq!(stats.acked, 0);
    assert_eq!(stats.nacked, 1);
    let info = nats.info("c").await;
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "the failed message was acked"
    );
    assert_eq!(db.count("SELECT count(*) FROM inbox").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM accounts").await, 0);
}
