//! The databases the conformance suite runs on. Each is one [`TestBackend`] impl: how to make a
//! fresh database, its business tables and handlers, and how to observe it.

use crate::handlers::{Entry, Probe};
use crate::{off_runtime, unique};
use inbox_runtime::{Handler, InboxBackend};
use sqlx::{AssertSqlSafe, Pool};
use std::collections::BTreeMap;
use std::future::Future;

/// A fresh database of one backend, removed when dropped (also when the test panics).
pub struct TestDb<DB: sqlx::Database> {
    /// The database's name (for SQLite, the file's stem).
    pub name: String,
    /// Its URL, for other processes.
    pub url: String,
    /// A pool on it.
    pub pool: Pool<DB>,
    _cleanup: Cleanup,
}

/// Runs its closure when dropped: removes a test database even when the test panics.
struct Cleanup(Option<Box<dyn FnOnce() + Send + Sync>>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(cleanup) = self.0.take() {
            cleanup();
        }
    }
}

/// One database under test. A new backend is one impl of this trait and one line in the suite.
pub trait TestBackend: Send + Sync + 'static {
    /// The sqlx database.
    type Db: InboxBackend;
    /// `ledger`, see [`backend_handlers!`](crate::backend_handlers).
    type Ledger: Handler<Db = Self::Db, Message = Entry, State = Probe> + Default;
    /// `ledger_by_transport_id`.
    type LedgerByTransportId: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `credit`.
    type Credit: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `payment`.
    type Payment: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;

    /// Whether the database admits one writer at a time (SQLite), which serialises what the
    /// others must lock for.
    const SINGLE_WRITER: bool = false;

    /// A fresh database with the business tables (`ledger`, `accounts`, `payments`) and a pool of
    /// `max` connections; fails naming the server when it cannot be reached.
    fn create(max: u32) -> impl Future<Output = TestDb<Self::Db>> + Send;

    /// A pool on the database at `url`: with [`TestDb::url`], another "instance".
    fn connect(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// Runs `sql` (no binds).
    fn exec(db: &TestDb<Self::Db>, sql: &'static str) -> impl Future<Output = ()> + Send;

    /// The single number `sql` (a `SELECT count(..)`) returns.
    fn count(db: &TestDb<Self::Db>, sql: &'static str) -> impl Future<Output = i64> + Send;

    /// Sessions of this database blocked behind another's write (a row lock; for SQLite, the
    /// database's single write lock, seen as a second connection in use).
    fn waiting_writers(db: &TestDb<Self::Db>) -> impl Future<Output = i64> + Send;

    /// Ends every other session on the test database, as a failover or an operator would; returns
    /// how many. `None` where the database has no connections to cut (SQLite is in-process).
    fn cut_connections(db: &TestDb<Self::Db>) -> impl Future<Output = Option<u64>> + Send;

    /// Moves the marker of `key` two hours into the past (`received_at`), as if time had passed.
    fn backdate(db: &TestDb<Self::Db>, key: &'static str) -> impl Future<Output = ()> + Send;

    /// `accounts` as (id, balance).
    fn balances(db: &TestDb<Self::Db>) -> impl Future<Output = BTreeMap<i64, i64>> + Send;
}

async fn exec_all<DB>(pool: &Pool<DB>, statements: &[&'static str])
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    for sql in statements {
        sqlx::query::<DB>(*sql)
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

/// Defines `count` and `balances`, whose SQL is the same on every backend.
macro_rules! common_queries {
    ($db:ty) => {
        async fn count(db: &TestDb<$db>, sql: &'static str) -> i64 {
            // A few tries: tests that cut the database's connections cut these too.
            let mut tries = 0;
            loop {
                match sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.pool).await {
                    Ok(n) => return n,
                    Err(e) if tries < 5 && inbox_runtime::is_transient::<$db>(&e) => {
                        tries += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("{sql}: {e}"),
                }
            }
        }

        async fn exec(db: &TestDb<$db>, sql: &'static str) {
            sqlx::query(sql)
                .execute(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        async fn balances(db: &TestDb<$db>) -> BTreeMap<i64, i64> {
            sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts")
                .fetch_all(&db.pool)
                .await
                .expect("SELECT accounts")
                .into_iter()
                .collect()
        }
    };
}

/// PostgreSQL: `INBOX_TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
pub struct Postgres;

/// The PostgreSQL test handlers.
pub mod pg {
    crate::backend_handlers!(
        sqlx::Postgres,
        ledger = "INSERT INTO ledger (msg_key, account, amount) VALUES ($1, $2, $3)",
        credit = "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
                  ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        payment = "INSERT INTO payments (reference) VALUES ($1)",
    );
}

/// The PostgreSQL server the tests use.
pub fn pg_url() -> String {
    std::env::var("INBOX_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

impl TestBackend for Postgres {
    type Db = sqlx::Postgres;
    type Ledger = pg::ledger;
    type LedgerByTransportId = pg::ledger_by_transport_id;
    type Credit = pg::credit;
    type Payment = pg::payment;

    async fn create(max: u32) -> TestDb<sqlx::Postgres> {
        let admin_url = pg_url();
        let admin = sqlx::PgPool::connect(&admin_url).await.unwrap_or_else(|e| {
            panic!("PostgreSQL is not reachable at {admin_url}: {e} (start it; see DEVELOPERS.md)")
        });
        let name = unique("inbox_t_");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .expect("CREATE DATABASE");
        admin.close().await;
        let url = with_database(&admin_url, &name);
        let drop_name = name.clone();
        let cleanup = Cleanup(Some(Box::new(move || {
            off_runtime(async move {
                if let Ok(admin) = sqlx::PgPool::connect(&pg_url()).await {
                    let sql = format!("DROP DATABASE IF EXISTS {drop_name} WITH (FORCE)");
                    let _ = sqlx::query(AssertSqlSafe(sql)).execute(&admin).await;
                    admin.close().await;
                }
            })
        })));
        let pool = Self::connect(&url, max).await;
        let db = TestDb {
            name,
            url,
            pool,
            _cleanup: cleanup,
        };
        exec_all(
            &db.pool,
            &[
                "CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, msg_key TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
                "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0))",
                "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
            ],
        )
        .await;
        db
    }

    async fn connect(url: &str, max: u32) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max)
            .test_before_acquire(false)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"))
    }

    common_queries!(sqlx::Postgres);

    async fn cut_connections(db: &TestDb<sqlx::Postgres>) -> Option<u64> {
        let admin = sqlx::PgPool::connect(&pg_url())
            .await
            .expect("PostgreSQL admin");
        let cut = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()) t",
        )
        .bind(&db.name)
        .fetch_one(&admin)
        .await
        .expect("pg_terminate_backend");
        admin.close().await;
        Some(cut as u64)
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

/// MySQL or MariaDB: `INBOX_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
pub struct MySql;

/// The MySQL test handlers.
pub mod mysql {
    crate::backend_handlers!(
        sqlx::MySql,
        ledger = "INSERT INTO ledger (msg_key, account, amount) VALUES (?, ?, ?)",
        credit = "INSERT INTO accounts (id, balance) VALUES (?, ?) \
                  ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
        payment = "INSERT INTO payments (reference) VALUES (?)",
    );
}

/// The MySQL or MariaDB server the tests use.
pub fn mysql_url() -> String {
    std::env::var("INBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

impl TestBackend for MySql {
    type Db = sqlx::MySql;
    type Ledger = mysql::ledger;
    type LedgerByTransportId = mysql::ledger_by_transport_id;
    type Credit = mysql::credit;
    type Payment = mysql::payment;

    async fn create(max: u32) -> TestDb<sqlx::MySql> {
        let admin_url = mysql_url();
        let admin = sqlx::MySqlPool::connect(&admin_url).await.unwrap_or_else(|e| {
            panic!("MariaDB/MySQL is not reachable at {admin_url}: {e} (start it; see DEVELOPERS.md)")
        });
        let name = unique("inbox_t_");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .expect("CREATE DATABASE");
        admin.close().await;
        let url = with_database(&admin_url, &name);
        let drop_name = name.clone();
        let cleanup = Cleanup(Some(Box::new(move || {
            off_runtime(async move {
                if let Ok(admin) = sqlx::MySqlPool::connect(&mysql_url()).await {
                    // DROP DATABASE waits for the metadata locks of open transactions (a test
                    // that failed while holding one): end those sessions first.
                    let sessions: Vec<i64> = sqlx::query_scalar(
                        "SELECT id FROM information_schema.processlist WHERE db = ?",
                    )
                    .bind(&drop_name)
                    .fetch_all(&admin)
                    .await
                    .unwrap_or_default();
                    for id in sessions {
                        let kill = format!("KILL {id}");
                        let _ = sqlx::query(AssertSqlSafe(kill)).execute(&admin).await;
                    }
                    let sql = format!("DROP DATABASE IF EXISTS {drop_name}");
                    let _ = sqlx::query(AssertSqlSafe(sql)).execute(&admin).await;
                    admin.close().await;
                }
            })
        })));
        let pool = Self::connect(&url, max).await;
        let db = TestDb {
            name,
            url,
            pool,
            _cleanup: cleanup,
        };
        exec_all(
            &db.pool,
            &[
                "CREATE TABLE ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, msg_key VARCHAR(255) NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
                "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, CHECK (balance >= 0))",
                "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
            ],
        )
        .await;
        db
    }

    async fn connect(url: &str, max: u32) -> sqlx::MySqlPool {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(max)
            .test_before_acquire(false)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"))
    }

    common_queries!(sqlx::MySql);

    async fn cut_connections(db: &TestDb<sqlx::MySql>) -> Option<u64> {
        let admin = sqlx::MySqlPool::connect(&mysql_url())
            .await
            .expect("MariaDB admin");
        let sessions: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
        )
        .bind(&db.name)
        .fetch_all(&admin)
        .await
        .expect("processlist");
        for id in &sessions {
            // A session may end on its own meanwhile.
            let _ = sqlx::query(AssertSqlSafe(format!("KILL {id}")))
                .execute(&admin)
                .await;
        }
        admin.close().await;
        Some(sessions.len() as u64)
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

/// SQLite: a fresh file in the temporary directory.
pub struct Sqlite;

/// The SQLite test handlers.
pub mod sqlite {
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
    type Ledger = sqlite::ledger;
    type LedgerByTransportId = sqlite::ledger_by_transport_id;
    type Credit = sqlite::credit;
    type Payment = sqlite::payment;
    const SINGLE_WRITER: bool = true;

    async fn create(max: u32) -> TestDb<sqlx::Sqlite> {
        let name = unique("inbox_t_");
        let path = std::env::temp_dir().join(format!("{name}.db"));
        let url = format!("sqlite://{}", path.display());
        let cleanup = Cleanup(Some(Box::new(move || {
            for suffix in ["", "-wal", "-shm"] {
                let mut file = path.clone().into_os_string();
                file.push(suffix);
                let _ = std::fs::remove_file(file);
            }
        })));
        let pool = Self::connect(&url, max).await;
        let db = TestDb {
            name,
            url,
            pool,
            _cleanup: cleanup,
        };
        exec_all(
            &db.pool,
            &[
                "CREATE TABLE ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, msg_key TEXT NOT NULL, account INTEGER NOT NULL, amount INTEGER NOT NULL)",
                "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL CHECK (balance >= 0))",
                "CREATE TABLE payments (reference INTEGER NOT NULL UNIQUE)",
            ],
        )
        .await;
        db
    }

    async fn connect(url: &str, max: u32) -> sqlx::SqlitePool {
        let options = inbox_runtime::sqlite_options(url).expect("SQLite URL");
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(max)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("SQLite cannot open {url}: {e}"))
    }

    common_queries!(sqlx::Sqlite);

    async fn cut_connections(_: &TestDb<sqlx::Sqlite>) -> Option<u64> {
        None
    }

    async fn backdate(db: &TestDb<sqlx::Sqlite>, key: &'static str) {
        sqlx::query("UPDATE inbox SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-2 hours') WHERE message_key = ?1")
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("backdate");
    }

    async fn waiting_writers(db: &TestDb<sqlx::Sqlite>) -> i64 {
        // SQLite has no lock table to look at; BEGIN IMMEDIATE makes the second writer wait for
        // the database's one write lock, so a second connection in use is that writer.
        let in_use = db.pool.size() as i64 - db.pool.num_idle() as i64;
        in_use - 1
    }
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let head = base.rsplit_once('/').map_or(base, |(h, _)| h);
    match query {
        Some(q) => format!("{head}/{db}?{q}"),
        None => format!("{head}/{db}"),
    }
}
