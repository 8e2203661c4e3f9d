//! The partitioned inbox (PostgreSQL only; `Inbox::partitioned`): what holds there beyond the
//! conformance suite, which runs its layout-independent behaviours on it too
//! (`suite::*::postgres_partitioned`).
//!
//! - A duplicate whose marker sits in an older partition is still skipped: UNIQUE (consumer,
//!   message_key, received_at) would let it in, the claim's lookup across partitions does not.
//! - Cleanup drops a partition only when its whole range is past the cutoff; a partition that
//!   still holds an open claim or another consumer's marker loses only this consumer's finished
//!   markers, and a marker younger than the retention stays a duplicate.
//! - A marker for which no partition exists fails its claim (nothing is acked, skipped or
//!   dead-lettered at once) until the partitions are created again.

mod postgres {
    use inbox_runtime::{ErrorClass, Inbox, Outcome, Partitions, ProcessError, Stage, classify};
    use inbox_tests::backends::{Postgres, TestBackend, TestDb};
    use inbox_tests::handlers::{Entry, Probe};
    use std::time::Duration;

    async fn setup() -> (TestDb<sqlx::Postgres>, Inbox<sqlx::Postgres>) {
        let db = Postgres::create(4).await;
        let inbox = Inbox::new(db.pool.clone()).partitioned(Partitions::daily());
        inbox
            .migrate()
            .await
            .expect("migrate the partitioned inbox");
        (db, inbox)
    }

    /// Attaches a partition `[today - from_days, today - to_days)` (UTC days) named as the
    /// inbox names its own, its upper bound cut to the next existing partition, unless one
    /// overlapping it exists already.
    async fn old_partition(db: &TestDb<sqlx::Postgres>, from_days: i32, to_days: i32) {
        let sql = format!(
            "DO $$ DECLARE
                v_lo TIMESTAMPTZ := (date_trunc('day', now() AT TIME ZONE 'UTC') - interval '{from_days} days') AT TIME ZONE 'UTC';
                v_hi TIMESTAMPTZ := (date_trunc('day', now() AT TIME ZONE 'UTC') - interval '{to_days} days') AT TIME ZONE 'UTC';
                part TEXT := 'inbox_p' || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24');
            BEGIN
                v_hi := least(v_hi, (SELECT min(p.lo) FROM inbox_partitions() p WHERE p.lo >= v_lo));
                IF v_lo < v_hi AND NOT EXISTS (SELECT 1 FROM inbox_partitions() p WHERE p.lo < v_hi AND p.hi > v_lo) THEN
                    EXECUTE format('CREATE TABLE %I (LIKE inbox INCLUDING DEFAULTS)', part);
                    EXECUTE format('ALTER TABLE inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', part, v_lo, v_hi);
                END IF;
            END $$"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&db.pool)
            .await
            .expect("attach an old partition");
    }

    /// Inserts a marker of `consumer` for `key` received at `received_at` (an SQL expression),
    /// finished unless `open` (then an open two-phase claim whose lease ran out).
    async fn marker(
        db: &TestDb<sqlx::Postgres>,
        consumer: &str,
        key: &str,
        received_at: &str,
        open: bool,
    ) {
        let (processed, lease) = if open {
            ("NULL", "now() - interval '1 hour'")
        } else {
            ("now()", "NULL")
        };
        let sql = format!(
            "INSERT INTO inbox (consumer, message_key, received_at, processed_at, lease_until, fence) \
             VALUES ($1, $2, {received_at}, {processed}, {lease}, 1)"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("insert a marker");
    }

    async fn count(db: &TestDb<sqlx::Postgres>, sql: &'static str) -> i64 {
        Postgres::count(db, sql).await
    }

    async fn process(inbox: &Inbox<sqlx::Postgres>, key: &str) -> Result<Outcome, ProcessError> {
        let probe = Probe::open();
        inbox
            .process(
                &<Postgres as TestBackend>::Ledger::default(),
                &probe,
                Entry::new(key, 1, 1),
                &inbox_runtime::Delivery::default(),
            )
            .await
    }

    /// Today's partition and three ahead (four or five: the one two hours back may be
    /// yesterday's), created once however many instances migrate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partitions_are_created_ahead_once() {
        let (db, inbox) = setup().await;
        let made = "SELECT count(*) FROM inbox_partitions()";
        let n = count(&db, made).await;
        assert!((4..=5).contains(&n), "{n} partitions");
        let ahead = "SELECT count(*) FROM inbox_partitions() WHERE lo >= now() + interval '2 days'";
        assert!(count(&db, ahead).await >= 1);
        assert_eq!(inbox.add_partitions().await.unwrap(), 0);
        assert_eq!(count(&db, made).await, n);
    }

    /// A duplicate whose marker was received yesterday, in an older partition: skipped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_duplicate_in_an_older_partition_is_skipped() {
        let (db, inbox) = setup().await;
        old_partition(&db, 3, 0).await;
        marker(&db, "ledger", "old", "now() - interval '1 day'", false).await;
        let old = "SELECT count(*) FROM inbox WHERE received_at < now() - interval '20 hours'";
        assert_eq!(count(&db, old).await, 1);
        assert_eq!(process(&inbox, "old").await.unwrap(), Outcome::Skip);
        assert_eq!(count(&db, "SELECT count(*) FROM ledger").await, 0);
        assert_eq!(count(&db, "SELECT count(*) FROM inbox").await, 1);
        assert_eq!(process(&inbox, "new").await.unwrap(), Outcome::Ack);
        assert_eq!(process(&inbox, "new").await.unwrap(), Outcome::Skip);
        assert_eq!(count(&db, "SELECT count(*) FROM ledger").await, 1);
    }

    /// Cleanup with a retention of two days, where today is day D (UTC): the partition of
    /// D-5 (only this consumer's finished markers) is dropped; D-4 holds an open claim and D-3
    /// another consumer's marker, so they lose only this consumer's finished markers; D-2 runs
    /// past the cutoff and is kept whole, its marker younger than the retention still a
    /// duplicate. The other consumer's cleanup then drops D-3, left with its marker alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cleanup_drops_only_expired_partitions_and_keeps_the_window() {
        let (db, inbox) = setup().await;
        for day in [5, 4, 3, 2] {
            old_partition(&db, day, day - 1).await;
        }
        old_partition(&db, 1, 0).await;
        let day = |d: i32| {
            format!(
                "(date_trunc('day', now() AT TIME ZONE 'UTC') - interval '{d} days' + interval '1 hour') AT TIME ZONE 'UTC'"
            )
        };
        marker(&db, "ledger", "a5", &day(5), false).await;
        marker(&db, "ledger", "b5", &day(5), false).await;
        marker(&db, "ledger", "a4", &day(4), false).await;
        marker(&db, "ledger", "open4", &day(4), true).await;
        marker(&db, "ledger", "a3", &day(3), false).await;
        marker(&db, "other", "d3", &day(3), false).await;
        // Just inside the retention: must stay a duplicate.
        let window = "now() - interval '2 days' + interval '10 minutes'";
        marker(&db, "ledger", "w", window, false).await;
        let partitions = "SELECT count(*) FROM inbox_partitions()";
        let before = count(&db, partitions).await;

        let retention = Duration::from_secs(2 * 86400);
        let removed = inbox.cleanup("ledger", retention, 1).await.unwrap();
        assert_eq!(removed, Some(4), "a5, b5 (dropped), a4 and a3 (deleted)");
        assert_eq!(count(&db, partitions).await, before - 1, "only D-5 dropped");
        let left = "SELECT count(*) FROM inbox WHERE message_key IN ('open4', 'd3', 'w')";
        assert_eq!(count(&db, left).await, 3);
        assert_eq!(count(&db, "SELECT count(*) FROM inbox").await, 3);
        assert_eq!(process(&inbox, "w").await.unwrap(), Outcome::Skip);

        let removed = inbox.cleanup("other", retention, 100).await.unwrap();
        assert_eq!(removed, Some(1), "d3, its partition dropped");
        assert_eq!(count(&db, partitions).await, before - 2);
        let open = inbox.open_claims("ledger", Duration::ZERO).await.unwrap();
        assert_eq!(open.len(), 1, "{open:?}");
        // Nothing more to do: a second pass removes nothing.
        assert_eq!(
            inbox.cleanup("ledger", retention, 100).await.unwrap(),
            Some(0)
        );
    }

    /// With no partition for now, the claim fails (a database error at the claim, redelivered
    /// later, never a permanent failure); once the partitions are created again it succeeds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_marker_outside_every_partition_fails_its_claim_until_partitions_exist() {
        let (db, inbox) = setup().await;
        let current = "SELECT name FROM inbox_partitions() WHERE lo <= now() AND hi > now()";
        let name: String = sqlx::query_scalar(current)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let drop = format!("DROP TABLE {name}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&db.pool)
            .await
            .unwrap();
        let err = process(&inbox, "k").await.unwrap_err();
        assert!(
            matches!(
                err,
                ProcessError::Database {
                    stage: Stage::Claim,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("no partition"), "{err}");
        assert_eq!(classify::<sqlx::Postgres>(&err), ErrorClass::Unknown);
        assert_eq!(count(&db, "SELECT count(*) FROM ledger").await, 0);
        assert_eq!(inbox.add_partitions().await.unwrap(), 1);
        assert_eq!(process(&inbox, "k").await.unwrap(), Outcome::Ack);
    }
}
