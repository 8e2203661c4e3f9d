//! MySQL or MariaDB: a fresh database on `INBOX_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`) per test.

use super::{TestBackend, common_queries, server_queries};
use inbox_testkit::Backend;

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
    type ProbedByTransportId = handlers::probed_by_transport_id;
    type LedgerStrict = handlers::ledger_strict;
    type Credit = handlers::credit;
    type CreditLaned = handlers::credit_laned;
    type LedgerLaned = handlers::ledger_laned;
    type Payment = handlers::payment;
    type Remote = handlers::remote;
    type Announce = handlers::announce;
    const BACKEND: Backend = Backend::MySql;
    async fn connect_acquiring(
        url: &str,
        max: u32,
        acquire: std::time::Duration,
    ) -> sqlx::Pool<Self::Db> {
        let options = url.parse().expect("a MySQL URL");
        super::pool_acquiring(url, options, max, acquire).await
    }

    const READ_ONLY_SESSION: &'static str = "SET SESSION TRANSACTION READ ONLY";

    async fn standby_pool(
        db: &super::TestDb<Self::Db>,
        max: u32,
        read_only: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> sqlx::Pool<Self::Db> {
        let options = db.url.parse().expect("a MySQL URL");
        super::switchable_pool(&db.url, options, max, read_only, Self::READ_ONLY_SESSION).await
    }

    const TABLES: [&'static str; 3] = [
        "CREATE TABLE ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, msg_key VARCHAR(255) NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, CHECK (balance >= 0))",
        "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
    ];

    async fn connect(url: &str, max: u32) -> sqlx::MySqlPool {
        let options = url.parse().expect("a MySQL URL");
        super::pool(url, options, max).await
    }

    common_queries!(
        sqlx::MySql,
        backdate = "UPDATE inbox SET received_at = CURRENT_TIMESTAMP(6) - INTERVAL 2 HOUR \
                    WHERE message_key = ?"
    );

    server_queries!(
        sqlx::MySql,
        lock = "SELECT GET_LOCK(SHA2(CONCAT(DATABASE(), ?), 256), 0)" -> Option<i64>,
        held = Some(1),
        unlock = "DO RELEASE_LOCK(SHA2(CONCAT(DATABASE(), ?), 256))",
        // information_schema.innodb_trx proved unreliable on MariaDB 10.11 (it missed waiting
        // transactions while other sessions were open): look for a claim (or cleanup)
        // statement still executing instead; one that is not blocked returns at once.
        waiting_writers = "SELECT count(*) FROM information_schema.processlist \
                           WHERE db = ? AND (info LIKE 'INSERT INTO inbox %' \
                           OR info LIKE 'DELETE FROM inbox %')",
        // A GET_LOCK with a wait, still executing: the lock is held elsewhere.
        waiting_for_lock = "SELECT count(*) FROM information_schema.processlist \
                            WHERE db = ? AND info LIKE 'SELECT GET_LOCK(%'",
        // The turn row's lock, waited for by a statement still executing.
        waiting_for_turn = "SELECT count(*) FROM information_schema.processlist \
                            WHERE db = ? AND info LIKE 'SELECT id FROM %\\_relay WHERE id = 1 FOR UPDATE'"
    );
}
