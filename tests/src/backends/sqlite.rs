//! SQLite: a fresh file in the temporary directory per test.

use super::{TestBackend, TestDb, common_queries};
use inbox_testkit::Backend;
use sqlx::pool::PoolConnection;

/// SQLite.
pub struct Sqlite;

/// The SQLite test handlers.
pub mod handlers {
    crate::backend_handlers!(
        sqlx::Sqlite,
        ledger = "INSERT INTO ledger (msg_key, account, amount) VALUES (?1, ?2, ?3)",
        credit = "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
                  ON CONFLICT (id) DO UPDATE SET balance = balance + excluded.balance",
        payment = "INSERT INTO payments (reference) VALUES (?1)",
    );
}

impl TestBackend for Sqlite {
    type Db = sqlx::Sqlite;
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
    const BACKEND: Backend = Backend::Sqlite;
    const SINGLE_WRITER: bool = true;
    async fn connect_acquiring(
        url: &str,
        max: u32,
        acquire: std::time::Duration,
    ) -> sqlx::Pool<Self::Db> {
        let options = inbox_runtime::sqlite_options(url).expect("a SQLite URL");
        super::pool_acquiring(url, options, max, acquire).await
    }

    const READ_ONLY_SESSION: &'static str = "PRAGMA query_only = ON";

    async fn standby_pool(
        db: &super::TestDb<Self::Db>,
        max: u32,
        read_only: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> sqlx::Pool<Self::Db> {
        let options = inbox_runtime::sqlite_options(&db.url).expect("a SQLite URL");
        super::switchable_pool(&db.url, options, max, read_only, Self::READ_ONLY_SESSION).await
    }

    const TABLES: [&'static str; 3] = [
        "CREATE TABLE ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, msg_key TEXT NOT NULL, account INTEGER NOT NULL, amount INTEGER NOT NULL)",
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE payments (reference INTEGER NOT NULL UNIQUE)",
    ];

    async fn connect(url: &str, max: u32) -> sqlx::SqlitePool {
        let options = inbox_runtime::sqlite_options(url).expect("a SQLite URL");
        super::pool(url, options, max).await
    }

    common_queries!(
        sqlx::Sqlite,
        backdate = "UPDATE inbox SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-2 hours') \
                    WHERE message_key = ?1"
    );

    /// None: one writer at a time serialises cleanups without a lock.
    async fn hold_cleanup_lock(
        _: &TestDb<sqlx::Sqlite>,
        _: &'static str,
    ) -> Option<PoolConnection<sqlx::Sqlite>> {
        None
    }

    async fn release_cleanup_lock(_: PoolConnection<sqlx::Sqlite>, _: &'static str) {}

    /// None: relays take turns by their lease, which no one waits for.
    async fn waiting_for_relay_turn(_: &TestDb<sqlx::Sqlite>) -> i64 {
        0
    }

    /// None: there is no fleet lock to wait for.
    async fn waiting_for_fleet_lock(_: &TestDb<sqlx::Sqlite>) -> i64 {
        0
    }

    async fn waiting_writers(db: &TestDb<sqlx::Sqlite>) -> i64 {
        // SQLite has no lock table to look at; BEGIN IMMEDIATE makes the second writer wait for
        // the database's one write lock, so a second connection in use is that writer.
        let in_use = db.pool.size() as i64 - db.pool.num_idle() as i64;
        in_use - 1
    }
}
