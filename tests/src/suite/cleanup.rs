//! Cleanup deletes finished markers older than the retention, in bounded batches, never an open
//! claim, and one instance at a time. Time is moved by back-dating rows.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use futures::StreamExt;
use inbox_runtime::{Outcome, process_delivery};
use inbox_testkit::{Poll, wait_until};
use std::time::Duration;

/// Old finished markers go; recent ones and open claims stay.
async fn cleanup_deletes_only_old_finished_markers<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    for key in ["old-1", "old-2", "old-3", "new-1", "new-2"] {
        let entry = Entry::new(key, 1, 1);
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
    // An open claim (a two-phase claim whose side effect is still running), also old.
    B::exec(
        &db,
        "INSERT INTO inbox (consumer, message_key) VALUES ('credit', 'open')",
    )
    .await;
    for key in ["old-1", "old-2", "old-3", "open"] {
        B::backdate(&db, key).await;
    }
    // Another consumer's old marker is not this consumer's to delete.
    B::exec(
        &db,
        "INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
         SELECT 'other', message_key, received_at, processed_at FROM inbox WHERE message_key = 'old-1'",
    )
    .await;

    let deleted = inbox
        .cleanup("credit", Duration::from_secs(3600), 2)
        .await
        .unwrap();
    assert_eq!(deleted, Some(3));
    let left = B::count(&db, "SELECT count(*) FROM inbox WHERE consumer = 'credit'").await;
    assert_eq!(left, 3, "two recent markers and the open claim remain");
    let open = B::count(&db, "SELECT count(*) FROM inbox WHERE message_key = 'open'").await;
    assert_eq!(open, 1);
    let other = B::count(&db, "SELECT count(*) FROM inbox WHERE consumer = 'other'").await;
    assert_eq!(other, 1);
    // Nothing more is old enough.
    let again = inbox.cleanup("credit", Duration::from_secs(3600), 2).await;
    assert_eq!(again.unwrap(), Some(0));
}

/// While one instance holds the cleanup lock, another's cleanup does nothing (on backends with
/// more than one writer; SQLite's single writer serialises them anyway).
async fn cleanup_runs_one_instance_at_a_time<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let entry = Entry::new("old", 1, 1);
    inbox
        .process(
            &B::Credit::default(),
            &(),
            entry,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap();
    B::backdate(&db, "old").await;

    // Held on a connection of its own, as another instance's cleanup would hold it.
    let lock = "inbox-cleanup:inbox:credit";
    let holder = B::hold_cleanup_lock(&db, lock).await;
    let while_held = inbox
        .cleanup("credit", Duration::from_secs(3600), 10)
        .await
        .unwrap();
    match holder {
        None => {
            assert!(B::SINGLE_WRITER, "only a single-writer backend has no lock");
            assert_eq!(while_held, Some(1));
        }
        Some(holder) => {
            assert_eq!(
                while_held, None,
                "a second instance cleaned up concurrently"
            );
            assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
            B::release_cleanup_lock(holder, lock).await;
            let after = inbox
                .cleanup("credit", Duration::from_secs(3600), 10)
                .await
                .unwrap();
            assert_eq!(after, Some(1));
        }
    }
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// The fleet lock's name holds the table and the consumer (up to 200 bytes); MySQL refuses
/// `GET_LOCK` names over 64 characters, so cleanup of a long consumer name failed there every time.
async fn repro_cleanup_lock_name_too_long_for_mysql<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(2).await;
    let consumer = "c".repeat(200);
    let deleted = inbox
        .cleanup(&consumer, Duration::from_secs(3600), 10)
        .await
        .expect("cleanup of a 200-byte consumer name");
    assert_eq!(deleted, Some(0));
}

/// A cleanup cancelled while it held the fleet lock (its task aborted, its worker shutting down)
/// returned its pooled connection still holding the session lock: no other instance could clean
/// up again for as long as that connection lived, and nothing said so.
async fn repro_cancelled_cleanup_keeps_the_lock<B: TestBackend>() {
    let (db, inbox) = setup::<B>(3).await;
    let entry = Entry::new("old", 1, 1);
    inbox
        .process(
            &B::Credit::default(),
            &(),
            entry,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap();
    B::backdate(&db, "old").await;
    if B::SINGLE_WRITER {
        // No fleet lock: a single writer serialises cleanups by itself.
        let lock = B::hold_cleanup_lock(&db, "inbox-cleanup:inbox:credit").await;
        assert!(lock.is_none());
        return;
    }
    // Another transaction holds the old marker's row: cleanup takes the lock, then waits in its
    // DELETE, where it is cancelled.
    let blocker = B::hold_in_transaction(
        &db,
        "UPDATE inbox SET attempts = 1 WHERE message_key = 'old'",
    )
    .await;
    let cleanup = tokio::spawn({
        let inbox = inbox.clone();
        async move { inbox.cleanup("credit", Duration::from_secs(3600), 10).await }
    });
    wait_until(
        "the cleanup to wait behind the held row",
        Duration::from_secs(30),
        async || B::waiting_writers(&db).await > 0,
    )
    .await
    .unwrap();
    cleanup.abort();
    assert!(cleanup.await.unwrap_err().is_cancelled());
    drop(blocker);

    // Another instance can clean up again.
    let other = B::inbox(B::connect(&db.url, 1).await);
    let mut poll = Poll::new(
        "another instance to get the cleanup lock",
        Duration::from_secs(30),
    );
    loop {
        match other.cleanup("credit", Duration::from_secs(3600), 10).await {
            // The cancelled DELETE may have finished on the server once the row was free.
            Ok(Some(_)) => break,
            Ok(None) => poll.tick().await.unwrap(),
            Err(e) => panic!("cleanup failed: {e}"),
        }
    }
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// Cleanup followed the wall clock: a marker older than the retention was deleted even while
/// the consumer had not yet processed a copy of its message published with the original (the
/// consumer stopped or lagging for longer than the retention), and the copy was applied again.
/// The worker's cleanup now keeps what the consumer's oldest unacked message may duplicate.
async fn repro_cleanup_deletes_markers_a_lagging_consumer_needs<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    // The original and a producer's retried copy, published together; no Nats-Msg-Id, so only
    // the inbox can tell them apart.
    let entry = Entry::new("a", 1, 1);
    nats.publish_all([entry.json(), entry.json()]).await;
    let (ledger, probe) = (B::Ledger::default(), Probe::open());
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let original = batch.next().await.expect("a delivery").unwrap();
    let outcome = process_delivery(&inbox, &ledger, &probe, &original).await;
    assert_eq!(outcome.unwrap(), Outcome::Ack);
    original.double_ack().await.unwrap();
    drop(batch);

    // The consumer then stops for longer than the retention. A marker of another consumer,
    // written now, tells when that much time has passed by the database's clock.
    let retention = Duration::from_secs(1);
    let clock = Entry::new("clock", 1, 1);
    inbox
        .process(
            &B::Credit::default(),
            &(),
            clock,
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap();
    wait_until(
        "the retention to pass",
        Duration::from_secs(30),
        async || inbox.cleanup("credit", retention, 10).await.unwrap() == Some(1),
    )
    .await
    .unwrap();
    let pass = inbox.cleanup_behind("ledger", &nats.js, &consumer, retention, 10);
    assert_eq!(
        pass.await.unwrap(),
        Some(0),
        "the copy still needs the marker"
    );

    // The consumer comes back: the copy finds the marker.
    let worker = nats
        .worker(inbox.clone(), consumer.clone())
        .build_with_state(ledger, probe)
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.skipped), (0, 1), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);

    // Nothing pending any more: the marker goes once it is older than the retention.
    wait_until(
        "the marker to be cleaned up",
        Duration::from_secs(30),
        async || {
            let pass = inbox.cleanup_behind("ledger", &nats.js, &consumer, retention, 10);
            pass.await.unwrap() == Some(1)
        },
    )
    .await
    .unwrap();
}

super::behaviours!(
    repro_cleanup_deletes_markers_a_lagging_consumer_needs,
    repro_cancelled_cleanup_keeps_the_lock,
    cleanup_deletes_only_old_finished_markers,
    cleanup_runs_one_instance_at_a_time,
    repro_cleanup_lock_name_too_long_for_mysql,
);
