//! A try cut at its deadline while its BEGIN was on the wire (a database slow to answer, a
//! network that holds packets) left its connection inside a transaction that nothing would end:
//! sqlx 0.9.0 counted the transaction only once the BEGIN's answer was read, so the rollback
//! queued on drop was skipped, and the pool's check on release (a ping) passed it. The pool then
//! handed the connection on: the next statements (the circuit's probe, a cleanup, the next try)
//! ran inside that transaction and kept their locks, and the first error left the connection
//! refusing every statement (25P02) until its lifetime ended. In the table-lock test this held
//! the circuit open after the lock went. sqlx 0.9.1 counts the transaction before the round
//! trip (pinned below, PostgreSQL). MySQL's driver still does not: the worker closes a
//! connection whose BEGIN it cut rather than putting it back, and MySQL's BEGIN statement
//! commits first whatever transaction a path that does not close it left (before, the next
//! try's `SET TRANSACTION` was refused, 1568, for the connection's life, so every message tried
//! on it was dead-lettered).

use inbox_runtime::Inbox;
use inbox_testkit::{TcpProxy, wait_until};
use inbox_tests::backends::{MySql, Postgres, TestBackend};
use inbox_tests::handlers::{Entry, Probe};
use inbox_tests::{NatsStream, Running};
use std::time::Duration;

/// Whether PostgreSQL's pooled connection is inside a transaction begun before this statement.
async fn pg_in_transaction(pool: &sqlx::PgPool) -> bool {
    use sqlx::Row;
    // One simple query: outside a transaction block it is its own transaction, begun with it.
    sqlx::raw_sql("SELECT now() < statement_timestamp()")
        .fetch_one(pool)
        .await
        .expect("PostgreSQL: ask whether the session is in a transaction")
        .get(0)
}

/// Whether MariaDB's pooled connection is inside a transaction.
async fn mysql_in_transaction(pool: &sqlx::MySqlPool) -> bool {
    let open: i64 = sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
        .fetch_one(pool)
        .await
        .expect("MariaDB: ask whether the session is in a transaction");
    open == 1
}

/// Begins a transaction on `pool`'s one connection and cuts it while its BEGIN is on the wire
/// (held by the frozen `proxy`), then waits until the connection is back in the pool (its
/// release check answered once the proxy thaws).
async fn cut_a_begin<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, proxy: &TcpProxy) {
    let idle = async || pool.num_idle() == 1;
    wait_until(
        "the connection idle in the pool",
        Duration::from_secs(30),
        idle,
    )
    .await
    .unwrap();
    proxy.freeze();
    let mut conn = pool.acquire().await.expect("the pool's connection");
    let begin = sqlx::Connection::begin(&mut *conn);
    // The BEGIN is written, and held by the frozen proxy: no answer, so the future is cut.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), begin)
            .await
            .is_err(),
        "BEGIN answered through a frozen proxy"
    );
    drop(conn);
    proxy.thaw();
    wait_until(
        "the connection back in the pool",
        Duration::from_secs(30),
        idle,
    )
    .await
    .unwrap();
}

async fn a_begin_cut_on_the_wire_leaves_no_transaction<B: TestBackend>(
    in_transaction: impl AsyncFn(&sqlx::Pool<B::Db>) -> bool,
) {
    let db = B::create(1).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 1).await;
    assert!(
        !in_transaction(&pool).await,
        "in a transaction before the test"
    );
    cut_a_begin(&pool, &proxy).await;
    assert!(
        !in_transaction(&pool).await,
        "a BEGIN cut on the wire left its pooled connection inside a transaction"
    );
}

/// sqlx 0.9.1's own guard, for PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_cut_on_the_wire_leaves_no_postgres_transaction() {
    a_begin_cut_on_the_wire_leaves_no_transaction::<Postgres>(pg_in_transaction).await;
}

/// The worker's, on each server backend: its one connection's BEGIN cut at the deadline (the
/// database silent), the message is applied once when the database answers again, and the
/// connection is in no transaction afterwards.
async fn a_try_cut_in_its_begin_is_applied_once<B: TestBackend>(
    in_transaction: impl AsyncFn(&sqlx::Pool<B::Db>) -> bool,
) {
    inbox_tests::init_tracing();
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 1).await;
    let worker = nats
        .worker(B::inbox(pool.clone()), consumer)
        .deadline(Duration::from_secs(1))
        .concurrency(1)
        .nak_delay(Duration::from_millis(50), Duration::from_millis(100))
        .build_with_state(B::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    // Started, and its one connection idle in the pool: a first message applied.
    nats.publish_all([Entry::new("warm", 0, 1).json()]).await;
    wait_until("the first message", Duration::from_secs(60), async || {
        worker.stats().acked == 1 && pool.num_idle() == 1
    })
    .await
    .unwrap();
    // The try's first statement is its BEGIN, written and held: cut at the deadline. The
    // probe after it finds no connection (the pool's one is being released, or closed), so
    // the circuit opens.
    proxy.freeze();
    nats.publish_all([Entry::new("m-1", 1, 1).json()]).await;
    wait_until("the circuit to open", Duration::from_secs(60), async || {
        worker.database_unreachable()
    })
    .await
    .unwrap();
    proxy.thaw();
    nats.wait_drained("c").await;
    let stats = run.stop().await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "the message was dead-lettered: {stats:?}"
    );
    assert_eq!((stats.acked, stats.terminated), (2, 0), "{stats:?}");
    inbox_tests::backends::assert_applied_once::<B>(&db, 2).await;
    assert!(
        !in_transaction(&pool).await,
        "the worker left its connection inside a transaction"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_cut_in_its_begin_is_applied_once_on_postgres() {
    a_try_cut_in_its_begin_is_applied_once::<Postgres>(pg_in_transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_cut_in_its_begin_is_applied_once_on_mysql() {
    a_try_cut_in_its_begin_is_applied_once::<MySql>(mysql_in_transaction).await;
}

/// A dead letter kept in the database (the dead-letter stream refusing it, on its last
/// delivery) was an autocommit INSERT: on a pooled connection that something else had left
/// inside a transaction (here a BEGIN of the application's own, cut on a pool it shares with
/// the worker; MySQL's driver does not roll that back), the INSERT committed only with that
/// transaction, and was lost when the connection closed, after its message had been termed.
/// The letter is now parked in a transaction of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_letter_parked_on_a_connection_left_in_a_transaction_is_kept() {
    use async_nats::jetstream::stream;
    let db = MySql::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(30)).await;
    // The dead-letter stream listens elsewhere: the letter is kept in the database.
    nats.js
        .create_stream(stream::Config {
            name: nats.dlq_stream.clone(),
            subjects: vec![format!("elsewhere.{}", nats.stream.to_lowercase())],
            ..Default::default()
        })
        .await
        .unwrap();
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<MySql>(&db, &mut proxy, 1).await;
    cut_a_begin(&pool, &proxy).await;
    assert!(
        mysql_in_transaction(&pool).await,
        "the application's cut BEGIN left no transaction: nothing to test"
    );

    nats.publish_all([b"{ not json".to_vec()]).await;
    let worker = nats
        .worker(MySql::inbox(pool.clone()), consumer)
        .nak_delay(Duration::from_millis(10), Duration::from_millis(10))
        .build_with_state(<MySql as TestBackend>::Ledger::default(), Probe::open())
        .unwrap();
    let run = Running::start(&worker);
    wait_until(
        "the message to be terminated",
        Duration::from_secs(60),
        async || worker.stats().terminated == 1,
    )
    .await
    .unwrap();
    run.stop().await;
    // The connection closes: what it had not committed is rolled back.
    pool.close().await;
    assert_eq!(
        MySql::count(&db, "SELECT count(*) FROM inbox_dead_letters").await,
        1,
        "the termed message's letter was lost"
    );
}

/// A two-phase claim's transaction is begun from the pool, where MySQL's driver does not count a
/// BEGIN cut on the wire: the lease statements that ran next on that connection (a renewal, a
/// release) ran inside the transaction it left, uncommitted, holding the claim row's lock until
/// the connection's next BEGIN. A lease statement's connection now commits first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_statement_after_a_cut_begin_is_not_left_in_its_transaction() {
    type B = MySql;
    let db = B::create(1).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    let mut proxy = TcpProxy::reserve().unwrap();
    let pool = inbox_tests::pool_through::<B>(&db, &mut proxy, 1).await;
    cut_a_begin(&pool, &proxy).await;
    // A release on the pool's one connection, the one the cut BEGIN left.
    let released = B::inbox(pool.clone()).release_claim("c", "k").await;
    assert!(!released.expect("the release"), "no claim to release");
    assert!(
        !mysql_in_transaction(&pool).await,
        "the lease statement ran inside the transaction a cut BEGIN left, uncommitted"
    );
}
