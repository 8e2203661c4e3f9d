//! The inbox store: the table a duplicate is decided in, and everything the runtime does on it.
//!
//! One concept per file: this file holds [`Inbox`] and its settings; `process` (one message's
//! transaction, where a duplicate is decided), `begun` (a message claimed by its BEGIN, where
//! the dialect sends the claim in the BEGIN's round trip), `two_phase` (claims with a lease, for side effects
//! outside the database), `batch` (several messages in one transaction), `cleanup` (retention
//! and the deletion of old markers), `partitions` (the partitioned layout's upkeep),
//! `dead_letters` (letters parked in the database), `held` (the outbox rows a handler writes,
//! held until it returns and written with its marker's check).

mod batch;
mod begun;
mod cleanup;
mod dead_letters;
pub(crate) mod held;
mod kept;
mod partitions;
mod process;
mod two_phase;

pub(crate) use batch::Batched;
pub use cleanup::{CleanupError, RetentionFloor, retention_floor};
pub(crate) use kept::IDLE as KEPT_IDLE;

use crate::backend::{
    Beginning, Cut, DEFAULT_LOCK_TIMEOUT, InboxBackend, InboxStatements, ServerFacts, TableName,
    migrate,
};
use crate::claim::DEFAULT_LEASE;
use crate::layout::Layout;
use sqlx::Pool;
use std::time::Duration;

/// The inbox over one database pool and table. Cheap to clone.
///
/// Each message costs exactly BEGIN, the claim (which inserts the marker finished), the
/// handler's statements, a lookup of the marker by id (the handler's statements ran in the
/// transaction that holds it) and COMMIT. Build the
/// pool with `test_before_acquire(false)`: sqlx otherwise pings the server on every acquire, an
/// extra round trip per message; a dead connection fails at BEGIN and the message is retried.
/// A worker's tries also keep their connection from one message to the next, which spares the
/// check sqlx makes of every connection given back to the pool: a round trip per message.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let inbox = inbox_runtime::Inbox::new(pool);
/// inbox.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Inbox<DB: InboxBackend> {
    pool: Pool<DB>,
    table: TableName,
    layout: Layout,
    lock_timeout: Duration,
    lease: Duration,
    /// How long `migrate` waits for another instance migrating the table.
    migration_wait: Duration,
    pub(crate) sql: InboxStatements,
    /// Duplicates found with another payload than their key's first, by this inbox and its
    /// clones.
    pub(crate) key_reuses: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// What its tries learned of the server: whether a try cut at its deadline has its session
    /// killed (see `Inbox::try_connection`), and which server it is (`backend::Server`).
    facts: std::sync::Arc<ServerFacts>,
    /// Connections the tries keep between messages (a worker's inbox only; see `kept.rs`).
    kept: Option<std::sync::Arc<kept::Kept<DB>>>,
}

impl<DB: InboxBackend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            layout: self.layout,
            lock_timeout: self.lock_timeout,
            lease: self.lease,
            migration_wait: self.migration_wait,
            sql: self.sql.clone(),
            key_reuses: self.key_reuses.clone(),
            facts: self.facts.clone(),
            kept: self.kept.clone(),
        }
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// An inbox in the table `inbox`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_table(pool, TableName::default())
    }

    /// An inbox in `table`.
    pub fn with_table(pool: Pool<DB>, table: TableName) -> Self {
        Inbox {
            sql: InboxStatements::new::<DB>(&table, &Layout::Plain, DEFAULT_LOCK_TIMEOUT),
            pool,
            table,
            layout: Layout::Plain,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            lease: DEFAULT_LEASE,
            migration_wait: migrate::MIGRATION_LOCK_WAIT,
            key_reuses: Default::default(),
            facts: Default::default(),
            kept: None,
        }
    }

    /// How many duplicates this inbox (and its clones) found with another payload than the one
    /// their key was first processed with (also `inbox_key_reuse_total`, and a warning each).
    pub fn key_reuses(&self) -> u64 {
        self.key_reuses.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The table's layout.
    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// How long a two-phase claim's lease lasts (default 10 s; at least 30 ms): how long a
    /// crashed owner's claim holds its key before a redelivery may take it over. It is renewed
    /// every quarter of it while the side effect runs, so a slow side effect keeps its claim; keep
    /// it at most two thirds of the consumer's `ack_wait` (the worker refuses it otherwise), so
    /// that the redelivery after a crash finds the lease run out.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(30));
        self
    }

    /// The lease of two-phase claims: see [`Inbox::lease`].
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// How long a message's transaction waits for a lock (default 30 s): PostgreSQL's
    /// `lock_timeout` (which is unlimited by default), MySQL's `innodb_lock_wait_timeout` (whole
    /// seconds). A twin whose claim waits behind the transaction of a frozen peer (stopped,
    /// partitioned) then fails with a transient error and is redelivered later, instead of
    /// holding its slot for as long as TCP keepalive allows. SQLite waits for its write lock as
    /// long as the connection's busy timeout (see [`sqlite_options`](crate::sqlite_options)).
    /// Keep it below the worker's [deadline](crate::WorkerBuilder::deadline). Between 1 ms and
    /// 24 days.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        // PostgreSQL takes at most i32::MAX milliseconds (24.8 days), and 0 would mean no limit.
        let timeout = timeout.clamp(Duration::from_millis(1), Duration::from_secs(24 * 86400));
        self.lock_timeout = timeout;
        self.sql = InboxStatements::new::<DB>(&self.table, &self.layout, timeout);
        self
    }

    /// This inbox with every statement of a message's transaction bounded by `timeout` (a
    /// worker's deadline), where the database can (PostgreSQL's `statement_timeout`, MariaDB's
    /// `max_statement_time`).
    /// Where the database has no such bound (MySQL), a try cut at its deadline has its session
    /// killed instead (see [`Inbox::try_connection`]).
    pub(crate) fn bounded_by(mut self, timeout: Duration) -> Self {
        if self.facts.cut() == Cut::Kill {
            // Forced (`kill_cut_sessions`): the bound is left out, so that the kill is what
            // ends a cut try's statement.
            return self;
        }
        self.sql.bound_statements::<DB>(timeout);
        self.facts = std::sync::Arc::new(ServerFacts::deadline());
        self
    }

    /// For tests (feature `test-util`, not part of the stable API): on MariaDB, what a worker's
    /// deadline does on MySQL, which cannot bound every statement: no statement bound, and a
    /// try cut at its deadline has its session killed. Nothing on the other backends.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn kill_cut_sessions(mut self) -> Self {
        let facts = ServerFacts::deadline();
        facts.set(crate::backend::Server::MySql);
        self.facts = std::sync::Arc::new(facts);
        self
    }

    /// A connection for a message's try (one the worker's tries kept, if any), armed (where the
    /// server cannot bound the try's statements by its deadline) to kill its session should the
    /// try be cut: call [`Beginning::settle`] once the try has ended, then
    /// [`Inbox::keep_connection`] if it ended cleanly.
    pub(crate) async fn try_connection(&self) -> Result<TryConnection<DB>, sqlx::Error> {
        let (mut conn, session, lease) = match self.kept.as_ref().and_then(|k| k.take()) {
            Some((conn, session, lease)) => (Beginning::kept(conn), session, Some(lease)),
            None => {
                let lease = self.kept.as_ref().map(|k| k.lease());
                (Beginning::new(self.pool.acquire().await?), None, lease)
            }
        };
        let session = match session {
            Some(id) => Some(id),
            None => DB::session_to_kill(&mut conn, &self.facts).await?,
        };
        if let Some(id) = session {
            conn.arm(&self.pool, id);
        }
        Ok(TryConnection { conn, lease })
    }

    /// Keeps the connection of a try that ended cleanly for the next try, where the worker
    /// keeps them (see `kept.rs`); else it goes back to the pool.
    pub(crate) fn keep_connection(&self, conn: TryConnection<DB>) {
        let TryConnection { conn, lease } = conn;
        if let (Some(kept), Some(lease)) = (&self.kept, lease)
            && let Some((conn, session)) = conn.into_settled()
        {
            kept.put(conn, session, lease);
        }
    }

    /// This inbox with its tries keeping their connections between messages, the tries holding
    /// at most `limit` at once (see `kept.rs`); for a worker, which gives them back once idle
    /// ([`Inbox::release_idle_connections`]) and when it stops ([`Inbox::release_kept_connections`]).
    pub(crate) fn keeping_connections(mut self, limit: usize) -> Self {
        self.kept = (limit > 0).then(|| std::sync::Arc::new(kept::Kept::new(limit)));
        self
    }

    /// Gives back to the pool the kept connections unused for a while.
    pub(crate) fn release_idle_connections(&self) {
        if let Some(kept) = &self.kept {
            kept.release_idle(std::time::Instant::now());
        }
    }

    /// Gives back to the pool every kept connection.
    pub(crate) fn release_kept_connections(&self) {
        if let Some(kept) = &self.kept {
            kept.release_all();
        }
    }

    /// For tests (feature `test-util`, not part of the stable API): how long
    /// [`Inbox::migrate`] waits for another instance migrating the table (default 5 minutes).
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn migration_lock_wait(mut self, wait: Duration) -> Self {
        self.migration_wait = wait;
        self
    }

    /// The pool messages are processed on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The inbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates or updates the inbox table (and, when [partitioned](Inbox::partitioned), its
    /// partitions ahead: see [`Inbox::add_partitions`]). Safe to run from several instances at
    /// once: they take turns on a lock of the database (PostgreSQL's advisory lock, MySQL's
    /// `GET_LOCK`; none on SQLite), each waiting at most 5 minutes for the others, then failing
    /// with an error naming the lock. The migrations run on the lock's connection: a pool of
    /// one connection is enough.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        self.run_migrations().await?;
        self.add_partitions().await?;
        Ok(())
    }

    async fn run_migrations(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let steps = DB::migration_sql(&self.table, &self.layout);
        let migrator = migrate::migrator(&self.table, "inbox", steps);
        let wait = self.migration_wait;
        migrate::migrate_racing(&self.pool, &self.table, &migrator, wait, &[]).await
    }

    /// Whether the database can be reached and takes writes: a connection of its own (not one
    /// from the pool, which busy handlers may all hold), opened, given the writability probe
    /// (`Backend::writable_probe_sql`: a standby fails it; [`probed`]) and closed within 5 s. For health
    /// probes.
    pub(crate) async fn reachable(&self) -> bool {
        use sqlx::{ConnectOptions, Connection};
        let options = self.pool.connect_options();
        let ping = async {
            let mut conn = options.connect().await?;
            probed::<DB>(DB::execute_raw(&mut conn, self.sql.writable.clone()).await)?;
            conn.close().await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), ping).await,
            Ok(Ok(()))
        )
    }

    /// Whether the database answers and takes writes into the inbox: a connection from the
    /// pool, given a write to the inbox that changes nothing (`Backend::inbox_probe_sql`),
    /// within 5 s. A connection that answers "read-only" (to a standby, say, after a failover)
    /// is closed rather than returned to the pool: a new one may reach the new primary. Unlike
    /// [`Inbox::reachable`], a write held up by a lock on the inbox table is no answer here: the
    /// circuit and the worker's check after a deadline or a lock timeout ask it, and while a
    /// lock blocks the inbox table no message can be processed, so none may spend a delivery.
    pub(crate) async fn answers(&self) -> bool {
        let ping = async {
            let mut conn = self.pool.acquire().await?;
            let written = DB::execute_raw(&mut conn, self.sql.inbox_probe.clone())
                .await
                .map(|_| ());
            if let Err(e) = &written {
                crate::classify::close_if_read_only(&mut conn, e);
            }
            written
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), ping).await,
            Ok(Ok(()))
        )
    }
}

/// What the health probe's write came to: done, or refused only for a lock another session holds
/// on the table (MySQL's probe waits 1 s for it, then fails with a lock wait timeout), which is
/// an answer from a database that takes writes (a read-only one refuses the write before any
/// wait): the process is healthy, and restarting it would not help.
fn probed<DB: InboxBackend>(
    written: Result<DB::QueryResult, sqlx::Error>,
) -> Result<(), sqlx::Error> {
    match written {
        Err(sqlx::Error::Database(e)) if DB::is_conflict_error(e.as_ref()) => Ok(()),
        written => written.map(|_| ()),
    }
}

/// A try's connection ([`Inbox::try_connection`]) and, in a worker, its count among the
/// connections the tries hold.
#[derive(Debug)]
pub(crate) struct TryConnection<DB: InboxBackend> {
    conn: Beginning<DB>,
    lease: Option<kept::Lease>,
}

impl<DB: InboxBackend> std::ops::Deref for TryConnection<DB> {
    type Target = Beginning<DB>;

    fn deref(&self) -> &Beginning<DB> {
        &self.conn
    }
}

impl<DB: InboxBackend> std::ops::DerefMut for TryConnection<DB> {
    fn deref_mut(&mut self) -> &mut Beginning<DB> {
        &mut self.conn
    }
}
