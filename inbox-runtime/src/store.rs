//! The inbox store: where a duplicate is decided. One transaction per message: BEGIN, the claim,
//! the handler's statements, the marker's `processed_at`, COMMIT.

use crate::backend::sealed::Claim;
use crate::backend::{self, InboxBackend, Statements, TableName};
use crate::backoff::Backoff;
use crate::delivery::Delivery;
use crate::handler::{BoxError, Handler, Outcome};
use crate::key::{KeyError, message_key};
use crate::partition::Layout;
#[cfg(feature = "postgres")]
use crate::partition::Partitions;
use sqlx::{Pool, Transaction};
use std::fmt;
use std::time::Duration;
use tracing::Instrument;

/// How long a message's transaction waits for a lock by default: see [`Inbox::lock_timeout`].
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The step of the inbox protocol at which the database failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Opening the transaction.
    Begin,
    /// Inserting the marker.
    Claim,
    /// Recording when the effect was done (`processed_at`).
    Finish,
    /// Committing marker and effect. The result is unknown: redelivery lets the marker decide.
    Commit,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "beginning the transaction",
            Stage::Claim => "claiming the message key",
            Stage::Finish => "marking the message processed",
            Stage::Commit => "committing",
        })
    }
}

/// Why a message was not processed. Nothing was committed in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The payload does not decode as the handler's message type. Permanent.
    #[error("payload does not decode as {ty} ({codec}): {source}")]
    Decode {
        /// The expected message type.
        ty: &'static str,
        /// The codec's name ([`Codec::NAME`](crate::Codec::NAME)).
        codec: &'static str,
        /// The decoder's error.
        source: BoxError,
    },
    /// The key is empty, too long or missing. Permanent.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The inbox's own SQL failed. Transient: retry with a fresh transaction.
    #[error("inbox database error while {stage}: {source}")]
    Database {
        /// Where it failed.
        stage: Stage,
        /// The driver's error.
        source: sqlx::Error,
    },
    /// The handler returned an error; its transaction was rolled back.
    #[error("handler failed: {0}")]
    Handler(BoxError),
    /// The message has no `Nats-Msg-Id` and its stream, whose creation time the default key
    /// names, could not be looked up. Transient.
    #[error("looking up stream {stream} for the message's default key: {source}")]
    StreamLookup {
        /// The stream.
        stream: String,
        /// NATS's error.
        source: BoxError,
    },
    /// Processing did not finish within the worker's per-delivery deadline; its transaction was
    /// rolled back. Redelivered with a delay.
    #[error("processing did not finish within the deadline of {0:?}")]
    Deadline(Duration),
    /// The handler (or its key expression) panicked; its transaction was rolled back. Permanent:
    /// the same message would panic again.
    #[error("handler panicked: {0}")]
    Panicked(String),
    /// Two-phase: the key's claim is held by another owner whose lease runs `remaining` longer.
    /// Redelivered after it (never acked: that owner may still fail, and then this delivery
    /// takes over); on the last delivery the worker waits the lease out in process instead.
    #[error("the key's claim is held by another owner for {remaining:?} more")]
    ClaimHeld {
        /// How long the owner's lease still runs.
        remaining: Duration,
    },
    /// Two-phase: another owner took the claim over (this one's lease had run out, a frozen
    /// process say), so this owner's completion was refused and its writes rolled back. The
    /// side effect may have happened twice, with the same idempotency key. Nak'd; the
    /// redelivery finds the claim done (or held).
    #[error(
        "the claim was taken over by another owner: fence {fence} no longer holds it, so its completion was refused"
    )]
    FencedOut {
        /// The fence this owner held.
        fence: i64,
    },
    /// A two-phase handler (consumer named) was run in a caller's transaction
    /// ([`Inbox::process_in`]), where its claim cannot commit on its own. Permanent.
    #[error(
        "handler for consumer {0:?} is two-phase (`claim`): it runs through Inbox::process or a worker, not in a caller's transaction"
    )]
    TwoPhaseInTransaction(&'static str),
}

/// The inbox over one database pool and table. Cheap to clone.
///
/// Each message costs exactly BEGIN, the claim, the handler's statements, the marker's
/// `processed_at` and COMMIT. Build the
/// pool with `test_before_acquire(false)`: sqlx otherwise pings the server on every acquire, an
/// extra round trip per message; a dead connection fails at BEGIN and the message is retried.
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
    pub(crate) sql: Statements,
}

impl<DB: InboxBackend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            layout: self.layout,
            lock_timeout: self.lock_timeout,
            lease: self.lease,
            sql: self.sql.clone(),
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
            sql: Statements::new::<DB>(&table, &Layout::Plain, DEFAULT_LOCK_TIMEOUT),
            pool,
            table,
            layout: Layout::Plain,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            lease: crate::claim::DEFAULT_LEASE,
        }
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
        self.sql = Statements::new::<DB>(&self.table, &self.layout, timeout);
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
    /// once.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        self.run_migrations().await?;
        self.add_partitions().await?;
        Ok(())
    }

    async fn run_migrations(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let migrator = backend::migrator::<DB>(&self.table, &self.layout);
        migrate_racing(&self.pool, &self.table, &migrator).await
    }

    /// Processes `message` exactly once: in a fresh transaction, claims its key and, when the claim
    /// is new, runs the handler and commits both. Returns [`Outcome::Skip`] for a duplicate, in
    /// which case the handler did not run.
    ///
    /// `delivery` is what the handler and its `key` expression see of the message's transport:
    /// in a test, [`Delivery::new`](crate::Delivery::new) with the headers the case needs. Its
    /// `Nats-Msg-Id` is the key when the handler has no `key` expression.
    pub async fn process<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
    ) -> Result<Outcome, ProcessError> {
        let key = message_key(handler, state, &message, delivery)?;
        let span = tracing::debug_span!("inbox.tx", consumer = H::CONSUMER, key = %key);
        self.process_keyed(handler, state, message, delivery, &key)
            .instrument(span)
            .await
    }

    /// [`Inbox::process`] with the key already computed and validated.
    pub(crate) async fn process_keyed<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        // The relay of every outbox the handler wrote to is woken once this ends.
        // Boxed: the processing future (a two-phase claim's above all) is large, and moving it
        // through the scope's layers by value overflowed a worker thread's stack in debug
        // builds.
        let work = Box::pin(self.process_keyed_now(handler, state, message, delivery, key));
        crate::outbox::waking(work).await
    }

    async fn process_keyed_now<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        if H::TWO_PHASE {
            return self
                .process_claimed(handler, state, message, delivery, key)
                .await;
        }
        let mut tx = DB::begin(&self.pool, self.sql.begin.clone())
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Begin,
                source,
            })?;
        let processed = self
            .process_in(&mut tx, handler, state, message, delivery, key)
            .await;
        match processed {
            Ok(Outcome::Ack) => match tx.commit().await {
                Ok(()) => Ok(Outcome::Ack),
                Err(source) => self.after_failed_commit(H::CONSUMER, key, source).await,
            },
            other => {
                // A duplicate wrote nothing and a failure must leave nothing: roll back now
                // rather than on drop, so that the connection returns to the pool clean.
                if let Err(e) = tx.rollback().await {
                    tracing::debug!(error = %e, "rollback failed; the connection is discarded");
                }
                other
            }
        }
    }

    /// Whether the database can be reached: a connection of its own (not one from the pool,
    /// which busy handlers may all hold), opened, pinged and closed within 5 s. For health
    /// probes.
    pub(crate) async fn reachable(&self) -> bool {
        use sqlx::{ConnectOptions, Connection};
        let options = self.pool.connect_options();
        let ping = async {
            let mut conn = options.connect().await?;
            conn.ping().await?;
            conn.close().await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), ping).await,
            Ok(Ok(()))
        )
    }

    /// Whether the database answers: a connection from the pool, pinged, within 5 s.
    pub(crate) async fn answers(&self) -> bool {
        use sqlx::Connection;
        let ping = async {
            let mut conn = self.pool.acquire().await?;
            conn.ping().await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), ping).await,
            Ok(Ok(()))
        )
    }

    /// COMMIT failed with `source`, and its outcome is unknown: the connection may have been
    /// lost after the server committed, on the reply's way back. The marker, looked up on
    /// another connection, decides: committed, the message is done ([`Outcome::Ack`]; its effect
    /// is committed once, by this transaction or a twin's); absent, or not to be looked up, the
    /// failure stands and is retried (where the claim decides again).
    pub(crate) async fn after_failed_commit(
        &self,
        consumer: &str,
        key: &str,
        source: sqlx::Error,
    ) -> Result<Outcome, ProcessError> {
        let done = async {
            let mut conn = self.pool.acquire().await?;
            DB::fetch_id(&mut conn, self.sql.done.clone(), consumer, key).await
        };
        match done.await {
            Ok(Some(_)) => {
                tracing::info!(error = %source, "COMMIT reported an error, but the marker is committed");
                Ok(Outcome::Ack)
            }
            Ok(None) => Err(ProcessError::Database {
                stage: Stage::Commit,
                source,
            }),
            Err(lookup) => {
                tracing::debug!(error = %lookup, "looking the marker up after a failed COMMIT failed");
                Err(ProcessError::Database {
                    stage: Stage::Commit,
                    source,
                })
            }
        }
    }

    /// Keeps a dead letter (its headers and payload) in `<table>_dead_letters`, until
    /// [`Inbox::parked_letters`] hands it to a publisher.
    pub(crate) async fn park_letter(
        &self,
        consumer: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<(), sqlx::Error> {
        let headers = serde_json::to_string(headers).expect("strings serialize");
        DB::park(
            &self.pool,
            self.sql.park.clone(),
            consumer,
            &headers,
            payload,
        )
        .await?;
        Ok(())
    }

    /// The oldest letters parked for `consumer`: (id, headers, payload).
    pub(crate) async fn parked_letters(
        &self,
        consumer: &str,
    ) -> Result<Vec<(i64, Vec<(String, String)>, Vec<u8>)>, sqlx::Error> {
        let rows = DB::parked(&self.pool, self.sql.parked.clone(), consumer).await?;
        rows.into_iter()
            .map(|(id, headers, payload)| {
                let headers =
                    serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                Ok((id, headers, payload))
            })
            .collect()
    }

    /// Forgets parked letter `id`.
    pub(crate) async fn unpark_letter(&self, id: i64) -> Result<(), sqlx::Error> {
        DB::execute_id_on(&self.pool, self.sql.unpark.clone(), id).await?;
        Ok(())
    }

    /// Claims `key` and runs the handler inside `tx`, a transaction (or savepoint) the caller owns
    /// and commits. On [`Outcome::Skip`] or an error the caller must roll `tx` back. A two-phase
    /// handler cannot run in a caller's transaction (its claim commits first):
    /// [`ProcessError::TwoPhaseInTransaction`].
    pub async fn process_in<'c, H: Handler<Db = DB>>(
        &self,
        tx: &mut Transaction<'c, DB>,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        if H::TWO_PHASE {
            return Err(ProcessError::TwoPhaseInTransaction(H::CONSUMER));
        }
        let claim = DB::claim(tx, self.sql.claim.clone(), H::CONSUMER, key)
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Claim,
                source,
            })?;
        let Claim::New(id) = claim else {
            return Ok(Outcome::Skip);
        };
        handler
            .handle(message, delivery, tx, state)
            .await
            .map_err(|e| ProcessError::Handler(e.into()))?;
        // processed_at says when the effect was done; it commits with the effect or not at all.
        let finished = DB::execute_id(&mut **tx, self.sql.finish.clone(), id)
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Finish,
                source,
            })?;
        // The marker this transaction inserted is gone: never commit as if it were done. Not a
        // transient error (a retry would not bring it back); redelivery leaves time to look.
        match DB::rows_affected(&finished) {
            0 => Err(ProcessError::Database {
                stage: Stage::Finish,
                source: sqlx::Error::RowNotFound,
            }),
            _ => Ok(Outcome::Ack),
        }
    }
}

#[cfg(feature = "postgres")]
impl Inbox<sqlx::Postgres> {
    /// Puts the markers in range partitions of `received_at` (PostgreSQL only; opt in, the
    /// unpartitioned table stays the default): cleanup then drops whole partitions past the
    /// cutoff instead of deleting rows, so a day of churn leaves no dead tuples behind and costs
    /// a catalog change instead of a row-by-row DELETE. Claims cost a little more: a
    /// transaction-scoped advisory lock on the key, then a lookup in every partition (see
    /// ARCHITECTURE.md). Choose it before the first [`Inbox::migrate`]: an existing
    /// unpartitioned table is not converted (its migrations no longer match, and `migrate`
    /// says so).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use inbox_runtime::{Inbox, Partitions};
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
    /// let inbox = Inbox::new(pool).partitioned(Partitions::daily());
    /// inbox.migrate().await?; // the table, and today's partition with three ahead
    /// # Ok(()) }
    /// ```
    pub fn partitioned(mut self, partitions: Partitions) -> Self {
        self.layout = Layout::Partitioned(partitions);
        self.sql = Statements::new::<sqlx::Postgres>(&self.table, &self.layout, self.lock_timeout);
        self
    }
}

/// Runs `migrator` (of `table`) on `pool`, where instances starting together race: sqlx takes no
/// lock on SQLite, and its MySQL lock did not hold on MariaDB here, so the loser fails to record
/// a migration the winner is applying or has applied. The DDL is idempotent; a later attempt
/// sees it recorded.
pub(crate) async fn migrate_racing<DB: InboxBackend>(
    pool: &Pool<DB>,
    table: &TableName,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), sqlx::migrate::MigrateError> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut attempt = 1;
    loop {
        match DB::run_migrator(pool, migrator).await {
            Ok(()) => return Ok(()),
            // A step that was interrupted (MySQL's DDL is not transactional, so a process
            // killed inside it leaves the step recorded as dirty) would block every restart.
            // Every step is idempotent: forget the dirty record and run the step again.
            Err(sqlx::migrate::MigrateError::Dirty(version)) if attempt < 5 => {
                tracing::warn!(
                    %table,
                    version,
                    "an earlier migration of the table was interrupted; running it again"
                );
                let forget = backend::forget_dirty_sql(table, version);
                DB::execute(pool, forget).await?;
                attempt += 1;
            }
            Err(e) if attempt < 5 => {
                tracing::debug!(error = %e, attempt, %table, "migration raced another instance; retrying");
                tokio::time::sleep(backoff.next()).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}
