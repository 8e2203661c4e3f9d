//! Every stored message ends applied or dead-lettered, also when its last delivery ends without
//! a verdict: the process holding it died, or the client could not even read it (a header block
//! from another client that async-nats cannot parse). The delivery-limit backstop dead-letters
//! such a message from the server's advisory, unless its marker is committed.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use inbox_runtime::{App, Durable, Inbox, Outcome, UNREADABLE_HEADERS};
use inbox_testkit::wait_until;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Takes `n` messages of `consumer` and drops them unanswered: a process that fetched them and
/// was killed before it could ack, nak or term them.
async fn take_and_die(consumer: &PullConsumer, n: usize) {
    let mut batch = consumer
        .batch()
        .max_messages(n)
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .expect("pull");
    for _ in 0..n {
        let message = batch.next().await.expect("a message").expect("a message");
        let info = message.info().expect("a JetStream message");
        assert_eq!(info.delivered, 1);
    }
}

/// Waits until the backstop's consumer of `durable` on the test's advisory stream has nothing
/// pending and nothing awaiting an ack, having seen at least `advisories`.
async fn backstop_drained(nats: &NatsStream, durable: &str, advisories: u64) {
    let advisory_stream = inbox_runtime::advisory_stream_name(&nats.stream);
    let backstop = format!("inbox_backstop_{}_{durable}", nats.stream);
    wait_until(
        "the backstop to handle every advisory",
        Duration::from_secs(60),
        async || {
            let Ok(stream) = nats.js.get_stream(&advisory_stream).await else {
                return false;
            };
            let Ok(mut consumer) = stream
                .get_consumer::<jetstream::consumer::pull::Config>(&backstop)
                .await
            else {
                return false;
            };
            let Ok(info) = consumer.info().await else {
                return false;
            };
            info.delivered.stream_sequence >= advisories
                && info.num_pending == 0
                && info.num_ack_pending == 0
        },
    )
    .await
    .unwrap();
}

/// A worker with the backstop, on a connection of its own (another instance).
async fn instance<B: TestBackend>(
    nats: &NatsStream,
    inbox: &Inbox<B::Db>,
    durable: &str,
) -> (inbox_runtime::Worker<B::Credit>, Running) {
    let on = nats.consumer_on_new_connection(durable).await;
    let worker = nats
        .worker(inbox.clone(), on)
        .backstop()
        .build(B::Credit::default())
        .unwrap();
    let run = Running::start(&worker);
    (worker, run)
}

/// Runs a first instance of `durable`'s worker with the backstop until it has made its advisory
/// stream, then stops it; returns the stream's name.
async fn advisory_stream_made<B: TestBackend>(
    nats: &NatsStream,
    inbox: &Inbox<B::Db>,
    durable: &str,
) -> String {
    let (_, first) = instance::<B>(nats, inbox, durable).await;
    let advisory_stream = inbox_runtime::advisory_stream_name(&nats.stream);
    wait_until("the advisory stream", Duration::from_secs(30), async || {
        nats.js.get_stream(&advisory_stream).await.is_ok()
    })
    .await
    .unwrap();
    first.stop().await;
    advisory_stream
}

/// A process killed while it holds a message on its last delivery: the message is dead-lettered,
/// once, with two instances running the backstop and the advisory repeated; the advisory is kept
/// while no instance runs.
async fn a_death_on_the_last_delivery_is_dead_lettered_once<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer_with("c", Duration::from_secs(1), 1).await;
    let advisory_stream = advisory_stream_made::<B>(&nats, &inbox, "c").await;

    let payload = Entry::new("k-1", 1, 5).json();
    nats.publish_all([payload.clone()]).await;
    take_and_die(&consumer, 1).await;

    let (a, run_a) = instance::<B>(&nats, &inbox, "c").await;
    let (b, run_b) = instance::<B>(&nats, &inbox, "c").await;
    wait_until("the dead letter", Duration::from_secs(60), async || {
        !nats.dead_letters().await.is_empty()
    })
    .await
    .unwrap();
    backstop_drained(&nats, "c", 1).await;
    // The same advisory again (the server repeats one around a leader change).
    let stream = nats.js.get_stream(&advisory_stream).await.unwrap();
    let advisory = stream.get_raw_message(1).await.unwrap();
    nats.js
        .publish(advisory.subject.clone(), advisory.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    backstop_drained(&nats, "c", 2).await;
    run_a.stop().await;
    run_b.stop().await;

    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1, "one letter: {letters:?}");
    let (body, headers) = &letters[0];
    assert_eq!(body, &payload, "the payload, intact");
    let error = headers.get("Inbox-Error").unwrap().as_str();
    assert!(error.contains("delivery limit"), "{error}");
    assert_eq!(headers.get("Inbox-Stream-Seq").unwrap().as_str(), "1");
    assert_eq!(headers.get("Inbox-Consumer").unwrap().as_str(), "credit");
    let markers = B::count(&db, "SELECT count(*) FROM inbox").await;
    assert_eq!(markers, 0, "never applied");
    assert_eq!(a.stats().acked + b.stats().acked, 0);
}

/// A message whose effect committed but whose ack was lost on its last delivery: no letter. The
/// message beside it, never applied, is dead-lettered: the backstop ran.
async fn committed_but_unacked_on_the_last_delivery_is_not_dead_lettered<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer_with("c", Duration::from_secs(1), 1).await;
    advisory_stream_made::<B>(&nats, &inbox, "c").await;

    let (done, lost) = (Entry::new("done", 1, 5), Entry::new("lost", 2, 7));
    nats.publish_all([done.json(), lost.json()]).await;
    // `done`'s effect commits (by an instance whose ack then never arrived).
    let outcome = inbox
        .process(
            &B::Credit::default(),
            &(),
            done.clone(),
            &inbox_runtime::Delivery::default(),
        )
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Ack);
    take_and_die(&consumer, 2).await;

    let (_, run) = instance::<B>(&nats, &inbox, "c").await;
    backstop_drained(&nats, "c", 2).await;
    run.stop().await;
    let letters = nats.dead_letters().await;
    assert_eq!(
        letters.len(),
        1,
        "only the message never applied: {letters:?}"
    );
    assert_eq!(letters[0].0, lost.json());
    let markers = B::count(&db, "SELECT count(*) FROM inbox").await;
    assert_eq!(markers, 1);
}

/// The header lines of the poison messages: each valid but for one line async-nats 0.51 cannot
/// parse (it drops its connection when such a message is delivered).
fn poison_lines() -> [Vec<Vec<u8>>; 3] {
    let ok = b"X-Ok: fine".to_vec();
    [
        vec![ok.clone(), "X-Ünïcode: v".as_bytes().to_vec()],
        vec![ok.clone(), b"X-Bin: \xff\xfe".to_vec()],
        vec![ok, b"X\x01Ctl: v".to_vec()],
    ]
}

/// Three messages whose header block the client cannot parse, sent over a raw connection: each
/// ends dead-lettered with its payload intact within `max_deliver` × `ack_wait` and a few
/// seconds; a second handler of the same `App`, on a connection of its own, is never
/// interrupted and keeps processing; cleanup's progress read survives them.
async fn unreadable_headers_are_dead_lettered<B: TestBackend>() {
    crate::init_tracing();
    let (db, inbox) = setup::<B>(8).await;
    let poisoned = NatsStream::create().await;
    let healthy = NatsStream::create().await;
    let (ack_wait, max_deliver) = (Duration::from_secs(2), 3);
    let credit = poisoned
        .consumer_with("credit", ack_wait, max_deliver)
        .await;
    healthy.consumer("ledger", Duration::from_secs(30)).await;

    // Each handler's connection counts its disconnections, in the order the app opens them.
    let drops: Arc<Vec<AtomicUsize>> = Arc::new((0..2).map(|_| AtomicUsize::new(0)).collect());
    let opened = Arc::new(AtomicUsize::new(0));
    let url = poisoned.url().to_owned();
    let connect = {
        let (drops, opened) = (drops.clone(), opened.clone());
        move || {
            let (url, drops) = (url.clone(), drops.clone());
            let i = opened.fetch_add(1, Ordering::SeqCst).min(1);
            async move {
                let client = async_nats::ConnectOptions::new()
                    .event_callback(move |event| {
                        let drops = drops.clone();
                        async move {
                            if matches!(event, async_nats::Event::Disconnected) {
                                drops[i].fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                    .connect(url)
                    .await?;
                Ok(jetstream::new(client))
            }
        }
    };
    let dlq = |n: &NatsStream| (n.dlq_stream.clone(), n.dlq_prefix.clone());
    let (credit_dlq, ledger_dlq) = (dlq(&poisoned), dlq(&healthy));
    let app = App::new(inbox.clone(), &poisoned.js)
        .pull_connections(connect)
        .handler_configured(
            B::Credit::default(),
            (),
            Durable::existing(&poisoned.stream, "credit"),
            move |w| w.dead_letters(credit_dlq.0.clone(), credit_dlq.1.clone()),
        )
        .handler_configured(
            B::LedgerByTransportId::default(),
            (),
            Durable::existing(&healthy.stream, "ledger"),
            move |w| w.dead_letters(ledger_dlq.0.clone(), ledger_dlq.1.clone()),
        );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(app.run_until(shutdown.clone()));
    wait_until(
        "both handlers' connections",
        Duration::from_secs(30),
        async || opened.load(Ordering::SeqCst) == 2,
    )
    .await
    .unwrap();

    let payloads: Vec<Vec<u8>> = (0..3)
        .map(|i| Entry::new(format!("p-{i}"), i, 1).json())
        .collect();
    for (lines, payload) in poison_lines().iter().zip(&payloads) {
        inbox_testkit::publish_raw_lines(poisoned.url(), &poisoned.subject, lines, payload)
            .await
            .unwrap();
    }
    let published = Instant::now();

    // Cleanup reads the consumer's oldest unacked message: one of those.
    wait_until(
        "the poison to be delivered",
        Duration::from_secs(30),
        async || poisoned.info("credit").await.num_ack_pending > 0,
    )
    .await
    .unwrap();
    let cleanup = async || {
        let retention = Duration::from_secs(3600);
        inbox
            .cleanup_behind("credit", &poisoned.js, &credit, retention, 100)
            .await
    };
    let pass = cleanup().await;
    assert!(pass.is_ok(), "cleanup behind the poison: {pass:?}");

    // Within max_deliver × ack_wait and a few seconds, the three letters; the other handler
    // keeps processing meanwhile, a message a round.
    let bound = ack_wait * max_deliver as u32 + Duration::from_secs(10);
    let rounds = AtomicUsize::new(0);
    wait_until(
        "three letters",
        bound.saturating_sub(published.elapsed()),
        async || {
            let round = rounds.fetch_add(1, Ordering::SeqCst) + 1;
            healthy
                .publish_all([Entry::new(format!("h-{round}"), 1, 1).json()])
                .await;
            healthy.wait_drained("ledger").await;
            poisoned.dead_letters().await.len() >= 3
        },
    )
    .await
    .unwrap();
    let rounds = rounds.load(Ordering::SeqCst);

    let letters = poisoned.dead_letters().await;
    assert_eq!(letters.len(), 3, "{letters:?}");
    let mut bodies: Vec<Vec<u8>> = letters.iter().map(|(b, _)| b.clone()).collect();
    bodies.sort();
    let mut expected = payloads.clone();
    expected.sort();
    assert_eq!(bodies, expected, "every payload intact");
    for (_, headers) in &letters {
        assert_eq!(headers.get("X-Ok").map(|v| v.as_str()), Some("fine"));
        let carried = headers
            .get(UNREADABLE_HEADERS)
            .expect("the unreadable line");
        assert!(!carried.as_str().is_empty());
    }
    let healthy_markers = B::count(
        &db,
        "SELECT count(*) FROM inbox WHERE consumer = 'ledger_by_transport_id'",
    )
    .await;
    assert_eq!(healthy_markers, rounds as i64);
    assert!(
        drops[0].load(Ordering::SeqCst) >= 1,
        "the poisoned handler's connection dropped (else async-nats reads such headers now)"
    );
    assert_eq!(
        drops[1].load(Ordering::SeqCst),
        0,
        "the other handler's connection was never interrupted"
    );
    let pass = cleanup().await;
    assert!(pass.is_ok(), "cleanup after: {pass:?}");
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

/// An advisory about a consumer since deleted and created again (a reset to replay) names a
/// message the new consumer is to deliver afresh, or never (here: it delivers only new
/// messages): it is ignored, where it used to dead-letter that message.
async fn an_advisory_of_an_earlier_consumer_is_ignored<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer_with("c", Duration::from_secs(1), 1).await;
    let advisory_stream = advisory_stream_made::<B>(&nats, &inbox, "c").await;
    nats.publish_all([Entry::new("old", 1, 5).json()]).await;
    take_and_die(&consumer, 1).await;
    // The server publishes the advisory once the consumer is pulled from again.
    let advisories = nats.js.get_stream(&advisory_stream).await.unwrap();
    wait_until("the advisory", Duration::from_secs(30), async || {
        let _ = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_millis(200))
            .messages()
            .await;
        let mut advisories = advisories.clone();
        advisories.info().await.is_ok_and(|i| i.state.messages > 0)
    })
    .await
    .unwrap();
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    stream.delete_consumer("c").await.unwrap();
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("c".to_owned()),
            ack_wait: Duration::from_secs(1),
            max_deliver: 1,
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    let (_, run) = instance::<B>(&nats, &inbox, "c").await;
    backstop_drained(&nats, "c", 1).await;
    run.stop().await;
    assert!(nats.dead_letters().await.is_empty(), "no letter");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

/// A header value with a bare CR kills the client's connection for good (see
/// `tests/client_drops_unreadable_headers.rs`): the app's health says so, so that its
/// supervisor restarts it, rather than the handler sitting on a dead connection.
async fn a_dead_pull_connection_makes_the_app_unhealthy<B: TestBackend>() {
    let (_db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;
    let url = nats.url().to_owned();
    let (dlq, prefix) = (nats.dlq_stream.clone(), nats.dlq_prefix.clone());
    let app = App::new(inbox, &nats.js)
        .pull_connections(move || {
            let url = url.clone();
            async move { Ok(jetstream::new(async_nats::connect(url).await?)) }
        })
        .handler_configured(
            B::Credit::default(),
            (),
            Durable::existing(&nats.stream, "c"),
            move |w| w.dead_letters(dlq.clone(), prefix.clone()),
        );
    let health = app.health();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(app.run_until(shutdown.clone()));
    wait_until(
        "the app to be healthy",
        Duration::from_secs(30),
        async || health.check().await.healthy(),
    )
    .await
    .unwrap();
    let payload = Entry::new("cr", 1, 1).json();
    inbox_testkit::publish_raw_lines(
        nats.url(),
        &nats.subject,
        &[b"X-Cr: a\rb".to_vec()],
        &payload,
    )
    .await
    .unwrap();
    wait_until(
        "the app to say it is not",
        Duration::from_secs(30),
        async || !health.check().await.nats,
    )
    .await
    .unwrap();
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

/// Advisories anyone could publish on this consumer's advisory subject, whose bodies name
/// another stream: one whose message the backstop would dead-letter under this consumer, and
/// one too long for a JetStream API subject (the server would close the connection at every
/// try). Both are acked and ignored: no letter, nothing left pending.
async fn forged_advisories_naming_another_stream_are_ignored<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    nats.consumer_with("c", Duration::from_secs(1), 1).await;
    advisory_stream_made::<B>(&nats, &inbox, "c").await;
    let victim = NatsStream::create().await;
    victim.publish_all([Entry::new("v-1", 1, 5).json()]).await;
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.c",
        nats.stream
    );
    for stream in [victim.stream.clone(), format!("S{}", "x".repeat(5000))] {
        let body = serde_json::json!({
            "type": "io.nats.jetstream.advisory.v1.max_deliver",
            "id": "forged",
            "stream": stream,
            "consumer": "c",
            "stream_seq": 1,
            "deliveries": 1,
        });
        let body = serde_json::to_vec(&body).unwrap();
        let ack = nats.js.publish(subject.clone(), body.into()).await.unwrap();
        ack.await
            .expect("the advisory stream stores the forged advisory");
    }
    let (_, run) = instance::<B>(&nats, &inbox, "c").await;
    backstop_drained(&nats, "c", 2).await;
    run.stop().await;
    assert!(nats.dead_letters().await.is_empty(), "no letter");
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 0);
}

super::behaviours!(
    a_death_on_the_last_delivery_is_dead_lettered_once,
    committed_but_unacked_on_the_last_delivery_is_not_dead_lettered,
    unreadable_headers_are_dead_lettered,
    an_advisory_of_an_earlier_consumer_is_ignored,
    forged_advisories_naming_another_stream_are_ignored,
    a_dead_pull_connection_makes_the_app_unhealthy,
);
