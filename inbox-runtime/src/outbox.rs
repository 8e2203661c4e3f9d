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

mod relay;

pub use relay::{DEFAULT_RETENTION, Relay, RelayError, RelayStats};

use crate::backend::{InboxBackend, TableName, outbox_migrator};
use serde::Serialize;
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr, Transaction};
use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::Notify;

/// The longest message id and order key the outbox stores.
pub const MAX_ID_LEN: usize = 255;

/// A message to publish through an [`Outbox`]: its subject, payload and headers, and optionally
/// its id and ordering key.
///
/// ```
/// use inbox_runtime::OutboxMessage;
/// let message = OutboxMessage::new("credits.applied", br#"{"id":"r-1"}"#.to_vec())
///     .header("Content-Type", "application/json")
///     .order_key("account-7");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    subject: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    msg_id: Option<String>,
    order_key: Option<String>,
}

impl OutboxMessage {
    /// A message of `payload` to `subject`.
    pub fn new(subject: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        OutboxMessage {
            subject: subject.into(),
            payload: payload.into(),
            headers: Vec::new(),
            msg_id: None,
            order_key: None,
        }
    }

    /// A message of `value` as JSON to `subject`, with `Content-Type: application/json`.
    pub fn json<T: Serialize + ?Sized>(
        subject: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(OutboxMessage::new(subject, serde_json::to_vec(value)?)
            .header("Content-Type", "application/json"))
    }

    /// Adds a header (a name may repeat). `Nats-Msg-Id` is set by the relay: use
    /// [`OutboxMessage::msg_id`] for it.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The message's id (`Nats-Msg-Id`), for a message that has one of its own (an event id):
    /// the target stream drops a second message with the same id within its duplicate window.
    /// Without it, the outbox generates one (a NUID) when the row is written.
    pub fn msg_id(mut self, id: impl Into<String>) -> Self {
        self.msg_id = Some(id.into());
        self
    }

    /// The key whose messages are published in the order they were written (the order of their
    /// rows' ids). Messages of different keys may overtake each other. Without it, the subject
    /// is the key: every message to one subject is published in order.
    pub fn order_key(mut self, key: impl Into<String>) -> Self {
        self.order_key = Some(key.into());
        self
    }

    /// The subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Why NATS would refuse this message, if it would.
    fn check(&self) -> Result<(), InvalidMessage> {
        if let Err(why) = publish_subject(&self.subject) {
            return Err(InvalidMessage::Subject {
                subject: self.subject.clone(),
                why,
            });
        }
        for (name, value) in &self.headers {
            let bad_name = name.is_empty()
                || name
                    .bytes()
                    .any(|b| b == b':' || b.is_ascii_whitespace() || b.is_ascii_control());
            if bad_name {
                return Err(InvalidMessage::HeaderName(name.clone()));
            }
            if value.contains(['\r', '\n']) {
                return Err(InvalidMessage::HeaderValue(name.clone()));
            }
            if name.eq_ignore_ascii_case("Nats-Msg-Id") {
                return Err(InvalidMessage::MsgIdHeader);
            }
        }
        for (what, text) in [("message id", &self.msg_id), ("order key", &self.order_key)] {
            if let Some(text) = text
                && (text.is_empty() || text.len() > MAX_ID_LEN)
            {
                return Err(InvalidMessage::Length {
                    what,
                    len: text.len(),
                });
            }
        }
        Ok(())
    }
}

/// Why NATS would refuse `subject` as a publish subject.
fn publish_subject(subject: &str) -> Result<(), &'static str> {
    if subject.is_empty() {
        return Err("it is empty");
    }
    if subject
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err("it contains whitespace");
    }
    for token in subject.split('.') {
        match token {
            "" => return Err("it has an empty token"),
            "*" | ">" => return Err("a message cannot be published to a wildcard"),
            _ => {}
        }
    }
    Ok(())
}

/// A message [`Outbox::enqueue`] refuses, before anything is written: NATS would never take it,
/// and the row would stay pending for ever. A permanent error for the handler (its message is
/// dead-lettered).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMessage {
    /// Not a subject a message can be published to.
    #[error("outbox message subject {subject:?} is not valid: {why}")]
    Subject {
        /// The subject.
        subject: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A header name NATS would refuse.
    #[error(
        "outbox message header name {0:?} is not valid (empty, or with ':', whitespace or a control character)"
    )]
    HeaderName(String),
    /// A header value with a line break.
    #[error("outbox message header {0:?} has a line break in its value")]
    HeaderValue(String),
    /// `Nats-Msg-Id` set as a header.
    #[error(
        "outbox messages get Nats-Msg-Id from their row: set it with OutboxMessage::msg_id, not as a header"
    )]
    MsgIdHeader,
    /// A message id or order key empty or too long.
    #[error("outbox message {what} is {len} bytes: it must be 1 to 255")]
    Length {
        /// "message id" or "order key".
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

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
    sql: Statements,
    /// Wakes this outbox's relay.
    wake: Arc<Notify>,
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
                sql: Statements::new::<DB>(&table),
                pool,
                table,
                wake: Arc::new(Notify::new()),
            }),
        }
    }

    /// Creates or updates the outbox's table (its migrations are tracked in
    /// `_<table>_migrations`, apart from the application's). Safe to run from several instances
    /// at once.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let migrator = outbox_migrator::<DB>(&self.inner.table);
        crate::store::migrate_racing(&self.inner.pool, &self.inner.table, &migrator).await
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
            .map_err(|e| sqlx::Error::Encode(Box::new(crate::Permanent::new(e))))?;
        self.enqueue(tx, message).await
    }

    /// Writes `message` in `tx`: it is published if and only if `tx` commits, once. Returns the
    /// message's id (`Nats-Msg-Id`). A message NATS would refuse (a wildcard subject, a bad
    /// header) is refused here, as a permanent error ([`InvalidMessage`] inside
    /// [`sqlx::Error::Encode`]).
    ///
    /// In a worker's handler, the worker wakes the relay once the transaction commits. Elsewhere,
    /// call [`Outbox::wake`] after committing, or the relay finds the row at its next poll.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, DB>,
        message: OutboxMessage,
    ) -> Result<String, sqlx::Error> {
        message
            .check()
            .map_err(|e| sqlx::Error::Encode(Box::new(crate::Permanent::new(e))))?;
        let msg_id = message.msg_id.unwrap_or_else(|| nuid::next().to_string());
        let order_key = message.order_key.as_deref().unwrap_or(&message.subject);
        let headers = serde_json::to_string(&message.headers)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let row = (
            msg_id.as_str(),
            message.subject.as_str(),
            order_key,
            headers.as_str(),
            message.payload.as_slice(),
        );
        DB::outbox_insert(&mut **tx, self.inner.sql.insert.clone(), row).await?;
        written(&self.inner.wake);
        Ok(msg_id)
    }

    /// Wakes the relay: for rows committed outside a worker's handler.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// How many rows are waiting to be published, and how old the oldest is.
    pub async fn pending(&self) -> Result<(u64, std::time::Duration), sqlx::Error> {
        let (n, ms) = DB::two_ints(&self.inner.pool, self.inner.sql.pending.clone()).await?;
        Ok((
            u64::try_from(n).unwrap_or(0),
            std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        ))
    }

    pub(crate) fn waker(&self) -> &Notify {
        &self.inner.wake
    }

    pub(crate) fn statements(&self) -> &Statements {
        &self.inner.sql
    }
}

/// The outbox's SQL, written once per [`Outbox`].
pub(crate) struct Statements {
    /// Binds msg id, subject, order key, headers (JSON), payload.
    insert: SqlStr,
    /// Binds a limit: the oldest pending rows, locked (passing over those another relay holds).
    pub(crate) fetch: SqlStr,
    /// Binds an id: (order key, smallest id) of pending rows up to that id.
    pub(crate) heads: SqlStr,
    /// (pending rows, age in ms of the oldest).
    pending: SqlStr,
    /// Binds seconds, limit: deletes rows sent longer ago than that.
    pub(crate) cleanup: SqlStr,
    /// SQLite: binds owner, lease seconds: takes or renews the relays' lease.
    pub(crate) lease: SqlStr,
    /// The table, for statements written per batch.
    pub(crate) table: TableName,
}

impl Statements {
    fn new<DB: InboxBackend>(table: &TableName) -> Self {
        let p = DB::param;
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        Statements {
            insert: sql(format!(
                "INSERT INTO {table} (msg_id, subject, order_key, headers, payload) \
                 VALUES ({}, {}, {}, {}, {})",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5)
            )),
            fetch: sql(format!(
                "SELECT id, msg_id, subject, order_key, headers, payload FROM {table} \
                 WHERE sent_at IS NULL ORDER BY id LIMIT {}{}",
                p(1),
                DB::SKIP_LOCKED
            )),
            heads: sql(format!(
                "SELECT order_key, MIN(id) FROM {table} WHERE sent_at IS NULL AND id <= {} \
                 GROUP BY order_key",
                p(1)
            )),
            pending: sql(format!(
                "SELECT CAST(COUNT(*) AS {int}), CAST(COALESCE(MAX(-({})), 0) AS {int}) \
                 FROM {table} WHERE sent_at IS NULL",
                DB::ms_until_sql("created_at"),
                int = DB::INT64
            )),
            cleanup: DB::outbox_cleanup_sql(table),
            lease: sql(format!(
                "INSERT INTO {table}_relay (id, owner, lease_until) VALUES (1, {}, {}) \
                 ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, \
                 lease_until = excluded.lease_until \
                 WHERE {table}_relay.owner = excluded.owner OR {table}_relay.lease_until <= {}",
                p(1),
                DB::secs_from_now_sql(&p(2)),
                DB::NOW_SQL
            )),
            table: table.clone(),
        }
    }

    /// Marks rows `ids` sent. The ids are the database's own integers, written into the
    /// statement (it runs unprepared, since its text changes with every batch).
    pub(crate) fn mark_sent<DB: InboxBackend>(&self, ids: &[i64]) -> SqlStr {
        let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
        AssertSqlSafe(format!(
            "UPDATE {} SET sent_at = {} WHERE id IN ({})",
            self.table,
            DB::NOW_SQL,
            ids.join(", ")
        ))
        .into_sql_str()
    }
}

tokio::task_local! {
    /// The relays to wake once the transaction being processed in this task ends.
    static WRITTEN: RefCell<Vec<Arc<Notify>>>;
}

/// Notes that the transaction of the current task wrote to the outbox of `wake`.
fn written(wake: &Arc<Notify>) {
    let _ = WRITTEN.try_with(|w| {
        let mut w = w.borrow_mut();
        if !w.iter().any(|n| Arc::ptr_eq(n, wake)) {
            w.push(Arc::clone(wake));
        }
    });
}

/// Runs `work` (a message's or a batch's processing, commit included) and then wakes the relay
/// of every outbox it wrote to. Woken after a rollback too: the relay then finds nothing, which
/// costs one query.
pub(crate) async fn waking<T>(work: impl Future<Output = T>) -> T {
    let (out, written) = WRITTEN
        .scope(RefCell::new(Vec::new()), async {
            let out = work.await;
            (out, WRITTEN.with(|w| std::mem::take(&mut *w.borrow_mut())))
        })
        .await;
    for wake in written {
        wake.notify_one();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_nats_would_refuse_is_refused_before_it_is_written() {
        let ok = OutboxMessage::new("credits.applied", b"{}".to_vec());
        assert_eq!(ok.check(), Ok(()));
        for subject in ["", "a..b", "credits.*", "credits.>", "a b", ".a", "a."] {
            let m = OutboxMessage::new(subject, Vec::new());
            assert!(
                matches!(m.check(), Err(InvalidMessage::Subject { .. })),
                "{subject:?}"
            );
        }
        for name in ["", "a:b", "a b"] {
            let m = ok.clone().header(name, "v");
            assert_eq!(m.check(), Err(InvalidMessage::HeaderName(name.into())));
        }
        let m = ok.clone().header("X", "a\r\nb");
        assert_eq!(m.check(), Err(InvalidMessage::HeaderValue("X".into())));
        let m = ok.clone().header("nats-msg-id", "x");
        assert_eq!(m.check(), Err(InvalidMessage::MsgIdHeader));
        let m = ok.clone().msg_id("");
        assert!(matches!(m.check(), Err(InvalidMessage::Length { .. })));
        let m = ok.clone().order_key("k".repeat(256));
        assert!(matches!(
            m.check(),
            Err(InvalidMessage::Length { len: 256, .. })
        ));
    }

    #[tokio::test]
    async fn a_scope_wakes_each_outbox_written_to_once() {
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        waking(async {
            written(&a);
            written(&a);
            written(&b);
        })
        .await;
        // A permit each: both are woken now, without waiting.
        tokio::time::timeout(std::time::Duration::from_secs(1), a.notified())
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(1), b.notified())
            .await
            .unwrap();
        // Outside a scope, nothing is recorded (and nothing panics).
        written(&a);
    }
}
