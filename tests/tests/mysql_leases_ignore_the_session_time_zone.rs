//! MySQL and MariaDB convert `TIMESTAMP` values to and from the session's time zone, and two-phase
//! leases were computed there (`CURRENT_TIMESTAMP(6) + INTERVAL ..`): in a zone with daylight
//! saving time, a lease taken in the hour before the clocks go back, or in the repeated hour,
//! ended an hour late (a takeover blocked for an hour) or an hour early (it looked expired at
//! once to other instances: a second side effect under the same key). Lease statements now run
//! with the session in UTC and back, so a lease ends `lease` after it was taken, whatever the
//! application's zone.
//!
//! The sessions run in Europe/Berlin with the server's clock set (`SET timestamp`) to two
//! instants of the night the clocks go back (25 October 2026): 02:59:50 CEST, 30 s before the
//! change, and 02:30:00 CET, in the repeated hour. The lease is read as the server stores it
//! (`UNIX_TIMESTAMP` of a `TIMESTAMP` column is its UTC instant, whatever the zone).
//!
//! The zone's rules are loaded into the server's `mysql` schema (with `mysql_tzinfo_to_sql`)
//! when it does not have them yet: a named zone needs them.

use inbox_runtime::Inbox;
use inbox_tests::backends::{MySql, TestBackend};
use inbox_tests::handlers::{Entry, Remote};
use inbox_tests::{NatsStream, Running};
use sqlx::pool::PoolOptions;
use sqlx::{Executor, MySqlPool};
use std::time::Duration;

const ZONE: &str = "Europe/Berlin";
const LEASE: Duration = Duration::from_secs(30);

/// Loads the rules of [`ZONE`] into the server unless it has them.
async fn ensure_zone(admin: &MySqlPool) {
    // The tests of this file run at once: one loads the rules, the others wait and find them.
    static LOADING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _loading = LOADING.lock().await;
    let known: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM mysql.time_zone_name WHERE Name = ?")
        .bind(ZONE)
        .fetch_one(admin)
        .await
        .expect("MariaDB (127.0.0.1:3306): read mysql.time_zone_name");
    if known > 0 {
        return;
    }
    let file = format!("/usr/share/zoneinfo/{ZONE}");
    let out = std::process::Command::new("mysql_tzinfo_to_sql")
        .args([&file, ZONE])
        .output()
        .unwrap_or_else(|e| panic!("mysql_tzinfo_to_sql (MariaDB's client tools): {e}"));
    assert!(out.status.success(), "mysql_tzinfo_to_sql {file}: {out:?}");
    let script = String::from_utf8(out.stdout).expect("SQL text");
    // A connection of its own, closed after: `USE mysql` must not go back to the pool.
    let mut conn = admin.acquire().await.expect("a connection").detach();
    conn.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "USE mysql; {script}"
    ))))
    .await
    .unwrap_or_else(|e| panic!("loading the rules of {ZONE}: {e}"));
}

/// Takes a two-phase claim with the server's clock at `now` (Unix seconds) in [`ZONE`], and
/// returns when its lease ends, as stored (Unix seconds).
async fn lease_taken_at(now: i64) -> f64 {
    let db = MySql::create(4).await;
    ensure_zone(&db.pool).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("c", Duration::from_secs(60)).await;
    let session = format!("SET time_zone = '{ZONE}', timestamp = {now}");
    let pool = PoolOptions::<sqlx::MySql>::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            let session = session.clone();
            Box::pin(async move {
                conn.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(session)))
                    .await?;
                Ok(())
            })
        })
        .connect(&db.url)
        .await
        .expect("MariaDB (127.0.0.1:3306): connect");
    let remote = Remote::default();
    remote.hold();
    let worker = nats
        .worker(MySql::inbox(pool).lease(LEASE), consumer)
        .build_with_state(<MySql as TestBackend>::Remote::default(), remote.clone())
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all([Entry::new("k", 1, 1).json()]).await;
    tokio::time::timeout(Duration::from_secs(60), remote.entered())
        .await
        .expect("the claim's call to reach the remote");
    let until: f64 = sqlx::query_scalar(
        "SELECT CAST(UNIX_TIMESTAMP(lease_until) AS DOUBLE) FROM inbox WHERE consumer = 'remote'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the claim's lease");
    remote.release();
    nats.wait_drained("c").await;
    run.stop().await;
    until
}

/// Asserts that a lease taken with the server's clock at `now` ends [`LEASE`] later.
async fn assert_lease_ends_on_time(now: i64) {
    let until = lease_taken_at(now).await;
    let after = until - now as f64;
    assert_eq!(
        after,
        LEASE.as_secs_f64(),
        "the lease ends {after:+.0} s after it was taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_before_the_clocks_go_back_ends_on_time() {
    // 2026-10-25 00:59:50 UTC: 02:59:50 CEST, 10 s before the clocks go back to 02:00.
    assert_lease_ends_on_time(1_792_889_990).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_in_the_repeated_hour_ends_on_time() {
    // 2026-10-25 01:30:00 UTC: 02:30:00 CET, the second time the clocks show 02:30.
    assert_lease_ends_on_time(1_792_891_800).await;
}
