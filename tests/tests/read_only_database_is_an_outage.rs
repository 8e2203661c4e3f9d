//! A failover: for a while the database answers, but takes no writes (a standby before its
//! promotion: PostgreSQL 25006, MySQL 1792/1290, SQLite READONLY). Every message meets the same
//! refusal, so it is an outage, not the messages' fault: the worker waits (spending no
//! delivery) until the database takes writes again, and the connections that answered
//! "read-only" leave the pool rather than refusing every later try. Before, the refusal was a
//! message's failure: healthy messages ran out of deliveries and were dead-lettered.
//!
//! The outbox relay, too, drops a connection that said "read-only", rather than taking it again
//! for every pass.
//!
//! The standby is simulated per connection: the pool's new connections are read-only sessions
//! while a flag is set (the shared servers are never made read-only).

use inbox_runtime::{Outbox, OutboxMessage, Relay};
use inbox_testkit::wait_until;
use inbox_tests::backends::TestBackend;
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{NatsStream, Running};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const MESSAGES: i64 = 10;

async fn read_only_period_dead_letters_nothing<B: TestBackend>() {
    let db = B::create(4).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    // A short ack_wait: without progress acks, held messages would be redelivered at once.
    let ack_wait = Duration::from_secs(2);
    let consumer = nats.consumer("c", ack_wait).await;
    let read_only = Arc::new(AtomicBool::new(true));
    let standby = B::standby_pool(&db, 4, read_only.clone()).await;
    // Naks that come back at once: MAX_DELIVER deliveries take a second or two.
    let worker = nats
        .worker(B::inbox(standby), consumer)
        .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all((0..MESSAGES).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    // Read-only for three ack_waits: far longer than MAX_DELIVER quick naks take (before, every
    // message was dead-lettered within about a second), and than an unacked delivery lasts.
    let period = ack_wait * 3;
    inbox_testkit::throughout(period, async || {
        let stats = worker.stats();
        assert_eq!(
            (stats.terminated, stats.acked),
            (0, 0),
            "a message ended while the database took no writes: {stats:?}"
        );
    })
    .await;
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 0);
    // Promoted: new connections take writes; those that said read-only must be gone.
    read_only.store(false, Ordering::SeqCst);
    wait_until(
        "every message applied",
        Duration::from_secs(60),
        async || worker.stats().acked == MESSAGES as u64,
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "healthy messages dead-lettered: {stats:?}"
    );
    assert_eq!(stats.terminated, 0, "{stats:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, MESSAGES).await;
}

/// The outbox relay, on its own pool, after a failover: the connection that said "read-only"
/// must leave the pool. Before, the relay put it back after each failed pass and took it again
/// for the next one, so its rows stayed pending for as long as the connection lived (sqlx's
/// `max_lifetime`, 30 minutes by default), with nothing but a warning at each pass.
async fn relay_drops_a_connection_that_said_read_only<B: TestBackend>() {
    let db = B::create(2).await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            OutboxMessage::new(&*nats.subject, b"event".to_vec()),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The relay's pool of one: its connection, made now, is a standby's. The flag is cleared
    // at once (promoted), so every connection made from here on takes writes.
    let read_only = Arc::new(AtomicBool::new(true));
    let standby = B::standby_pool(&db, 1, read_only.clone()).await;
    drop(standby.acquire().await.unwrap());
    read_only.store(false, Ordering::SeqCst);
    let relay = Relay::new(Outbox::new(standby)).poll_interval(Duration::from_millis(100));
    let stop = CancellationToken::new();
    let relaying = tokio::spawn({
        let (js, stop) = (nats.js.clone(), stop.clone());
        async move { relay.run_until(&js, stop).await }
    });
    wait_until(
        "the row to be marked sent",
        Duration::from_secs(60),
        async || outbox.pending().await.is_ok_and(|(n, _)| n == 0),
    )
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!(stats.marked, 1, "{stats:?}");
    let mut stream = nats.js.get_stream(&nats.stream).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1, "{stats:?}");
}

inbox_tests::on_all_backends!(
    read_only_period_dead_letters_nothing,
    relay_drops_a_connection_that_said_read_only
);
