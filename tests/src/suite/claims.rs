//! Two-phase claims (`#[idempotent(.., claim)]`), in process, with a fake remote side
//! ([`Remote`]) that counts calls per idempotency key:
//! - two instances race on one key while the owner's call is held past its lease: one call; the
//!   twin is nak'd (never acked) while the owner renews its lease, then skipped;
//! - a twin meeting the held claim on its last delivery waits the lease out in process (a nak
//!   would never come back), and is skipped once the owner is done;
//! - a failing side effect (503) releases the lease at once: every try takes the claim over
//!   without waiting for the lease, and after `max_deliver` the message is dead-lettered with
//!   the remote's status; the claim stays open (released) for a replay: the sweeper API lists it,
//!   cleanup never deletes it, and a replay completes it, its retention counting from then.
//!
//! The process-level cases (SIGKILL before and after the call, a zombie frozen past its lease,
//! the sweeper and a release after a crash) drive the `email` example in
//! `examples/tests/email_processes.rs`.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Remote};
use crate::{MAX_DELIVER, NatsStream, Running};
use inbox_testkit::wait_until;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);

/// The test.
async fn racing_twins_make_one_call<B: TestBackend>() {
    let (db, _) = setup::<B>(2).await;
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;
    let remote = Remote::default();
    remote.hold();
    // The twin's second visit comes after this lease would have run out without renewals. Not
    // shorter: renewals run every quarter of it, and on a loaded machine (CI runs three test
    // passes side by side) a renewal late by more than half a lease makes the owner give up.
    let lease = Duration::from_secs(3);
    let mut workers = Vec::new();
    for _ in 0..2 {
        let inbox = B::inbox(B::connect(&db.url, 4).await).lease(lease);
        let consumer = nats.consumer_on_new_connection("c").await;
        let worker = nats
            .worker(inbox, consumer)
            .build_with_state(B::Remote::default(), remote.clone())
            .unwrap();
        let run = Running::start(&worker);
        workers.push((worker, run));
    }
    // The same key twice, without broker dedup: the twins land on the instances together.
    let entry = Entry::new("k", 1, 10);
    nats.publish_all([entry.json(), entry.json()]).await;
    tokio::time::timeout(DEADLINE, remote.entered())
        .await
        .expect("the owner's call to reach the remote");
    let stats = |workers: &[(inbox_runtime::Worker<B::Remote>, Running)]| {
        workers.iter().fold((0, 0, 0), |(a, s, n), (w, _)| {
            let st = w.stats();
            (a + st.acked, s + st.skipped, n + st.nacked)
        })
    };
    // The twin came back after the lease would have run out, and still found it held: the owner
    // renews it while its call runs.
    wait_until("the twin to be nak'd twice", DEADLINE, || async {
        stats(&workers).2 >= 2
    })
    .await
    .unwrap();
    assert_eq!(stats(&workers), (0, 0, 2), "acked, skipped, nacked");
    assert_eq!(remote.calls().len(), 1, "{:?}", remote.calls());
    let open = "SELECT count(*) FROM inbox WHERE processed_at IS NULL";
    assert_eq!(B::count(&db, open).await, 1);

    remote.release();
    wait_until(
        "the owner to finish and the twin to be skipped",
        DEADLINE,
        || async {
            let (acked, skipped, _) = stats(&workers);
            acked == 1 && skipped == 1
        },
    )
    .await
    .unwrap();
    nats.wait_drained("c").await;
    for (_, run) in workers {
        run.stop().await;
    }
    let calls = remote.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!((calls[0].fence, calls[0].attempt), (1, 1));
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    let done = "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL AND fence = 1";
    assert_eq!(B::count(&db, done).await, 1);
}

/// The test.
async fn held_claim_on_the_last_delivery_is_waited_out<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    // One delivery each: the twin's first is its last, where a nak would never come back.
    let consumer = nats
        .js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .get_or_create_consumer(
            "c",
            async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("c".into()),
                ack_wait: Duration::from_secs(30),
                max_deliver: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let remote = Remote::default();
    remote.hold();
    let worker = nats
        .worker(inbox.lease(Duration::from_secs(2)), consumer)
        .build_with_state(B::Remote::default(), remote.clone())
        .unwrap();
    let run = Running::start(&worker);
    let entry = Entry::new("k", 1, 10);
    nats.publish_all([entry.json(), entry.json()]).await;
    tokio::time::timeout(DEADLINE, remote.entered())
        .await
        .expect("the owner's call");
    // The twin has met the held claim on its last delivery: it waits, neither dead-lettered nor
    // nak'd into oblivion.
    wait_until("the twin to meet the held claim", DEADLINE, || async {
        worker.stats().held >= 1
    })
    .await
    .unwrap();
    remote.release();
    wait_until(
        "the owner to finish and the twin to be skipped",
        DEADLINE,
        || async {
            let s = worker.stats();
            s.acked == 1 && s.skipped == 1
        },
    )
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!((stats.terminated, stats.nacked), (0, 0), "{stats:?}");
    assert!(nats.dead_letters().await.is_empty());
    assert_eq!(remote.calls().len(), 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

/// The test.
async fn failing_side_effect_releases_the_lease_and_dead_letters<B: TestBackend>() {
    let (db, inbox) = setup::<B>(4).await;
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let remote = Remote::default();
    remote.answer(503);
    // Far longer than the whole test: a try that had to wait for it would never come.
    let inbox = inbox.lease(Duration::from_secs(20));
    let worker = nats
        .worker(inbox.clone(), consumer)
        .attempts(2)
        .nak_delay(Duration::from_millis(20), Duration::from_millis(50))
        .sweep(Duration::from_millis(100), Duration::ZERO)
        .build_with_state(B::Remote::default(), remote.clone())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all([Entry::new("k", 1, 10).json()]).await;
    wait_until("the dead letter", DEADLINE, || async {
        !nats.dead_letters().await.is_empty()
    })
    .await
    .unwrap();
    // The sweeper reports the claim left open.
    wait_until("the sweeper to count the open claim", DEADLINE, || async {
        worker.stats().open_claims == 1
    })
    .await
    .unwrap();
    let stats = run.stop().await;
    assert_eq!(stats.terminated, 1, "{stats:?}");

    // Two tries per delivery, each taking the claim over at once: fence and attempt grow by one
    // with every call, under one idempotency key.
    let calls = remote.calls();
    let tries = 2 * MAX_DELIVER as usize;
    assert_eq!(calls.len(), tries, "{calls:?}");
    for (i, call) in calls.iter().enumerate() {
        assert_eq!((call.fence, call.attempt), (i as i64 + 1, i as i64 + 1));
        assert_eq!(call.idempotency_key, calls[0].idempotency_key);
    }
    let letters = nats.dead_letters().await;
    let reason = letters[0].1.get("Inbox-Error").unwrap().as_str().to_owned();
    assert!(reason.contains("remote answered 503"), "{reason}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 0);

    // Left open (released), so that a replay of the dead letter takes it over; the sweeper
    // reports it, and cleanup never deletes it.
    let open = inbox.open_claims("remote", Duration::ZERO).await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(
        (open[0].key.as_str(), open[0].fence, open[0].lease_left),
        ("k", tries as i64, None)
    );
    B::backdate(&db, "k").await;
    let deleted = inbox
        .cleanup("remote", Duration::from_secs(60), 100)
        .await
        .unwrap();
    assert_eq!(deleted, Some(0), "cleanup deleted an open claim");
    assert_eq!(
        inbox
            .open_claims("remote", Duration::ZERO)
            .await
            .unwrap()
            .len(),
        1
    );

    // A replay of the dead letter, once the remote works: taken over at once and done. Its
    // retention counts from now, not from the first claim two hours ago.
    remote.answer(0);
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let worker = nats
        .worker(inbox.clone(), consumer)
        .build_with_state(B::Remote::default(), remote.clone())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all([Entry::new("k", 1, 10).json()]).await;
    wait_until("the replay to complete the claim", DEADLINE, || async {
        B::count(
            &db,
            "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL",
        )
        .await
            == 1
    })
    .await
    .unwrap();
    run.stop().await;
    assert_eq!(remote.calls().len(), tries + 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    let deleted = inbox
        .cleanup("remote", Duration::from_secs(60), 100)
        .await
        .unwrap();
    assert_eq!(deleted, Some(0), "cleanup deleted a claim just completed");
}

super::behaviours!(
    partitioned_too;
    racing_twins_make_one_call,
    held_claim_on_the_last_delivery_is_waited_out,
    failing_side_effect_releases_the_lease_and_dead_letters,
);
