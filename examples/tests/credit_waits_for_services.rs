//! `credit` started while NATS or the database is down waits for it (capped backoff, one log line
//! per attempt: no crash loop, no busy loop) and starts working when it comes back.

use inbox_examples::CreditRequested;
use inbox_runtime::Inbox;
use inbox_testkit::{CreditConfig, CreditProcess, PrivateNats, TcpProxy, wait_until};
use inbox_testkit::{consumer_ready, publish_and_wait, with_database};
use inbox_tests::NatsStream;
use inbox_tests::backends::{Postgres, TestBackend, TestDb};
use std::path::{Path, PathBuf};
use std::time::Duration;

const STREAM: &str = "WAITS";
const SUBJECT: &str = "waits.credits";
const DURABLE: &str = "waits";

/// `credit` on `database_url` and `nats_url`, its log in a file of the test's own.
fn spawn_credit(database_url: &str, nats_url: &str, log: &Path) -> CreditProcess {
    let config = CreditConfig {
        binary: env!("CARGO_BIN_EXE_credit").into(),
        nats_url: nats_url.into(),
        database_url: database_url.into(),
        stream: STREAM.into(),
        subject: SUBJECT.into(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
    CreditProcess::spawn(&config, Some(log)).expect("spawn credit")
}

fn retries_logged(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&format!("{what} is not reachable")))
        .count()
}

/// A fresh PostgreSQL database with the inbox migrated, and a log file named after it.
async fn database(log: &str) -> (TestDb<sqlx::Postgres>, PathBuf) {
    let db = Postgres::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let log = std::env::temp_dir().join(format!("{}-{log}.log", db.name));
    (db, log)
}

/// `credit` logs a retry for `what` at least twice, and with backoff (not ten in a minute).
async fn assert_retries_with_backoff(log: &Path, what: &str) {
    wait_until("two logged retries", Duration::from_secs(60), async || {
        retries_logged(log, what) >= 2
    })
    .await
    .unwrap();
    assert!(retries_logged(log, what) < 10, "retrying without backoff");
}

/// Once the missing service is back: `credit` creates its stream and consumer, applies 20 credits, and stops
/// cleanly on SIGTERM.
async fn works_once_back(credit: CreditProcess, nats_url: &str, db: &TestDb<sqlx::Postgres>) {
    let nats = NatsStream::create_at(nats_url).await;
    consumer_ready(&nats.js, STREAM, DURABLE).await.unwrap();
    let requests = (0..20).map(|i| {
        let request = CreditRequested {
            id: format!("w-{i}"),
            account: 1,
            amount: 1,
        };
        serde_json::to_vec(&request).unwrap()
    });
    publish_and_wait(&nats.js, SUBJECT, requests).await.unwrap();
    wait_until("the credits", Duration::from_secs(60), async || {
        Postgres::count(db, "SELECT count(*) FROM inbox").await == 20
    })
    .await
    .unwrap();
    credit.stop(Duration::from_secs(60)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_waits_for_nats_at_start() {
    let (db, log) = database("nats").await;
    let mut server = PrivateNats::start().await.unwrap();
    server.kill();
    let credit = spawn_credit(&db.url, &server.url, &log);
    assert_retries_with_backoff(&log, "NATS").await;
    server.restart().await.unwrap();
    works_once_back(credit, &server.url, &db).await;
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_waits_for_the_database_at_start() {
    let (db, log) = database("db").await;
    let server = PrivateNats::start().await.unwrap();
    let mut proxy = TcpProxy::reserve().unwrap();
    let through_proxy = with_database(
        &format!("postgres://postgres@127.0.0.1:{}/x", proxy.port),
        &db.name,
    );
    let credit = spawn_credit(&through_proxy, &server.url, &log);
    assert_retries_with_backoff(&log, "the database").await;
    proxy.start("127.0.0.1:5432").await.unwrap();
    works_once_back(credit, &server.url, &db).await;
    let _ = std::fs::remove_file(&log);
}

/// `NATS_URL` as a comma-separated server list (the NATS convention for a cluster) was refused
/// at start ("invalid port number"). With a list whose first server is down, `credit` connects to
/// the one that answers and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_nats_server_list_is_refused() {
    let (db, log) = database("list").await;
    let server = PrivateNats::start().await.unwrap();
    let down = TcpProxy::reserve().unwrap();
    let list = format!("nats://127.0.0.1:{}, {}", down.port, server.url);
    let credit = spawn_credit(&db.url, &list, &log);
    works_once_back(credit, &server.url, &db).await;
    let _ = std::fs::remove_file(&log);
}

/// The database answers at start, and then the connection `credit` creates its tables on is lost
/// (the database restarting, its sessions ended by a failover or an operator): CI's chaos run
/// caught `credit` exiting there. It waits that out like a database that is down, and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_waits_out_a_connection_lost_while_creating_its_tables() {
    let (db, log) = database("tables").await;
    let server = PrivateNats::start().await.unwrap();
    let mut proxy = TcpProxy::reserve().unwrap();
    // TLS off: the trap reads the statement in clear.
    let (upstream, through_proxy) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.lose_reply_to(b"CREATE TABLE IF NOT EXISTS accounts");
    proxy.start(&upstream).await.unwrap();
    let credit = spawn_credit(&through_proxy, &server.url, &log);
    wait_until(
        "the CREATE TABLE sent",
        Duration::from_secs(60),
        async || proxy.trap_sprung(),
    )
    .await
    .unwrap();
    // Every connection dropped, the server's sessions with them; new ones forwarded as before.
    proxy.switch_to(&upstream);
    works_once_back(credit, &server.url, &db).await;
    assert!(
        retries_logged(&log, "the database") >= 1,
        "no retry logged: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let _ = std::fs::remove_file(&log);
}
