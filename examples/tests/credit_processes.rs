//! The `credit` binary as users run it, several processes on one durable consumer, on every
//! backend:
//! - SIGTERM mid-stream: the process exits 0, and every message is either applied and acked, or
//!   not applied and redelivered to the other instance; none is applied twice.
//! - Three processes, 2,000 unique messages each published twice: every balance is exact.

use inbox_examples::CreditRequested;
use inbox_runtime::Inbox;
use inbox_testkit::{CreditConfig, CreditProcess, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::{NatsStream, nats_url};
use std::collections::BTreeMap;
use std::time::Duration;

const DURABLE: &str = "credit_t";
/// How long a stopped `credit` may take to exit.
const STOP: Duration = Duration::from_secs(60);

fn spawn_credit<DB: sqlx::Database>(db: &TestDb<DB>, nats: &NatsStream) -> CreditProcess {
    let config = CreditConfig {
        binary: env!("CARGO_BIN_EXE_credit").into(),
        nats_url: nats_url(),
        database_url: db.url.clone(),
        stream: nats.stream.clone(),
        subject: nats.subject.clone(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
    CreditProcess::spawn(&config, None).expect("spawn credit")
}

/// SIGTERMs `credit`, which must exit 0; returns how many messages it applied.
async fn stop(process: CreditProcess) -> u64 {
    process.stop(STOP).await.expect("stop credit").applied
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

/// Waits until `n` requests have their marker.
async fn wait_applied<B: TestBackend>(db: &TestDb<B::Db>, n: usize, deadline: Duration) {
    wait_until("every request to be applied", deadline, async || {
        B::count(db, "SELECT count(*) FROM inbox").await == n as i64
    })
    .await
    .unwrap();
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
        async || B::count(&db, "SELECT count(*) FROM inbox").await >= 100,
    )
    .await
    .unwrap();
    let a_applied = stop(a).await;
    assert!(a_applied > 0, "the stopped instance applied nothing");

    // The rest of the stream arrives after A is gone: B alone must finish it.
    nats.publish_all(second.iter().map(json)).await;
    wait_applied::<B>(&db, requests.len(), Duration::from_secs(120)).await;
    nats.wait_drained(DURABLE).await;
    let b_applied = stop(b).await;
    assert!(b_applied > 0);

    let balances = B::balances(&db).await;
    assert_eq!(balances, expected, "a request was lost or applied twice");
    assert_eq!(a_applied + b_applied, requests.len() as u64);
}

async fn three_processes_with_duplicates<B: TestBackend>() {
    let db = database::<B>().await;
    let nats = NatsStream::create().await;
    nats.consumer(DURABLE, Duration::from_secs(30)).await;
    let (requests, expected) = requests(2_000);
    nats.publish_all(requests.iter().flat_map(|r| [json(r), json(r)]))
        .await;

    let processes: Vec<CreditProcess> = (0..3).map(|_| spawn_credit(&db, &nats)).collect();
    wait_applied::<B>(&db, requests.len(), Duration::from_secs(180)).await;
    nats.wait_drained(DURABLE).await;
    let mut applied_total = 0;
    for p in processes {
        applied_total += stop(p).await;
    }
    assert_eq!(
        B::balances(&db).await,
        expected,
        "a request was lost or applied twice"
    );
    assert_eq!(applied_total, requests.len() as u64);
    // Every applied request announced once, through the outbox of whichever process applied it.
    let events = format!("{}_EVENTS", nats.stream);
    let stream = nats
        .js
        .get_stream(&events)
        .await
        .expect("the events stream");
    let state = stream.cached_info().state.clone();
    let mut ids = std::collections::BTreeSet::new();
    for seq in state.first_sequence..=state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let event: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert!(
            ids.insert(event["id"].as_str().unwrap().to_owned()),
            "{event} twice"
        );
    }
    assert_eq!(
        ids.len(),
        requests.len(),
        "every applied request announced once"
    );
    let _ = nats.js.delete_stream(&events).await;
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
on_backend!(mysql, inbox_tests::backends::MySql);
on_backend!(sqlite, inbox_tests::backends::Sqlite);
