//! `credit`'s announcements, process by process: a `credit` SIGKILLed while its outbox relay
//! holds rows it has published (their PubAck came) and not yet marked sent. The next `credit`
//! publishes them again: every PubAck says "duplicate" (`inbox_outbox_republished_total`), the
//! events stream holds one copy of each, and every row ends marked sent.

use inbox_examples::{CreditApplied, CreditRequested};
use inbox_runtime::{Inbox, Outbox};
use inbox_testkit::{CreditProcess, TcpProxy, unique, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::{NatsStream, nats_url};
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);
const REQUESTS: usize = 5;

/// The value of the series `name` in a Prometheus text page, if present.
fn series(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn metrics(url: &str) -> String {
    match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

async fn relay_killed_after_the_puback<B: TestBackend>() {
    let db: TestDb<B::Db> = B::create(2).await;
    // Made here, so that they can be counted from the start.
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    Outbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let (events, events_subject) = (
        format!("{}_EVENTS", nats.stream),
        format!("events.{}", nats.subject),
    );
    let durable = unique("outbox_");
    let log = std::env::temp_dir().join(format!("{}.credit-outbox.log", db.name));
    let env = |hold_ms: u64, metrics_port: u16| {
        vec![
            ("NATS_URL", nats_url()),
            ("DATABASE_URL", db.url.clone()),
            ("CREDIT_STREAM", nats.stream.clone()),
            ("CREDIT_SUBJECT", nats.subject.clone()),
            ("CREDIT_CONSUMER", durable.clone()),
            ("CREDIT_EVENTS_STREAM", events.clone()),
            ("CREDIT_EVENTS_SUBJECT", events_subject.clone()),
            ("CREDIT_CONCURRENCY", "2".into()),
            ("CREDIT_TEST_RELAY_HOLD_MS", hold_ms.to_string()),
            ("METRICS_ADDR", format!("127.0.0.1:{metrics_port}")),
            ("RUST_LOG", "info".into()),
        ]
    };
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_credit"));
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    let first_port = TcpProxy::reserve().unwrap().port;
    let mut first =
        CreditProcess::spawn_with("credit", &binary, &env(600_000, first_port), Some(&log))
            .unwrap();
    let requests: Vec<CreditRequested> = (0..REQUESTS)
        .map(|i| CreditRequested {
            id: format!("o-{i}"),
            account: i as i64,
            amount: 1,
        })
        .collect();
    nats.publish_all(requests.iter().map(|r| serde_json::to_vec(r).unwrap()))
        .await;

    // Every credit committed with its row, some events stored (the relay has their PubAcks),
    // and no row marked sent: the relay holds before its first mark.
    let stored = async || match nats.js.get_stream(&events).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    };
    let unsent = "SELECT count(*) FROM outbox WHERE sent_at IS NULL";
    let applied = "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL";
    wait_until("events stored and none marked sent", DEADLINE, async || {
        B::count(&db, applied).await == REQUESTS as i64
            && B::count(&db, unsent).await == REQUESTS as i64
            && stored().await >= 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    first.kill().await.unwrap();
    // What the killed relay published and never marked: those must come again as duplicates.
    let held = stored().await;
    assert_eq!(B::count(&db, unsent).await, REQUESTS as i64);

    let second_port = TcpProxy::reserve().unwrap().port;
    let second =
        CreditProcess::spawn_with("credit", &binary, &env(0, second_port), Some(&log)).unwrap();
    let page = format!("http://127.0.0.1:{second_port}/metrics");
    wait_until("the rows to be published again", DEADLINE, async || {
        B::count(&db, unsent).await == 0
            && series(&metrics(&page).await, "inbox_outbox_republished_total") == Some(held as f64)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let page = metrics(&page).await;
    assert_eq!(
        series(&page, "inbox_outbox_published_total"),
        Some((REQUESTS as u64 - held) as f64),
        "{page}"
    );
    nats.wait_drained(&durable).await;
    second.stop(DEADLINE).await.unwrap();

    // One copy of each event, as applied.
    let stream = nats.js.get_stream(&events).await.unwrap();
    let last = stream.cached_info().state.last_sequence;
    let mut got = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.unwrap();
        got.push(serde_json::from_slice::<CreditApplied>(&m.payload).unwrap());
    }
    got.sort_by(|a, b| a.id.cmp(&b.id));
    let expected: Vec<CreditApplied> = requests
        .iter()
        .map(|r| CreditApplied {
            id: r.id.clone(),
            account: r.account,
            amount: r.amount,
        })
        .collect();
    assert_eq!(got, expected);
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM outbox").await,
        REQUESTS as i64
    );
    let _ = nats.js.delete_stream(&events).await;
}

macro_rules! on_backend {
    ($name:ident, $backend:ty) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn relay_killed_after_the_puback_is_republished_once() {
                super::relay_killed_after_the_puback::<$backend>().await
            }
        }
    };
}

on_backend!(postgres, inbox_tests::backends::Postgres);
on_backend!(mysql, inbox_tests::backends::MySql);
on_backend!(sqlite, inbox_tests::backends::Sqlite);
