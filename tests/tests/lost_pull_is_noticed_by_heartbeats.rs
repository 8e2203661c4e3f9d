//! A nats-server restart forgets the pull requests waiting at it. A worker whose requests stay
//! open long (fetch_expiry 30 s) noticed only when they should have expired, a second after, so
//! a message published after the restart waited half a minute. Requests now ask for idle
//! heartbeats (half the expiry, at most 5 s): two heartbeats of silence, and they are asked for
//! again. Published after the restart, the message is applied well within the expiry.

use inbox_runtime::Inbox;
use inbox_testkit::{PrivateNats, wait_until};
use inbox_tests::backends::{Sqlite, TestBackend};
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{NatsStream, Running};
use std::time::{Duration, Instant};

const EXPIRY: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_lost_in_a_restart_is_asked_for_again_before_it_expires() {
    let db = Sqlite::create(1).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    let mut server = PrivateNats::start().await.unwrap();
    let nats = NatsStream::create_at(&server.url).await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let worker = nats
        .worker(inbox, consumer)
        .fetch_expiry(EXPIRY)
        .build_with_state(<Sqlite as TestBackend>::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the worker's pull to wait at the server",
        EXPIRY,
        || async { nats.info("c").await.num_waiting > 0 },
    )
    .await
    .unwrap();

    server.kill();
    wait_until("the client to notice", Duration::from_secs(30), || async {
        nats.client.connection_state() != async_nats::connection::State::Connected
    })
    .await
    .unwrap();
    server.restart().await.unwrap();
    wait_until(
        "the client to reconnect",
        Duration::from_secs(30),
        || async { nats.client.connection_state() == async_nats::connection::State::Connected },
    )
    .await
    .unwrap();
    let published = Instant::now();
    nats.publish_all([Entry::new("after-restart", 1, 1).json()])
        .await;
    // Two 5 s heartbeats of silence, then a new request: well before the lost one would have
    // expired (30 s + 1 s).
    wait_until("the message to be applied", EXPIRY * 2 / 3, || async {
        Sqlite::count(&db, "SELECT count(*) FROM ledger").await == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e} (published {:?} ago)", published.elapsed()));
    run.stop().await;
}
