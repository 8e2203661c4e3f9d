//! The database probes (the health check's, and the one that closes the circuit) asked
//! PostgreSQL for a write that changes nothing, a DELETE of no row of the inbox, to tell a
//! standby from a primary. That DELETE waits behind an ACCESS EXCLUSIVE lock on the table (the
//! partitioned layout's partition DDL takes one, so do `VACUUM FULL` and some `ALTER TABLE`s), so
//! while one was held the 5 s probe reported the database down: `/healthz` failed and an
//! orchestrator restarted healthy processes. The probe now asks what makes PostgreSQL refuse
//! writes (recovery, a read-only session) and touches no table; a read-only session is still
//! refused (`read_only_database_is_an_outage` covers the outage itself).
//!
//! MariaDB and MySQL: the probe is that DELETE still, bounded to wait 1 s for a table's metadata
//! lock, and a probe that timed out waiting for a lock counts as an answer from a writable
//! database. Before, a table locked by `LOCK TABLES .. WRITE` (or waited for by an `ALTER
//! TABLE`) failed the probe. A read-only server or session refuses the DELETE before any lock
//! wait (1792 at once, with the table locked by another session); the health probe's own
//! connection cannot be made read-only from here (MySQL's connect options run no statement), so
//! `read_only_database_is_an_outage` is where read-only sessions meet the probe.
//!
//! SQLite's probe writes to a temporary table of its own connection, which no other connection
//! locks.

use inbox_runtime::App;
use inbox_testkit::wait_until;
use inbox_tests::backends::{MySql, Postgres, TestBackend};
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{MAX_DELIVER, NatsStream, Running};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lock_does_not_fail_the_database_probe() {
    let db = Postgres::create(4).await;
    Postgres::inbox(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let health = App::new(Postgres::inbox(db.pool.clone()), &nats.js).health();
    assert!(health.check().await.database, "the probe fails unlocked");

    let lock =
        Postgres::hold_in_transaction(&db, "LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE").await;
    let report = health.check().await;
    assert!(
        report.database,
        "the database probe failed while a table lock was held: {report:?}"
    );
    drop(lock);

    // Sessions that take no writes (the probe opens one of its own with the pool's options) are
    // still told apart.
    let options: PgConnectOptions = db.url.parse().expect("a PostgreSQL URL");
    let standby = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("default_transaction_read_only", "on")]))
        .await
        .expect("PostgreSQL: cannot connect to the test database");
    let health = App::new(Postgres::inbox(standby), &nats.js).health();
    let report = health.check().await;
    assert!(
        !report.database,
        "a read-only session passed the database probe: {report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lock_does_not_fail_the_mysql_database_probe() {
    let db = MySql::create(4).await;
    MySql::inbox(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let health = App::new(MySql::inbox(db.pool.clone()), &nats.js).health();
    assert!(health.check().await.database, "the probe fails unlocked");

    let mut locker = sqlx::MySqlConnection::connect(&db.url)
        .await
        .expect("MariaDB: cannot connect to the test database");
    sqlx::raw_sql("LOCK TABLES inbox WRITE")
        .execute(&mut locker)
        .await
        .expect("LOCK TABLES inbox WRITE");
    let report = health.check().await;
    sqlx::raw_sql("UNLOCK TABLES")
        .execute(&mut locker)
        .await
        .expect("UNLOCK TABLES");
    locker.close().await.expect("close the locking connection");
    assert!(
        report.database,
        "the database probe failed while a table lock was held: {report:?}"
    );
}

/// Messages that meet a table lock on the inbox (held here past every delivery's tries: an
/// `ALTER TABLE`, `VACUUM FULL` or partition DDL waiting on a long transaction, `LOCK TABLES`)
/// cannot be processed, whichever message it is: the lock is an outage of the inbox, and no
/// delivery may be spent on it. Before, PostgreSQL's check after a failed try (a lock timeout,
/// or the deadline) asked a probe that touches no table, which said "up", so each try spent a
/// delivery and the messages were dead-lettered at `max_deliver`. Now the circuit's probe writes
/// to the inbox under a short lock wait, and a lock timeout asks it too: the circuit opens, the
/// messages wait, and they are applied once when the lock goes.
async fn a_held_table_lock_spends_no_delivery<B: TestBackend>(
    lock: &'static [&'static str],
    unlock: &'static str,
    lock_timeout: Duration,
    deadline: Duration,
) {
    const MESSAGES: i64 = 3;
    inbox_tests::init_tracing();
    let db = B::create(2).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let ack_wait = Duration::from_secs(30);
    let consumer = nats.consumer("c", ack_wait).await;
    // One connection, which holds the lock (MySQL's `LOCK TABLES` belongs to its session).
    let locker = B::connect(&db.url, 1).await;
    for sql in lock {
        B::exec_on(&locker, sql).await;
    }
    let pool = B::connect_acquiring(&db.url, 4, Duration::from_millis(300)).await;
    let inbox = B::inbox(pool.clone()).lock_timeout(lock_timeout);
    let worker = nats
        .worker(inbox, consumer)
        .deadline(deadline)
        .concurrency(1)
        .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all((0..MESSAGES).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    // Held for longer than `MAX_DELIVER` tries take, each ended by the lock wait or the
    // deadline, with its in-process retries and nak delay.
    let period = (lock_timeout.min(deadline) * 3 + Duration::from_millis(500)) * MAX_DELIVER as u32;
    inbox_testkit::throughout(period, async || {
        let stats = worker.stats();
        assert_eq!(
            stats.terminated, 0,
            "a message was dead-lettered while a table lock was held: {stats:?}"
        );
    })
    .await;
    assert!(
        worker.database_unreachable(),
        "the circuit is closed while the inbox is locked: {:?}",
        worker.stats()
    );
    B::exec_on(&locker, unlock).await;
    // Failed once in about twenty runs (the deadline variant, in CI on both nats-servers):
    // nothing drained in 90 s after the unlock, the circuit open. A try cut at its deadline
    // while its BEGIN was on the wire left its connection inside a transaction (sqlx 0.9.0; see
    // `cancelled_begin_leaves_no_transaction`). Should it come back: what the worker, its pool
    // and the database's sessions say then (with RUST_LOG set, the worker's log too).
    let drained = wait_until(
        "the consumer to drain after the unlock",
        Duration::from_secs(90),
        async || {
            inbox_testkit::backlog(&nats.js, &nats.stream, "c")
                .await
                .is_ok_and(|b| b.drained())
        },
    )
    .await;
    if let Err(e) = drained {
        let backlog = inbox_testkit::backlog(&nats.js, &nats.stream, "c").await;
        panic!(
            "{e}: {:?}, circuit open: {}, backlog: {backlog:?}, pool: {} open, {} idle; \
             sessions: {}",
            worker.stats(),
            worker.database_unreachable(),
            pool.size(),
            pool.num_idle(),
            sessions(&db.url).await,
        );
    }
    let stats = run.stop().await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "messages dead-lettered: {stats:?}"
    );
    assert_eq!(
        (stats.acked, stats.terminated),
        (MESSAGES as u64, 0),
        "{stats:?}"
    );
    inbox_tests::backends::assert_applied_once::<B>(&db, MESSAGES).await;
    locker.close().await;
}

/// What each session of the test's database is doing, where the database says (PostgreSQL).
async fn sessions(url: &str) -> String {
    if !url.starts_with("postgres") {
        return "(not asked)".to_owned();
    }
    /// pid, state, wait event, statement.
    type Session = (i32, Option<String>, Option<String>, Option<String>);
    let rows: Result<Vec<Session>, sqlx::Error> = async {
        let pool = sqlx::PgPool::connect(url).await?;
        sqlx::query_as(
            "SELECT pid, state, wait_event, left(query, 120) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_all(&pool)
        .await
    }
    .await;
    format!("{rows:?}")
}

const PG_LOCK: &[&str] = &["BEGIN", "LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE"];
const MYSQL_LOCK: &[&str] = &["LOCK TABLES inbox WRITE"];

/// The lock wait ends each try first (the inbox's `lock_timeout` below the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_table_lock_spends_no_delivery_at_its_lock_timeout() {
    let (lock_timeout, deadline) = (Duration::from_millis(500), Duration::from_secs(2));
    a_held_table_lock_spends_no_delivery::<Postgres>(PG_LOCK, "ROLLBACK", lock_timeout, deadline)
        .await;
}

/// The deadline ends each try first (the inbox's default `lock_timeout`, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_table_lock_spends_no_delivery_at_its_deadline() {
    let (lock_timeout, deadline) = (Duration::from_secs(30), Duration::from_secs(1));
    a_held_table_lock_spends_no_delivery::<Postgres>(PG_LOCK, "ROLLBACK", lock_timeout, deadline)
        .await;
}

/// MariaDB: DML waits for `LOCK TABLES`' metadata lock (`lock_wait_timeout`, a year by
/// default), so the deadline ends each try, whatever the inbox's lock timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_mysql_table_lock_spends_no_delivery() {
    let (lock_timeout, deadline) = (Duration::from_secs(1), Duration::from_secs(2));
    a_held_table_lock_spends_no_delivery::<MySql>(
        MYSQL_LOCK,
        "UNLOCK TABLES",
        lock_timeout,
        deadline,
    )
    .await;
}
