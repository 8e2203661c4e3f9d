//! `credit` with `METRICS_ADDR`: `/metrics` counts what it did, in the Prometheus text format, and
//! `/healthz` turns unhealthy (503, `"database": false`) while its database is cut (a proxy of
//! the test's own between them), and healthy again once the database is back.

use inbox_examples::CreditRequested;
use inbox_testkit::{CreditProcess, TcpProxy, unique, wait_until, with_database};
use inbox_tests::backends::{Postgres, TestBackend};
use inbox_tests::{NatsStream, nats_url};
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);

async fn get(url: &str) -> Option<(u16, String)> {
    let response = reqwest::get(url).await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_and_healthz_follows_the_database() {
    let db = Postgres::create(2).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    proxy.start("127.0.0.1:5432").await.unwrap();
    let database_url = with_database(
        &format!("postgres://postgres@127.0.0.1:{}/x", proxy.port),
        &db.name,
    );
    let nats = NatsStream::create().await;
    let metrics_port = TcpProxy::reserve().unwrap().port;
    let base = format!("http://127.0.0.1:{metrics_port}");
    let log = std::env::temp_dir().join(format!("{}.credit-metrics.log", db.name));
    let env = [
        ("NATS_URL", nats_url()),
        ("DATABASE_URL", database_url),
        ("CREDIT_STREAM", nats.stream.clone()),
        ("CREDIT_SUBJECT", nats.subject.clone()),
        ("CREDIT_EVENTS_STREAM", format!("{}_EVENTS", nats.stream)),
        ("CREDIT_EVENTS_SUBJECT", format!("events.{}", nats.subject)),
        ("CREDIT_CONSUMER", unique("metrics_")),
        ("CREDIT_CONCURRENCY", "2".into()),
        ("METRICS_ADDR", format!("127.0.0.1:{metrics_port}")),
    ];
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_credit"));
    let credit = CreditProcess::spawn_with("credit", &binary, &env, Some(&log)).unwrap();
    let healthz = format!("{base}/healthz");
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();

    wait_until("/healthz to answer 200", DEADLINE, async || {
        matches!(get(&healthz).await, Some((200, _)))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));

    let credits = (0..5).map(|i| {
        serde_json::to_vec(&CreditRequested {
            id: format!("m-{i}"),
            account: 1,
            amount: 1,
        })
        .unwrap()
    });
    nats.publish_all(credits).await;
    let line = "inbox_messages_total{consumer=\"credit\",outcome=\"ack\"} 5";
    let acked = wait_until("/metrics to count 5 acks", DEADLINE, async || {
        get(&format!("{base}/metrics"))
            .await
            .is_some_and(|(status, body)| status == 200 && body.contains(line))
    })
    .await;
    let (_, body) = get(&format!("{base}/metrics")).await.unwrap();
    if let Err(e) = acked {
        panic!("{e}: {body}");
    }
    assert!(body.contains("inbox_handler_seconds"), "{body}");

    proxy.cut();
    wait_until(
        "/healthz to answer 503 with the database cut",
        DEADLINE,
        async || {
            get(&healthz)
                .await
                .is_some_and(|(status, body)| status == 503 && body.contains("\"database\":false"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));

    proxy.start("127.0.0.1:5432").await.unwrap();
    wait_until("/healthz to answer 200 again", DEADLINE, async || {
        matches!(get(&healthz).await, Some((200, _)))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));

    let summary = credit.stop(DEADLINE).await.unwrap();
    assert_eq!(summary.applied, 5);
    let _ = std::fs::remove_file(&log);
}
