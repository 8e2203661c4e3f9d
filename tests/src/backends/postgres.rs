//! PostgreSQL: a fresh database on `INBOX_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) per test.

use super::{TestBackend, TestDb, common_queries};
use inbox_testkit::Backend;
use sqlx::pool::PoolConnection;

/// PostgreSQL.
pub struct Postgres;

/// The PostgreSQL test handlers.
pub mod handlers {
    crate::backend_handlers!(
        sqlx::Postgres,
        ledger = "INSERT INTO ledger (msg_key, account, amount) VALUES ($1, $2, $3)",
        credit = "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
                  ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        payment = "INSERT INTO payments (reference) VALUES ($1)",
    );
}

impl TestBackend for Postgres {
    type Db = sqlx::Postgres;
    type Ledger = handlers::ledger;
    type LedgerByTransportId = handlers::ledger_by_transport_id;
    type Credit = handlers::credit;
    type Payment = handlers::payment;
    const BACKEND: Backend = Backend::Postgres;
    const TABLES: [&'static str; 3] = [
        "CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, msg_key TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
    ];

    async fn connect(url: &str, max: u32) -> sqlx::PgPool {
        let options = url.parse().expect("a PostgreSQL URL");
        super::pool(url, options, max).await
    }

    common_queries!(sqlx::Postgres);

    async fn hold_cleanup_lock(
        db: &TestDb<sqlx::Postgres>,
        lock: &'static str,
    ) -> Option<PoolConnection<sqlx::Postgres>> {
        let mut holder = db.pool.acquire().await.expect("a connection");
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
            .bind(lock)
            .fetch_one(&mut *holder)
            .await
            .expect("pg_try_advisory_lock");
        assert!(got, "the cleanup lock {lock:?} is already held");
        Some(holder)
    }

    async fn release_cleanup_lock(mut holder: PoolConnection<sqlx::Postgres>, lock: &'static str) {
        sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(lock)
            .execute(&mut *holder)
            .await
            .expect("pg_advisory_unlock");
    }

    async fn backdate(db: &TestDb<sqlx::Postgres>, key: &'static str) {
        sqlx::query(
            "UPDATE inbox SET received_at = now() - interval '2 hours' WHERE message_key = $1",
        )
        .bind(key)
        .execute(&db.pool)
        .await
        .expect("backdate");
    }

    async fn waiting_writers(db: &TestDb<sqlx::Postgres>) -> i64 {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
        )
        .bind(&db.name)
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_activity")
    }
}
