//! The `email` binary (two-phase claims) as users run it, driven from outside with a local HTTP
//! sink that counts calls per `Idempotency-Key`, on every backend:
//! - killed after the claim committed and before the call: the redelivery takes over (fence 2)
//!   and calls once;
//! - killed after the call and before phase 2: the takeover calls again with the same
//!   idempotency key;
//! - frozen (SIGSTOP) past its lease while another process takes over and completes: resumed
//!   (SIGCONT), its completion is refused by the fence, and the claim ends done once;
//! - a killed owner's claim is listed with its age by `Inbox::open_claims`, and releasing it lets
//!   the next delivery of the key run at once instead of waiting out the lease.

use inbox_examples::email::EmailRequested;
use inbox_runtime::Inbox;
use inbox_testkit::{CreditProcess, EmailConfig, Sink, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::{NatsStream, nats_url};
use std::path::PathBuf;
use std::time::Duration;

const DURABLE: &str = "email_t";
const STOP: Duration = Duration::from_secs(60);
const DEADLINE: Duration = Duration::from_secs(90);

/// A database, a stream with the durable consumer (`ack_wait` as given), and a sink.
struct Setup<B: TestBackend> {
    db: TestDb<B::Db>,
    inbox: Inbox<B::Db>,
    nats: NatsStream,
    sink: Sink,
    logs: PathBuf,
}

impl<B: TestBackend> Setup<B> {
    async fn new(ack_wait: Duration) -> Self {
        let db = B::create(2).await;
        let inbox = Inbox::new(db.pool.clone());
        inbox.migrate().await.unwrap();
        let nats = NatsStream::create().await;
        nats.consumer(DURABLE, ack_wait).await;
        let sink = Sink::start().await.unwrap();
        let logs = std::env::temp_dir().join(format!("{}.email-logs", db.name));
        std::fs::create_dir_all(&logs).unwrap();
        Setup {
            db,
            inbox,
            nats,
            sink,
            logs,
        }
    }

    /// Starts `email` (process `name`, logging to its own file) with `lease`, waiting
    /// `hold_before_call` between claim and call.
    fn spawn(&self, name: &str, lease: Duration, hold_before_call: Duration) -> CreditProcess {
        let config = EmailConfig {
            binary: env!("CARGO_BIN_EXE_email").into(),
            nats_url: nats_url(),
            database_url: self.db.url.clone(),
            stream: self.nats.stream.clone(),
            subject: self.nats.subject.clone(),
            consumer: DURABLE.into(),
            api_url: self.sink.url.clone(),
            lease,
            hold_before_call,
            concurrency: None,
            rust_log: "info,inbox_runtime=debug".into(),
        };
        config
            .spawn(Some(&self.logs.join(format!("{name}.log"))))
            .expect("spawn email")
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default()
    }

    async fn publish(&self, id: &str) {
        let msg = EmailRequested {
            id: id.into(),
            to: "a@example.com".into(),
            body: "hello".into(),
        };
        self.nats
            .publish_all([serde_json::to_vec(&msg).unwrap()])
            .await;
    }

    /// Waits until the claim of `key` has `sql`'s shape (a count of inbox rows).
    async fn wait_for(&self, what: &str, sql: &'static str) {
        wait_until(what, DEADLINE, async || B::count(&self.db, sql).await == 1)
            .await
            .unwrap();
    }
}

impl<B: TestBackend> Drop for Setup<B> {
    fn drop(&mut self) {
        // Kept when the test failed, for a look at what the processes said.
        if std::thread::panicking() {
            eprintln!("email logs kept in {}", self.logs.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.logs);
        }
    }
}

const CLAIMED: &str = "SELECT count(*) FROM inbox WHERE fence = 1 AND processed_at IS NULL";
const DONE_BY_2: &str = "SELECT count(*) FROM inbox WHERE fence = 2 AND processed_at IS NOT NULL";
const LEASE: Duration = Duration::from_millis(1500);

async fn killed_before_the_call<B: TestBackend>() {
    let s = Setup::<B>::new(LEASE * 2).await;
    let mut owner = s.spawn("owner", LEASE, Duration::from_secs(600));
    s.publish("m-1").await;
    s.wait_for("the owner's claim", CLAIMED).await;
    owner.kill().await.unwrap();
    assert!(
        s.sink.calls().is_empty(),
        "the owner called before it was killed"
    );

    let taker = s.spawn("taker", LEASE, Duration::ZERO);
    s.wait_for("the takeover to complete", DONE_BY_2).await;
    s.nats.wait_drained(DURABLE).await;
    let summary = taker.stop(STOP).await.unwrap();
    assert_eq!(summary.applied, 1, "{summary:?}");
    let calls = s.sink.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let attempts = "SELECT count(*) FROM inbox WHERE attempts = 2";
    assert_eq!(B::count(&s.db, attempts).await, 1);
}

async fn killed_after_the_call<B: TestBackend>() {
    let s = Setup::<B>::new(LEASE * 2).await;
    s.sink.hold();
    let mut owner = s.spawn("owner", LEASE, Duration::ZERO);
    s.publish("m-1").await;
    tokio::time::timeout(DEADLINE, s.sink.entered())
        .await
        .expect("the owner's call");
    // The remote has the call; the owner dies before it hears back, so before phase 2.
    owner.kill().await.unwrap();
    s.sink.release();

    let taker = s.spawn("taker", LEASE, Duration::ZERO);
    s.wait_for("the takeover to complete", DONE_BY_2).await;
    s.nats.wait_drained(DURABLE).await;
    taker.stop(STOP).await.unwrap();
    let calls = s.sink.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].idempotency_key, calls[1].idempotency_key);
    assert_eq!(calls[0].idempotency_key.len(), 64);
}

async fn zombie_is_refused_by_the_fence<B: TestBackend>() {
    let s = Setup::<B>::new(LEASE * 2).await;
    s.sink.hold();
    let zombie = s.spawn("zombie", LEASE, Duration::ZERO);
    s.publish("m-1").await;
    tokio::time::timeout(DEADLINE, s.sink.entered())
        .await
        .expect("the owner's call");
    // Frozen with its call in flight: no renewals, no progress acks. Not in the middle of a
    // renewal, though: frozen there it would hold that write's lock (a row lock; on SQLite, the
    // database's one write lock, for up to an fsync) and block the takeover for as long as it
    // stays frozen. A write of the test's own, given a moment, says the locks are free.
    loop {
        zombie.pause().unwrap();
        let probe = B::exec(&s.db, "UPDATE inbox SET attempts = attempts");
        if tokio::time::timeout(Duration::from_secs(5), probe)
            .await
            .is_ok()
        {
            break;
        }
        zombie.resume().unwrap();
    }
    s.sink.release();
    let taker = s.spawn("taker", LEASE, Duration::ZERO);
    s.wait_for("the takeover to complete", DONE_BY_2).await;

    zombie.resume().unwrap();
    wait_until(
        "the zombie to learn it was fenced out",
        DEADLINE,
        async || s.log("zombie").contains("taken over"),
    )
    .await
    .unwrap();
    s.nats.wait_drained(DURABLE).await;
    let zombie = zombie.stop(STOP).await.unwrap();
    let taker = taker.stop(STOP).await.unwrap();
    assert_eq!(
        (zombie.applied, taker.applied),
        (0, 1),
        "{zombie:?} {taker:?}"
    );
    assert!(zombie.nacked >= 1, "{zombie:?}");
    assert_eq!(B::count(&s.db, DONE_BY_2).await, 1);
    assert_eq!(B::count(&s.db, "SELECT count(*) FROM inbox").await, 1);
    let calls = s.sink.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].idempotency_key, calls[1].idempotency_key);
}

async fn release_lets_the_next_delivery_run<B: TestBackend>() {
    // A lease far longer than the test: only the release can end it.
    let lease = Duration::from_secs(300);
    let s = Setup::<B>::new(lease * 2).await;
    let mut owner = s.spawn("owner", lease, Duration::from_secs(600));
    s.publish("m-1").await;
    s.wait_for("the owner's claim", CLAIMED).await;
    owner.kill().await.unwrap();

    let open = s.inbox.open_claims("email", Duration::ZERO).await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!((open[0].key.as_str(), open[0].fence), ("m-1", 1));
    assert!(open[0].lease_left.is_some(), "{open:?}");
    wait_until("the claim to age", DEADLINE, async || {
        let open = s.inbox.open_claims("email", Duration::from_millis(300));
        open.await.unwrap().len() == 1
    })
    .await
    .unwrap();

    assert!(s.inbox.release_claim("email", "m-1").await.unwrap());
    let open = s.inbox.open_claims("email", Duration::ZERO).await.unwrap();
    assert_eq!(open[0].lease_left, None, "{open:?}");
    // The key again (an operator's replay): taken over at once, never nak'd for the lease.
    let taker = s.spawn("taker", lease, Duration::ZERO);
    s.publish("m-1").await;
    s.wait_for("the takeover to complete", DONE_BY_2).await;
    let summary = taker.stop(STOP).await.unwrap();
    assert_eq!((summary.applied, summary.nacked), (1, 0), "{summary:?}");
    assert_eq!(s.sink.calls().len(), 1);
    assert!(
        s.inbox
            .open_claims("email", Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
}

/// The tests for one backend.
macro_rules! on_backend {
    ($name:ident, $backend:ty) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_before_the_call_is_taken_over_with_fence_2_and_called_once() {
                super::killed_before_the_call::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_after_the_call_is_called_again_with_the_same_idempotency_key() {
                super::killed_after_the_call::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn zombie_frozen_past_its_lease_is_refused_by_the_fence() {
                super::zombie_is_refused_by_the_fence::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn released_claim_of_a_killed_owner_lets_the_next_delivery_run() {
                super::release_lets_the_next_delivery_run::<$backend>().await
            }
        }
    };
}

on_backend!(postgres, inbox_tests::backends::Postgres);
on_backend!(mysql, inbox_tests::backends::MySql);
on_backend!(sqlite, inbox_tests::backends::Sqlite);
