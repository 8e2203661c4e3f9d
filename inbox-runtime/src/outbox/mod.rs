//! The transactional outbox: messages a handler publishes leave if and only if its transaction
//! commits, exactly once in the target stream.
//!
//! - [`Outbox::publish`] (or [`Outbox::enqueue`]) writes a row in the handler's transaction, so
//!   it commits or rolls back with the marker and the business write. The row carries the
//!   message's stable id: given, or generated (a NUID) when the row is written.
//! - A [`Relay`] (run by the [`App`](crate::App) next to the workers) publishes pending rows with
//!   `Nats-Msg-Id` = that id and marks them sent only after the PubAck: a relay that dies in
//!   between publishes the row again, into the stream's duplicate window, and the stream keeps
//!   one copy.
//! - A worker's commit wakes the relay of every outbox its handler wrote to (no polling delay);
//!   the relay polls too, for rows whose writer died between COMMIT and the wake-up, and for rows
//!   written outside a worker.
//!
//! One concept per file: this file holds [`Outbox`]; `message` (what a message is, and what NATS
//! would refuse), `statements` (its SQL), `relay` (the [`Relay`] and its loop), `pass` (one
//! pass: rows taken, published, marked; cleanup), `streams` (the checks of target streams),
//! `error` (why a relay refuses a stream or a pass failed).

mod error;
mod message;
mod pass;
mod relay;
mod statements;
mod streams;
mod taken;

pub use crate::backend::FailedRow;
pub use error::RelayError;
pub use message::{InvalidMessage, MAX_HEADERS_LEN, MAX_SUBJECT_LEN, OutboxMessage};
#[cfg(feature = "test-util")]
pub use relay::Hook;
pub use relay::{DEFAULT_RETENTION, Relay, RelayStats};

use crate::backend::{InboxBackend, TableName, migrate};
use crate::classify::Permanent;
use crate::store::held;
use serde::Serialize;
use sqlx::{Pool, Transaction};
use statements::OutboxStatements;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Notify;

/// A transactional outbox: a table (default `outbox`) of messages written in a handler's
/// transaction and published by a [`Relay`] once committed. Cheap to clone; hand it to the
/// handler as its state (or part of it) and to [`App::relay`](crate::App::relay).
///
/// ```no_run
/// use inbox_runtime::{App, Durable, Inbox, Outbox, Relay, Tx, idempotent};
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct CreditRequested { id: String, account: i64, amount: i64 }
///
/// #[idempotent(consumer = "credit", key = msg.id)]
/// async fn credit(
///     msg: CreditRequested,
///     tx: &mut Tx<Postgres>,
///     outbox: &Outbox<Postgres>,
/// ) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(msg.amount)
///         .bind(msg.account)
///         .execute(&mut **tx)
///         .await?;
///     let event = serde_json::json!({"id": msg.id, "account": msg.account, "amount": msg.amount});
///     outbox.publish(tx, "credits.applied", &event).await?;
///     Ok(())
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let (inbox, outbox) = (Inbox::new(pool.clone()), Outbox::new(pool));
/// inbox.migrate().await?;
/// outbox.migrate().await?;
/// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// App::new(inbox, &js)
///     .handler_with_state(credit, outbox.clone(), Durable::existing("CREDITS", "credit"))
///     .relay(Relay::new(outbox).stream("CREDIT_EVENTS"))
///     .run()
///     .await?;
/// # Ok(()) }
/// ```
pub struct Outbox<DB: InboxBackend> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: InboxBackend> {
    pool: Pool<DB>,
    table: TableName,
    sql: OutboxStatements,
    /// Wakes this outbox's relay.
    wake: Arc<Notify>,
    /// The NATS server's `max_payload`, once a relay has connected (0 until then).
    max_payload: AtomicUsize,
}

impl<DB: InboxBackend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Outbox {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: InboxBackend> fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.inner.table)
            .finish_non_exhaustive()
    }
}

impl<DB: InboxBackend> Outbox<DB> {
    /// The outbox in table `outbox` of `pool`'s database.
    pub fn new(pool: Pool<DB>) -> Self {
        Outbox::with_table(pool, TableName::new("outbox").expect("a valid name"))
    }

    /// The outbox in `table`.
    pub fn with_table(pool: Pool<DB>, table: TableName) -> Self {
        Outbox {
            inner: Arc::new(Inner {
                sql: OutboxStatements::new::<DB>(&table),
                pool,
                table,
                wake: Arc::new(Notify::new()),
                max_payload: AtomicUsize::new(0),
            }),
        }
    }

    /// Creates or updates the outbox's table (its migrations are tracked in
    /// `_<table>_migrations`, apart from the application's; a step recorded by a later version
    /// is let be), and on MySQL the relays' turn row (`<table>_relay`). Safe to run from
    /// several instances at once: they take turns, as for
    /// [`Inbox::migrate`](crate::Inbox::migrate).
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let table = &self.inner.table;
        let migrator = migrate::migrator(table, "outbox", DB::outbox_migration_sql(table));
        let wait = migrate::MIGRATION_LOCK_WAIT;
        let then = DB::outbox_unversioned_sql(table);
        migrate::migrate_racing(&self.inner.pool, table, &migrator, wait, &then).await
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.inner.table
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// Writes `value` as JSON to `subject` in `tx` ([`OutboxMessage::json`]); returns the
    /// message's id. See [`Outbox::enqueue`].
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        tx: &mut Transaction<'_, DB>,
        subject: &str,
        value: &T,
    ) -> Result<String, sqlx::Error> {
        let message = OutboxMessage::json(subject, value)
            .map_err(|e| sqlx::Error::Encode(Box::new(Permanent::new(e))))?;
        self.enqueue(tx, message).await
    }

    /// Writes `message` in `tx`: it is published if and only if `tx` commits, once. Returns the
    /// message's id (`Nats-Msg-Id`). A message NATS would refuse (a wildcard subject, a bad
    /// header) is refused here, as a permanent error ([`InvalidMessage`] inside
    /// [`sqlx::Error::Encode`]).
    ///
    /// In a worker's handler, the worker wakes the relay once the transaction commits. Elsewhere,
    /// call [`Outbox::wake`] after committing, or the relay finds the row at its next poll.
    ///
    /// In a worker's handler, a row written in the transaction the worker handed it is held
    /// until the handler returns and then written, with the handler's other rows in the order
    /// they were written, by the one statement that also checks the message's marker (it takes
    /// the place of the marker's lookup: a round trip per message saved). So an error of that
    /// insert ends the message's try after the handler, not inside it, and the handler does
    /// not see the row in the table. A row written in a savepoint the handler opens
    /// (`tx.begin()`) is written at once, to go with it if it is rolled back: it then comes
    /// before the held rows of the same order key. A savepoint opened with raw SQL is not seen:
    /// a row held inside it is written even if the handler rolls back to it. Elsewhere the row
    /// is written at once.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, DB>,
        message: OutboxMessage,
    ) -> Result<String, sqlx::Error> {
        let refuse = |e: InvalidMessage| sqlx::Error::Encode(Box::new(Permanent::new(e)));
        message.check().map_err(refuse)?;
        let msg_id = match &message.msg_id {
            Some(id) => id.clone(),
            None => nuid::next().to_string(),
        };
        let header_size = message.header_size(&msg_id);
        if header_size > MAX_HEADERS_LEN {
            let (size, max) = (header_size, MAX_HEADERS_LEN);
            return Err(refuse(InvalidMessage::HeadersTooLarge { size, max }));
        }
        let max = self.inner.max_payload.load(Ordering::Relaxed);
        let size = header_size + message.payload.len();
        if max > 0 && size > max {
            return Err(refuse(InvalidMessage::TooLarge { size, max }));
        }
        let headers = serde_json::to_string(&message.headers)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        crate::wake::after_scope(&self.inner.wake);
        let row = held::HeldRow {
            table: self.inner.table.clone(),
            msg_id: msg_id.clone(),
            order_key: message.order_key.unwrap_or_else(|| message.subject.clone()),
            subject: message.subject,
            headers,
            payload: message.payload,
        };
        // In a worker's transaction, held and written with the check of its marker.
        if let Some(row) = held::hold(&*tx, row) {
            let sql = self.inner.sql.insert.clone();
            let new = [row.new_row()];
            DB::outbox_insert(&mut **tx, sql, &new, None).await?;
        }
        Ok(msg_id)
    }

    /// Records the NATS server's `max_payload` (a relay does, once connected): from then on,
    /// [`Outbox::enqueue`] refuses a message larger than that.
    pub(crate) fn learn_max_payload(&self, max: usize) {
        self.inner.max_payload.store(max, Ordering::Relaxed);
    }

    /// The rows a relay gave up on (NATS refused them for good: a header or id it cannot
    /// carry, over `max_payload`), oldest first, at most `limit`. Each holds back its order
    /// key's later rows until [`Outbox::retry_failed`] (once the cause is fixed) or
    /// [`Outbox::discard_failed`].
    pub async fn failed(&self, limit: i64) -> Result<Vec<FailedRow>, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?;
        DB::outbox_failed(&mut *conn, self.inner.sql.failed.clone(), limit).await
    }

    /// Lets the relay try failed row `id` again (and its key's later rows after it). Returns
    /// whether it was failed.
    pub async fn retry_failed(&self, id: i64) -> Result<bool, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?;
        let done = DB::execute_id(&mut *conn, self.inner.sql.unfail.clone(), id).await?;
        self.wake();
        Ok(DB::rows_affected(&done) > 0)
    }

    /// Deletes failed row `id` for good (it is never published); its key's later rows go on.
    /// Returns whether it was failed.
    pub async fn discard_failed(&self, id: i64) -> Result<bool, sqlx::Error> {
        let mut tx = self.inner.pool.begin().await?;
        let done = DB::execute_id(&mut *tx, self.inner.sql.unfail.clone(), id).await?;
        if DB::rows_affected(&done) > 0 {
            DB::execute_id(&mut *tx, self.inner.sql.delete.clone(), id).await?;
        }
        tx.commit().await?;
        self.wake();
        Ok(DB::rows_affected(&done) > 0)
    }

    /// Wakes the relay: for rows committed outside a worker's handler.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// How many rows are waiting to be published, and how old the oldest is.
    pub async fn pending(&self) -> Result<(u64, std::time::Duration), sqlx::Error> {
        let backlog = DB::outbox_backlog(&self.inner.pool, self.inner.sql.pending.clone()).await?;
        Ok((
            u64::try_from(backlog.rows).unwrap_or(0),
            std::time::Duration::from_millis(u64::try_from(backlog.oldest_ms).unwrap_or(0)),
        ))
    }

    pub(crate) fn waker(&self) -> &Notify {
        &self.inner.wake
    }

    pub(crate) fn statements(&self) -> &OutboxStatements {
        &self.inner.sql
    }
}
