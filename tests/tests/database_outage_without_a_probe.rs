//! The database circuit under outages that used to leave it wrong (both on the server backends:
//! a TCP proxy of the test's own stands between a worker and the database; SQLite is
//! in-process):
//! - the database silent (packets dropped: statements hang instead of failing) for longer than
//!   `max_deliver` tries take: each try ended at the worker's deadline, which was not an outage
//!   but a spent delivery, so healthy messages were dead-lettered. A deadline while the database
//!   does not answer is now an outage: the message waits, and is applied once afterwards;
//! - one instance cut off from the database alone: it paused the durable consumer on the
//!   server (nats-server 2.11+), so every other instance stopped too. Now only its own pulls
//!   stop (a server-side pause is opt-in, `WorkerBuilder::pause_on_server`), and the other
//!   instance serves everything published meanwhile;
//! - a circuit open with no delivery left to retry (every held try ended otherwise: a deadline,
//!   a panic, a failed stream lookup): only a held message's retry could close it, so the worker
//!   stayed paused for ever. Its own probe now asks the database while it is open, and closes
//!   it once the database answers;
//! - a deadline not longer than the pool's acquire timeout is refused when the worker is built.

use inbox_runtime::{Inbox, WorkerError};
use inbox_testkit::{TcpProxy, wait_until};
use inbox_tests::backends::TestBackend;
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{MAX_DELIVER, NatsStream, Running};
use std::time::Duration;

const MESSAGES: i64 = 10;

async fn silent_database_dead_letters_nothing<B: TestBackend>() {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let ack_wait = Duration::from_secs(2);
    let consumer = nats.consumer("c", ack_wait).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    // Many connections, open before the silence: a try takes one (nothing to wait for) and
    // hangs on its first statement, until the deadline.
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 16).await;
    let worker = nats
        .worker(B::inbox(pool), consumer)
        .deadline(Duration::from_secs(1))
        .concurrency(1)
        .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    proxy.freeze();
    nats.publish_all((0..MESSAGES).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    // Silent longer than MAX_DELIVER tries cut at the deadline take (before, the first message
    // was dead-lettered within about eight seconds), and than an unacked delivery lasts.
    let period = Duration::from_secs(2) * MAX_DELIVER as u32 + ack_wait;
    inbox_testkit::throughout(period, async || {
        let stats = worker.stats();
        assert_eq!(
            stats.terminated, 0,
            "a message was dead-lettered while the database was silent: {stats:?}"
        );
    })
    .await;
    proxy.thaw();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "healthy messages dead-lettered: {stats:?}"
    );
    assert_eq!(stats.terminated, 0, "{stats:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, MESSAGES).await;
}

async fn one_instance_cut_off_does_not_stop_the_others<B: TestBackend>() {
    let db = B::create(4).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 4).await;
    // One at a time: what it pulled before its circuit opened is only the message it holds.
    let cut_off = nats
        .worker(
            B::inbox(pool),
            nats.consumer("c", Duration::from_secs(30)).await,
        )
        // Unbatched, also in the batched test pass.
        .concurrency(1)
        .batch(1, Duration::from_millis(1))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let cut_off_run = Running::start(&cut_off);
    proxy.cut();
    // The cut-off instance takes the first message and finds the database unreachable.
    nats.publish_all([Entry::new("first", 0, 1).json()]).await;
    wait_until(
        "the cut-off instance to open its circuit",
        Duration::from_secs(60),
        async || cut_off.database_unreachable(),
    )
    .await
    .unwrap();
    // The other instance, which reaches the database, serves what comes meanwhile.
    let healthy = nats
        .worker(
            B::inbox(db.pool.clone()),
            nats.consumer("c", Duration::from_secs(30)).await,
        )
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let healthy_run = Running::start(&healthy);
    nats.publish_all((1..=MESSAGES).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    wait_until(
        "the healthy instance to serve every later message",
        Duration::from_secs(30),
        async || healthy.stats().acked == MESSAGES as u64,
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: the cut-off instance stopped the others ({:?})",
            healthy.stats()
        )
    });
    // Back: the first message, held by the cut-off instance, is applied too.
    let (upstream, _) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    nats.wait_drained("c").await;
    let (a, b) = (cut_off_run.stop().await, healthy_run.stop().await);
    assert_eq!(a.terminated + b.terminated, 0, "{a:?} {b:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, MESSAGES + 1).await;
}

async fn open_circuit_without_messages_closes_when_the_database_answers<B: TestBackend>() {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 2).await;
    let worker = nats
        .worker(B::inbox(pool), consumer)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    // Cut off, and open before the worker starts (so that no pull request is open either):
    // nothing is held, and no delivery's retry will ever ask the database.
    proxy.cut();
    worker.trip_circuit();
    let run = Running::start(&worker);
    nats.publish_all([Entry::new("meanwhile", 1, 1).json()])
        .await;
    // While the database is cut off, the probe finds it so: the circuit stays open and nothing
    // is pulled (watched over several of the probe's tries).
    let period = Duration::from_secs(3);
    inbox_testkit::throughout(period, async || {
        assert!(
            worker.database_unreachable(),
            "the circuit closed while the database was cut off"
        );
        assert_eq!(
            nats.info("c").await.delivered.stream_sequence,
            0,
            "pulled while open"
        );
    })
    .await;
    let (upstream, _) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    wait_until(
        "the probe to close the circuit",
        Duration::from_secs(30),
        async || !worker.database_unreachable(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: the worker stays paused with no message to retry"));
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.terminated), (1, 0), "{stats:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, 1).await;
}

async fn deadline_not_above_the_acquire_timeout_is_refused<B: TestBackend>() {
    let db = B::create(2).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let pool = B::connect_acquiring(&db.url, 2, Duration::from_secs(5)).await;
    let built = nats
        .worker(B::inbox(pool), consumer)
        .deadline(Duration::from_secs(5))
        .build_with_state(B::Ledger::default(), Probe::open());
    let Err(refused) = built else {
        panic!("a deadline equal to the acquire timeout was accepted");
    };
    assert!(
        matches!(refused, WorkerError::DeadlineNotAboveAcquireTimeout { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("acquire timeout"), "{refused}");
}

inbox_tests::on_server_backends!(
    silent_database_dead_letters_nothing,
    one_instance_cut_off_does_not_stop_the_others,
    open_circuit_without_messages_closes_when_the_database_answers,
    deadline_not_above_the_acquire_timeout_is_refused,
);
