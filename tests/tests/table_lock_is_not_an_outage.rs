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
use inbox_tests::NatsStream;
use inbox_tests::backends::{MySql, Postgres, TestBackend};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

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
