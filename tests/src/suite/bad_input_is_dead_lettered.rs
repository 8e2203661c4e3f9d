//! Bad input is dead-lettered with a reason naming the problem, and the stream never stalls: the
//! messages behind it are processed. A large (just under 1 MiB) valid payload is processed.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::time::Duration;

/// The test.
async fn bad_input_is_dead_lettered_and_does_not_block<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let entry = |key: String| Entry::new(key, 1, 1).json();
    // (payload, what the dead letter's reason must say)
    let bad: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "does not decode"),
        (
            br#"{"key": 5, "account": "x", "amount": 1}"#.to_vec(),
            "invalid type",
        ),
        (
            br#"{"account": 1, "amount": 1}"#.to_vec(),
            "missing field `key`",
        ),
        (entry(String::new()), "key is empty"),
        (entry("x".repeat(256)), "256 bytes long"),
        (vec![0xff, 0xfe, 0x00, 0x7b], "does not decode"),
    ];
    let big = format!(
        r#"{{"key": "big", "account": 2, "amount": 3, "padding": "{}"}}"#,
        "p".repeat(1_000_000)
    );
    let mut payloads: Vec<Vec<u8>> = bad.iter().map(|(p, _)| p.clone()).collect();
    payloads.push(big.into_bytes());
    payloads.extend((0..5).map(|i| entry(format!("good-{i}"))));
    nats.publish_all(payloads).await;

    // One at a time: the bad messages at the head must not block what follows.
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(1)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "every message to be handled",
        Duration::from_secs(60),
        || async {
            let s = worker.stats();
            s.acked == 6 && s.terminated == bad.len() as u64
        },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.nacked, 0);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 6);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 6);

    let mut letters = nats.dead_letters().await;
    assert_eq!(letters.len(), bad.len());
    // In the order of the messages; batched, a batch's failing messages are handled after it.
    letters.sort_by_key(|(payload, _)| bad.iter().position(|(sent, _)| sent == payload));
    for ((payload, headers), (sent, reason)) in letters.iter().zip(&bad) {
        assert_eq!(
            payload, sent,
            "the dead letter carries the original payload"
        );
        let error = headers.get("Inbox-Error").map(|v| v.as_str().to_owned());
        assert!(
            error.as_deref().is_some_and(|e| e.contains(reason)),
            "expected {reason:?} in {error:?}"
        );
        for h in [
            "Inbox-Consumer",
            "Inbox-Stream",
            "Inbox-Stream-Seq",
            "Inbox-Delivered",
        ] {
            assert!(headers.get(h).is_some(), "missing {h}");
        }
        assert_eq!(headers.get("Inbox-Stream").unwrap().as_str(), nats.stream);
    }
}

super::behaviours!(bad_input_is_dead_lettered_and_does_not_block);
