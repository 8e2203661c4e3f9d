//! `credit` started while NATS or the database is down waits for it (capped backoff, one log line
//! per attempt: no crash loop, no busy loop) and starts working when it comes back.

use inbox_examples::CreditRequested;
use inbox_runtime::Inbox;
use inbox_tests::backends::{Postgres, TestBackend, with_database};
use inbox_tests::{NatsStream, PrivateNats, TcpProxy, wait_until};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

fn spawn_credit(database_url: &str, nats_url: &str, log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_credit"))
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url)
        .env("CREDIT_STREAM", "WAITS")
        .env("CREDIT_SUBJECT", "waits.credits")
        .env("CREDIT_CONSUMER", "waits")
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn credit")
}

fn retries_logged(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&format!("{what} is not reachable")))
        .count()
}

async fn publish(nats: &NatsStream, n: i64) {
    let requests = (0..n).map(|i| {
        serde_json::to_vec(&CreditRequested {
            id: format!("w-{i}"),
            account: 1,
            amount: 1,
        })
        .unwrap()
    });
    let mut acks = Vec::new();
    for r in requests {
        acks.push(nats.js.publish("waits.credits", r.into()).await.unwrap());
    }
    for a in acks {
        a.await.unwrap();
    }
}

async fn sigterm_and_wait(mut child: Child) {
    let pid = child.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("credit did not stop")
        .unwrap();
    assert!(status.success(), "credit exited with {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_waits_for_nats_at_start() {
    let db = Postgres::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let mut server = PrivateNats::start();
    server.kill();
    let log = std::env::temp_dir().join(format!("{}-nats.log", db.name));
    let child = spawn_credit(&db.url, &server.url, &log);
    wait_until("two logged retries", Duration::from_secs(60), || async {
        retries_logged(&log, "NATS") >= 2
    })
    .await;
    assert!(
        retries_logged(&log, "NATS") < 10,
        "retrying without backoff"
    );
    server.restart();
    let nats = NatsStream::create_at(&server.url).await;
    wait_until(
        "credit to create its stream",
        Duration::from_secs(60),
        || async { nats.js.get_stream("WAITS").await.is_ok() },
    )
    .await;
    publish(&nats, 20).await;
    wait_until("the credits", Duration::from_secs(60), || async {
        Postgres::count(&db, "SELECT count(*) FROM inbox").await == 20
    })
    .await;
    sigterm_and_wait(child).await;
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_waits_for_the_database_at_start() {
    let db = Postgres::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let server = PrivateNats::start();
    let mut proxy = TcpProxy::reserve();
    let through_proxy = with_database(
        &format!("postgres://postgres@127.0.0.1:{}/x", proxy.port),
        &db.name,
    );
    let log = std::env::temp_dir().join(format!("{}-db.log", db.name));
    let child = spawn_credit(&through_proxy, &server.url, &log);
    wait_until("two logged retries", Duration::from_secs(60), || async {
        retries_logged(&log, "the database") >= 2
    })
    .await;
    assert!(
        retries_logged(&log, "the database") < 10,
        "retrying without backoff"
    );
    proxy.start("127.0.0.1:5432").await;
    let nats = NatsStream::create_at(&server.url).await;
    wait_until(
        "credit to create its stream",
        Duration::from_secs(60),
        || async { nats.js.get_stream("WAITS").await.is_ok() },
    )
    .await;
    publish(&nats, 20).await;
    wait_until("the credits", Duration::from_secs(60), || async {
        Postgres::count(&db, "SELECT count(*) FROM inbox").await == 20
    })
    .await;
    sigterm_and_wait(child).await;
    let _ = std::fs::remove_file(&log);
}
