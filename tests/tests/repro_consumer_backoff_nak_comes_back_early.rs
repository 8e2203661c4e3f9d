//! A consumer with a `backoff`: the worker nak'd a failure with the backoff step of the delivery,
//! but nats-server counts a nak's delay from `backoff[0]` and then waits the step: the message
//! came back after `2 × step - backoff[0]`, and at once when the step was shorter than
//! `backoff[0]`, spending deliveries within milliseconds. With backoff `[1 s, 200 ms, ..]` the
//! second to fifth deliveries now each come at least 200 ms after the one before.

use async_nats::jetstream::consumer::pull;
use inbox_runtime::Inbox;
use inbox_testkit::wait_until;
use inbox_tests::backends::{Postgres, TestBackend};
use inbox_tests::handlers::{Failure, Probe};
use inbox_tests::{MAX_DELIVER, NatsStream, Running};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naks_follow_the_consumer_backoff() {
    let db = Postgres::create(2).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let step = Duration::from_millis(200);
    let backoff = vec![Duration::from_secs(1), step, step, step];
    let consumer = nats
        .js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("c".into()),
            max_deliver: MAX_DELIVER,
            backoff,
            ..Default::default()
        })
        .await
        .unwrap();
    nats.publish_all([inbox_tests::handlers::Entry::new("k", 1, 1).json()])
        .await;
    let worker = nats
        .worker(inbox, consumer)
        // Handler runs stand for deliveries here; batched, a failing message also runs in its
        // batch's lean try before it is handled alone (same nak, same backoff).
        .batch(1, Duration::ZERO)
        .build_with_state(
            <Postgres as TestBackend>::Ledger::default(),
            Probe::failing(usize::MAX, Failure::Plain),
        )
        .unwrap();
    let run = Running::start(&worker);
    // When each delivery's handler ran, as the handler itself records it (a look from here
    // could be starved on a loaded machine and see two runs at once). Each nak follows its run,
    // so the next run comes at least the backoff step after it.
    wait_until(
        "every delivery to run",
        Duration::from_secs(60),
        async || worker.state().runs() >= MAX_DELIVER as usize,
    )
    .await
    .unwrap();
    run.stop().await;
    let seen = worker.state().run_times();
    let gaps: Vec<Duration> = seen.windows(2).map(|w| w[1] - w[0]).collect();
    for (i, gap) in gaps.iter().enumerate().skip(1) {
        assert!(
            *gap >= step * 3 / 4,
            "delivery {} came {gap:?} after the one before, not after the backoff step of {step:?}: {gaps:?}",
            i + 2
        );
    }
}
