//! The database's connections are cut three times mid-stream (`pg_terminate_backend`, MariaDB
//! `KILL`): in-flight messages are retried in-process or redelivered, processing resumes, and every
//! message is applied exactly once. SQLite is in-process and has no connections to cut.

use inbox_runtime::Inbox;
use inbox_testkit::wait_until;
use inbox_tests::backends::TestBackend;
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

const UNIQUE: i64 = 600;

async fn connections_cut_mid_stream<B: TestBackend>() {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(5)).await;
    let entries: Vec<Vec<u8>> = (0..UNIQUE)
        .flat_map(|i| {
            let e = Entry::new(format!("m-{i}"), i % 7, 1);
            [e.json(), e.json()]
        })
        .collect();
    nats.publish_all(entries).await;

    let inbox = Inbox::new(B::connect(&db.url, 6).await);
    let worker = nats
        .worker(inbox, nats.consumer_on_new_connection("c").await)
        // Per message: batched, the stream is done before the third cut (too fast to tell).
        .batch(1, Duration::ZERO)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    let probe = worker.state();
    for round in 1..=3 {
        let target = round * UNIQUE / 5;
        wait_until(
            "progress before the cut",
            Duration::from_secs(120),
            || async { B::count(&db, "SELECT count(*) FROM inbox").await >= target },
        )
        .await
        .unwrap();
        // The last cut lands mid-stream whatever the machine's speed: runs wait at the gate,
        // their transactions open, while the connections under them are cut.
        if round == 3 {
            probe.pause();
        }
        let cut = B::cut_connections(&db).await.expect("a server database");
        assert!(cut > 0, "round {round}: no connection to cut");
    }
    assert!(
        B::count(&db, "SELECT count(*) FROM inbox").await < UNIQUE,
        "the stream was done before the last cut"
    );
    probe.resume();

    wait_until(
        "every message to be applied",
        Duration::from_secs(180),
        || async { B::count(&db, "SELECT count(*) FROM inbox").await == UNIQUE },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(
        stats.terminated, 0,
        "a message was dead-lettered: {stats:?}"
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, UNIQUE);
    assert_eq!(
        B::count(&db, "SELECT count(DISTINCT msg_key) FROM ledger").await,
        UNIQUE
    );
}

inbox_tests::on_server_backends!(connections_cut_mid_stream);
