//! Hot rows in batches: two batched workers (each its own pool and NATS connection) on one
//! durable consumer credit 10 accounts from interleaved messages, so that every batch of either
//! worker updates most of the 10 rows.
//!
//! With a lane (`lane = msg.account`), every batch takes the rows in one order: no transaction
//! ever ends in a conflict (the workers' counters, which count every deadlock, serialization
//! failure, lock timeout or busy error a batch met; on PostgreSQL also the database's own
//! `pg_stat_database.deadlocks`), and every balance is exact. Without one, batches sorted by key
//! take the rows in different orders and deadlock, as they would in production: they are tried
//! again as a whole, every balance is still exact, and the run ends within [`BOUND`].

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::Entry;
use crate::{NatsStream, Running};
use inbox_runtime::Handler;
use inbox_testkit::{Backend, wait_until};
use std::collections::BTreeMap;
use std::time::Duration;

/// Messages, spread round-robin over [`ACCOUNTS`].
const MESSAGES: usize = 1_200;
/// The hot accounts.
const ACCOUNTS: usize = 10;
/// How long the run may take, lane or not. Seen on 2 cores: under a second with a lane; without,
/// about 15 s on PostgreSQL (each deadlock ends at the batch's short lock wait, 200 ms, rather
/// than at `deadlock_timeout`, 1 s, which took 200 s) and a few seconds elsewhere.
const BOUND: Duration = Duration::from_secs(120);
/// The application name of the workers' PostgreSQL sessions, to see them gone.
const APP: &str = "inbox_hot_rows";

/// Runs the two workers with handler `H`; returns their summed conflicts and, when there were
/// some on MariaDB/MySQL, InnoDB's report of its latest deadlock.
async fn credit_hot_accounts<B: TestBackend, H>() -> (u64, Option<String>)
where
    H: Handler<Db = B::Db, Message = Entry, State = ()> + Default,
{
    let (db, _) = setup::<B>(2).await;
    // Every account exists, as hot ones do: the first insert of a row is not what is measured.
    B::exec(
        &db,
        "INSERT INTO accounts (id, balance) VALUES \
         (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0), (9, 0)",
    )
    .await;
    let nats = NatsStream::create().await;
    nats.consumer("c", Duration::from_secs(30)).await;
    // Interleaved: consecutive messages (and so consecutive keys) credit different accounts.
    nats.publish_all(
        (0..MESSAGES).map(|i| Entry::new(format!("h-{i:05}"), (i % ACCOUNTS) as i64, 1).json()),
    )
    .await;
    let url = match B::BACKEND {
        Backend::Postgres => {
            let join = if db.url.contains('?') { '&' } else { '?' };
            format!("{}{join}application_name={APP}", db.url)
        }
        _ => db.url.clone(),
    };
    let mut workers = Vec::new();
    for _ in 0..2 {
        let pool = B::connect(&url, 6).await;
        let inbox = B::inbox(pool.clone());
        let consumer = nats.consumer_on_new_connection("c").await;
        let worker = nats
            .worker(inbox, consumer)
            .concurrency(4)
            .batch(16, Duration::from_millis(20))
            .build(H::default())
            .unwrap();
        let run = Running::start(&worker);
        workers.push((worker, run, pool));
    }
    let started = std::time::Instant::now();
    wait_until("every credit to be applied", BOUND, || async {
        let done: u64 = workers.iter().map(|(w, _, _)| w.stats().acked).sum();
        done >= MESSAGES as u64
    })
    .await
    .unwrap();
    let took = started.elapsed();
    nats.wait_drained("c").await;
    let mut conflicts = 0;
    for (_, run, pool) in workers {
        let stats = run.stop().await;
        assert!(stats.acked > 0, "a worker did no work: {stats:?}");
        assert_eq!((stats.skipped, stats.terminated), (0, 0), "{stats:?}");
        conflicts += stats.conflicts;
        pool.close().await;
    }
    let expected: BTreeMap<i64, i64> = (0..ACCOUNTS as i64)
        .map(|a| (a, (MESSAGES / ACCOUNTS) as i64))
        .collect();
    assert_eq!(
        B::balances(&db).await,
        expected,
        "a credit was lost or doubled"
    );
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM inbox").await,
        MESSAGES as i64
    );
    if B::BACKEND == Backend::Postgres {
        // A session flushes its statistics when it ends: once the workers' sessions are gone,
        // the database's deadlock count includes every deadlock they met.
        wait_until(
            "the workers' sessions to end",
            Duration::from_secs(30),
            || async {
                B::count(
                    &db,
                    "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'inbox_hot_rows'",
                )
                .await
                    == 0
            },
        )
        .await
        .unwrap();
        let deadlocks = B::count(
            &db,
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
        )
        .await;
        assert!(
            deadlocks as u64 <= conflicts,
            "PostgreSQL saw {deadlocks} deadlocks, the workers {conflicts} conflicts"
        );
        if conflicts == 0 {
            assert_eq!(deadlocks, 0, "PostgreSQL saw deadlocks the workers did not");
        }
    }
    eprintln!(
        "{}: {conflicts} conflicts in {took:?}",
        std::any::type_name::<H>()
    );
    let report = match (conflicts, B::BACKEND) {
        (1.., Backend::MySql) => Some(innodb_latest_deadlock(&db.url).await),
        _ => None,
    };
    (conflicts, report)
}

/// With `lane = msg.account`: not one conflict.
async fn hot_accounts_with_a_lane_never_conflict<B: TestBackend>() {
    let (conflicts, report) = credit_hot_accounts::<B, B::CreditLaned>().await;
    // On MariaDB/MySQL, what InnoDB last reported (the server's latest deadlock, whichever
    // database it was in): which locks crossed.
    assert_eq!(
        conflicts,
        0,
        "laned batches met conflicts; InnoDB's latest deadlock:\n{}",
        report.unwrap_or_default()
    );
}

/// The LATEST DETECTED DEADLOCK section of `SHOW ENGINE INNODB STATUS`, or why it is missing.
async fn innodb_latest_deadlock(url: &str) -> String {
    use sqlx::{Connection, Row};
    let status = async {
        let mut conn = sqlx::MySqlConnection::connect(url).await?;
        let row = sqlx::query("SHOW ENGINE INNODB STATUS")
            .fetch_one(&mut conn)
            .await?;
        row.try_get::<String, _>("Status")
    };
    match status.await {
        Ok(status) => match status.split_once("LATEST DETECTED DEADLOCK") {
            Some((_, deadlock)) => deadlock
                .split("\nTRANSACTIONS\n")
                .next()
                .unwrap_or(deadlock)
                .to_owned(),
            None => "none reported (a lock wait timeout, not a deadlock)".to_owned(),
        },
        Err(e) => format!("SHOW ENGINE INNODB STATUS failed: {e}"),
    }
}

/// Without a lane: conflicts are tried again, and every balance is exact within the bound.
async fn hot_accounts_without_a_lane_stay_exact<B: TestBackend>() {
    credit_hot_accounts::<B, B::Credit>().await;
}

super::behaviours!(
    hot_accounts_with_a_lane_never_conflict,
    hot_accounts_without_a_lane_stay_exact,
);
