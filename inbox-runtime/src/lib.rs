//! Exactly-once *effects* for NATS JetStream consumers.
//!
//! JetStream delivers at least once. This crate makes the database decide whether a message was
//! already handled: the handler runs inside a transaction that also inserts a marker row, unique on
//! (consumer, key), and both commit or neither does. A duplicate delivery finds the marker and is
//! skipped; a concurrent twin waits on the marker's row lock and then skips.
//!
//! ```no_run
//! use inbox_runtime::{Delivery, Inbox, Tx, WorkerBuilder, idempotent};
//! use sqlx::Postgres;
//!
//! #[derive(serde::Deserialize)]
//! struct CreditRequested { id: String, account: i64, amount: i64 }
//!
//! #[idempotent(consumer = "credit", key = msg.id)]
//! async fn credit(msg: CreditRequested, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(msg.amount)
//!         .bind(msg.account)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn run() -> Result<(), async_nats::Error> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
//! let inbox = Inbox::new(pool);
//! inbox.migrate().await?;
//!
//! // Without NATS: pool and message in, Ack or Skip out.
//! let msg = CreditRequested { id: "m-1".into(), account: 1, amount: 5 };
//! let outcome = inbox.process(&credit, &(), msg, &Delivery::new("credits")).await?;
//!
//! // On a JetStream durable pull consumer:
//! let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! let consumer = js.get_stream("CREDITS").await?.get_consumer("credit").await?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! WorkerBuilder::new(inbox, &js, consumer).build(credit)?.run_until(shutdown).await;
//! # Ok(()) }
//! ```

mod app;
mod backend;
mod backoff;
mod batch;
mod claim;
mod classify;
mod cleanup;
mod delivery;
mod handler;
mod key;
mod store;
mod worker;

pub use app::{App, AppError, AppStats, Durable, recommended_consumer};
#[cfg(feature = "sqlite")]
pub use backend::sqlite_options;
pub use backend::{InboxBackend, InvalidTableName, TableName, is_transient};
pub use backoff::Backoff;
pub use claim::{Claim, DEFAULT_LEASE, OpenClaim, idempotency_key};
pub use classify::{ErrorClass, Permanent, Transient, classify};
pub use cleanup::{CleanupError, RetentionFloor, retention_floor};
#[cfg(feature = "msgpack")]
pub use delivery::MsgPack;
pub use delivery::{Codec, Delivery, Json, Raw};
pub use handler::{BoxError, Handler, Outcome};
pub use key::{KeyError, MAX_KEY_LEN, ToMessageKey, validate_key};

/// The `sqlx` this crate is built with: name its types (`inbox_runtime::sqlx::PgPool`) without
/// a dependency of your own at exactly this version.
pub use sqlx;

/// The `async_nats` this crate is built with, for the same reason.
pub use async_nats;
pub use store::{DEFAULT_LOCK_TIMEOUT, Inbox, ProcessError, Stage};
pub use worker::{
    AckMode, DEFAULT_DEADLINE, DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM, NoState, Stats, Worker,
    WorkerBuilder, WorkerError, process_delivery, transport_id,
};

/// Makes an `async fn` an idempotent message handler.
///
/// ```no_run
/// use inbox_runtime::{Tx, idempotent};
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct CreditRequested { id: String, account: i64, amount: i64 }
///
/// #[idempotent(consumer = "credit", key = msg.id)]
/// async fn credit(msg: CreditRequested, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(msg.amount)
///         .bind(msg.account)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
/// ```
///
/// - `consumer` (required): a non-empty string literal of at most 200 bytes and one NATS subject
///   token (no spaces, `.`, `*` or `>`), stored with every marker; handlers with different
///   consumer names dedup independently.
/// - `key` (optional): an expression over the arguments, evaluated on borrows of them before the
///   body runs; its value converts through [`ToMessageKey`] (strings, integers, `Uuid`). Without
///   it the transport id is the key: `Nats-Msg-Id` (unless empty), else
///   `"{stream}:{stream_sequence}"`.
///
/// - `claim` (optional): a two-phase handler, for side effects outside the database (an e-mail,
///   a card charge, an HTTP call): it takes `claim: &mut Claim<DB>` in place of the transaction.
///   The key is claimed with a lease and committed before the body runs; the body performs the
///   side effect with [`Claim::idempotency_key`] while the lease is renewed, and writes what must
///   commit with "done" in [`Claim::tx`]; the claim is then marked done only if its fence still
///   holds. See [`Claim`].
///
/// The function takes the decoded message by value, the transaction as `&mut Tx<DB>` (or, with
/// `claim`, the claim as `&mut Claim<DB>`), and optionally a shared `&State` supplied once at
/// registration, in any order, and returns `Result<(), E>`. It becomes a unit struct of the same
/// name implementing [`Handler`].
pub use inbox_macros::idempotent;

/// The transaction a handler writes in: `&mut Tx<Postgres>` in a handler's signature.
pub type Tx<'c, DB> = sqlx::Transaction<'c, DB>;

pub use sqlx::Transaction;

/// Not public API: what the code generated by `#[idempotent]` refers to.
#[doc(hidden)]
pub mod __private {
    pub use crate::claim::Claim;
    pub use crate::handler::{BoxError, Handler, HandlerResult, ReturnsUnit};
    pub use sqlx::Transaction;

    pub use crate::delivery::{Delivery, Json};
    pub use crate::key::{KeyError, KeyOf};

    /// The key expression's value as stored; `expr` is the expression as written.
    pub fn key_of<K: KeyOf + ?Sized>(key: &K, expr: &'static str) -> Result<String, KeyError> {
        key.key_of(expr)
    }
}
