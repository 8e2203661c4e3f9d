//! The `credit` binary as users run it, several processes on one durable consumer, on every
//! backend:
//! - SIGTERM mid-stream: the process exits 0, and every message is either applied and acked, or
//!   not applied and redelivered to the other instance; none is applied twice.
//! - Three processes, 2,000 unique messages each published twice: every balance is exact.

use inbox_examples::CreditRequested;
use inbox_runtime::Inbox;
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::{NatsStream, nats_url, wait_until};
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const DURABLE: &str = "credit_t";

fn spawn_credit<DB: sqlx::Database>(db: &TestDb<DB>, nats: &NatsStream) -> Child {
    Command::new(env!("CARGO_BIN_EXE_credit"))
        .env("DATABASE_URL", &db.url)
        .env("NATS_URL", nats_url())
        .env("CREDIT_STREAM", &nats.stream)
        .env("CREDIT_SUBJECT", &nats.subject)
        .env("CREDIT_CONSUMER", DURABLE)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn credit")
}

fn sigterm(child: &Child) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM {pid} failed");
}

async fn stop(mut child: Child) -> String {
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("credit did not exit within 60 s of SIGTERM")
        .expect("wait for credit");
    assert!(status.success(), "credit exited with {status}");
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)
        .await
        .expect("read stdout");
    out
}

/// `applied=N` from the line `credit` prints when it stops.
fn applied(stdout: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("credit stopped:"))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("applied="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no applied= in {line:?}"))
}

/// Requests over 25 accounts and the balance each account must end with.
fn requests(n: i64) -> (Vec<CreditRequested>, BTreeMap<i64, i64>) {
    let requests: Vec<CreditRequested> = (0..n)
        .map(|i| CreditRequested {
            id: format!("req-{i}"),
            account: i % 25,
            amount: i % 7 + 1,
        })
        .collect();
    let mut expected = BTreeMap::new();
    for r in &requests {
        *expected.entry(r.account).or_insert(0i64) += r.amount;
    }
    (requests, expected)
}

fn json(r: &CreditRequested) -> Vec<u8> {
    serde_json::to_vec(r).unwrap()
}

/// A fresh database with the inbox already migrated, so that it can be counted from the start.
async fn database<B: TestBackend>() -> TestDb<B::Db> {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    db
}

async fn sigterm_mid_stream<B: TestBackend>() {
    let db = database::<B>().await;
    let nats = NatsStream::create().await;
    // Made here with a short ack_wait, so that anything the stopped instance held comes back fast.
    nats.consumer(DURABLE, Duration::from_secs(3)).await;

    let (requests, expected) = requests(2_000);
    let (first, second) = requests.split_at(1_000);
    nats.publish_all(first.iter().map(json)).await;

    let a = spawn_credit(&db, &nats);
    let b = spawn_credit(&db, &nats);
    wait_until(
        "credit to be applying messages",
        Duration::from_secs(120),
        || async { B::count(&db, "SELECT count(*) FROM inbox").await >= 100 },
    )
    .await;
    sigterm(&a);
    let a_out = stop(a).await;
    assert!(applied(&a_out) > 0, "the stopped instance applied nothing");

    // The rest of the stream arrives after A is gone: B alone must finish it.
    nats.publish_all(second.iter().map(json)).await;
    wait_until(
        "every request to be applied",
        Duration::from_secs(120),
        || async { B::count(&db, "SELECT count(*) FROM inbox").await == requests.len() as i64 },
    )
    .await;
    nats.wait_drained(DURABLE).await;
    sigterm(&b);
    let b_out = stop(b).await;
    assert!(applied(&b_out) > 0);

    let balances = B::balances(&db).await;
    assert_eq!(balances, expected, "a request was lost or applied twice");
    assert_eq!(applied(&a_out) + applied(&b_out), requests.len() as u64);
}

async fn three_processes_with_duplicates<B: TestBackend>() {
    let db = database::<B>().await;
    let nats = NatsStream::create().await;
    nats.consumer(DURABLE, Duration::from_secs(30)).await;
    let (requests, expected) = requests(2_000);
    nats.publish_all(requests.iter().flat_map(|r| [json(r), json(r)]))
        .await;

    let processes: Vec<Child> = (0..3).map(|_| spawn_credit(&db, &nats)).collect();
    wait_until(
        "every request to be applied",
        Duration::from_secs(180),
        || async { B::count(&db, "SELECT count(*) FROM inbox").await == requests.len() as i64 },
    )
    .await;
    nats.wait_drained(DURABLE).await;
    let mut applied_total = 0;
    for p in processes {
        sigterm(&p);
        applied_total += applied(&stop(p).await);
    }
    assert_eq!(
        B::balances(&db).await,
        expected,
        "a request was lost or applied twice"
    );
    assert_eq!(applied_total, requests.len() as u64);
}

/// Both tests for one backend.
macro_rules! on_backend {
    ($name:ident, $backend:ty) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sigterm_mid_stream_exits_zero_and_applies_each_message_once() {
                super::sigterm_mid_stream::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn three_processes_apply_each_message_once() {
                super::three_processes_with_duplicates::<$backend>().await
            }
        }
    };
}

on_backend!(postgres, inbox_tests::backends::Postgres);
on_backend!(mariadb, inbox_tests::backends::MySql);
on_backend!(sqlite, inbox_tests::backends::Sqlite);
