//! A rejected message's dead letter reaches the dead-letter stream whoever else rejected the same
//! message, and whatever JetStream control headers its producer set.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use crate::{MAX_DELIVER, NatsStream, Running};
use async_nats::jetstream::stream;
use inbox_runtime::{Handler, Stats, Worker};
use inbox_testkit::wait_until;
use std::collections::BTreeSet;
use std::time::Duration;

/// Runs `worker` until it has dead-lettered one message, then stops it and returns what it did.
async fn until_one_is_dead_lettered<H>(worker: &Worker<H>) -> Stats
where
    H: Handler,
    H::Message: serde::de::DeserializeOwned,
{
    let run = Running::start(worker);
    wait_until("the dead letter", Duration::from_secs(60), async || {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    run.stop().await
}

/// Runs a `ledger` worker of `consumer` until it has dead-lettered one message, which must be
/// the stream's only letter, stored at the first try (no nak): returns it.
async fn only_letter_stored_at_first<B: TestBackend>(
    nats: &NatsStream,
    inbox: inbox_runtime::Inbox<B::Db>,
    consumer: async_nats::jetstream::consumer::PullConsumer,
) -> (Vec<u8>, async_nats::HeaderMap) {
    let worker = nats
        .worker(inbox, consumer)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let stats = until_one_is_dead_lettered(&worker).await;
    assert_eq!(
        stats.nacked, 0,
        "the letter was refused at first: {stats:?}"
    );
    let mut letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    letters.remove(0)
}

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
    let stats = until_one_is_dead_lettered(&worker).await;
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

/// On the last delivery, a letter the dead-letter stream would not take (it was down, full,
/// or, here, did not hold the letters' subject) was nak'd like on any other: but JetStream
/// never redelivers after `max_deliver`, so the message vanished without a trace. Now the letter
/// is kept in the database, the original termed, and the worker publishes the letter as soon as
/// the stream takes it.
async fn repro_unstorable_letter_on_the_last_delivery_is_lost<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    // The dead-letter stream exists, but listens elsewhere: every letter finds no stream.
    let parked = |subject: String| stream::Config {
        name: nats.dlq_stream.clone(),
        subjects: vec![subject],
        ..Default::default()
    };
    let elsewhere = format!("elsewhere.{}", nats.stream.to_lowercase());
    nats.js.create_stream(parked(elsewhere)).await.unwrap();
    nats.publish_all([b"{ not json".to_vec()]).await;
    let worker = nats
        .worker(inbox, consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the message to be terminated",
        Duration::from_secs(60),
        async || worker.stats().terminated == 1,
    )
    .await
    .unwrap();
    let kept = "SELECT count(*) FROM inbox_dead_letters";
    assert_eq!(
        B::count(&db, kept).await,
        1,
        "the letter is kept in the database"
    );
    assert!(nats.dead_letters().await.is_empty());
    // The term is sent without a reply and applied by the server on its own time: wait for it.
    nats.wait_drained("c").await;
    let info = nats.info("c").await;
    assert_eq!(info.delivered.consumer_sequence, MAX_DELIVER as u64);
    assert_eq!(info.ack_floor.stream_sequence, 1, "the original is termed");

    // The stream takes letters again: the kept one is published, once, and forgotten.
    let letters = format!("{}.>", nats.dlq_prefix);
    nats.js.update_stream(parked(letters)).await.unwrap();
    wait_until(
        "the kept letter to be published",
        Duration::from_secs(60),
        async || B::count(&db, kept).await == 0,
    )
    .await
    .unwrap();
    run.stop().await;
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let (payload, headers) = &letters[0];
    assert_eq!(payload, b"{ not json");
    assert_eq!(headers.get("Inbox-Consumer").unwrap().as_str(), "ledger");
    assert_eq!(
        headers.get("Inbox-Delivered").unwrap().as_str(),
        MAX_DELIVER.to_string()
    );
    assert!(headers.get("Inbox-Error").is_some());
}

/// A message whose payload is close to the server's `max_payload` got a letter with headers
/// added that no longer fit: every publish failed, and after `max_deliver` the message was
/// gone. Now the letter is stored with its payload cut and `Inbox-Truncated` giving the
/// original length (its stream and sequence say where to fetch it whole).
async fn repro_letter_too_large_for_the_server_is_lost<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let max = nats.client.server_info().max_payload;
    let mut poison = b"{ not json ".to_vec();
    poison.resize(max - 64, b'x');
    nats.publish_all([poison.clone()]).await;
    let (payload, headers) = &only_letter_stored_at_first::<B>(&nats, inbox, consumer).await;
    assert_eq!(
        headers.get("Inbox-Truncated").unwrap().as_str(),
        poison.len().to_string()
    );
    assert!(payload.len() < poison.len() && poison.starts_with(payload));
    assert_eq!(headers.get("Inbox-Stream").unwrap().as_str(), nats.stream);
    assert_eq!(headers.get("Inbox-Stream-Seq").unwrap().as_str(), "1");
}

/// A business UNIQUE violation dead-letters the message. The letter's `Inbox-Error` was the
/// database's message, which on MySQL names the row's values (`Duplicate entry '424242' for key
/// ..`): data of the business table travelled on in a header. It now holds our words (kind,
/// SQLSTATE, constraint); the full message stays in the log.
async fn repro_dead_letter_error_shows_row_values<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let first = Entry::new("k1", 424242, 1);
    let same_reference = Entry::new("k2", 424242, 1);
    nats.publish_all([first.json(), same_reference.json()])
        .await;
    let worker = nats
        .worker(inbox, consumer)
        .build(B::Payment::default())
        .unwrap();
    until_one_is_dead_lettered(&worker).await;
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let error = letters[0].1.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(
        !error.contains("424242"),
        "a row value in the letter: {error}"
    );
    assert!(error.contains("unique violation"), "{error}");
}

/// The dead-letter stream deleted while the worker runs (an operator cleaning up) is created
/// again for the next letter: before, the worker remembered it as ready, every later letter
/// failed with "no stream", its message burned its deliveries and its letter stayed parked
/// until a restart.
async fn deleted_dead_letter_stream_is_created_again<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let worker = nats
        .worker(inbox, consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all([b"{ first, not json".to_vec()]).await;
    wait_until("the first letter", Duration::from_secs(60), async || {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    nats.js
        .delete_stream(&nats.dlq_stream)
        .await
        .expect("delete the dead-letter stream");
    nats.publish_all([b"{ second, not json".to_vec()]).await;
    wait_until(
        "the second letter, in a new stream",
        Duration::from_secs(60),
        async || nats.dead_letters().await.len() == 1,
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(stats.terminated, 2, "{stats:?}");
    assert_eq!(
        stats.nacked, 0,
        "the second letter was refused at first: {stats:?}"
    );
    let letters = nats.dead_letters().await;
    assert_eq!(letters[0].0, b"{ second, not json");
}

/// A message whose header block is near JetStream's 64 KiB limit (a foreign producer's) got a
/// letter with our headers added that JetStream refused (error 10097) at every try: nak'd
/// through every delivery, then parked and refused for ever. Now the letter leaves the
/// original's headers out and says so (`Inbox-Headers-Dropped`); its payload is whole.
async fn repro_letter_headers_over_64k_are_never_stored<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let big = "v".repeat(65_400);
    let poison = b"{ not json".to_vec();
    inbox_testkit::publish_raw(nats.url(), &nats.subject, &[("X-Big", &big)], &poison)
        .await
        .expect("JetStream stores a header block under 64 KiB");
    let (payload, headers) = &only_letter_stored_at_first::<B>(&nats, inbox, consumer).await;
    assert_eq!(payload, &poison, "the payload, whole");
    assert!(headers.get("X-Big").is_none());
    let dropped: usize = headers
        .get("Inbox-Headers-Dropped")
        .unwrap()
        .as_str()
        .parse()
        .unwrap();
    assert!(dropped > 65_400, "{dropped}");
    assert!(headers.get("Inbox-Truncated").is_none());
    assert_eq!(headers.get("Inbox-Stream-Seq").unwrap().as_str(), "1");
}

super::behaviours!(
    deleted_dead_letter_stream_is_created_again,
    repro_dead_letter_error_shows_row_values,
    repro_unstorable_letter_on_the_last_delivery_is_lost,
    repro_letter_too_large_for_the_server_is_lost,
    repro_letter_headers_over_64k_are_never_stored,
    repro_dead_letters_of_two_consumers_collide,
    repro_foreign_control_headers_block_the_dead_letter,
);
