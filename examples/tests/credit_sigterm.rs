//! SIGTERM to a running `credit` mid-stream: it exits 0, and every message is either applied and
//! acked, or not applied and redelivered to the other instance; none is applied twice.

use inbox_examples::CreditRequested;
use inbox_tests::{NatsStream, PgDb, nats_url, wait_until};
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const DURABLE: &str = "credit_t";

fn spawn_credit(db: &PgDb, nats: &NatsStream) -> Child {
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

async fn inbox_rows(db: &PgDb) -> i64 {
    // The table appears when the first instance has migrated.
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_exits_zero_and_applies_each_message_once() {
    let db = PgDb::create(2).await;
    let nats = NatsStream::create().await;
    // Made here with a short ack_wait, so that anything the stopped instance held comes back fast.
    nats.consumer(DURABLE, Duration::from_secs(3)).await;

    let requests: Vec<CreditRequested> = (0..2_000)
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
    let json = |r: &CreditRequested| serde_json::to_vec(r).unwrap();
    let (first, second) = requests.split_at(1_000);
    nats.publish_all(first.iter().map(json)).await;

    let a = spawn_credit(&db, &nats);
    let b = spawn_credit(&db, &nats);
    wait_until(
        "credit to be applying messages",
        Duration::from_secs(120),
        || async { inbox_rows(&db).await >= 100 },
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
        || async { inbox_rows(&db).await == requests.len() as i64 },
    )
    .await;
    nats.wait_drained(DURABLE).await;
    sigterm(&b);
    let b_out = stop(b).await;
    assert!(applied(&b_out) > 0);

    let balances: BTreeMap<i64, i64> =
        sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(balances, expected, "a request was lost or applied twice");
    assert_eq!(applied(&a_out) + applied(&b_out), requests.len() as u64);
}
