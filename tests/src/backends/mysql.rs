//! MySQL or MariaDB: a fresh database on `INBOX_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`) per test.

use super::{TestBackend, TestDb, common_queries};
use inbox_testkit::Backend;
use sqlx::pool::PoolConnection;

/// MySQL or MariaDB.
pub struct MySql;

/// The MySQL test handlers.
pub mod handlers {
    crate::backend_handlers!(
        sqlx::MySql,
        ledger = "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)",
        credit = "INSERT INTO accounts (id, balance) VALUES (?, ?) \
                  ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
        payment = "INSERT INTO payments (reference) VALUES (?)",
    );
}

impl TestBackend for MySql {
    type Db = sqlx::MySql;
    type Ledger = handlers::ledger;
    type LedgerByTransportId = handlers::ledger_by_transport_id;
    type Credit = handlers::credit;
    type Payment = handlers::payment;
    const BACKEND: Backend = Backend::MySql;
    const TABLES: [&'static str; 3] = [
        "CREATE TABLE ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, msg_key VARCHAR(255) NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, CHECK (balance >= 0))",
        "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
    ];

    async fn connect(url: &str, max: u32) -> sqlx::MySqlPool {
        let options = url.parse().expect("a MySQL URL");
        super::pool(url, options, max).await
    }

    common_queries!(sqlx::MySql);

    async fn hold_cleanup_lock(
        db: &TestDb<sqlx::MySql>,
        lock: &'static str,
    ) -> Option<PoolConnection<sqlx::MySql>> {
        let mut holder = db.pool.acquire().await.expect("a connection");
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(lock)
            .fetch_one(&mut *holder)
            .await
            .expect("GET_LOCK");
        assert_eq!(got, Some(1), "the cleanup lock {lock:?} is already held");
        Some(holder)
    }

    async fn release_cleanup_lock(mut holder: PoolConnection<sqlx::MySql>, lock: &'static str) {
        sqlx::query("DO RELEASE_LOCK(?)")
            .bind(lock)
            .execute(&mut *holder)
            .await
            .expect("RELEASE_LOCK");
    }

    async fn backdate(db: &TestDb<sqlx::MySql>, key: &'static str) {
        sqlx::query("UPDATE inbox SET received_at = CURRENT_TIMESTAMP(6) - INTERVAL 2 HOUR WHERE message_key = ?")
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("backdate");
    }

    async fn waiting_writers(db: &TestDb<sqlx::MySql>) -> i64 {
        sqlx::query_scalar::<_, i64>(
            // information_schema.innodb_trx proved unreliable on MariaDB 10.11 (it missed
            // waiting transactions while other sessions were open): look for a claim statement
            // still executing instead; a claim that is not blocked returns at once.
            "SELECT count(*) FROM information_schema.processlist \
             WHERE db = ? AND info LIKE 'INSERT INTO inbox %'",
        )
        .bind(&db.name)
        .fetch_one(&db.pool)
        .await
        .expect("information_schema.processlist")
    }
}
