//! A rejected message's dead letter reaches the dead-letter stream whoever else rejected the same
//! message, and whatever JetStream control headers its producer set.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Probe;
use crate::{NatsStream, Running};
use inbox_testkit::wait_until;
use std::collections::BTreeSet;
use std::time::Duration;

/// Two handlers (`ledger`, `credit`) on two consumers of one stream both reject message 1. Its
/// letters used to share the msg-id `dlq:<stream>:1`, so JetStream dropped the second as a
/// duplicate, and its original was termed anyway: one rejection without a trace.
async fn repro_dead_letters_of_two_consumers_collide<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let (a, b) = (
        nats.consumer("a", Duration::from_secs(30)).await,
        nats.consumer("b", Duration::from_secs(30)).await,
    );
    nats.publish_all([b"{ not json".to_vec()]).await;
    let ledger = nats
        .worker(inbox.clone(), a)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let credit = nats.worker(inbox, b).build(B::Credit::default()).unwrap();
    let runs = [Running::start(&ledger), Running::start(&credit)];
    wait_until("both to reject", Duration::from_secs(60), async || {
        ledger.stats().terminated == 1 && credit.stats().terminated == 1
    })
    .await
    .unwrap();
    for run in runs {
        run.stop().await;
    }
    let consumers: BTreeSet<String> = nats
        .dead_letters()
        .await
        .iter()
        .map(|(_, h)| h.get("Inbox-Consumer").unwrap().as_str().to_owned())
        .collect();
    assert_eq!(
        consumers,
        BTreeSet::from(["credit".to_owned(), "ledger".to_owned()]),
        "one letter per rejecting consumer"
    );
}

/// A producer such as nats-py (`js.publish(.., stream=S)`) sets `Nats-Expected-Stream: S`. Copied
/// onto the dead letter, it made the dead-letter stream reject every letter (10060): the message
/// was nak'd until `max_deliver` and then lost. Control headers are no longer copied; the
/// original's msg-id is kept as `Inbox-Original-Msg-Id`.
async fn repro_foreign_control_headers_block_the_dead_letter<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Expected-Stream", nats.stream.as_str());
    headers.insert(async_nats::header::NATS_MESSAGE_ID, "order-7");
    headers.insert("Traceparent", "00-abc-def-01");
    nats.js
        .publish_with_headers(nats.subject.clone(), headers, "{ not json".into())
        .await
        .expect("publish")
        .await
        .expect("stored in the source stream");
    let worker = nats
        .worker(inbox, consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until("the dead letter", Duration::from_secs(60), async || {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(
        stats.nacked, 0,
        "the letter was refused at first: {stats:?}"
    );
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let h = &letters[0].1;
    assert!(h.get("Nats-Expected-Stream").is_none());
    assert_eq!(h.get("Inbox-Original-Msg-Id").unwrap().as_str(), "order-7");
    assert_eq!(h.get("Traceparent").unwrap().as_str(), "00-abc-def-01");
}

super::behaviours!(
    repro_dead_letters_of_two_consumers_collide,
    repro_foreign_control_headers_block_the_dead_letter,
);
