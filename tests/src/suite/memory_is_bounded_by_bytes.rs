//! A worker holds at most its byte budget of messages (`WorkerBuilder::max_bytes`), whatever
//! size producers publish: its pull requests ask for no more bytes than are free, so large
//! messages wait at the server, not in memory, and each is fetched once there is room.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Probe;
use crate::{NatsStream, Running};
use inbox_testkit::Poll;
use std::time::{Duration, Instant};

/// Messages published, each three fifths of the server's `max_payload`: two never fit in a
/// budget of one `max_payload`.
const MESSAGES: usize = 4;

/// Pull requests used to carry no `max_bytes`: a worker of concurrency 4 fetched all four large
/// messages at once (and, batched, concurrency times the batch size), so memory was bounded by
/// concurrency × `max_payload` alone. With a budget of one message (`max_bytes(1)` is raised to
/// one of the largest), one is in flight at a time, and every one is still processed.
async fn large_messages_wait_at_the_server<B: TestBackend>() {
    let (db, inbox) = setup::<B>(6).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let size = nats.client.server_info().max_payload * 3 / 5;
    let pad = "x".repeat(size);
    nats.publish_all((0..MESSAGES).map(|i| {
        // Fields the handler does not know are ignored: the message is an `Entry`.
        format!(r#"{{"key":"big-{i}","account":1,"amount":1,"pad":"{pad}"}}"#).into_bytes()
    }))
    .await;
    let worker = nats
        .worker(inbox, consumer)
        .concurrency(MESSAGES)
        .max_bytes(1)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    // Every run waits at the gate, its message held, until resumed.
    worker.state().pause();
    let run = Running::start(&worker);
    let mut poll = Poll::new(
        "the first message to reach the handler",
        Duration::from_secs(60),
    );
    while worker.state().runs() == 0 {
        poll.tick().await.unwrap();
    }
    // While the handler holds it, the worker fetches no second one: watched for a while (a
    // worker without the bound had all four delivered at once, within milliseconds).
    let watched = Instant::now();
    let mut poll = Poll::new("three seconds of watching", Duration::from_secs(60));
    while watched.elapsed() < Duration::from_secs(3) {
        let info = nats.info("c").await;
        assert_eq!(
            (info.num_ack_pending, worker.state().runs()),
            (1, 1),
            "messages of {size} bytes delivered to a worker whose budget holds one: {info:?}"
        );
        poll.tick().await.unwrap();
    }
    worker.state().resume();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, MESSAGES as u64, "{stats:?}");
    assert_eq!(worker.state().runs(), MESSAGES, "each message ran once");
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM ledger").await,
        MESSAGES as i64
    );
}

/// A consumer whose `max_bytes` (the most one pull request may ask for) is below a message's
/// size: every bounded request was refused for that message, which stayed at the head of the
/// consumer, so nothing behind it was ever processed. One request goes without `max_bytes` then.
async fn a_message_over_the_consumers_max_bytes_is_served<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats
        .js
        .get_stream(&nats.stream)
        .await
        .expect("get stream")
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("c".into()),
            ack_wait: Duration::from_secs(30),
            max_deliver: crate::MAX_DELIVER,
            max_bytes: 2048,
            ..Default::default()
        })
        .await
        .expect("create consumer");
    let pad = "x".repeat(4096);
    nats.publish_all([
        format!(r#"{{"key":"big","account":1,"amount":1,"pad":"{pad}"}}"#).into_bytes(),
        br#"{"key":"small","account":2,"amount":1}"#.to_vec(),
    ])
    .await;
    let worker = nats
        .worker(inbox, consumer)
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert_eq!(stats.acked, 2, "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 2);
}

super::behaviours!(
    large_messages_wait_at_the_server,
    a_message_over_the_consumers_max_bytes_is_served,
);
