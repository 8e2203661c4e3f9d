//! PostgreSQL: a fresh database on `INBOX_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) per test.

use super::{TestBackend, common_queries, server_queries};
use inbox_runtime::{Inbox, Partitions};
use inbox_testkit::Backend;

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

/// PostgreSQL with the partitioned inbox ([`Inbox::partitioned`], daily partitions): the
/// behaviours that must hold whatever the layout run on it too (`suite::partitioned_too!`).
pub struct PostgresPartitioned;

/// The impl both layouts share; `$inbox` makes the inbox on a pool.
macro_rules! postgres_backend {
    ($ty:ty, $inbox:expr) => {
        impl TestBackend for $ty {
            fn inbox(pool: sqlx::PgPool) -> Inbox<sqlx::Postgres> {
                $inbox(pool)
            }

    type Db = sqlx::Postgres;
    type Ledger = handlers::ledger;
    type LedgerByTransportId = handlers::ledger_by_transport_id;
    type ProbedByTransportId = handlers::probed_by_transport_id;
    type LedgerStrict = handlers::ledger_strict;
    type Credit = handlers::credit;
    type CreditLaned = handlers::credit_laned;
    type LedgerLaned = handlers::ledger_laned;
    type Payment = handlers::payment;
    type Remote = handlers::remote;
    type Announce = handlers::announce;
    const BACKEND: Backend = Backend::Postgres;
    async fn connect_acquiring(
        url: &str,
        max: u32,
        acquire: std::time::Duration,
    ) -> sqlx::Pool<Self::Db> {
        let options = url.parse().expect("a PostgreSQL URL");
        super::pool_acquiring(url, options, max, acquire).await
    }

    const READ_ONLY_SESSION: &'static str = "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY";

    async fn standby_pool(
        db: &super::TestDb<Self::Db>,
        max: u32,
        read_only: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> sqlx::Pool<Self::Db> {
        let options = db.url.parse().expect("a PostgreSQL URL");
        super::switchable_pool(&db.url, options, max, read_only, Self::READ_ONLY_SESSION).await
    }

    const TABLES: [&'static str; 3] = [
        "CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, msg_key TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
    ];

    async fn connect(url: &str, max: u32) -> sqlx::PgPool {
        let options = url.parse().expect("a PostgreSQL URL");
        super::pool(url, options, max).await
    }

    common_queries!(
        sqlx::Postgres,
        backdate =
            "UPDATE inbox SET received_at = now() - interval '2 hours' WHERE message_key = $1"
    );

    server_queries!(
        sqlx::Postgres,
        lock = "SELECT pg_try_advisory_lock(hashtext($1))" -> bool,
        held = true,
        unlock = "SELECT pg_advisory_unlock(hashtext($1))",
        waiting_writers = "SELECT count(*) FROM pg_stat_activity \
                           WHERE datname = $1 AND wait_event_type = 'Lock'",
        waiting_for_lock = "SELECT count(*) FROM pg_stat_activity \
                            WHERE datname = $1 AND wait_event_type = 'Lock' \
                            AND wait_event = 'advisory'",
        waiting_for_turn = "SELECT count(*) FROM pg_stat_activity \
                            WHERE datname = $1 AND wait_event_type = 'Lock' \
                            AND wait_event = 'advisory' AND query LIKE '%outbox-relay-turn:%'"
    );
        }
    };
}

postgres_backend!(Postgres, Inbox::new);
postgres_backend!(PostgresPartitioned, |pool| Inbox::new(pool)
    .partitioned(Partitions::daily()));
