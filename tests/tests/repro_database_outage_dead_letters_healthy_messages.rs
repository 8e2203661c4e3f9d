//! The database is unreachable (a proxy between the worker and the server, cut) for longer than
//! `max_deliver` deliveries take. Every failure was nak'd like any other, so healthy messages ran
//! out of deliveries and were dead-lettered. Now the worker sees that the database cannot be
//! reached at all, stops pulling, and holds what it has (with progress acks, spending no
//! delivery) until the database answers: afterwards every message is applied once and the
//! dead-letter stream is empty. On nats-server 2.11+, asked to (`pause_on_server`), the consumer
//! is also paused on the server during the outage and resumed after it; on older servers it
//! never is (the fallback). SQLite is in-process: it has no outage of this kind.

use inbox_runtime::Inbox;
use inbox_testkit::{TcpProxy, wait_until};
use inbox_tests::backends::TestBackend;
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{MAX_DELIVER, NatsStream, Running};
use sqlx::pool::PoolOptions;
use std::time::Duration;

const MESSAGES: i64 = 40;

async fn outage_dead_letters_nothing<B: TestBackend>() {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    // A short ack_wait: without progress acks, held messages would be redelivered at once.
    let ack_wait = Duration::from_secs(2);
    let consumer = nats.consumer("c", ack_wait).await;
    nats.publish_all((0..MESSAGES).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;

    let mut proxy = TcpProxy::reserve().unwrap();
    let (upstream, url) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    // Fail fast while the database is away, as a production pool would.
    let pool = PoolOptions::<B::Db>::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .test_before_acquire(false)
        .connect(&url)
        .await
        .expect("connect through the proxy");
    // Naks that come back at once: MAX_DELIVER deliveries take a second or two.
    let worker = nats
        .worker(Inbox::new(pool), consumer)
        .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
        // One instance: it may pause the consumer for all (opt-in).
        .pause_on_server(true)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    // Take the database away with work still to do.
    proxy.lose_reply_to(b"INSERT INTO ledger");
    wait_until("the cut to happen", Duration::from_secs(60), async || {
        proxy.trap_sprung()
    })
    .await
    .unwrap();
    proxy.cut();
    // The outage lasts far longer than MAX_DELIVER quick naks, or ack_wait, would take. On a
    // server that pauses consumers (2.11+) the worker pauses this one meanwhile; on an older one
    // it only stops its own pulls. Either way, look at the consumer throughout.
    let outage = ack_wait * (MAX_DELIVER as u32 + 2);
    let pauses = server_pauses_consumers(&nats.client.server_info().version);
    let mut seen_paused = false;
    let mut poll = inbox_testkit::Poll::new("the outage to last", outage);
    while poll.elapsed() < outage {
        seen_paused |= paused(&nats, "c").await;
        let _ = poll.tick().await;
    }
    let during = B::count(&db, "SELECT count(*) FROM ledger").await;
    assert!(during < MESSAGES, "everything was applied before the cut");
    assert_eq!(
        seen_paused,
        pauses,
        "nats-server {}: the consumer was paused on the server during the outage: {seen_paused}",
        nats.client.server_info().version
    );
    proxy.start(&upstream).await.unwrap();
    // Resumed once the database answers, not when the pause runs out.
    wait_until(
        "the consumer to be resumed on the server",
        Duration::from_secs(15),
        async || !paused(&nats, "c").await,
    )
    .await
    .unwrap();

    nats.wait_drained("c").await;
    let stats = run.stop().await;
    let letters = nats.dead_letters().await;
    assert!(
        letters.is_empty(),
        "{} healthy messages dead-lettered during the outage: {stats:?}",
        letters.len()
    );
    assert_eq!(stats.terminated, 0, "{stats:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, MESSAGES).await;
}

/// Whether the consumer `durable` is paused on the server now (asked raw: the field is new in
/// 2.11, and absent, so false, before).
async fn paused(nats: &NatsStream, durable: &str) -> bool {
    let info: serde_json::Value = nats
        .js
        .request(
            format!("CONSUMER.INFO.{}.{durable}", nats.stream),
            &serde_json::json!({}),
        )
        .await
        .expect("consumer info");
    info["paused"].as_bool().unwrap_or(false)
}

/// Whether a nats-server of `version` pauses consumers (2.11+).
fn server_pauses_consumers(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (2, 11)
}

inbox_tests::on_server_backends!(outage_dead_letters_nothing);
