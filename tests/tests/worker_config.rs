//! A worker refuses, at start and with an error naming the problem, what would break its
//! guarantees later: a consumer that redelivers forever, acks that are not explicit, a consumer
//! name that cannot be a subject token, two handlers sharing a consumer name, a two-phase
//! handler whose lease is over two thirds of `ack_wait`.

use async_nats::jetstream::consumer::{AckPolicy, pull};
use inbox_runtime::{Handler, Tx, WorkerError, idempotent};
use inbox_tests::NatsStream;
use inbox_tests::backends::{Postgres, TestBackend};
use inbox_tests::handlers::Entry;
use std::time::Duration;

/// A handler written by hand, whose consumer name `#[idempotent]` would refuse at compile time:
/// the runtime refuses it too.
#[derive(Default)]
struct BadlyNamed;

impl Handler for BadlyNamed {
    type Db = sqlx::Postgres;
    type Message = Entry;
    type State = ();
    type Error = sqlx::Error;
    type Codec = inbox_runtime::Json;
    const CONSUMER: &'static str = "bad name";

    fn key(
        &self,
        msg: &Entry,
        _: &inbox_runtime::Delivery,
        _: &(),
    ) -> Result<Option<String>, inbox_runtime::KeyError> {
        Ok(Some(msg.key.clone()))
    }

    fn handle<'a, 'c>(
        &'a self,
        _: Entry,
        _: &'a inbox_runtime::Delivery,
        _: &'a mut inbox_runtime::Transaction<'c, sqlx::Postgres>,
        _: &'a (),
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        std::future::ready(Ok(()))
    }
}

#[idempotent(consumer = "fine", key = msg.key)]
async fn fine(msg: Entry, tx: &mut Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

/// Another handler that took the name `fine`: in one process it would skip `fine`'s messages.
#[idempotent(consumer = "fine", key = msg.key)]
async fn also_fine(msg: Entry, tx: &mut Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

/// Two-phase: its lease must be below the consumer's `ack_wait`.
#[idempotent(consumer = "leased", key = msg.key, claim)]
async fn leased(
    msg: Entry,
    claim: &mut inbox_runtime::Claim<sqlx::Postgres>,
) -> Result<(), inbox_runtime::BoxError> {
    let _ = (msg, claim);
    Ok(())
}

/// The error of a worker that must be refused at build.
fn refused<H: inbox_runtime::Handler>(
    built: Result<inbox_runtime::Worker<H>, WorkerError>,
) -> WorkerError {
    built.expect_err("the worker was built")
}

async fn consumer(
    nats: &NatsStream,
    name: &str,
    config: pull::Config,
) -> async_nats::jetstream::consumer::PullConsumer {
    nats.js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some(name.into()),
            ..config
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn bad_configurations_are_rejected_at_build() {
    let db = Postgres::create(2).await;
    let inbox = inbox_runtime::Inbox::new(db.pool.clone());
    let nats = NatsStream::create().await;

    let unbounded = consumer(&nats, "unbounded", pull::Config::default()).await;
    let err = refused(nats.worker(inbox.clone(), unbounded).build(fine));
    assert!(
        matches!(err, WorkerError::UnboundedMaxDeliver { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("max_deliver"), "{err}");

    let ack_all = pull::Config {
        ack_policy: AckPolicy::All,
        max_deliver: 5,
        ..Default::default()
    };
    let ack_all = consumer(&nats, "ack_all", ack_all).await;
    let err = refused(nats.worker(inbox.clone(), ack_all).build(fine));
    assert!(matches!(err, WorkerError::AckPolicy { .. }), "{err}");

    let ok = pull::Config {
        max_deliver: 5,
        ..Default::default()
    };
    let ok = consumer(&nats, "ok", ok).await;
    let err = refused(nats.worker(inbox.clone(), ok.clone()).build(BadlyNamed));
    assert!(matches!(err, WorkerError::ConsumerName { .. }), "{err}");
    assert!(err.to_string().contains("\"bad name\""), "{err}");

    // ack_wait 30 s × max_deliver 5 + duplicate window 120 s + margin 60 s = 330 s; the stream's
    // max_age (an hour) is no figure, the cutoff following the oldest stored message.
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    let err = refused(
        nats.worker(inbox.clone(), ok.clone())
            .cleanup(Duration::from_secs(329), &stream)
            .cleanup_margin(Duration::from_secs(60))
            .build(fine),
    );
    assert!(
        matches!(err, WorkerError::RetentionTooShort { .. }),
        "{err}"
    );
    let text = err.to_string();
    for figure in [
        "ack_wait 30s",
        "max_deliver 5",
        "duplicate window 120s",
        "margin 60s",
        "= 330s",
    ] {
        assert!(text.contains(figure), "{figure:?} missing from: {text}");
    }
    assert!(!text.contains("max_age"), "{text}");
    let long_enough = nats
        .worker(inbox.clone(), ok.clone())
        .cleanup(Duration::from_secs(330), &stream)
        .cleanup_margin(Duration::from_secs(60))
        .build(fine);
    assert!(long_enough.is_ok());

    let err = refused(
        nats.worker(inbox.clone(), ok.clone())
            .concurrency(0)
            .build(fine),
    );
    assert!(matches!(err, WorkerError::ZeroConcurrency), "{err}");
    assert!(nats.worker(inbox.clone(), ok.clone()).build(fine).is_ok());

    // Two handlers with one consumer name in one process: the second is refused, naming both.
    // The same handler again (another instance of it) is not.
    let err = refused(nats.worker(inbox.clone(), ok.clone()).build(also_fine));
    assert!(matches!(err, WorkerError::ConsumerTaken { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("also_fine") && text.contains("::fine"),
        "{text}"
    );
    assert!(nats.worker(inbox.clone(), ok.clone()).build(fine).is_ok());
    // On another inbox table the name is free.
    let other = inbox_runtime::Inbox::with_table(
        db.pool.clone(),
        inbox_runtime::TableName::new("inbox_other").unwrap(),
    );
    assert!(nats.worker(other, ok.clone()).build(also_fine).is_ok());

    // ack_wait 30 s (the server's default): a lease over 20 s is refused, naming both.
    let long_lease = inbox.clone().lease(Duration::from_millis(20_001));
    let err = refused(nats.worker(long_lease, ok.clone()).build(leased));
    assert!(
        matches!(err, WorkerError::LeaseNotBelowAckWait { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("30s") && text.contains("ack_wait"), "{text}");
    let short_lease = inbox.lease(Duration::from_secs(20));
    assert!(nats.worker(short_lease, ok).build(leased).is_ok());
}

#[tokio::test]
async fn an_app_refuses_shared_names_and_an_oversubscribed_pool() {
    use inbox_runtime::{App, AppError, Durable};
    let db = Postgres::create(2).await;
    let inbox = inbox_runtime::Inbox::new(db.pool.clone());
    inbox.migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let bounded = || pull::Config {
        max_deliver: 5,
        ..Default::default()
    };
    for name in ["one", "two"] {
        consumer(&nats, name, bounded()).await;
    }
    let on = |name: &str| Durable::existing(&nats.stream, name);
    let stop = tokio_util::sync::CancellationToken::new();

    // Two handlers with one consumer name: refused, naming both.
    let err = App::new(inbox.clone(), &nats.js)
        .handler(fine, on("one"))
        .handler(also_fine, on("two"))
        .run_until(stop.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::DuplicateConsumer { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("also_fine") && text.contains("::fine"),
        "{text}"
    );

    // Two handlers on one durable consumer: each would get part of the messages.
    let err = App::new(inbox.clone(), &nats.js)
        .handler(fine, on("one"))
        .handler(leased, on("one"))
        .run_until(stop.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::DuplicateDurable { .. }), "{err}");

    // A pool of 2 cannot give 2 to one handler and 1 (+1 for lease renewals) to a two-phase one;
    // refused before anything is created on the server.
    let never = Durable::recommended(&nats.stream, "never", &nats.subject);
    let err = App::new(inbox.clone(), &nats.js)
        .handler_configured(fine, (), never, |w| w.concurrency(2))
        .handler(leased, on("two"))
        .run_until(stop.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::PoolTooSmall { .. }), "{err}");
    assert!(err.to_string().contains("need 4"), "{err}");
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    assert!(
        stream.consumer_info("never").await.is_err(),
        "a refused app created its consumer"
    );

    // A name NATS would refuse is refused at once, not retried as a lost request.
    let err = App::new(inbox.clone(), &nats.js)
        .handler(
            fine,
            Durable::recommended(&nats.stream, "bad name", &nats.subject),
        )
        .run_until(stop.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::InvalidName { .. }), "{err}");

    // Stopped before it started: nothing is created, nothing counted.
    stop.cancel();
    let made = || Durable::recommended(&nats.stream, "made", &nats.subject);
    let stats = App::new(inbox.clone(), &nats.js)
        .handler(fine, made())
        .run_until(stop.clone())
        .await
        .unwrap();
    assert!(stats.is_empty(), "{stats:?}");
    assert!(stream.consumer_info("made").await.is_err());

    // A consumer the app creates with the recommended configuration; run until stopped.
    let later = tokio_util::sync::CancellationToken::new();
    let app = App::new(inbox.clone(), &nats.js).handler(fine, made());
    let running = tokio::spawn(app.run_until(later.clone()));
    // Its worker pulling (a pull request waiting), not only its consumer made: cancelled
    // between the two, the app would stop before its worker started and count nothing.
    inbox_testkit::wait_until(
        "the app's worker pulling",
        Duration::from_secs(30),
        async || {
            stream
                .consumer_info("made")
                .await
                .is_ok_and(|info| info.num_waiting > 0)
        },
    )
    .await
    .unwrap();
    later.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(stats.keys().copied().collect::<Vec<_>>(), vec!["fine"]);
    let made = nats.info("made").await;
    assert_eq!(made.config.max_deliver, 10);
    assert_eq!(made.config.ack_policy, AckPolicy::Explicit);
    assert_eq!(made.config.filter_subject, nats.subject);
}
