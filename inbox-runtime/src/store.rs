//! The inbox store: where a duplicate is decided. One transaction per message: BEGIN, the claim,
//! the handler's statements, COMMIT.

use crate::backend::{self, Claim, InboxBackend};
use crate::handler::{BoxError, Handler, Outcome};
use crate::key::{KeyError, validate_key};
use sqlx::{Pool, SqlStr, Transaction};
use std::fmt;
use tracing::Instrument;

/// A validated SQL identifier naming the inbox table: ASCII letters, digits and `_`, not starting
/// with a digit, at most 48 bytes (so that derived index names stay within identifier limits).
///
/// ```
/// use inbox_runtime::TableName;
/// assert!(TableName::new("inbox").is_ok());
/// assert!(TableName::new("inbox; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

/// The longest accepted table name.
const MAX_TABLE_LEN: usize = 48;

/// A table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid inbox table name {name:?}: use 1 to {MAX_TABLE_LEN} ASCII letters, digits or `_`, not starting with a digit"
)]
pub struct InvalidTableName {
    /// The rejected name.
    pub name: String,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, InvalidTableName> {
        let ok = !name.is_empty()
            && name.len() <= MAX_TABLE_LEN
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if ok {
            Ok(TableName(name.to_owned()))
        } else {
            Err(InvalidTableName {
                name: name.to_owned(),
            })
        }
    }

    /// The name as written in SQL.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName("inbox".to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The step of the inbox protocol at which the database failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Opening the transaction.
    Begin,
    /// Inserting the marker.
    Claim,
    /// Committing marker and effect. The result is unknown: redelivery lets the marker decide.
    Commit,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "beginning the transaction",
            Stage::Claim => "claiming the message key",
            Stage::Commit => "committing",
        })
    }
}

/// Why a message was not processed. Nothing was committed in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The payload does not decode as the handler's message type. Permanent.
    #[error("payload does not decode as {ty}: {source}")]
    Decode {
        /// The expected message type.
        ty: &'static str,
        /// The decoder's error.
        source: serde_json::Error,
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
}

/// The inbox over one database pool and table. Cheap to clone.
///
/// Each message costs exactly BEGIN, the claim, the handler's statements and COMMIT. Build the
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
    claim_sql: SqlStr,
}

impl<DB: InboxBackend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            claim_sql: self.claim_sql.clone(),
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
        let claim_sql = DB::claim_sql(&table);
        Inbox {
            pool,
            table,
            claim_sql,
        }
    }

    /// The pool messages are processed on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The inbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates or updates the inbox table. Safe to run from several instances at once.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let migrator = backend::migrator::<DB>(&self.table);
        // Instances starting together race: sqlx takes no lock on SQLite, and its MySQL lock did
        // not hold on MariaDB here, so the loser fails to record a migration the winner is
        // applying or has applied. The DDL is idempotent; a later attempt sees it recorded.
        let mut attempt = 1;
        loop {
            match DB::run_migrator(&self.pool, &migrator).await {
                Ok(()) => return Ok(()),
                Err(e) if attempt < 5 => {
                    tracing::debug!(error = %e, attempt, "inbox migration raced another instance; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(100 * attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Deletes `consumer`'s finished markers received more than `older_than` ago, in batches of
    /// `batch` rows (short transactions that never hold up the hot path for long), one instance at
    /// a time across the fleet. Returns how many were deleted, or `None` when another instance
    /// is cleaning up. Open claims are never deleted.
    ///
    /// `older_than` must cover every possible redelivery: see [`retention_floor`](crate::retention_floor).
    pub async fn cleanup(
        &self,
        consumer: &str,
        older_than: std::time::Duration,
        batch: u32,
    ) -> Result<Option<u64>, sqlx::Error> {
        let lock = format!("inbox-cleanup:{}:{consumer}", self.table);
        let mut conn = self.pool.acquire().await?;
        if !DB::try_cleanup_lock(&mut conn, &lock).await? {
            return Ok(None);
        }
        let sql = DB::cleanup_sql(&self.table);
        let mut deleted = 0;
        let result = loop {
            let limit = i64::from(batch.max(1));
            let secs = older_than.as_secs_f64();
            match DB::cleanup_batch(&mut conn, sql.clone(), consumer, secs, limit).await {
                Ok(0) => break Ok(Some(deleted)),
                Ok(n) => deleted += n,
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = DB::cleanup_unlock(&mut conn, &lock).await {
            // A lock left on a pooled connection would stop every later cleanup: drop it.
            tracing::warn!(error = %e, "releasing the cleanup lock failed; closing the connection");
            let _ = conn.detach();
        }
        result
    }

    /// Processes `message` exactly once: in a fresh transaction, claims its key and, when the claim
    /// is new, runs the handler and commits both. Returns [`Outcome::Skip`] for a duplicate, in
    /// which case the handler did not run.
    ///
    /// `transport_id` is the key when the handler has no `key` expression.
    pub async fn process<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        transport_id: Option<&str>,
    ) -> Result<Outcome, ProcessError> {
        let key = message_key(handler, state, &message, transport_id)?;
        let span = tracing::debug_span!("inbox.tx", consumer = H::CONSUMER, key = %key);
        self.process_keyed(handler, state, message, &key)
            .instrument(span)
            .await
    }

    /// [`Inbox::process`] with the key already computed and validated.
    pub(crate) async fn process_keyed<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        let mut tx = DB::begin(&self.pool)
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Begin,
                source,
            })?;
        match self.process_in(&mut tx, handler, state, message, key).await {
            Ok(Outcome::Ack) => {
                tx.commit().await.map_err(|source| ProcessError::Database {
                    stage: Stage::Commit,
                    source,
                })?;
                Ok(Outcome::Ack)
            }
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

    /// Claims `key` and runs the handler inside `tx`, a transaction (or savepoint) the caller owns
    /// and commits. On [`Outcome::Skip`] or an error the caller must roll `tx` back.
    pub async fn process_in<'c, H: Handler<Db = DB>>(
        &self,
        tx: &mut Transaction<'c, DB>,
        handler: &H,
        state: &H::State,
        message: H::Message,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        let claim = DB::claim(tx, self.claim_sql.clone(), H::CONSUMER, key)
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Claim,
                source,
            })?;
        if claim == Claim::Duplicate {
            return Ok(Outcome::Skip);
        }
        handler
            .handle(message, tx, state)
            .await
            .map_err(|e| ProcessError::Handler(e.into()))?;
        Ok(Outcome::Ack)
    }
}

/// The message's key: the handler's `key` expression, else the transport id; validated.
pub(crate) fn message_key<H: Handler>(
    handler: &H,
    state: &H::State,
    message: &H::Message,
    transport_id: Option<&str>,
) -> Result<String, KeyError> {
    let key = match handler.key(message, state) {
        Some(k) => k,
        None => transport_id.ok_or(KeyError::Missing)?.to_owned(),
    };
    validate_key(&key)?;
    Ok(key)
}
