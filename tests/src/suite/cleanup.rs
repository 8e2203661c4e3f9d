//! Cleanup deletes finished markers older than the retention, in bounded batches, never an open
//! claim, and one instance at a time; behind a stream, never the marker of a message still in
//! it, nor of one the consumer's backlog may duplicate. Time is moved by back-dating rows, or,
//! where a marker must not predate its message, by waiting out a retention of a second.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use async_nats::jetstream::stream;
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
    let original = crate::first_delivery(&consumer).await;
    let outcome = process_delivery(&inbox, &ledger, &probe, &original).await;
    assert_eq!(outcome.unwrap(), Outcome::Ack);
    original.double_ack().await.unwrap();

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

    // Nothing pending any more, but both copies are still in the stream, where a replay would
    // find them: the marker stays.
    let pass = inbox.cleanup_behind("ledger", &nats.js, &consumer, retention, 10);
    assert_eq!(
        pass.await.unwrap(),
        Some(0),
        "the messages are still stored"
    );

    // Once they have left the stream, the marker goes (it is older than the retention).
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    stream.purge().await.unwrap();
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

/// Retention follows the stream. On a stream made with `nats`-style defaults (no `max_age`),
/// limited to three messages: a marker older than the retention is kept while its message is
/// still in the stream (a replay, a consumer reset or a new consumer, would need it), and goes
/// once the stream has dropped the message and the retention has passed since. The cutoff used
/// to follow the consumer and the wall clock alone: with nothing pending it deleted the markers
/// of messages still stored, and a stream without `max_age` was refused at start.
async fn markers_follow_the_messages_in_the_stream<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create_with(stream::Config {
        max_messages: 3,
        ..Default::default()
    })
    .await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    let markers =
        async || B::count(&db, "SELECT count(*) FROM inbox WHERE consumer = 'ledger'").await;
    let cleanup = async |retention| {
        let pass = inbox.cleanup_behind("ledger", &nats.js, &consumer, retention, 10);
        pass.await.unwrap()
    };

    // A worker cleaning up on it starts (its first pass, at once, is a week's retention: it
    // deletes nothing here) and processes a, b and c.
    let entries = ["a", "b", "c"].map(|key| Entry::new(key, 1, 1).json());
    nats.publish_all(entries).await;
    let worker = nats
        .worker(inbox.clone(), consumer.clone())
        .cleanup(Duration::from_secs(7 * 86400), &stream)
        .cleanup_every(Duration::from_secs(3600))
        .build_with_state(B::Ledger::default(), Probe::open())
        .expect("a stream that keeps messages forever is accepted");
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 3, "{stats:?}");

    // The retention passes: a marker of another consumer, written after these, is older than
    // it by the database's clock. (Back-dating the markers cannot show this: a marker dated
    // before its own message was published is one no run writes.)
    let short = Duration::from_secs(1);
    let clock = Entry::new("clock", 1, 1);
    let delivery = inbox_runtime::Delivery::default();
    let credit = B::Credit::default();
    let clocked = inbox.process(&credit, &(), clock, &delivery);
    assert_eq!(clocked.await.unwrap(), Outcome::Ack);
    wait_until(
        "the retention to pass",
        Duration::from_secs(30),
        async || inbox.cleanup("credit", short, 10).await.unwrap() == Some(1),
    )
    .await
    .unwrap();

    // Nothing is pending, and every marker is older than the retention, but a, b and c are
    // still in the stream: their markers stay.
    assert_eq!(cleanup(short).await, Some(0), "markers of stored messages");
    assert_eq!(markers().await, 3);

    // Three more messages push a, b and c out of the stream (max_msgs 3).
    let entries = ["d", "e", "f"].map(|key| Entry::new(key, 1, 1).json());
    nats.publish_all(entries).await;
    wait_until(
        "a, b and c to leave the stream",
        Duration::from_secs(30),
        async || {
            let state = stream.get_info().await.unwrap().state;
            (state.first_sequence, state.messages) == (4, 3)
        },
    )
    .await
    .unwrap();

    // Gone from the stream, they still keep their markers for the retention (an hour here,
    // which a and b are made older than)...
    let hour = Duration::from_secs(3600);
    assert_eq!(cleanup(hour).await, Some(0), "within the retention");
    B::backdate(&db, "a").await;
    B::backdate(&db, "b").await;
    // ...and lose them once it has passed.
    assert_eq!(cleanup(hour).await, Some(2));
    assert_eq!(markers().await, 1);
    let c = "SELECT count(*) FROM inbox WHERE consumer = 'ledger' AND message_key = 'c'";
    assert_eq!(B::count(&db, c).await, 1);
    assert_eq!(cleanup(short).await, Some(1), "c is older than a second");
    assert_eq!(markers().await, 0);
}

super::behaviours!(
    markers_follow_the_messages_in_the_stream,
    repro_cleanup_deletes_markers_a_lagging_consumer_needs,
    repro_cancelled_cleanup_keeps_the_lock,
    cleanup_deletes_only_old_finished_markers,
    cleanup_runs_one_instance_at_a_time,
    repro_cleanup_lock_name_too_long_for_mysql,
);
