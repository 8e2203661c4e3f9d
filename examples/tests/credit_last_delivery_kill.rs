//! A `credit` process SIGKILLed while it holds a message on its last delivery (the test-only
//! hold `CREDIT_TEST_LAST_DELIVERY_HOLD_MS`, before the handler's first statement), on every
//! backend. JetStream never delivers that message again; the delivery-limit backstop of the two
//! instances then running (the other one and the killed one's replacement) dead-letters it
//! exactly once: one letter naming its stream and sequence, with its payload, saying that the
//! delivery limit was reached without a verdict; no marker, no balance.
//!
//! On a private nats-server (whichever binary the pass selects, `INBOX_NATS_SERVER`), so that
//! the dead-letter stream and the advisories are the test's alone.

use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use inbox_examples::CreditRequested;
use inbox_runtime::BACKSTOP_ERROR;
use inbox_runtime::Inbox;
use inbox_testkit::{
    CreditConfig, CreditProcess, LastDeliveryHolds, PrivateNats, backlog, publish_acked, unique,
    wait_until,
};
use inbox_tests::backends::{TestBackend, TestDb};
use std::path::PathBuf;
use std::time::Duration;

const DURABLE: &str = "credit_last";
/// The consumer's `max_deliver`: the first delivery is the last.
const MAX_DELIVER: i64 = 1;
/// Short, so that the advisory comes soon after the kill.
const ACK_WAIT: Duration = Duration::from_secs(2);
const DEADLINE: Duration = Duration::from_secs(120);
/// The runtime's default dead-letter stream, which `credit` uses.
const DLQ_STREAM: &str = "INBOX_DLQ";

/// Every letter of the dead-letter stream: (payload, headers), none while it does not exist.
async fn letters(js: &jetstream::Context) -> Vec<(Vec<u8>, async_nats::HeaderMap)> {
    let Ok(mut dlq) = js.get_stream(DLQ_STREAM).await else {
        return Vec::new();
    };
    let state = dlq
        .info()
        .await
        .expect("dead-letter stream info")
        .state
        .clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = dlq.get_raw_message(seq).await {
            out.push((m.payload.to_vec(), m.headers));
        }
    }
    out
}

/// Whether every consumer of `stream` has nothing pending and nothing awaiting an ack (false
/// while it has none, or does not exist).
async fn consumers_drained(js: &jetstream::Context, stream: &str) -> bool {
    use futures::StreamExt;
    let Ok(handle) = js.get_stream(stream).await else {
        return false;
    };
    let names: Vec<String> = handle
        .consumer_names()
        .filter_map(|n| async move { n.ok() })
        .collect()
        .await;
    let mut drained = !names.is_empty();
    for name in names {
        drained &= backlog(js, stream, &name).await.is_ok_and(|b| b.drained());
    }
    drained
}

async fn killed_on_its_last_delivery_is_dead_lettered_once<B: TestBackend>() {
    let db: TestDb<B::Db> = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = PrivateNats::start().await.unwrap_or_else(|e| panic!("{e}"));
    let js = jetstream::new(inbox_testkit::connect(&nats.url).await.unwrap());
    let name = unique("LAST_");
    let subject = format!("last.{}", name.to_lowercase());
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("a stream");
    let mut consumer: PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_wait: ACK_WAIT,
            max_deliver: MAX_DELIVER,
            filter_subject: subject.clone(),
            ..Default::default()
        })
        .await
        .expect("a consumer");

    let config = CreditConfig {
        binary: env!("CARGO_BIN_EXE_credit").into(),
        nats_url: nats.url.clone(),
        database_url: db.url.clone(),
        stream: name.clone(),
        subject: subject.clone(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
    let mut env = config.env();
    env.push(("CREDIT_TEST_LAST_DELIVERY_HOLD_MS", "600000".into()));
    env.push(("CREDIT_CONCURRENCY", "2".into()));
    let log = |k: usize| -> PathBuf {
        std::env::temp_dir().join(format!("{}.credit-last-{k}.log", db.name))
    };
    let logs = || {
        (0..2)
            .map(|k| std::fs::read_to_string(log(k)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let spawn = |k: usize| CreditProcess::spawn_with("credit", &config.binary, &env, Some(&log(k)));
    let mut holds: Vec<LastDeliveryHolds> =
        (0..2).map(|k| LastDeliveryHolds::new(&log(k))).collect();
    let mut children: Vec<CreditProcess> = (0..2).map(|k| spawn(k).unwrap()).collect();
    // Both pulling before the message exists.
    wait_until("both instances to pull", DEADLINE, async || {
        consumer.info().await.is_ok_and(|i| i.num_waiting >= 2)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));

    let request = CreditRequested {
        id: "last-0".into(),
        account: 7,
        amount: 1,
    };
    let payload = serde_json::to_vec(&request).unwrap();
    let acks = publish_acked(&js, &subject, [payload.clone()])
        .await
        .unwrap();
    let seq = acks[0].sequence;

    // The instance holding it on its (first and) last delivery dies there.
    let mut holder = None;
    wait_until("an instance to hold the message", DEADLINE, async || {
        for (k, h) in holds.iter_mut().enumerate() {
            if h.held().unwrap().contains(&seq) {
                holder = Some(k);
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let k = holder.unwrap();
    children[k].kill().await.unwrap();
    assert!(
        holds[k].held().unwrap().contains(&seq),
        "credit #{k} let the message go before it died\n{}",
        logs()
    );
    // Two instances run the backstop again.
    holds[k].restart();
    children[k] = spawn(k).unwrap();

    let ours = |headers: &async_nats::HeaderMap| {
        let header = |n: &str| headers.get(n).map(|v| v.as_str().to_owned());
        header("Inbox-Stream").as_deref() == Some(name.as_str())
            && header("Inbox-Stream-Seq") == Some(seq.to_string())
    };
    wait_until("the message to be dead-lettered", DEADLINE, async || {
        letters(&js).await.iter().any(|(_, h)| ours(h))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: the message was lost\n{}", logs()));
    // Every advisory answered by the instances, and the consumer drained: nothing more to come.
    let advisories = inbox_runtime::advisory_stream_name(&name);
    wait_until(
        "the backstop to answer every advisory",
        DEADLINE,
        async || {
            consumers_drained(&js, &advisories).await
                && backlog(&js, &name, DURABLE)
                    .await
                    .is_ok_and(|b| b.drained())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    for (k, child) in children.into_iter().enumerate() {
        child
            .stop(DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("credit #{k}: {e}\n{}", logs()));
    }

    let letters = letters(&js).await;
    assert_eq!(letters.len(), 1, "one letter, and only ours: {letters:?}");
    let (letter, headers) = &letters[0];
    assert!(ours(headers), "{headers:?}");
    assert_eq!(letter, &payload, "the letter carries the message's payload");
    let header = |n: &str| headers.get(n).map(|v| v.as_str().to_owned());
    assert_eq!(header("Inbox-Consumer").as_deref(), Some("credit"));
    assert_eq!(header("Inbox-Delivered"), Some(MAX_DELIVER.to_string()));
    let error = header("Inbox-Error").unwrap_or_default();
    assert!(error.starts_with(BACKSTOP_ERROR), "Inbox-Error: {error:?}");
    let id = header("Nats-Msg-Id").unwrap_or_default();
    assert!(
        id.starts_with(&format!("dlq:credit:{name}:")) && id.ends_with(&format!(":{seq}")),
        "Nats-Msg-Id: {id:?}"
    );
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM inbox").await,
        0,
        "no marker: the message was never applied"
    );
    assert!(B::balances(&db).await.is_empty(), "no balance");
    for k in 0..2 {
        let _ = std::fs::remove_file(log(k));
    }
}

inbox_tests::on_all_backends!(killed_on_its_last_delivery_is_dead_lettered_once);
