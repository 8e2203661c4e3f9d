//! The databases the conformance suite runs on, one file each. A backend is one [`TestBackend`]
//! impl (how to make a fresh database with the business tables, its handlers, how to observe it)
//! and one line in the suite's backend list (`suite/mod.rs`); see CONTRIBUTING.md.

pub mod mysql;
pub mod postgres;
pub mod sqlite;

pub use mysql::MySql;
pub use postgres::{Postgres, PostgresPartitioned};
pub use sqlite::Sqlite;

use crate::handlers::{Entry, Probe};
use inbox_runtime::{Backoff, Handler, Inbox, InboxBackend};
use inbox_testkit::{Backend, Database};
use sqlx::pool::{PoolConnection, PoolOptions};
use sqlx::{Connection, Pool};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A fresh database of one backend with a pool on it, removed when dropped (also when the test
/// panics).
pub struct TestDb<DB: sqlx::Database> {
    /// The database's name (for SQLite, the file's stem).
    pub name: String,
    /// Its URL, for other processes.
    pub url: String,
    /// A pool on it.
    pub pool: Pool<DB>,
    database: Database,
}

/// One database under test. A new backend is one impl of this trait and one line in the suite.
pub trait TestBackend: Send + Sync + 'static {
    /// The sqlx database.
    type Db: InboxBackend;
    /// `ledger`, see [`backend_handlers!`](crate::backend_handlers).
    type Ledger: Handler<Db = Self::Db, Message = Entry, State = Probe> + Default;
    /// `ledger_by_transport_id`.
    type LedgerByTransportId: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `probed_by_transport_id`.
    type ProbedByTransportId: Handler<Db = Self::Db, Message = Entry, State = Probe> + Default;
    /// `ledger_strict`: `ledger` with `on_key_reuse = reject`.
    type LedgerStrict: Handler<Db = Self::Db, Message = Entry, State = Probe> + Default;
    /// `ledger_laned`: `ledger` with `lane = msg.account`.
    type LedgerLaned: Handler<Db = Self::Db, Message = Entry, State = Probe> + Default;
    /// `credit`.
    type Credit: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `credit_laned`: `credit` with `lane = msg.account`.
    type CreditLaned: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `payment`.
    type Payment: Handler<Db = Self::Db, Message = Entry, State = ()> + Default;
    /// `announce`: publishes through an outbox.
    type Announce: Handler<Db = Self::Db, Message = Entry, State = crate::handlers::Announcer<Self::Db>>
        + Default;
    /// `remote`: two-phase.
    type Remote: Handler<Db = Self::Db, Message = Entry, State = crate::handlers::Remote> + Default;

    /// The kit's name for this database.
    const BACKEND: Backend;

    /// Whether the database admits one writer at a time (SQLite), which serialises what the
    /// others must lock for.
    const SINGLE_WRITER: bool = false;

    /// A pool of `max` connections on `url` that waits at most `acquire` for a connection (a
    /// worker's deadline must be longer than that).
    fn connect_acquiring(
        url: &str,
        max: u32,
        acquire: Duration,
    ) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// The statement that makes a session take no writes, as a standby's does.
    const READ_ONLY_SESSION: &'static str;

    /// A pool of `max` connections on `db` whose new connections take no writes while
    /// `read_only` is set (a standby answering before its promotion), made with
    /// [`TestBackend::READ_ONLY_SESSION`].
    fn standby_pool(
        db: &TestDb<Self::Db>,
        max: u32,
        read_only: Arc<AtomicBool>,
    ) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// The business tables (`ledger`, `accounts`, `payments`) in this dialect.
    const TABLES: [&'static str; 3];

    /// The inbox on `pool`, in this backend's table layout.
    fn inbox(pool: Pool<Self::Db>) -> Inbox<Self::Db> {
        Inbox::new(pool)
    }

    /// A pool of `max` connections on the database at `url`: with [`TestDb::url`], another
    /// "instance".
    fn connect(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// A fresh database with the business tables and a pool of `max` connections; fails naming
    /// the server when it cannot be reached.
    fn create(max: u32) -> impl Future<Output = TestDb<Self::Db>> + Send {
        async move {
            let database = Database::create(Self::BACKEND, "inbox_t_")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let pool = Self::connect(&database.url, max).await;
            for sql in Self::TABLES {
                Self::exec_on(&pool, sql).await;
            }
            TestDb {
                name: database.name.clone(),
                url: database.url.clone(),
                pool,
                database,
            }
        }
    }

    /// Runs `sql` (no binds).
    fn exec(db: &TestDb<Self::Db>, sql: &'static str) -> impl Future<Output = ()> + Send {
        Self::exec_on(&db.pool, sql)
    }

    /// Runs `sql` (no binds) on `pool`.
    fn exec_on(pool: &Pool<Self::Db>, sql: &'static str) -> impl Future<Output = ()> + Send;

    /// The single number `sql` (a `SELECT count(..)`) returns, once: see [`TestBackend::count`].
    fn try_count(
        db: &TestDb<Self::Db>,
        sql: &'static str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// The single number `sql` (a `SELECT count(..)`) returns. Retried a few times with backoff
    /// on a transient error: tests that cut the database's connections cut this pool's too.
    fn count(db: &TestDb<Self::Db>, sql: &'static str) -> impl Future<Output = i64> + Send {
        async move {
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(800));
            let mut tries = 0;
            loop {
                match Self::try_count(db, sql).await {
                    Ok(n) => return n,
                    Err(e) if tries < 5 && inbox_runtime::is_transient::<Self::Db>(&e) => {
                        tries += 1;
                        tokio::time::sleep(backoff.next()).await;
                    }
                    Err(e) => panic!("{sql}: {e}"),
                }
            }
        }
    }

    /// Sessions of this database blocked behind another's write (a row lock; for SQLite, the
    /// database's single write lock, seen as a second connection in use).
    fn waiting_writers(db: &TestDb<Self::Db>) -> impl Future<Output = i64> + Send;

    /// Ends every other session on the test database, as a failover or an operator would; returns
    /// how many. `None` where the database has no connections to cut (SQLite is in-process).
    fn cut_connections(db: &TestDb<Self::Db>) -> impl Future<Output = Option<u64>> + Send {
        async move { db.database.cut().await.unwrap_or_else(|e| panic!("{e}")) }
    }

    /// Takes the fleet-wide cleanup lock `lock` on a connection of its own, as another
    /// instance's cleanup would, and returns that connection (release it with
    /// [`TestBackend::release_cleanup_lock`]); `None` where there is no such lock (SQLite's single
    /// writer serialises cleanups anyway). Panics if the lock is already held.
    fn hold_cleanup_lock(
        db: &TestDb<Self::Db>,
        lock: &'static str,
    ) -> impl Future<Output = Option<PoolConnection<Self::Db>>> + Send;

    /// Sessions of this database waiting for a fleet lock (a cleanup's or a migration's) that
    /// another session holds; always 0 where there is no such lock (SQLite).
    fn waiting_for_fleet_lock(db: &TestDb<Self::Db>) -> impl Future<Output = i64> + Send;

    /// Sessions of this database waiting for the outbox relays' turn, which another relay's
    /// pass holds; always 0 where relays take turns by a lease instead (SQLite).
    fn waiting_for_relay_turn(db: &TestDb<Self::Db>) -> impl Future<Output = i64> + Send;

    /// Releases a lock taken by [`TestBackend::hold_cleanup_lock`].
    fn release_cleanup_lock(
        holder: PoolConnection<Self::Db>,
        lock: &'static str,
    ) -> impl Future<Output = ()> + Send;

    /// Runs `sql` (no binds) in a transaction that stays open, holding the locks it took, until
    /// the returned transaction is dropped or rolled back: another instance's transaction.
    fn hold_in_transaction(
        db: &TestDb<Self::Db>,
        sql: &'static str,
    ) -> impl Future<Output = sqlx::Transaction<'static, Self::Db>> + Send;

    /// Moves the marker of `key` two hours into the past (`received_at`), as if time had passed.
    fn backdate(db: &TestDb<Self::Db>, key: &'static str) -> impl Future<Output = ()> + Send;

    /// `accounts` as (id, balance).
    fn balances(db: &TestDb<Self::Db>) -> impl Future<Output = BTreeMap<i64, i64>> + Send;
}

/// Asserts that the `ledger` of `db` holds `n` rows, one per message key: every message applied,
/// none twice.
pub async fn assert_applied_once<B: TestBackend>(db: &TestDb<B::Db>, n: i64) {
    let rows = B::count(db, "SELECT count(*) FROM ledger").await;
    let keys = B::count(db, "SELECT count(DISTINCT msg_key) FROM ledger").await;
    assert_eq!((rows, keys), (n, n), "ledger rows and distinct keys");
}

/// A pool of `max` connections with `options`, without a test query on every acquire.
async fn pool<DB: sqlx::Database>(
    url: &str,
    options: <DB::Connection as Connection>::Options,
    max: u32,
) -> Pool<DB> {
    pool_acquiring(url, options, max, Duration::from_secs(30)).await
}

/// [`pool`], waiting at most `acquire` for a connection.
async fn pool_acquiring<DB: sqlx::Database>(
    url: &str,
    options: <DB::Connection as Connection>::Options,
    max: u32,
    acquire: Duration,
) -> Pool<DB> {
    PoolOptions::<DB>::new()
        .max_connections(max)
        .acquire_timeout(acquire)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"))
}

/// [`pool`], each new connection made read-only (with `read_only_sql`) while `read_only` is set.
async fn switchable_pool<DB: sqlx::Database>(
    url: &str,
    options: <DB::Connection as Connection>::Options,
    max: u32,
    read_only: Arc<AtomicBool>,
    read_only_sql: &'static str,
) -> Pool<DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    PoolOptions::<DB>::new()
        .max_connections(max)
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            let read_only = read_only.load(Ordering::SeqCst);
            Box::pin(async move {
                if read_only {
                    sqlx::raw_sql(read_only_sql).execute(&mut *conn).await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"))
}

/// Defines `exec_on`, `try_count` and `balances`, whose SQL is the same on every backend (sqlx's
/// executor bounds are per database, hence a macro).
macro_rules! common_queries {
    ($db:ty, backdate = $backdate:literal) => {
        async fn backdate(db: &$crate::backends::TestDb<$db>, key: &'static str) {
            sqlx::query($backdate)
                .bind(key)
                .execute(&db.pool)
                .await
                .expect("backdate");
        }

        async fn exec_on(pool: &sqlx::Pool<$db>, sql: &'static str) {
            sqlx::query(sql)
                .execute(pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        async fn hold_in_transaction(
            db: &$crate::backends::TestDb<$db>,
            sql: &'static str,
        ) -> sqlx::Transaction<'static, $db> {
            let mut tx = db.pool.begin().await.expect("BEGIN");
            sqlx::query(sql)
                .execute(&mut *tx)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            tx
        }

        async fn try_count(
            db: &$crate::backends::TestDb<$db>,
            sql: &'static str,
        ) -> Result<i64, sqlx::Error> {
            sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.pool).await
        }

        async fn balances(
            db: &$crate::backends::TestDb<$db>,
        ) -> std::collections::BTreeMap<i64, i64> {
            sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts")
                .fetch_all(&db.pool)
                .await
                .expect("SELECT accounts")
                .into_iter()
                .collect()
        }
    };
}
use common_queries;

/// Defines `hold_cleanup_lock` and `release_cleanup_lock` on a server backend from its SQL:
/// `$lock` tries the lock named by its one bind and returns `$held` (a `$t`) when it got it; `$unlock` releases it. Also `waiting_writers`, from a count of this database's sessions
/// (its name the one bind) blocked behind a write, `waiting_for_fleet_lock`, from a count of
/// them waiting for a fleet lock, and `waiting_for_relay_turn`, of those waiting for the relays'
/// turn.
macro_rules! server_queries {
    ($db:ty, lock = $lock:literal -> $t:ty, held = $held:expr, unlock = $unlock:literal,
     waiting_writers = $waiting:literal, waiting_for_lock = $waiting_lock:literal,
     waiting_for_turn = $waiting_turn:literal) => {
        async fn waiting_for_relay_turn(db: &$crate::backends::TestDb<$db>) -> i64 {
            sqlx::query_scalar::<_, i64>($waiting_turn)
                .bind(&db.name)
                .fetch_one(&db.pool)
                .await
                .expect($waiting_turn)
        }

        async fn waiting_for_fleet_lock(db: &$crate::backends::TestDb<$db>) -> i64 {
            sqlx::query_scalar::<_, i64>($waiting_lock)
                .bind(&db.name)
                .fetch_one(&db.pool)
                .await
                .expect($waiting_lock)
        }

        async fn hold_cleanup_lock(
            db: &$crate::backends::TestDb<$db>,
            lock: &'static str,
        ) -> Option<sqlx::pool::PoolConnection<$db>> {
            let mut holder = db.pool.acquire().await.expect("a connection");
            let got: $t = sqlx::query_scalar($lock)
                .bind(lock)
                .fetch_one(&mut *holder)
                .await
                .expect($lock);
            assert_eq!(got, $held, "the cleanup lock {lock:?} is already held");
            Some(holder)
        }

        async fn release_cleanup_lock(
            mut holder: sqlx::pool::PoolConnection<$db>,
            lock: &'static str,
        ) {
            sqlx::query($unlock)
                .bind(lock)
                .execute(&mut *holder)
                .await
                .expect($unlock);
        }

        async fn waiting_writers(db: &$crate::backends::TestDb<$db>) -> i64 {
            sqlx::query_scalar::<_, i64>($waiting)
                .bind(&db.name)
                .fetch_one(&db.pool)
                .await
                .expect($waiting)
        }
    };
}
use server_queries;
