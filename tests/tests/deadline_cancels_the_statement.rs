//! A try cut at the worker's deadline while its statement waits (here, its claim behind a frozen
//! peer's uncommitted marker, with a lock timeout longer than the deadline) left the statement
//! running on the server: its connection and the locks it held stayed taken until the lock
//! timeout, the pool drained, and the pool timeouts that followed tripped the circuit. Every
//! statement of a message's transaction is now bounded by the deadline (PostgreSQL's
//! `statement_timeout`, MariaDB's `max_statement_time`), so the server ends it with the try.
//!
//! On the server backends. SQLite runs in process. MySQL itself has no bound for every statement
//! (`max_execution_time` bounds SELECTs only): there a cut try's session is killed from a
//! connection of its own; the machine's MySQL flavour is MariaDB, which is made to take MySQL's
//! way (`Inbox::kill_cut_sessions`) in the `on_mysql_*` tests: a message's try, a laned batch,
//! a two-phase claim's transaction cut while the handler writes in it, and one cut in the
//! ROLLBACK after the handler failed, leaving a write of its own behind. Also on
//! MariaDB: the bound a message's transaction leaves on its connection does not cut a later wait
//! for the fleet's migration lock.

use inbox_runtime::{BoxError, Claim, Handler, Inbox, Tx, Worker, WorkerBuilder, idempotent};
use inbox_testkit::wait_until;
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

/// A database of `B` with the inbox's tables, and a stream.
async fn migrated<B: TestBackend>() -> (TestDb<B::Db>, NatsStream) {
    let db = B::create(4).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    (db, NatsStream::create().await)
}

/// A write of a try waits behind a frozen peer (`frozen`, run in a transaction that never
/// finishes) when the try is cut at the worker's deadline; the write must end on the server with
/// it. `waiting` counts the try's writes still waiting; `way` makes the worker's inbox and
/// `build` the worker from its builder. `kept`: a message of another key is processed first,
/// one try at a time, so that the cut try runs on the connection that try kept, and begins with
/// the shorter BEGIN of a kept connection (MySQL: without the COMMIT first).
async fn a_cut_write_ends_on_the_server<B: TestBackend, H>(
    db: &TestDb<B::Db>,
    nats: &NatsStream,
    kept: bool,
    frozen: &'static str,
    waiting: impl AsyncFn(&TestDb<B::Db>) -> i64,
    way: impl FnOnce(Inbox<B::Db>) -> Inbox<B::Db>,
    build: impl FnOnce(WorkerBuilder<B::Db>) -> Worker<H>,
) where
    H: Handler<Db = B::Db>,
    H::Message: serde::de::DeserializeOwned,
{
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let frozen = B::hold_in_transaction(db, frozen).await;
    let first = kept.then(|| Entry::new("first", 1, 1).json());
    nats.publish_all(first.into_iter().chain([Entry::new("k", 1, 1).json()]))
        .await;
    let pool = B::connect_acquiring(&db.url, 4, Duration::from_millis(500)).await;
    let builder = nats
        .worker(
            way(B::inbox(pool).lock_timeout(Duration::from_secs(120))),
            consumer,
        )
        .deadline(Duration::from_secs(2))
        // No second try while the test looks.
        .nak_delay(Duration::from_secs(120), Duration::from_secs(120));
    let worker = build(match kept {
        true => builder.concurrency(1),
        false => builder,
    });
    let run = Running::start(&worker);
    wait_until("the write to wait", Duration::from_secs(20), async || {
        waiting(db).await >= 1
    })
    .await
    .unwrap();
    wait_until("the try to be cut", Duration::from_secs(20), async || {
        worker.stats().nacked >= 1
    })
    .await
    .unwrap();
    // The write ends with its try, although the peer still holds what it waits for.
    wait_until(
        "the cut try's write to end on the server",
        Duration::from_secs(10),
        async || waiting(db).await == 0,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: the statement outlived its try"));
    frozen.rollback().await.expect("ROLLBACK");
    let stats = run.stop().await;
    assert_eq!(stats.acked, u64::from(kept), "{stats:?}");
}

/// A claim waiting behind a frozen peer's uncommitted marker of the same key, cut at the
/// worker's deadline. `way` makes the worker's inbox.
async fn a_cut_claim_ends_on_the_server<B: TestBackend>(
    db: &TestDb<B::Db>,
    nats: &NatsStream,
    kept: bool,
    way: impl FnOnce(Inbox<B::Db>) -> Inbox<B::Db>,
) {
    a_cut_write_ends_on_the_server::<B, _>(
        db,
        nats,
        kept,
        "INSERT INTO inbox (consumer, message_key) VALUES ('ledger', 'k')",
        B::waiting_writers,
        way,
        |builder| {
            builder
                .build_with_state(B::Ledger::default(), Probe::open())
                .unwrap()
        },
    )
    .await;
}

async fn a_statement_ends_with_its_try<B: TestBackend>() {
    let (db, nats) = migrated::<B>().await;
    a_cut_claim_ends_on_the_server::<B>(&db, &nats, false, |inbox| inbox).await;

    // A connection that served a message (the only one of its pool) then waits for the
    // migration lock longer than the deadline: a session-wide bound left on it (MariaDB's is
    // the session's) would cut the wait.
    let pool = B::connect_acquiring(&db.url, 1, Duration::from_millis(500)).await;
    let worker = nats
        .worker(
            B::inbox(pool.clone()),
            nats.consumer("d", Duration::from_secs(30)).await,
        )
        .deadline(Duration::from_secs(2))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.wait_drained("d").await;
    assert_eq!(run.stop().await.acked, 1);
    let lock = "migrate:inbox";
    let holder = B::hold_cleanup_lock(&db, lock)
        .await
        .expect("a server backend has a migration lock");
    let waiting = B::inbox(pool).migration_lock_wait(Duration::from_secs(120));
    let migrate = tokio::spawn(async move { waiting.migrate().await });
    wait_until(
        "the migration to wait for the lock",
        Duration::from_secs(30),
        async || B::waiting_for_fleet_lock(&db).await > 0,
    )
    .await
    .unwrap();
    let mut poll = inbox_testkit::Poll::new("twice the deadline", Duration::from_secs(60));
    while poll.elapsed() < Duration::from_secs(4) {
        assert!(
            !migrate.is_finished(),
            "the wait for the migration lock ended early: {:?}",
            migrate.await
        );
        let _ = poll.tick().await;
    }
    B::release_cleanup_lock(holder, lock).await;
    migrate
        .await
        .unwrap()
        .expect("the migration after the lock was released");
}

/// The cut try runs on the connection the try before it kept, and begins with a kept connection's
/// shorter BEGIN, which must bound its statements as well.
async fn a_statement_on_a_kept_connection_ends_with_its_try<B: TestBackend>() {
    let (db, nats) = migrated::<B>().await;
    a_cut_claim_ends_on_the_server::<B>(&db, &nats, true, |inbox| inbox).await;
}

inbox_tests::on_server_backends!(
    a_statement_ends_with_its_try,
    a_statement_on_a_kept_connection_ends_with_its_try
);

/// MySQL's way on the machine's MariaDB: no statement bound; the cut try's session is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_cut_try_has_its_session_killed() {
    type B = inbox_tests::backends::MySql;
    let (db, nats) = migrated::<B>().await;
    a_cut_claim_ends_on_the_server::<B>(&db, &nats, false, Inbox::kill_cut_sessions).await;
}

/// As above, the cut try on the connection the try before it kept: armed with the session's id
/// it kept with the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_cut_try_on_a_kept_connection_has_its_session_killed() {
    type B = inbox_tests::backends::MySql;
    let (db, nats) = migrated::<B>().await;
    a_cut_claim_ends_on_the_server::<B>(&db, &nats, true, Inbox::kill_cut_sessions).await;
}

/// The ledger's inserts still running on MariaDB's test database.
const LEDGER_WRITES: &str = "SELECT count(*) FROM information_schema.processlist \
                             WHERE db = DATABASE() AND info LIKE 'INSERT INTO ledger %'";

/// On MariaDB made to take MySQL's way: a two-phase handler's write to the ledger waits behind a
/// frozen peer (a locking read of the whole, empty, ledger, which makes every insert into it
/// wait: InnoDB locks the gap up to the supremum) when the try is cut at its deadline.
async fn a_cut_ledger_write_ends_on_the_server<H>(
    build: impl FnOnce(WorkerBuilder<sqlx::MySql>) -> Worker<H>,
) where
    H: Handler<Db = sqlx::MySql>,
    H::Message: serde::de::DeserializeOwned,
{
    type B = inbox_tests::backends::MySql;
    let (db, nats) = migrated::<B>().await;
    a_cut_write_ends_on_the_server::<B, H>(
        &db,
        &nats,
        false,
        "SELECT * FROM ledger FOR UPDATE",
        async |db| B::count(db, LEDGER_WRITES).await,
        Inbox::kill_cut_sessions,
        build,
    )
    .await;
}

/// The claim's transaction (which the handler holds between its calls, begun from the pool) is
/// cut at the deadline while the handler's write in it waits: its session must be killed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_cut_two_phase_try_has_its_session_killed() {
    a_cut_ledger_write_ends_on_the_server(|builder| {
        builder
            .build_with_state(
                <inbox_tests::backends::MySql as TestBackend>::Remote::default(),
                inbox_tests::handlers::Remote::default(),
            )
            .unwrap()
    })
    .await;
}

/// Two-phase, on MySQL: writes to the ledger in the claim's transaction, stops waiting for that
/// write after half a second, and fails; its ROLLBACK then waits behind the write it left.
#[idempotent(consumer = "abandons", key = msg.key, claim)]
async fn abandons(msg: Entry, claim: &mut Claim<sqlx::MySql>) -> Result<(), BoxError> {
    let insert = sqlx::query("INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)")
        .bind(msg.key)
        .bind(msg.account)
        .bind(msg.amount);
    let tx = claim.tx().await?;
    match tokio::time::timeout(Duration::from_millis(500), insert.execute(&mut **tx)).await {
        Ok(done) => done.map(drop).map_err(Into::into),
        Err(_) => Err("the ledger did not answer within 500 ms".into()),
    }
}

/// A two-phase handler that failed, leaving a write of its own waiting, has its claim rolled
/// back; the ROLLBACK waits behind that write and is cut at the deadline: the session must be
/// killed then too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_failed_claim_cut_in_its_rollback_has_its_session_killed() {
    a_cut_ledger_write_ends_on_the_server(|builder| builder.build(abandons).unwrap()).await;
}

/// MySQL's way on the machine's MariaDB, for a batch: a laned batch (whose lock waits last as
/// long as the lock timeout) credits an account whose row a frozen peer holds, and is cut at the
/// deadline; its session must be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_a_cut_batch_has_its_session_killed() {
    type B = inbox_tests::backends::MySql;
    let (db, nats) = migrated::<B>().await;
    a_cut_write_ends_on_the_server::<B, _>(
        &db,
        &nats,
        false,
        // Account 1's row, inserted and never committed: the batch's upsert of it waits.
        "INSERT INTO accounts (id, balance) VALUES (1, 0)",
        async |db| {
            let credits = "SELECT count(*) FROM information_schema.processlist \
                           WHERE db = DATABASE() AND info LIKE 'INSERT INTO accounts %'";
            B::count(db, credits).await
        },
        Inbox::kill_cut_sessions,
        |builder| {
            builder
                .batch(4, Duration::from_millis(20))
                .build(<B as TestBackend>::CreditLaned::default())
                .unwrap()
        },
    )
    .await;
}

/// On MariaDB: appends to the ledger, and for the key `first` first takes its session's statement
/// bound and lock wait off, as a handler may (`SET SESSION`).
#[idempotent(consumer = "unbounding", key = msg.key)]
async fn unbounding(msg: Entry, tx: &mut Tx<'_, sqlx::MySql>) -> Result<(), BoxError> {
    if msg.key == "first" {
        sqlx::query(
            "SET SESSION innodb_lock_wait_timeout = 1000 /*M!100100 , max_statement_time = 0 */",
        )
        .execute(&mut **tx)
        .await?;
    }
    sqlx::query("INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)")
        .bind(msg.key)
        .bind(msg.account)
        .bind(msg.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A handler took its session's bound off; the cut try after it, on the connection that try
/// kept, still has its statement bounded: a kept connection's BEGIN sets the bound again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mariadb_a_kept_connection_is_bounded_again_after_its_handler_unbound_it() {
    type B = inbox_tests::backends::MySql;
    let (db, nats) = migrated::<B>().await;
    a_cut_write_ends_on_the_server::<B, _>(
        &db,
        &nats,
        true,
        "INSERT INTO inbox (consumer, message_key) VALUES ('unbounding', 'k')",
        B::waiting_writers,
        |inbox| inbox,
        |builder| builder.build(unbounding).unwrap(),
    )
    .await;
}
